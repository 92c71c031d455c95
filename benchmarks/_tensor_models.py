"""For ``tensor_serving.py``: the two ONNX graphs it serves, their inputs, and the request bodies
every contender gets.

- ``tabular``: a scikit-learn ``GradientBoostingClassifier`` (100 trees of depth 3) trained on
  scikit-learn's bundled breast-cancer dataset (569 rows, 30 features), exported by skl2onnx
  with ``zipmap=False``: input ``float_input`` FP32 ``[-1, 30]``, outputs ``label`` INT64
  ``[-1]`` and ``probabilities`` FP32 ``[-1, 2]``. One request: one row (a dataset row).
- ``ocr``: PP-OCRv4's text detector as rapidocr-onnxruntime ships it: input ``x`` FP32
  ``[-1, 3, -1, -1]``, output ``sigmoid_0.tmp_0`` FP32 ``[-1, 1, -1, -1]``. One request: one
  image of a fixed size (``OCR_SIDE`` x ``OCR_SIDE``, seeded values in [0, 1): the graph's cost
  does not depend on them).

Bodies: Sokuji gets KServe V2 with Triton's binary tensor extension exactly as tritonclient
builds it (``InferenceServerClient.generate_request_body``; every output binary), or V2 JSON
(the c=1 JSON figure). The peers (FastAPI, LitServe) get the input's raw little-endian bytes
and answer the outputs' raw bytes: the cheapest codec there is, so any codec cost counted
against Sokuji is its own.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

OCR_SIDE = 320


@dataclass(frozen=True)
class TensorModelSpec:
    name: str
    path: Path
    input_name: str
    row_shape: tuple[int, ...]
    """One request's input shape past the batch dimension."""
    outputs: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    """Raw batch sizes swept for the best throughput."""


def tabular_path(cache_dir: str) -> Path:
    """The classifier's ONNX file, trained and exported on first use (~2 s)."""
    out = Path(cache_dir) / "tensor_bench" / "breast_cancer_gb100.onnx"
    if out.is_file():
        return out
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.datasets import load_breast_cancer
    from sklearn.ensemble import GradientBoostingClassifier

    x, y = load_breast_cancer(return_X_y=True)
    clf = GradientBoostingClassifier(n_estimators=100, max_depth=3, random_state=0)
    clf.fit(x.astype(np.float32), y)
    onx = convert_sklearn(clf, initial_types=[("float_input", FloatTensorType([None, 30]))],
                          options={id(clf): {"zipmap": False}})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(onx.SerializeToString())
    tmp.replace(out)
    return out


def ocr_path() -> Path:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("rapidocr-onnxruntime is not installed (the Makefile installs it)")
    return Path(spec.submodule_search_locations[0]) / "models" / "ch_PP-OCRv4_det_infer.onnx"


def spec(name: str, cache_dir: str) -> TensorModelSpec:
    if name == "tabular":
        return TensorModelSpec("tabular", tabular_path(cache_dir), "float_input", (30,),
                               ("label", "probabilities"), (1, 4, 16, 64, 256, 1024))
    if name == "ocr":
        return TensorModelSpec("ocr", ocr_path(), "x", (3, OCR_SIDE, OCR_SIDE),
                               ("sigmoid_0.tmp_0",), (1, 2, 4))
    raise ValueError(f"unknown model {name!r}: tabular or ocr")


def inputs(spec: TensorModelSpec, count: int = 8) -> list[np.ndarray]:
    """``count`` one-row inputs, ``[1, *row_shape]`` FP32: dataset rows for the classifier,
    seeded images for the detector."""
    if spec.name == "tabular":
        from sklearn.datasets import load_breast_cancer

        x = load_breast_cancer().data.astype(np.float32)
        return [x[i:i + 1].copy() for i in range(count)]
    rng = np.random.default_rng(0)
    return [rng.random((1, *spec.row_shape), dtype=np.float32) for _ in range(count)]


def v2_binary(spec: TensorModelSpec, array: np.ndarray) -> tuple[bytes, int]:
    """A V2 binary-extension body as tritonclient sends it, and its JSON header length."""
    import tritonclient.http as httpclient

    x = httpclient.InferInput(spec.input_name, list(array.shape), "FP32")
    x.set_data_from_numpy(array, binary_data=True)
    outs = [httpclient.InferRequestedOutput(name, binary_data=True) for name in spec.outputs]
    body, head = httpclient.InferenceServerClient.generate_request_body([x], outputs=outs)
    return bytes(body), int(head) if head is not None else len(body)


def v2_json(spec: TensorModelSpec, array: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": spec.input_name, "datatype": "FP32",
                                   "shape": list(array.shape),
                                   "data": array.ravel().tolist()}]}).encode()

"""Real user models served as plain tensor models (``runtime = "tensor"``), each answer
compared with ONNX Runtime called directly on the same request: PP-OCR's text detector
(rapidocr's ONNX: FP32 NCHW, dynamic H and W), silero-vad (several inputs, its state carried
by the client; no batch dimension on every input: served unbatched), MiniLM as raw INT64
tensors (the built-in export; ragged ``input_ids`` / ``attention_mask`` padded), and
scikit-learn models exported by skl2onnx (a classifier's label and probabilities, with
ZipMap and without; a regressor), trained on sklearn's bundled datasets here. The ``onnx``
runtime given a graph that is not a text encoder serves it the same way."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from tests.conftest import CACHE_DIR, client_for

pytestmark = pytest.mark.integration


def _package_file(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / relative
    return path if path.is_file() else None


DET = _package_file("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx")
VAD = _package_file("silero_vad", "data/silero_vad.onnx")


def _sklearn_models(directory: Path) -> dict[str, Path]:
    from skl2onnx import to_onnx
    from sklearn.datasets import load_diabetes, load_iris
    from sklearn.linear_model import LinearRegression, LogisticRegression

    x, y = load_iris(return_X_y=True)
    x = x.astype(np.float32)
    clf = LogisticRegression(max_iter=500).fit(x, y)
    out = {}
    for name, options in (("iris_zipmap", None), ("iris", {id(clf): {"zipmap": False}})):
        onx = to_onnx(clf, x[:1], options=options, target_opset=17)
        out[name] = directory / f"{name}.onnx"
        out[name].write_bytes(onx.SerializeToString())
    xd, yd = load_diabetes(return_X_y=True)
    reg = LinearRegression().fit(xd.astype(np.float32), yd)
    out["diabetes"] = directory / "diabetes.onnx"
    out["diabetes"].write_bytes(to_onnx(reg, xd[:1].astype(np.float32),
                                        target_opset=17).SerializeToString())
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from sokuji.weights.minilm import ensure_onnx

    out: dict[str, Path] = {"minilm": ensure_onnx(CACHE_DIR)}
    if DET is not None:
        out["det"] = DET
    if VAD is not None:
        out["vad"] = VAD
    if importlib.util.find_spec("skl2onnx") is not None:
        out.update(_sklearn_models(tmp_path_factory.mktemp("sklearn")))
    return out


RAGGED = {"ragged": {"input_ids": 0, "attention_mask": 0, "token_type_ids": 0}}


@pytest.fixture(scope="module")
def client(paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[TestClient]:
    models = [cfg.ModelConfig(name=name, runtime="tensor", path=str(path), max_batch_size=8,
                              intra_op_threads=1, cache=False,
                              options=RAGGED if name == "minilm" else {})
              for name, path in paths.items()]
    if "det" in paths:  # the onnx runtime, given a graph that is no text encoder
        models.append(cfg.ModelConfig(name="det_onnx", runtime="onnx", path=str(paths["det"]),
                                      max_batch_size=4, intra_op_threads=1, cache=False))
    config = cfg.validate(cfg.ServerConfig(
        models=tuple(models), builtin_pipelines=False, max_request_bytes=8 << 20,
        cache_dir=str(tmp_path_factory.mktemp("cache"))))
    with client_for(config) as c:
        yield c


def ort_run(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # as served (intra_op_threads = 1)
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def infer(client: TestClient, model: str, feeds: dict[str, np.ndarray],
          binary: bool = True) -> Any:
    import tritonclient.http as httpclient

    names = {"float32": "FP32", "int64": "INT64", "float16": "FP16"}
    inputs = []
    for name, array in feeds.items():
        inp = httpclient.InferInput(name, list(array.shape), names[array.dtype.name])
        inp.set_data_from_numpy(array, binary_data=binary)
        inputs.append(inp)
    outputs = [httpclient.InferRequestedOutput(o["name"], binary_data=binary)
               for o in client.get(f"/v2/models/{model}").json()["outputs"]]
    body, size = httpclient.InferenceServerClient.generate_request_body(inputs, outputs)
    headers = {"Inference-Header-Content-Length": str(size),
               "Content-Type": "application/octet-stream"} if size is not None else {}
    r = client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    length = r.headers.get("inference-header-content-length")
    return httpclient.InferenceServerClient.parse_response_body(
        r.content, header_length=int(length) if length else None)


@pytest.mark.skipif(DET is None, reason="rapidocr_onnxruntime (the media extra) not installed")
@pytest.mark.parametrize("model", ["det", "det_onnx"])
def test_ppocr_detector(client: TestClient, paths: dict[str, Path], model: str) -> None:
    meta = client.get(f"/v2/models/{model}").json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 3, -1, -1]}]
    rng = np.random.default_rng(0)
    for shape in ((1, 3, 64, 96), (2, 3, 32, 32)):
        x = rng.random(shape, dtype=np.float32)
        want = ort_run(paths["det"], {"x": x})["sigmoid_0.tmp_0"]
        got = infer(client, model, {"x": x}).as_numpy("sigmoid_0.tmp_0")
        assert got.shape == (shape[0], 1, *shape[2:])
        np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(VAD is None, reason="silero_vad (the media extra) not installed")
def test_silero_vad_with_its_state_carried_by_the_client(client: TestClient,
                                                         paths: dict[str, Path]) -> None:
    config = client.get("/v2/models/vad/config").json()
    assert config["max_batch_size"] == 0  # state is [2, batch, 128]: served unbatched
    chunk = np.sin(np.arange(512, dtype=np.float32) / 9).reshape(1, 512) * 0.3
    state = np.zeros((2, 1, 128), np.float32)
    sr = np.array(16000, dtype=np.int64)
    for step in range(3):
        feeds = {"input": chunk * (step + 1), "state": state, "sr": sr}
        want = ort_run(paths["vad"], feeds)
        got = infer(client, "vad", feeds, binary=step % 2 == 0)
        np.testing.assert_array_equal(got.as_numpy("output"), want["output"])
        np.testing.assert_array_equal(got.as_numpy("stateN"), want["stateN"])
        state = got.as_numpy("stateN")
    assert np.abs(state).sum() > 0


def _tokens(rows: list[list[int]]) -> dict[str, np.ndarray]:
    ids = np.array(rows, dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids),
            "token_type_ids": np.zeros_like(ids)}


def test_minilm_raw_tensors(client: TestClient, paths: dict[str, Path]) -> None:
    """Exactly ORT's answer for the same rows; a ragged request is refused per row shape."""
    feeds = _tokens([[101, 7592, 2088, 102], [101, 2023, 2003, 102]])
    want = ort_run(paths["minilm"], feeds)["sentence_embedding"]
    got = infer(client, "minilm", feeds).as_numpy("sentence_embedding")
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_sklearn_classifier_with_and_without_zipmap(client: TestClient,
                                                    paths: dict[str, Path]) -> None:
    if "iris" not in paths:
        pytest.skip("skl2onnx (the test extra) not installed")
    from sklearn.datasets import load_iris

    x = load_iris(return_X_y=True)[0][::30].astype(np.float32)
    plain = ort_run(paths["iris"], {"X": x})
    meta = client.get("/v2/models/iris_zipmap").json()
    assert [(o["name"], o["datatype"]) for o in meta["outputs"]] == \
        [("output_label", "INT64"), ("output_probability", "FP32")]
    assert plain["label"].tolist() == [0, 0, 1, 1, 2]
    for model, (label, probabilities) in (("iris", ("label", "probabilities")),
                                          ("iris_zipmap", ("output_label",
                                                           "output_probability"))):
        for binary in (True, False):
            got = infer(client, model, {"X": x}, binary)
            np.testing.assert_array_equal(got.as_numpy(label), plain["label"])
            np.testing.assert_array_equal(got.as_numpy(probabilities), plain["probabilities"])
    zipped = ort_run(paths["iris_zipmap"], {"X": x})["output_probability"]
    assert [sorted(row) for row in zipped] == [[0, 1, 2]] * len(x)  # dicts, served dense


def test_sklearn_regressor(client: TestClient, paths: dict[str, Path]) -> None:
    if "diabetes" not in paths:
        pytest.skip("skl2onnx (the test extra) not installed")
    from sklearn.datasets import load_diabetes

    x = load_diabetes(return_X_y=True)[0][:5].astype(np.float32)
    want = ort_run(paths["diabetes"], {"X": x})["variable"]
    got = infer(client, "diabetes", {"X": x}).as_numpy("variable")
    assert got.shape == (5, 1)
    np.testing.assert_array_equal(got, want)


def test_a_wrong_width_for_a_fixed_dim_names_the_input(client: TestClient) -> None:
    r = client.post("/v2/models/diabetes/infer", content=orjson.dumps({"inputs": [
        {"name": "X", "datatype": "FP32", "shape": [1, 3], "data": [0.0, 0.0, 0.0]}]}))
    assert r.status_code == 400 and "'X'" in r.text and "[-1, 10]" in r.text, r.text

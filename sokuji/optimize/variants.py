"""Building the variants of one ONNX text encoder.

- ``fp32``: the original, the reference every other variant is judged against.
- ``opt``: ONNX Runtime's transformer fusions (``onnxruntime.transformers.optimizer``:
  Attention, SkipLayerNormalization, BiasGelu, ...); FP32 arithmetic.
- ``fp16``: ``opt`` with FP16 weights and arithmetic (inputs and outputs stay FP32).
- ``int8``: dynamic quantization, INT8 per-channel weights on MatMul and Attention (embedding
  tables stay FP32; per-tensor loses too much on MiniLM), of ``opt`` if it measured faster
  than ``fp32``, else of ``fp32`` (ONNX Runtime's own session-time fusions then apply).
- ``int8-mixed``: ``int8`` with the FFN output projections (the MatMuls fed by GELU) and the
  attention output projections kept FP32. GELU's outputs have the widest range, and dynamic
  per-tensor activation quantization loses most there. Measured on MiniLM: recall@10
  0.93 (int8) -> 0.95 (GELU-fed kept) -> 0.97 (both kept), at 2.4x, 1.5x and 1.4x FP32's
  items/s;
- ``int8-static``: static QDQ quantization of ``fp32`` (MatMul weights per channel,
  activations calibrated on the calibration set).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

VARIANTS = ("fp32", "opt", "fp16", "int8", "int8-mixed", "int8-static")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")


@dataclass(frozen=True)
class Shape:
    num_heads: int
    hidden_size: int


def detect_shape(model_path: Path, config_json: Path | None = None) -> Shape | None:
    """Attention heads and hidden size: from a Hugging Face config.json if there is one,
    else from the graph (the embedding table's width; a Reshape to [.., .., heads, head_dim])."""
    if config_json is not None and config_json.is_file():
        cfg = json.loads(config_json.read_text())
        if "num_attention_heads" in cfg and "hidden_size" in cfg:
            return Shape(int(cfg["num_attention_heads"]), int(cfg["hidden_size"]))
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path), load_external_data=False)
    hidden = 0
    for init in model.graph.initializer:
        if len(init.dims) == 2 and init.dims[0] > 1000:  # a vocabulary-sized table
            hidden = max(hidden, int(init.dims[1]))
    if not hidden:
        return None
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
              if len(t.dims) <= 1}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and len(attr.t.dims) <= 1:
                    values[node.output[0]] = numpy_helper.to_array(attr.t)
    shapes = [v for v in values.values() if v.shape == (4,)]
    for node in model.graph.node:  # a Reshape target assembled as [batch, seq, heads, dim]
        if node.op_type == "Concat" and len(node.input) == 4 \
                and all(i in values for i in node.input[2:]):
            shapes.append(np.asarray([0, 0, *(int(np.ravel(values[i])[0])
                                              for i in node.input[2:])]))
    for arr in shapes:
        if arr.dtype.kind != "i":
            continue
        heads, dim = int(arr[2]), int(arr[3])
        if heads == -1 and dim > 0 and hidden % dim == 0:  # [.., .., -1, head_dim]
            heads = hidden // dim
        if dim == -1 and heads > 0 and hidden % heads == 0:
            dim = hidden // heads
        if heads > 0 and dim > 0 and heads * dim == hidden:
            return Shape(heads, hidden)
    return None


def build_opt(source: Path, target: Path, shape: Shape | None) -> dict[str, Any]:
    from onnxruntime.transformers import optimizer

    model = optimizer.optimize_model(
        str(source), model_type="bert", num_heads=shape.num_heads if shape else 0,
        hidden_size=shape.hidden_size if shape else 0, opt_level=1)
    stats = {k: v for k, v in model.get_fused_operator_statistics().items() if v}
    model.save_model_to_file(str(target))
    return {"tool": "onnxruntime.transformers.optimizer.optimize_model", "model_type": "bert",
            "num_heads": shape.num_heads if shape else None,
            "hidden_size": shape.hidden_size if shape else None, "fused": stats}


def build_fp16(opt_path: Path, target: Path) -> dict[str, Any]:
    import onnx
    from onnxruntime.transformers.onnx_model import OnnxModel

    model = OnnxModel(onnx.load(str(opt_path)))
    model.convert_float_to_float16(keep_io_types=True)
    model.save_model_to_file(str(target))
    return {"tool": "OnnxModel.convert_float_to_float16", "from": "opt", "keep_io_types": True}


def sensitive_matmuls(path: Path) -> list[str]:
    """MatMul nodes kept FP32 in ``int8-mixed``: those fed by a GELU (the FFN output
    projections) and those fed by an attention block (the attention output projections)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    producer = {o: n for n in graph.node for o in n.output}
    shape_only = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Cast", "Identity"}

    def origin(tensor: str) -> Any:
        node = producer.get(tensor)
        while node is not None and node.op_type in shape_only:
            node = producer.get(node.input[0])
        return node

    weights = {t.name: tuple(t.dims) for t in graph.initializer}

    def narrowing(node: Any) -> bool:  # [4h, h]: the FFN output projection, however GELU is
        dims = weights.get(node.input[1]) if len(node.input) > 1 else None  # written
        return dims is not None and len(dims) == 2 and dims[0] > dims[1]

    def sensitive(tensor: str) -> bool:
        node = origin(tensor)
        if node is None:
            return False
        if "Gelu" in node.op_type or "Attention" in node.op_type:
            return True
        # unfused attention: (softmax(QK^T) @ V) feeds the output projection
        src = origin(node.input[0]) if node.op_type == "MatMul" else None
        return src is not None and src.op_type == "Softmax"

    return [n.name for n in graph.node if n.op_type == "MatMul"
            and (sensitive(n.input[0]) or narrowing(n))]


def build_int8(base: Path, target: Path, mixed: bool = False, origin: str = "fp32"
               ) -> dict[str, Any]:
    """Quantize ``base`` (fp32 or opt: whichever measured faster)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    ops = ["MatMul", "Attention"]
    exclude = sensitive_matmuls(base) if mixed else []
    quantize_dynamic(str(base), str(target), weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=ops, nodes_to_exclude=exclude,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    return {"tool": "onnxruntime.quantization.quantize_dynamic", "from": origin,
            "weight_type": "QInt8", "per_channel": True, "op_types": ops,
            "kept_fp32": exclude}


class _Calibration:
    """Feeds tokenised calibration texts to ONNX Runtime's calibrator, batch by batch."""

    def __init__(self, batches: list[dict[str, np.ndarray]]) -> None:
        self._it: Iterator[dict[str, np.ndarray]] = iter(batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:  # (the calibrator may ask)
        pass


def build_int8_static(source: Path, target: Path,
                      feeds: Callable[[Sequence[str]], dict[str, np.ndarray]],
                      calibration: Sequence[str], batch: int = 16) -> dict[str, Any]:
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepped = target.with_name("preprocessed.onnx")
    quant_pre_process(str(source), str(prepped), skip_symbolic_shape=True)
    batches = [feeds(calibration[i:i + batch]) for i in range(0, len(calibration), batch)]
    reader = _Calibration(batches)
    ops = ["MatMul"]
    quantize_static(str(prepped), str(target), reader,
                    quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    op_types_to_quantize=ops, calibrate_method=CalibrationMethod.MinMax)
    prepped.unlink(missing_ok=True)
    return {"tool": "onnxruntime.quantization.quantize_static", "from": "fp32",
            "format": "QDQ", "per_channel": True, "activations": "QUInt8 (MinMax)",
            "weights": "QInt8", "op_types": ops, "calibration_texts": len(calibration)}

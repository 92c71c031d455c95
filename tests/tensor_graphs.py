"""Small real ONNX graphs for the tensor kind's tests, built with the ``onnx`` package's
helper API and run by real ONNX Runtime: one per property tested (every datatype through,
arithmetic whose results are NaN and infinity, a value-dependent failure, a fixed shape).

Each ``write_*`` writes one graph into a directory and returns its path (a test's
``tmp_path_factory`` directory: they take milliseconds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

NUMERIC = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
           "FP16", "FP32", "FP64")
EVERY = (*NUMERIC, "BYTES")
"""Every KServe V2 datatype."""
OPSET = 17


def elem_type(datatype: str) -> int:
    from onnx import TensorProto

    return {"BOOL": TensorProto.BOOL, "UINT8": TensorProto.UINT8,
            "UINT16": TensorProto.UINT16, "UINT32": TensorProto.UINT32,
            "UINT64": TensorProto.UINT64, "INT8": TensorProto.INT8,
            "INT16": TensorProto.INT16, "INT32": TensorProto.INT32,
            "INT64": TensorProto.INT64, "FP16": TensorProto.FLOAT16,
            "FP32": TensorProto.FLOAT, "FP64": TensorProto.DOUBLE,
            "BYTES": TensorProto.STRING}[datatype]


def _save(graph: Any, path: Path, opset: int = OPSET) -> Path:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="sokuji-tests")
    model.ir_version = 8 if opset < 19 else 9  # what ONNX Runtime 1.16 and later load
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def write_every_type(directory: Path, width: int = 3) -> Path:
    """``x_<DT>`` ``[batch, width]`` -> ``y_<DT>`` (Identity) for every V2 datatype, BYTES
    as an ONNX string tensor; and ``c_INT32`` ``[batch, width]`` -> ``c_FP64`` (Cast)."""
    from onnx import TensorProto, helper

    inputs, outputs, nodes = [], [], []
    for dt in EVERY:
        inputs.append(helper.make_tensor_value_info(f"x_{dt}", elem_type(dt), ["batch", width]))
        outputs.append(helper.make_tensor_value_info(f"y_{dt}", elem_type(dt),
                                                     ["batch", width]))
        nodes.append(helper.make_node("Identity", [f"x_{dt}"], [f"y_{dt}"]))
    inputs.append(helper.make_tensor_value_info("c_INT32", TensorProto.INT32, ["batch", width]))
    outputs.append(helper.make_tensor_value_info("c_FP64", TensorProto.DOUBLE, ["batch", width]))
    nodes.append(helper.make_node("Cast", ["c_INT32"], ["c_FP64"], to=TensorProto.DOUBLE))
    return _save(helper.make_graph(nodes, "every_type", inputs, outputs),
                 directory / "every_type.onnx")


def write_arith(directory: Path) -> Path:
    """``a``, ``b`` FP32 ``[batch, n]`` -> ``sum`` = a + b, ``ratio`` = a / b (0 / 0 is NaN,
    1 / 0 infinity), ``total`` FP32 ``[batch]`` = the row sums of a * b (a reduction: rows
    must never mix)."""
    from onnx import TensorProto, helper

    f32 = TensorProto.FLOAT
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["sum"]),
         helper.make_node("Div", ["a", "b"], ["ratio"]),
         helper.make_node("Mul", ["a", "b"], ["prod"]),
         helper.make_node("ReduceSum", ["prod", "axes"], ["total"], keepdims=0)],
        "arith",
        [helper.make_tensor_value_info("a", f32, ["batch", "n"]),
         helper.make_tensor_value_info("b", f32, ["batch", "n"])],
        [helper.make_tensor_value_info("sum", f32, ["batch", "n"]),
         helper.make_tensor_value_info("ratio", f32, ["batch", "n"]),
         helper.make_tensor_value_info("total", f32, ["batch"])],
        initializer=[axes])
    return _save(graph, directory / "arith.onnx")


def write_strings(directory: Path) -> Path:
    """``text`` BYTES ``[batch]`` -> ``same`` (Identity) and ``shout`` (StringConcat of
    ``"!"``, opset 20): a string tensor computed on."""
    from onnx import TensorProto, helper

    s = TensorProto.STRING
    suffix = helper.make_tensor("suffix", s, [], [b"!"])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["same"]),
         helper.make_node("StringConcat", ["text", "suffix"], ["shout"])],
        "strings",
        [helper.make_tensor_value_info("text", s, ["batch"])],
        [helper.make_tensor_value_info("same", s, ["batch"]),
         helper.make_tensor_value_info("shout", s, ["batch"])],
        initializer=[suffix])
    return _save(graph, directory / "strings.onnx", opset=20)


def write_gather(directory: Path, size: int = 5) -> Path:
    """``index`` INT64 ``[batch, 1]`` -> ``value`` FP32 ``[batch, 1]``: a table of ``size``
    entries looked up; an index past it fails in ONNX Runtime (a value-dependent failure
    that no shape check can see)."""
    from onnx import TensorProto, helper

    table = helper.make_tensor("table", TensorProto.FLOAT, [size],
                               [float(10 * i) for i in range(size)])
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "index"], ["value"], axis=0)],
        "gather",
        [helper.make_tensor_value_info("index", TensorProto.INT64, ["batch", 1])],
        [helper.make_tensor_value_info("value", TensorProto.FLOAT, ["batch", 1])],
        initializer=[table])
    return _save(graph, directory / "gather.onnx")


def write_reshape(directory: Path) -> Path:
    """``x`` FP32 ``[batch, n]`` -> ``y`` ``[batch, n / 3, 3]``: Reshape, which fails when
    ``n`` is not a multiple of 3."""
    from onnx import TensorProto, helper

    shape = helper.make_tensor("shape", TensorProto.INT64, [3], [0, -1, 3])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "m", 3])],
        initializer=[shape])
    return _save(graph, directory / "reshape.onnx")


def write_double(directory: Path, name: str = "double.onnx") -> Path:
    """``x`` FP32 ``[batch, n]`` -> ``y`` = x + x: the hostile suite's tensor model
    (``tests/data/tensor/double.onnx`` is this graph, written by ``python -m
    tests.tensor_graphs``)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])], "double",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])])
    return _save(graph, directory / name)


def write_fixed(directory: Path) -> Path:
    """``x`` FP32 ``[2, 4]`` (no dynamic batch dimension) -> ``y`` = x * 2: served
    unbatched, each request as the graph takes it."""
    from onnx import TensorProto, helper

    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])], "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        initializer=[two])
    return _save(graph, directory / "fixed.onnx")


def write_fp16(directory: Path) -> Path:
    """A small MLP in FP16 (weights, inputs, outputs): ``x`` FP16 ``[batch, 4]`` ->
    ``y`` FP16 ``[batch, 2]`` = relu(x W1 + b1) W2 + b2."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    w1, b1 = rng.normal(size=(4, 8)).astype(np.float16), rng.normal(size=8).astype(np.float16)
    w2, b2 = rng.normal(size=(8, 2)).astype(np.float16), rng.normal(size=2).astype(np.float16)
    f16 = TensorProto.FLOAT16
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h0"]),
         helper.make_node("Add", ["h0", "b1"], ["h1"]),
         helper.make_node("Relu", ["h1"], ["h2"]),
         helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
         helper.make_node("Add", ["h3", "b2"], ["y"])],
        "mlp_fp16",
        [helper.make_tensor_value_info("x", f16, ["batch", 4])],
        [helper.make_tensor_value_info("y", f16, ["batch", 2])],
        initializer=[numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
                     numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(b2, "b2")])
    return _save(graph, directory / "mlp_fp16.onnx")


def sample(datatype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Values of ``datatype`` that use its range (its extremes included) and, for floats,
    non-integers."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if datatype == "BYTES":
        words = ["", "a", "héllo", "日本語", "x" * 40, "with space", "\u00ff\u0100"]
        return np.array([words[int(i) % len(words)] for i in rng.integers(0, 99, n)],
                        dtype=object).reshape(shape)
    if datatype == "BOOL":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    from sokuji.core.tensor import DTYPES

    dtype = DTYPES[datatype]
    if dtype.kind == "f":
        values = rng.normal(scale=100, size=n).astype(dtype)
    else:
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        values[:2] = [info.min, info.max][: min(2, n)]
    return values.reshape(shape)


if __name__ == "__main__":  # the committed graph of the hostile suite
    write_double(Path(__file__).parent / "data" / "tensor")

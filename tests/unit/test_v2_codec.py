"""The one V2 codec (``server/v2.py``): every KServe datatype both ways (JSON and the binary
extension), checks against the model's metadata that name the input and what was expected
and received, work bounded by the data actually sent, outputs encoded as asked."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson
import pytest

from sokuji.core.model import ModelMetadata, TensorSpec
from sokuji.core.tensor import DTYPES, Tensor
from sokuji.errors import BadRequest, InvalidInput
from sokuji.server import cache_entries, v2, v2_encode

NUMERIC = sorted(DTYPES)
VALUES: dict[str, list[Any]] = {
    "BOOL": [True, False, True, True, False, False],
    **{t: [0, 1, 2, 3, 4, 5] for t in NUMERIC if t[0] == "U"},
    **{t: [-3, -2, -1, 0, 1, 2] for t in NUMERIC if t[0] == "I"},
    **{t: [0.5, -1.25, 2.0, 3.5, -0.125, 8.0] for t in NUMERIC if t.startswith("FP")},
}


def meta(*inputs: TensorSpec, outputs: tuple[TensorSpec, ...] = ()) -> ModelMetadata:
    return ModelMetadata("test", inputs, outputs)


def binary_body(doc: dict[str, Any], blobs: list[bytes]) -> tuple[bytes, int]:
    head = orjson.dumps(doc)
    return head + b"".join(blobs), len(head)


@pytest.mark.parametrize("datatype", NUMERIC)
def test_every_numeric_datatype_from_json_and_binary(datatype: str) -> None:
    m = meta(TensorSpec("x", datatype, (-1, 3)))
    values = VALUES[datatype]
    expected = np.array(values, dtype=DTYPES[datatype]).reshape(2, 3)
    doc = {"inputs": [{"name": "x", "datatype": datatype, "shape": [2, 3], "data": values}]}
    got = v2.decode(orjson.dumps(doc), None, m).inputs["x"]
    assert got.datatype == datatype and got.shape == (2, 3) and not got.binary
    assert got.data.dtype == DTYPES[datatype] and np.array_equal(got.data, expected)
    nested = {"inputs": [{**doc["inputs"][0], "data": [values[:3], values[3:]]}]}
    assert np.array_equal(v2.decode(orjson.dumps(nested), None, m).inputs["x"].data, expected)
    blob = expected.tobytes()
    body, head = binary_body({"inputs": [{"name": "x", "datatype": datatype, "shape": [2, 3],
                                          "parameters": {"binary_data_size": len(blob)}}]},
                             [blob])
    raw = v2.decode(body, head, m).inputs["x"]
    assert raw.binary and np.array_equal(raw.data, expected) and raw.data.dtype == expected.dtype


def test_bytes_elements_are_str_from_json_and_bytes_from_binary() -> None:
    m = meta(TensorSpec("t", "BYTES", (-1,)))
    doc = {"inputs": [{"name": "t", "datatype": "BYTES", "shape": [2], "data": ["a", "bé"]}]}
    assert v2.decode(orjson.dumps(doc), None, m).inputs["t"].data == ["a", "bé"]
    elements = [b"\xff\x00raw", b""]
    blob = b"".join(struct.pack("<I", len(e)) + e for e in elements)
    body, head = binary_body({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [2, 1],
                                          "parameters": {"binary_data_size": len(blob)}}]},
                             [blob])
    got = v2.decode(body, head, m).inputs["t"]
    assert got.data == elements and got.binary and got.shape == (2, 1)


def test_several_inputs_binary_and_json_mixed_in_order() -> None:
    m = meta(TensorSpec("ids", "INT64", (-1, -1)), TensorSpec("mask", "BOOL", (-1, -1)),
             TensorSpec("scale", "FP16", (1,), optional=True))
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    mask = np.array([[1, 1, 0], [1, 0, 0]], dtype=np.bool_)
    body, head = binary_body({"id": "r", "inputs": [
        {"name": "ids", "datatype": "INT64", "shape": [2, 3],
         "parameters": {"binary_data_size": ids.nbytes}},
        {"name": "mask", "datatype": "BOOL", "shape": [2, 3], "data": mask.tolist()}]},
        [ids.tobytes()])
    req = v2.decode(body, head, m)
    assert list(req.inputs) == ["ids", "mask"] and req.request_id == "r"
    assert np.array_equal(req.inputs["ids"].data, ids)
    assert np.array_equal(req.inputs["mask"].data, mask)


@pytest.mark.parametrize(("tensor", "words"), [
    ({"datatype": "INT8", "shape": [1], "data": [300]}, "out of the range of INT8"),
    ({"datatype": "UINT8", "shape": [1], "data": [-1]}, "out of the range of UINT8"),
    ({"datatype": "INT32", "shape": [1], "data": [1.5]}, "INT32 elements must be integers"),
    ({"datatype": "INT32", "shape": [1], "data": [True]}, "element 0 is bool"),
    ({"datatype": "FP32", "shape": [1], "data": ["1"]}, "FP32 elements must be numbers"),
    ({"datatype": "BOOL", "shape": [1], "data": [1]}, "BOOL elements must be booleans"),
    ({"datatype": "BF16", "shape": [1], "data": [1.0]}, "unsupported datatype 'BF16'"),
    ({"datatype": {"a": 1}, "shape": [1], "data": [1.0]}, "unsupported datatype"),
    ({"datatype": "FP64", "shape": [1], "data": [1.0]}, "datatype 'FP64'; expected FP32"),
    ({"datatype": "FP32", "shape": [2, 2], "data": [1.0, 2.0, 3.0]},
     "shape [2, 2] with 3 elements"),
    ({"datatype": "FP32", "shape": [2, 3], "data": [0.0] * 6}, "expected [-1, 2]"),
    ({"datatype": "FP32", "shape": [1, 2, 2], "data": [0.0] * 4}, "expected [-1, 2]"),
])
def test_bad_tensors_name_the_input_and_what_was_expected(tensor: dict[str, Any],
                                                          words: str) -> None:
    asked = tensor["datatype"]
    spec = TensorSpec("x", asked, (-1,)) \
        if isinstance(asked, str) and asked in DTYPES and not asked.startswith("FP") \
        else TensorSpec("x", "FP32", (-1, 2))
    m = meta(spec)
    with pytest.raises(InvalidInput, match="input 'x'") as exc:
        v2.decode(orjson.dumps({"inputs": [{"name": "x", **tensor}]}), None, m)
    assert words in exc.value.message


def test_free_dimensions_and_a_trailing_one() -> None:
    m = meta(TensorSpec("x", "FP32", (-1, 2)))
    for shape in ([0, 2], [3, 2], [3, 2, 1]):
        n = int(np.prod(shape))
        doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": shape,
                           "data": [0.0] * n}]}
        assert v2.decode(orjson.dumps(doc), None, m).inputs["x"].shape == tuple(shape)


def test_shapes_larger_than_the_data_are_refused_before_any_allocation() -> None:
    m = meta(TensorSpec("x", "FP32", (-1, -1)))
    huge = [2 ** 62, 2 ** 62]
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": huge, "data": [1.0]}]}
    with pytest.raises(InvalidInput, match="does not match its data"):
        v2.decode(orjson.dumps(doc), None, m)
    body, head = binary_body({"inputs": [{"name": "x", "datatype": "FP32", "shape": huge,
                                          "parameters": {"binary_data_size": 8}}]},
                             [b"\0" * 8])
    with pytest.raises(InvalidInput, match="does not match its data"):
        v2.decode(body, head, m)
    bm = meta(TensorSpec("t", "BYTES", (-1,)))
    body, head = binary_body({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [10 ** 9],
                                          "parameters": {"binary_data_size": 8}}]},
                             [b"\0" * 8])
    with pytest.raises(InvalidInput, match="does not match its data"):
        v2.decode(body, head, bm)


def test_binary_sizes_must_match_the_shape_exactly() -> None:
    m = meta(TensorSpec("x", "INT32", (-1,)))
    body, head = binary_body({"inputs": [{"name": "x", "datatype": "INT32", "shape": [3],
                                          "parameters": {"binary_data_size": 8}}]},
                             [b"\0" * 8])
    with pytest.raises(InvalidInput, match="8 bytes of INT32 data"):
        v2.decode(body, head, m)
    with pytest.raises(InvalidInput, match="does not fit"):
        body, head = binary_body({"inputs": [{"name": "x", "datatype": "INT32", "shape": [2],
                                              "parameters": {"binary_data_size": 99}}]},
                                 [b"\0" * 8])
        v2.decode(body, head, m)
    with pytest.raises(BadRequest, match="does not fit a body"):
        v2.decode(b"{}", 5, m)


def test_required_optional_and_unknown_inputs() -> None:
    m = meta(TensorSpec("q", "BYTES", (-1,)), TensorSpec("user", "BYTES", (-1,),
                                                        optional=True))
    one = {"name": "q", "datatype": "BYTES", "shape": [1], "data": ["a"]}
    assert list(v2.decode(orjson.dumps({"inputs": [one]}), None, m).inputs) == ["q"]
    with pytest.raises(InvalidInput, match="needs input 'q'"):
        v2.decode(orjson.dumps({"inputs": [{**one, "name": "user"}]}), None, m)
    with pytest.raises(InvalidInput, match=r"non-empty list \(the model needs input 'q'\)"):
        v2.decode(b'{"inputs": []}', None, m)
    with pytest.raises(InvalidInput, match="unexpected input 'z'; the model takes: q, user"):
        v2.decode(orjson.dumps({"inputs": [one, {**one, "name": "z"}]}), None, m)


def test_requested_outputs_in_the_models_order() -> None:
    m = meta(TensorSpec("x", "BYTES", (-1,)),
             outputs=(TensorSpec("a", "FP32", (-1,)), TensorSpec("b", "INT64", (-1,))))
    doc = {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["q"]}],
           "outputs": [{"name": "b", "parameters": {"binary_data": True}}, {"name": "a"}]}
    assert list(v2.decode(orjson.dumps(doc), None, m).outputs.items()) == [
        ("a", False), ("b", True)]
    doc = {**doc, "outputs": None, "parameters": {"binary_data_output": True}}
    assert v2.decode(orjson.dumps(doc), None, m).outputs == {"a": True, "b": True}


@pytest.mark.parametrize("datatype", [*NUMERIC, "BYTES"])
def test_outputs_both_ways_and_packed(datatype: str) -> None:
    if datatype == "BYTES":
        tensor = Tensor("o", "BYTES", (2,), ["é", b"raw"])
        as_json: Any = ["é", "raw"]
        blob = struct.pack("<I", 2) + "é".encode() + struct.pack("<I", 3) + b"raw"
    else:
        array = np.array(VALUES[datatype], dtype=DTYPES[datatype]).reshape(3, 2)
        tensor = Tensor("o", datatype, (3, 2), array)
        as_json, blob = array.reshape(-1).tolist(), array.tobytes()
    body, headers = v2_encode.encode_infer("m", "1", "rid", [tensor], {"o": False})
    doc = orjson.loads(body)
    assert doc["id"] == "rid" and doc["outputs"][0]["data"] == as_json
    assert doc["outputs"][0]["shape"] == list(tensor.shape)
    body, headers = v2_encode.encode_infer("m", "1", "", [tensor], {"o": True})
    n = int(headers[v2.HEADER_LENGTH])
    assert body[n:] == blob
    assert orjson.loads(body[:n])["outputs"][0]["parameters"] == {"binary_data_size": len(blob)}
    back = cache_entries.unpack(cache_entries.pack([tensor]))[0]
    assert back.name == "o" and back.datatype == datatype and back.shape == tensor.shape
    if datatype == "BYTES":
        assert back.data == ["é".encode(), b"raw"]
    else:
        assert np.array_equal(back.data, tensor.data)

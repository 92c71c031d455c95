"""The gRPC binding's codec (``server/grpc_codec.py``; its status codes: ``grpc_v2.py``)
without a server: a ``ModelInferRequest``
decodes to the ``InferRequest`` REST's codec gives for the same tensors, is checked the same
way (each refusal an ``InvalidInput`` naming the input), and a response reads back through
tritonclient's own ``InferResult``; the status table and the deadline."""

from __future__ import annotations

import math
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2

from sokuji import config as cfg
from sokuji.core.model import ModelMetadata, TensorSpec
from sokuji.core.tensor import Tensor
from sokuji.errors import (
    DeadlineExceeded,
    Forbidden,
    InvalidInput,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    Unauthorized,
)
from sokuji.server import grpc_codec, grpc_v2, v2

META = ModelMetadata("onnxruntime_onnx", (TensorSpec("x", "FP32", (-1, 2)),
                                          TensorSpec("t", "BYTES", (-1,), optional=True)),
                     (TensorSpec("y", "FP32", (-1, 2)), TensorSpec("z", "INT64", (-1,))))


def request(x: np.ndarray | None = None, raw: bytes | None = None, **fields: Any) -> Any:
    req = service_pb2.ModelInferRequest(model_name="m", id="r1")
    x = np.arange(4, dtype=np.float32).reshape(2, 2) if x is None else x
    req.inputs.add(name="x", datatype=fields.pop("datatype", "FP32"),
                   shape=fields.pop("shape", list(x.shape)))
    req.raw_input_contents.append(x.tobytes() if raw is None else raw)
    return req


def test_raw_decodes_as_rest_binary() -> None:
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    req = request(x)
    req.parameters["priority"].uint64_param = 2
    req.parameters["timeout"].int64_param = 5000
    decoded = grpc_codec.decode(req, META)
    head = b'{"id":"r1","inputs":[{"name":"x","datatype":"FP32","shape":[2,2],' \
        b'"parameters":{"binary_data_size":16}}]}'
    rest = v2.decode(head + x.tobytes(), len(head), META)
    assert decoded.inputs["x"].datatype == "FP32" and decoded.inputs["x"].shape == (2, 2)
    np.testing.assert_array_equal(decoded.inputs["x"].data, rest.inputs["x"].data)
    assert decoded.request_id == "r1" and decoded.parameters == {"priority": 2, "timeout": 5000}
    assert decoded.outputs == {"y": True, "z": True}


def test_byte_size_disagreeing_with_shape() -> None:
    with pytest.raises(InvalidInput, match=r"input 'x': raw content of 12 bytes does not "
                       r"match shape \[2, 2\] x FP32 \(4 elements x 4 bytes = 16\)"):
        grpc_codec.decode(request(raw=b"\0" * 12), META)


def test_refusals_name_the_input() -> None:
    with pytest.raises(InvalidInput, match="datatype 'INT32'; expected FP32"):
        grpc_codec.decode(request(np.zeros((2, 2), np.int32), datatype="INT32"), META)
    with pytest.raises(InvalidInput, match=r"shape \[2, 3\]; expected \[-1, 2\]"):
        grpc_codec.decode(request(np.zeros((2, 3), np.float32)), META)
    req = request()
    req.raw_input_contents.append(b"extra")
    with pytest.raises(InvalidInput, match="2 raw_input_contents for 1 inputs"):
        grpc_codec.decode(req, META)
    req = request()
    req.outputs.add(name="nope")
    with pytest.raises(InvalidInput, match="unknown output 'nope'"):
        grpc_codec.decode(req, META)
    req = service_pb2.ModelInferRequest(model_name="m")
    with pytest.raises(InvalidInput, match="needs input 'x'"):
        grpc_codec.decode(req, META)
    t = req.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    t.contents.fp32_contents.extend([1.0, 2.0, 3.0])
    with pytest.raises(InvalidInput, match=r"3 elements in contents\.fp32_contents"):
        grpc_codec.decode(req, META)


def test_typed_contents() -> None:
    meta = ModelMetadata("p", (TensorSpec("a", "INT8", (-1,)), TensorSpec("t", "BYTES", (-1,))),
                         (), open=False)
    req = service_pb2.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="a", datatype="INT8", shape=[3])
    t.contents.int_contents.extend([-128, 0, 127])
    s = req.inputs.add(name="t", datatype="BYTES", shape=[2])
    s.contents.bytes_contents.extend([b"x", b"yz"])
    decoded = grpc_codec.decode(req, meta)
    assert decoded.inputs["a"].data.dtype == np.int8
    assert decoded.inputs["a"].data.tolist() == [-128, 0, 127]
    assert decoded.inputs["t"].data == [b"x", b"yz"]
    t.contents.int_contents[0] = 128
    with pytest.raises(InvalidInput, match="out of the range of INT8"):
        grpc_codec.decode(req, meta)


def test_response_reads_back_through_tritonclient() -> None:
    y = np.arange(4, dtype=np.float32).reshape(2, 2)
    outputs = [Tensor("y", "FP32", (2, 2), y), Tensor("z", "INT64", (2,), np.array([1, 2])),
               Tensor("s", "BYTES", (2,), ["a", b"b"])]
    res = grpcclient.InferResult(grpc_codec.encode("m", "1", "r1", outputs,
                                                {"y": True, "s": True}))
    np.testing.assert_array_equal(res.as_numpy("y"), y)
    assert res.as_numpy("s").tolist() == [b"a", b"b"] and res.as_numpy("z") is None
    assert res.get_response().id == "r1"


def test_status_table() -> None:
    s = grpc.StatusCode
    assert grpc_v2.status_of(InvalidInput("x")) == s.INVALID_ARGUMENT
    assert grpc_v2.status_of(ModelNotFound("x")) == s.NOT_FOUND
    assert grpc_v2.status_of(Unauthorized("x")) == s.UNAUTHENTICATED
    assert grpc_v2.status_of(Forbidden("x")) == s.PERMISSION_DENIED
    assert grpc_v2.status_of(Overloaded("x", retry_after_s=1)) == s.RESOURCE_EXHAUSTED
    assert grpc_v2.status_of(PayloadTooLarge("x")) == s.RESOURCE_EXHAUSTED
    assert grpc_v2.status_of(DeadlineExceeded("x")) == s.DEADLINE_EXCEEDED


def test_deadline_is_the_sooner() -> None:
    decoded = grpc_codec.decode(request(), META)
    grpc_v2._deadline(decoded, {}, 0.25)
    assert math.isclose(decoded.parameters["timeout"], 250_000)
    decoded.parameters["timeout"] = 1000
    grpc_v2._deadline(decoded, {}, 0.25)
    assert decoded.parameters["timeout"] == 1000  # asked for sooner: kept
    decoded.parameters.pop("timeout")
    grpc_v2._deadline(decoded, {"x-sokuji-timeout-ms": "5"}, 0.25)
    assert "timeout" not in decoded.parameters  # the header rules, as on REST


def test_message_limit_is_the_largest() -> None:
    config = cfg.ServerConfig(max_request_bytes=1 << 20, models=(
        cfg.ModelConfig(name="a"), cfg.ModelConfig(name="b", max_request_bytes=8 << 20)))
    assert grpc_v2.message_limit(config) == 8 << 20

"""KServe V2 over gRPC, the messages: a ``ModelInferRequest`` decoded into the
``InferRequest`` of named ``Tensor``s REST decodes to (the checks of ``v2.py``: datatype,
shape against the model's metadata, element counts against the bytes sent), and outputs
encoded as a ``ModelInferResponse``'s raw contents, as Triton's are. The service that uses
them is ``grpc_v2.py``; ``grpc_generate.py`` reads generators' messages with the same
``parameters``.

- Inputs: ``raw_input_contents`` (what ``tritonclient.grpc`` always sends: one per input,
  row-major little-endian, BYTES elements each after a 4-byte little-endian length) or the
  typed ``contents`` fields (FP16 has none: raw only). Outputs always go back as
  ``raw_output_contents``; ``outputs`` chooses which."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from sokuji.core.model import ModelMetadata, ServedModel, TensorSpec
from sokuji.core.tensor import BYTES, DATATYPES, DTYPES, InferRequest, Tensor
from sokuji.errors import InvalidInput
from sokuji.server import v2, v2_encode

_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
             "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
             "UINT16": "uint_contents", "UINT32": "uint_contents",
             "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
             BYTES: "bytes_contents"}
"""The typed ``contents`` field of each datatype (FP16 has none: raw contents only)."""

# -- decoding ------------------------------------------------------------------------------

def parameters(params: Mapping[str, Any]) -> dict[str, Any]:
    """``InferParameter``s as plain values (what REST's JSON parameters are)."""
    out: dict[str, Any] = {}
    for key, param in params.items():
        choice = param.WhichOneof("parameter_choice")
        out[key] = getattr(param, choice) if choice is not None else None
    return out


def decode(req: Any, meta: ModelMetadata) -> InferRequest:
    """A ``ModelInferRequest`` as the ``InferRequest`` REST decodes to, checked the same way
    (``v2.py``), or ``InvalidInput`` naming the field."""
    raw = req.raw_input_contents
    if raw and len(raw) != len(req.inputs):
        raise InvalidInput(f"{len(raw)} raw_input_contents for {len(req.inputs)} inputs: "
                           "send one per input, or none (typed contents)",
                           param="raw_input_contents")
    if not req.inputs and not meta.open:
        required = [s.name for s in meta.inputs if not s.optional]
        needs = f" (the model needs input '{required[0]}')" if required else ""
        raise InvalidInput(f"'inputs' must be a non-empty list{needs}", param="inputs")
    size = req.ByteSize()
    inputs: dict[str, Tensor] = {}
    for i, tensor in enumerate(req.inputs):
        name = tensor.name
        sent = TensorSpec(name, tensor.datatype, (-1,) * len(tensor.shape)) \
            if meta.open else None
        spec = v2.input_spec(meta, name, inputs, sent)
        inputs[name] = _tensor(tensor, spec, raw[i] if raw else None, size)
    v2.require_inputs(meta, inputs)
    outputs = [{"name": o.name} for o in req.outputs] if req.outputs else None
    return InferRequest(inputs, req.id, parameters(req.parameters),
                        v2._requested_outputs(outputs, meta, True))


def _tensor(tensor: Any, spec: TensorSpec, raw: bytes | None, size: int) -> Tensor:
    name, datatype = spec.name, tensor.datatype
    if datatype not in DATATYPES:
        raise InvalidInput(f"input '{name}' has unsupported datatype {v2.brief(datatype)} "
                           f"(the KServe datatypes: {', '.join(sorted(DATATYPES))})",
                           param=f"inputs.{name}.datatype")
    if datatype != spec.datatype:
        raise InvalidInput(f"input '{name}' has datatype {v2.brief(datatype)}; expected "
                           f"{spec.datatype}", param=f"inputs.{name}.datatype")
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise InvalidInput(f"input '{name}' has shape {list(shape)}; expected non-negative "
                           "dimensions", param=f"inputs.{name}.shape")
    count = v2._count(shape, size)
    if raw is not None:
        if tensor.HasField("contents"):
            raise InvalidInput(f"input '{name}' has both raw_input_contents and contents",
                               param=f"inputs.{name}.contents")
        if datatype != BYTES and len(raw) != count * DTYPES[datatype].itemsize:
            raise InvalidInput(
                f"input '{name}': raw content of {len(raw)} bytes does not match shape "
                f"{list(shape)} x {datatype} ({count} elements x "
                f"{DTYPES[datatype].itemsize} bytes = {count * DTYPES[datatype].itemsize})",
                param=f"inputs.{name}.raw_input_contents")
        data = v2.binary_data(name, datatype, shape, count, memoryview(raw))
    else:
        data = _contents(name, datatype, shape, count, tensor.contents)
    if not v2._fits(shape, spec.shape):
        raise InvalidInput(f"input '{name}' has shape {list(shape)}; expected "
                           f"{v2._expected(spec.shape)} (-1: any size)",
                           param=f"inputs.{name}.shape")
    return Tensor(name, datatype, shape, data, parameters(tensor.parameters), binary=True)


def _contents(name: str, datatype: str, shape: tuple[int, ...], count: int,
              contents: Any) -> Any:
    """An input's typed ``contents`` as an array (BYTES: a list of ``bytes``)."""
    field = _CONTENTS.get(datatype)
    if field is None:
        raise InvalidInput(f"input '{name}' is {datatype}, which has no typed contents: send "
                           "it in raw_input_contents", param=f"inputs.{name}.contents")
    values = getattr(contents, field)
    if len(values) != count:
        raise InvalidInput(f"input '{name}' has shape {list(shape)} with {len(values)} "
                           f"elements in contents.{field}; the shape does not match its data",
                           param=f"inputs.{name}.contents")
    if datatype == BYTES:
        return list(values)
    dtype = DTYPES[datatype]
    if dtype.kind in "iu" and dtype.itemsize < 4 and values:
        wide = np.asarray(values, dtype=np.int64)
        info = np.iinfo(dtype)
        if wide.min() < info.min or wide.max() > info.max:
            raise InvalidInput(f"input '{name}' has an element out of the range of "
                               f"{datatype}", param=f"inputs.{name}.contents")
        return wide.astype(dtype).reshape(shape)
    return np.asarray(values, dtype=dtype).reshape(shape)


def decode_inputs(served: ServedModel, req: Any, meta: ModelMetadata) -> tuple[InferRequest, Any]:
    """The message as a V2 request and as the model's inputs (on any thread)."""
    request = decode(req, meta)
    return request, served.from_tensors(request)


# -- encoding ------------------------------------------------------------------------------

def encode(model_name: str, version: str, request_id: str, outputs: Sequence[Tensor],
           wanted: Mapping[str, bool]) -> Any:
    """A ``ModelInferResponse``: the outputs ``wanted`` names, each as a raw content."""
    response = service_pb2.ModelInferResponse(model_name=model_name, model_version=version,
                                              id=request_id)
    for tensor in outputs:
        if wanted.get(tensor.name) is None:  # (an open model's: every output it gives)
            continue
        response.outputs.add(name=tensor.name, datatype=tensor.datatype,
                             shape=tensor.shape)
        response.raw_output_contents.append(v2_encode._blob(tensor))
    return response


def metadata_response(doc: Mapping[str, Any]) -> Any:
    """``v2_encode.model_metadata``'s body as a ``ModelMetadataResponse``."""
    tensor = service_pb2.ModelMetadataResponse.TensorMetadata
    return service_pb2.ModelMetadataResponse(
        name=doc["name"], versions=doc["versions"], platform=doc["platform"],
        inputs=[tensor(**t) for t in doc["inputs"]],
        outputs=[tensor(**t) for t in doc["outputs"]])



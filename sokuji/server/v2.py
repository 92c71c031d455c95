"""Open Inference Protocol (KServe V2) codec, REST, with Triton's binary tensor extension.

Decoding turns a body into plain data (``V2Request``) or raises ``InvalidInput`` naming the
field; encoding turns outputs into a body. Binary tensor data: the JSON header is followed by
raw tensor bytes, its length in the ``Inference-Header-Content-Length`` header; BYTES elements
are each prefixed with a 4-byte little-endian length.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np
import orjson

from sokuji.errors import BadRequest, InvalidInput, TooManyItems
from sokuji.runtimes.base import ModelMetadata, TensorSpec

HEADER_LENGTH = "inference-header-content-length"


@dataclass
class V2Request:
    texts: list[str]
    request_id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    binary_outputs: dict[str, bool] = field(default_factory=dict)
    """Requested output name -> whether it goes back as binary data."""


def brief(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages name what a client sent
    without echoing megabytes of it back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def parse_json(raw: bytes, what: str = "request body") -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as ude:
            raise BadRequest(f"{what} is not valid UTF-8 (byte {ude.start})") from None
        raise BadRequest(f"malformed JSON in {what}: {exc}") from None


def _shape(name: str, raw: Any) -> list[int]:
    if not isinstance(raw, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw):
        raise InvalidInput(f"input '{name}' has shape {brief(raw)}; expected a list of "
                           "non-negative integers", param=f"inputs.{name}.shape")
    return raw


def _bytes_elements(name: str, buf: memoryview) -> list[str]:
    out, pos = [], 0
    while pos < len(buf):
        if pos + 4 > len(buf):
            raise InvalidInput(f"input '{name}': truncated BYTES element length at byte {pos}")
        (n,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if pos + n > len(buf):
            raise InvalidInput(f"input '{name}': BYTES element of {n} bytes overruns the data")
        try:
            out.append(bytes(buf[pos:pos + n]).decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidInput(f"input '{name}' element {len(out)} is not valid UTF-8",
                               param=f"inputs.{name}") from None
        pos += n
    return out


def _json_elements(name: str, data: Any) -> list[str]:
    if not isinstance(data, list):
        raise InvalidInput(f"input '{name}' data must be a list", param=f"inputs.{name}.data")
    flat: list[Any] = []
    for item in data:
        flat.extend(item if isinstance(item, list) else (item,))
    for i, item in enumerate(flat):
        if not isinstance(item, str):
            raise InvalidInput(f"input '{name}' element {i} is {type(item).__name__}; "
                               "BYTES elements must be strings", param=f"inputs.{name}.data")
    return flat


class _PlainTensor(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    datatype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    data: list[str]
    parameters: dict[str, Any] | None = None


class _PlainRequest(msgspec.Struct, forbid_unknown_fields=True):
    inputs: list[_PlainTensor]
    id: str = ""
    parameters: dict[str, Any] | None = None
    outputs: Any = None


_PLAIN = msgspec.json.Decoder(_PlainRequest)


def _decode_plain(body: bytes, meta: ModelMetadata, max_items: int) -> V2Request | None:
    """The common request (one JSON input, a flat list of strings, shape [N] or [N, 1]),
    parsed and type-checked in C: a cold request spends ~35 us less here than in the
    checks below. None for anything else, valid or not: ``decode_infer`` then decodes it
    the long way, which accepts the same requests and words every refusal."""
    try:
        doc = _PLAIN.decode(body)
    except msgspec.DecodeError:
        return None
    if len(doc.inputs) != 1:
        return None
    tensor, spec = doc.inputs[0], meta.inputs[0]
    texts, shape = tensor.data, tensor.shape
    n = len(texts)
    if tensor.name != spec.name or tensor.datatype != spec.datatype or not 0 < n <= max_items \
            or (shape != [n] and shape != [n, 1]) \
            or (tensor.parameters and "binary_data_size" in tensor.parameters):
        return None
    parameters = doc.parameters if doc.parameters is not None else {}
    all_binary = parameters.get("binary_data_output", False)
    if not isinstance(all_binary, bool):
        return None
    return V2Request(texts=texts, request_id=doc.id, parameters=parameters,
                     binary_outputs=_requested_outputs(doc.outputs, meta, all_binary))


def decode_infer(body: bytes, header_length: int | None, meta: ModelMetadata,
                 max_items: int) -> V2Request:
    """Decode an infer request for a model with one BYTES input."""
    if header_length is None:
        plain = _decode_plain(body, meta, max_items)
        if plain is not None:
            return plain
    return _decode_full(body, header_length, meta, max_items)


def _decode_full(body: bytes, header_length: int | None, meta: ModelMetadata,
                 max_items: int) -> V2Request:
    if header_length is not None:
        if not 0 < header_length <= len(body):
            raise BadRequest(f"Inference-Header-Content-Length {header_length} does not fit "
                             f"a body of {len(body)} bytes")
        head, binary = body[:header_length], memoryview(body)[header_length:]
    else:
        head, binary = body, memoryview(b"")
    doc = parse_json(head)
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput(f"'id' must be a string, got {brief(request_id)}", param="id")
    parameters = _object(doc, "parameters", "'parameters'", "parameters")
    all_binary = parameters.get("binary_data_output", False)
    if not isinstance(all_binary, bool):
        raise InvalidInput(f"parameter 'binary_data_output' must be a boolean, got "
                           f"{brief(all_binary)}", param="parameters.binary_data_output")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInput("'inputs' must be a non-empty list", param="inputs")

    spec: TensorSpec = meta.inputs[0]
    texts: list[str] | None = None
    offset = 0
    for tensor in inputs:
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise InvalidInput("each input must be an object with a string 'name'",
                               param="inputs")
        name = tensor["name"]
        if name != spec.name:
            raise InvalidInput(f"unexpected input {brief(name)}; the model takes: {spec.name}",
                               param="inputs")
        if texts is not None:
            raise InvalidInput(f"input '{name}' given twice", param="inputs")
        datatype = tensor.get("datatype")
        if datatype != spec.datatype:
            raise InvalidInput(f"input '{name}' has datatype {brief(datatype)}; expected "
                               f"{spec.datatype}", param=f"inputs.{name}.datatype")
        shape = _shape(name, tensor.get("shape"))
        tparams = _object(tensor, "parameters", f"input '{name}' parameters",
                          f"inputs.{name}.parameters")
        size = tparams.get("binary_data_size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0 \
                    or offset + size > len(binary):
                raise InvalidInput(f"input '{name}' binary_data_size {brief(size)} does not fit "
                                   f"the {len(binary) - offset} binary bytes left",
                                   param=f"inputs.{name}.parameters.binary_data_size")
            texts = _bytes_elements(name, binary[offset:offset + size])
            offset += size
        elif "data" in tensor:
            texts = _json_elements(name, tensor["data"])
        else:
            raise InvalidInput(f"input '{name}' has neither 'data' nor binary data")
        count = 1
        for dim in shape:
            count *= dim
        if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1) \
                or count != len(texts):
            raise InvalidInput(f"input '{name}' has shape {shape} with {len(texts)} elements; "
                               f"expected [N] or [N, 1] holding N elements",
                               param=f"inputs.{name}.shape")
    if offset != len(binary):
        raise InvalidInput(f"{len(binary) - offset} bytes of binary data belong to no input")
    assert texts is not None
    if not texts:
        raise InvalidInput(f"input '{spec.name}' is empty: nothing to infer",
                           param=f"inputs.{spec.name}")
    if len(texts) > max_items:
        raise TooManyItems(f"input '{spec.name}' has {len(texts)} items; this model takes at "
                           f"most {max_items} per request", param=f"inputs.{spec.name}")

    return V2Request(texts=texts, request_id=request_id, parameters=parameters,
                     binary_outputs=_requested_outputs(doc.get("outputs"), meta, all_binary))


def _object(doc: dict[str, Any], key: str, what: str, param: str) -> dict[str, Any]:
    """``doc[key]``, an optional JSON object (absent or null: empty)."""
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be an object, got {type(value).__name__}", param=param)
    return value


def _requested_outputs(outputs: Any, meta: ModelMetadata, all_binary: bool) -> dict[str, bool]:
    """Requested output name -> binary or not. No ``outputs``: every output, binary as the
    request-level ``binary_data_output`` says."""
    known = [o.name for o in meta.outputs]
    if outputs is None:
        return dict.fromkeys(known, all_binary)
    if not isinstance(outputs, list):
        raise InvalidInput("'outputs' must be a list", param="outputs")
    chosen: dict[str, bool] = {}
    for i, out in enumerate(outputs):
        name = out.get("name") if isinstance(out, dict) else None
        if not isinstance(name, str):
            raise InvalidInput(f"outputs[{i}] must be an object with a string 'name'",
                               param="outputs")
        if name not in known:
            raise InvalidInput(f"unknown output {brief(name)}; the model gives: "
                               f"{', '.join(known)}", param="outputs")
        oparams = _object(out, "parameters", f"output '{name}' parameters",
                          f"outputs.{name}.parameters")
        binary = oparams.get("binary_data", all_binary)
        if not isinstance(binary, bool):
            raise InvalidInput(f"output '{name}' parameter 'binary_data' must be a boolean, "
                               f"got {brief(binary)}",
                               param=f"outputs.{name}.parameters.binary_data")
        chosen[name] = binary
    return chosen


def encode_infer(model_name: str, version: str, request: V2Request,
                 outputs: Sequence[tuple[TensorSpec, np.ndarray]]) -> tuple[bytes, dict[str, str]]:
    """Body and extra headers of an infer response; binary outputs follow the JSON header."""
    doc: dict[str, Any] = {"model_name": model_name, "model_version": version}
    if request.request_id:
        doc["id"] = request.request_id
    tensors, blobs = [], []
    for spec, array in outputs:
        if spec.name not in request.binary_outputs:
            continue
        array = np.ascontiguousarray(array, dtype=np.float32)
        tensor: dict[str, Any] = {"name": spec.name, "datatype": spec.datatype,
                                  "shape": list(array.shape)}
        if request.binary_outputs[spec.name]:
            blob = array.tobytes()
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = array.reshape(-1)
        tensors.append(tensor)
    doc["outputs"] = tensors
    head = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return head, {"content-type": "application/json"}
    return b"".join([head, *blobs]), {"content-type": "application/octet-stream",
                                      "inference-header-content-length": str(len(head))}


def model_metadata(name: str, versions: Sequence[str], meta: ModelMetadata) -> dict[str, Any]:
    """The V2 model metadata body; ``versions``: every version name the model answers to."""
    def tensor(t: TensorSpec) -> dict[str, Any]:
        return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}

    return {"name": name, "versions": list(versions), "platform": meta.platform,
            "inputs": [tensor(t) for t in meta.inputs],
            "outputs": [tensor(t) for t in meta.outputs]}

"""Open Inference Protocol (KServe V2) codec, REST, with Triton's binary tensor extension:
the one codec every model serving V2 infer goes through.

Decoding turns a body into an ``InferRequest`` of named ``Tensor``s (``core/tensor.py``),
checked against the model's metadata before anything is queued, or raises ``InvalidInput``
(400) naming the field, what was expected and what was received. Every KServe datatype is
decoded: BOOL, UINT8-64, INT8-64, FP16, FP32, FP64 into numpy arrays, BYTES into a list of
elements (``str`` from JSON, ``bytes`` from binary data). Work is bounded before it is done:
a shape's element count is checked against the data actually sent before anything is
allocated for it. Encoding the answer is ``v2_encode.py``'s.

Binary tensor data: the JSON header is followed by raw tensor bytes, its length in the
``Inference-Header-Content-Length`` header; a tensor's bytes are its elements in row-major
order, little-endian; BYTES elements are each prefixed with a 4-byte little-endian length.

The common encoder request (one JSON input, a flat list of strings) is parsed and checked
by msgspec in C (``_decode_plain``): ~35 us less than the general path, which decides every
body the same way (``tests/unit/test_v2_plain_decode.py``).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
import numpy as np
import orjson

from sokuji.core.model import ModelMetadata, TensorSpec
from sokuji.core.tensor import BYTES, DATATYPES, DTYPES, InferRequest, Tensor
from sokuji.errors import BadRequest, InvalidInput

HEADER_LENGTH = "inference-header-content-length"
INLINE_MAX_BYTES = 256 * 1024
"""Bodies up to this size are decoded on the event loop; larger ones (base64 files: ~1 ms a
MiB) in the preparation pool."""
_LENGTH = struct.Struct("<I")


def brief(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages name what a client sent
    without echoing megabytes of it back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def parse_json(raw: bytes, what: str = "request body", non_finite: bool = False) -> Any:
    """``raw`` as JSON; ``non_finite``: the ``NaN``, ``Infinity`` and ``-Infinity`` tokens
    taken too (tensor data as Triton and its clients write it; orjson refuses them)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if non_finite and (b"NaN" in raw or b"Infinity" in raw):
            import json

            try:
                return json.loads(raw)
            except (ValueError, RecursionError):
                pass  # (worded as orjson words it, below)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as ude:
            raise BadRequest(f"{what} is not valid UTF-8 (byte {ude.start})") from None
        raise BadRequest(f"malformed JSON in {what}: {exc}") from None


def header_length(headers: Mapping[str, str]) -> int | None:
    """The binary extension's JSON header length (None: a JSON body); 400 if not a number."""
    raw = headers.get(HEADER_LENGTH)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"Inference-Header-Content-Length {raw!r} is not an "
                         "integer") from None


# -- the fast path -----------------------------------------------------------------------

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


def _decode_plain(body: bytes, meta: ModelMetadata) -> InferRequest | None:
    """The common request (one JSON BYTES input of the model's one required input, a flat
    list of strings, shape [N] or [N, 1] where the model takes [-1]), parsed and
    type-checked in C. None for anything else, valid or not: ``_decode_full`` then decodes
    it the long way, which accepts the same requests and words every refusal."""
    try:
        doc = _PLAIN.decode(body)
    except msgspec.DecodeError:
        return None
    if len(doc.inputs) != 1 or meta.open:
        return None
    tensor = doc.inputs[0]
    spec = _spec(meta, tensor.name)
    texts, shape = tensor.data, tensor.shape
    n = len(texts)
    if spec is None or spec.datatype != BYTES or tensor.datatype != BYTES \
            or spec.shape != (-1,) or (shape != [n] and shape != [n, 1]) \
            or (len(meta.inputs) > 1
                and any(s is not spec and not s.optional for s in meta.inputs)) \
            or (tensor.parameters and "binary_data_size" in tensor.parameters):
        return None
    parameters = doc.parameters if doc.parameters is not None else {}
    all_binary = parameters.get("binary_data_output", False)
    if not isinstance(all_binary, bool):
        return None
    return InferRequest(
        {tensor.name: Tensor(tensor.name, BYTES, tuple(shape), texts,
                             tensor.parameters or {})},
        doc.id, parameters, _requested_outputs(doc.outputs, meta, all_binary))


def _open_spec(name: str, raw: dict[str, Any]) -> TensorSpec:
    """An open model's spec of a tensor as sent: its own datatype, any size on each of its
    dimensions (``_tensor`` still checks the datatype, the shape and the data)."""
    datatype, shape = raw.get("datatype"), raw.get("shape")
    return TensorSpec(name, datatype if isinstance(datatype, str) else "",
                      (-1,) * len(shape) if isinstance(shape, list) else ())


class _Every(dict[str, bool]):
    """An open model's requested outputs when the request names none: every output it
    answers, binary as ``binary_data_output`` says."""

    def __init__(self, binary: bool) -> None:
        super().__init__()
        self.binary = binary

    def get(self, key: str, default: Any = None) -> Any:
        return self.binary


def _spec(meta: ModelMetadata, name: str) -> TensorSpec | None:
    for spec in meta.inputs:
        if spec.name == name:
            return spec
    return None


def input_spec(meta: ModelMetadata, name: str, seen: Mapping[str, Any],
               sent: TensorSpec | None) -> TensorSpec:
    """The spec input ``name`` is checked against (an open model's: ``sent``, the tensor as
    sent, which callers build only for an open model), or a 400 for a name the model does
    not take or one already in ``seen`` (both bindings' rule: ``grpc_codec`` calls it too)."""
    spec = _spec(meta, name) if not meta.open else sent
    if spec is None:
        known = ", ".join(s.name for s in meta.inputs) or "no inputs"
        raise InvalidInput(f"unexpected input {brief(name)}; the model takes: {known}",
                           param="inputs")
    if name in seen:
        raise InvalidInput(f"input '{name}' given twice", param="inputs")
    return spec


def require_inputs(meta: ModelMetadata, inputs: Mapping[str, Any]) -> None:
    """A 400 naming the first required input of ``meta`` missing from ``inputs``."""
    missing = [] if meta.open else \
        [s.name for s in meta.inputs if not s.optional and s.name not in inputs]
    if missing:
        raise InvalidInput(f"the model needs input '{missing[0]}'", param=missing[0])


# -- decoding ------------------------------------------------------------------------------

def decode(body: bytes, head_length: int | None, meta: ModelMetadata) -> InferRequest:
    """Decode an infer request for a model described by ``meta``; ``head_length``: the
    binary extension's JSON header length (None: the whole body is JSON)."""
    if head_length is None:
        plain = _decode_plain(body, meta)
        if plain is not None:
            return plain
    return _decode_full(body, head_length, meta)


def _decode_full(body: bytes, head_length: int | None, meta: ModelMetadata) -> InferRequest:
    if head_length is not None:
        if not 0 < head_length <= len(body):
            raise BadRequest(f"Inference-Header-Content-Length {head_length} does not fit "
                             f"a body of {len(body)} bytes")
        head, binary = body[:head_length], memoryview(body)[head_length:]
    else:
        head, binary = body, memoryview(b"")
    doc = parse_json(head, non_finite=True)
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
    raw_inputs = doc.get("inputs")
    required = [s.name for s in meta.inputs if not s.optional] if not meta.open else []
    if meta.open and raw_inputs is None:
        raw_inputs = []  # a request of parameters only (a Python model's plain values)
    if not isinstance(raw_inputs, list) or (not raw_inputs and not meta.open):
        needs = f" (the model needs input '{required[0]}')" if required else ""
        raise InvalidInput(f"'inputs' must be a non-empty list{needs}", param="inputs")
    inputs: dict[str, Tensor] = {}
    offset = 0
    for raw in raw_inputs:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise InvalidInput("each input must be an object with a string 'name'",
                               param="inputs")
        name = raw["name"]
        spec = input_spec(meta, name, inputs, _open_spec(name, raw) if meta.open else None)
        tensor, used = _tensor(raw, spec, binary[offset:], len(body))
        offset += used
        inputs[name] = tensor
    if offset != len(binary):
        raise InvalidInput(f"{len(binary) - offset} bytes of binary data belong to no input")
    require_inputs(meta, inputs)
    return InferRequest(inputs, request_id, parameters,
                        _requested_outputs(doc.get("outputs"), meta, all_binary))


def _tensor(raw: dict[str, Any], spec: TensorSpec, binary: memoryview, body_size: int
            ) -> tuple[Tensor, int]:
    """One input tensor, checked against ``spec``, and the binary bytes it used."""
    name = spec.name
    datatype = raw.get("datatype")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise InvalidInput(f"input '{name}' has unsupported datatype {brief(datatype)} (the "
                           f"KServe datatypes: {', '.join(sorted(DATATYPES))})",
                           param=f"inputs.{name}.datatype")
    if datatype != spec.datatype:
        raise InvalidInput(f"input '{name}' has datatype {brief(datatype)}; expected "
                           f"{spec.datatype}", param=f"inputs.{name}.datatype")
    shape = _shape(name, raw.get("shape"))
    count = _count(shape, body_size)
    params = _object(raw, "parameters", f"input '{name}' parameters",
                     f"inputs.{name}.parameters")
    size = params.get("binary_data_size")
    used = 0
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 \
                or size > len(binary):
            raise InvalidInput(f"input '{name}' binary_data_size {brief(size)} does not fit "
                               f"the {len(binary)} binary bytes left",
                               param=f"inputs.{name}.parameters.binary_data_size")
        data = binary_data(name, datatype, shape, count, binary[:size])
        used = size
    elif "data" in raw:
        data = _json_data(name, datatype, shape, count, raw["data"])
    else:
        raise InvalidInput(f"input '{name}' has neither 'data' nor binary data")
    if not _fits(shape, spec.shape):
        raise InvalidInput(f"input '{name}' has shape {list(shape)}; expected "
                           f"{_expected(spec.shape)} (-1: any size)",
                           param=f"inputs.{name}.shape")
    return Tensor(name, datatype, shape, data, params, binary=size is not None), used


def _shape(name: str, raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw):
        raise InvalidInput(f"input '{name}' has shape {brief(raw)}; expected a list of "
                           "non-negative integers", param=f"inputs.{name}.shape")
    return tuple(raw)


def _count(shape: tuple[int, ...], body_size: int) -> int:
    """The element count of ``shape``, or ``body_size + 1`` once it exceeds what a body of
    that size could hold (every element takes at least a byte): never a huge number."""
    count = 1
    for dim in shape:
        count *= dim
        if count > body_size:
            return 0 if 0 in shape else body_size + 1
    return count


def _mismatch(name: str, shape: tuple[int, ...], have: str) -> InvalidInput:
    return InvalidInput(f"input '{name}' has shape {list(shape)} with {have}; the shape does "
                        "not match its data", param=f"inputs.{name}.shape")


def binary_data(name: str, datatype: str, shape: tuple[int, ...], count: int,
                 buf: memoryview) -> Any:
    if datatype == BYTES:
        if count > len(buf) // 4:
            raise _mismatch(name, shape, f"{len(buf)} bytes of BYTES data")
        out: list[bytes] = []
        pos = 0
        while pos < len(buf):
            if pos + 4 > len(buf):
                raise InvalidInput(f"input '{name}': truncated BYTES element length at byte "
                                   f"{pos}")
            (n,) = _LENGTH.unpack_from(buf, pos)
            pos += 4
            if pos + n > len(buf):
                raise InvalidInput(f"input '{name}': BYTES element of {n} bytes overruns "
                                   "the data")
            out.append(bytes(buf[pos:pos + n]))
            pos += n
        if len(out) != count:
            raise _mismatch(name, shape, f"{len(out)} elements")
        return out
    dtype = DTYPES[datatype]
    if len(buf) != count * dtype.itemsize:
        raise _mismatch(name, shape, f"{len(buf)} bytes of {datatype} data "
                        f"({dtype.itemsize} a element)")
    if datatype == "BOOL":  # one byte each: any non-zero byte is true, stored as 1
        return np.frombuffer(buf, dtype=np.uint8).reshape(shape) != 0
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def _flat(data: list[Any]) -> list[Any]:
    """Nested lists (row-major) flattened; a flat list as it is."""
    if not any(isinstance(x, list) for x in data):
        return data
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


_KINDS = {"BOOL": (bool,), **{t: (int,) for t in DTYPES if t[0] in "UI"},
          **{t: (int, float) for t in DTYPES if t.startswith("FP")}}
_WORDS = {"BOOL": "booleans", **{t: "integers" for t in DTYPES if t[0] in "UI"},
          **{t: "numbers" for t in DTYPES if t.startswith("FP")}}


_TYPES = {"BOOL": frozenset({bool}), **{t: frozenset({int}) for t in DTYPES if t[0] in "UI"},
          **{t: frozenset({int, float}) for t in DTYPES if t.startswith("FP")}}


def _numbers(datatype: str, shape: tuple[int, ...], count: int, data: list[Any]
             ) -> np.ndarray | None:
    """Numeric JSON data as an array, with no Python work per element: the elements' types
    are checked as one set (``set(map(type, ...))`` runs in C), then numpy converts them. A
    detector's 1x3x320x320 image: ~15 ms flat, ~30 ms nested, where the element-by-element
    check below took 110-200 ms. None for anything unusual (ragged nesting, a wrong type, a
    count that does not match, an integer out of range): the general path then words the
    refusal, so both decide every body the same way."""
    if data and type(data[0]) is not list:
        flat: Any = data
    else:
        try:
            flat = np.array(data, dtype=object).reshape(-1)
        except (ValueError, TypeError):
            return None
    if len(flat) != count or not set(map(type, flat)) <= _TYPES[datatype]:
        return None
    try:
        return np.array(flat, dtype=DTYPES[datatype]).reshape(shape)
    except (OverflowError, ValueError, TypeError):
        return None


def _json_data(name: str, datatype: str, shape: tuple[int, ...], count: int,
               data: Any) -> Any:
    if not isinstance(data, list):
        raise InvalidInput(f"input '{name}' data must be a list", param=f"inputs.{name}.data")
    if datatype != BYTES:
        numbers = _numbers(datatype, shape, count, data)
        if numbers is not None:
            return numbers
    flat = _flat(data)
    if len(flat) != count:
        raise _mismatch(name, shape, f"{len(flat)} elements")
    if datatype == BYTES:
        for i, item in enumerate(flat):
            if not isinstance(item, str):
                raise InvalidInput(f"input '{name}' element {i} is {type(item).__name__}; "
                                   "BYTES elements must be strings",
                                   param=f"inputs.{name}.data")
        return flat
    kinds = _KINDS[datatype]
    for i, item in enumerate(flat):
        if not isinstance(item, kinds) or (isinstance(item, bool) and datatype != "BOOL"):
            raise InvalidInput(f"input '{name}' element {i} is {type(item).__name__}; "
                               f"{datatype} elements must be {_WORDS[datatype]}",
                               param=f"inputs.{name}.data")
    try:
        return np.array(flat, dtype=DTYPES[datatype]).reshape(shape)
    except OverflowError:
        raise InvalidInput(f"input '{name}' has an element out of the range of {datatype}",
                           param=f"inputs.{name}.data") from None


def _fits(shape: tuple[int, ...], spec: tuple[int, ...]) -> bool:
    """``shape`` is ``spec``'s, -1 dimensions free; or ``spec``'s with a trailing 1 (one
    element per batch entry: Triton's clients send a [-1] input as [N, 1])."""
    if len(shape) == len(spec) + 1 and shape[-1] == 1:
        shape = shape[:-1]
    return len(shape) == len(spec) and all(s in (-1, d) for d, s in zip(shape, spec,
                                                                         strict=True))


def _expected(spec: tuple[int, ...]) -> str:
    one = list(spec)
    return f"{one} or {[*one, 1]}" if len(spec) == 1 else str(one)


def _object(doc: dict[str, Any], key: str, what: str, param: str) -> dict[str, Any]:
    """``doc[key]``, an optional JSON object (absent or null: empty)."""
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be an object, got {type(value).__name__}", param=param)
    return value


def _requested_outputs(outputs: Any, meta: ModelMetadata, all_binary: bool) -> dict[str, bool]:
    """Requested output name -> binary or not, in the model's order. No ``outputs``: every
    output, binary as the request-level ``binary_data_output`` says."""
    known = [o.name for o in meta.outputs]
    if outputs is None:
        return _Every(all_binary) if meta.open else dict.fromkeys(known, all_binary)
    if not isinstance(outputs, list):
        raise InvalidInput("'outputs' must be a list", param="outputs")
    chosen: dict[str, bool] = {}
    for i, out in enumerate(outputs):
        name = out.get("name") if isinstance(out, dict) else None
        if not isinstance(name, str):
            raise InvalidInput(f"outputs[{i}] must be an object with a string 'name'",
                               param="outputs")
        if name not in known and not meta.open:
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
    if meta.open:
        return chosen
    return {name: chosen[name] for name in known if name in chosen}

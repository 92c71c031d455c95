"""A Python model's values and the protocols' forms, both ways (pure functions).

- In: a V2 request's tensors become numpy arrays (BYTES: an object array of ``str`` where
  the request sent JSON, ``bytes`` where it sent binary data), beside its non-reserved
  ``parameters`` as plain JSON values; a plain JSON body is its own values. A class with a
  typed input gets them converted to that type (``typed``), every refusal a 400 naming the
  field.
- Out: a result's arrays, numpy scalars and regular lists of numbers or strings become V2
  tensors (a Python scalar: shape ``[1]``, as Triton's clients expect); what is no tensor
  (a dict, None, a ragged list) is a ``BadModelOutput`` on V2 (the plain route carries it).
- ``digest``: what identifies a request's values for the response cache (each name, dtype,
  shape and the bytes' hash; JSON values by their canonical encoding).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np

from sokuji.core.tensor import BYTES, DTYPES, InferRequest, Tensor
from sokuji.errors import BadModelOutput, InvalidInput

RESERVED = frozenset({"binary_data_output", "priority", "timeout", "sequence_id",
                      "sequence_start", "sequence_end", "headers"})
"""V2 request parameters the server reads itself: never handed to the model."""

_DATATYPE = {np.dtype(d): name for name, d in DTYPES.items()}
_DATATYPE[np.dtype(np.bool_)] = "BOOL"
_ENCODER = msgspec.json.Encoder(order="sorted")


def from_request(request: InferRequest) -> dict[str, Any]:
    """One V2 request's values: its tensors as arrays, then its own parameters."""
    values: dict[str, Any] = {}
    for name, tensor in request.inputs.items():
        if tensor.datatype == BYTES:
            values[name] = np.array(tensor.data, dtype=object).reshape(tensor.shape)
        else:
            values[name] = tensor.data
    for name, value in request.parameters.items():
        if name in RESERVED:
            continue
        if name in values:
            raise InvalidInput(f"'{name}' is both an input tensor and a parameter; a Python "
                               "model takes each name once", param=f"parameters.{name}")
        values[name] = value
    return values


def typed(values: Mapping[str, Any], record: Any) -> Any:
    """``values`` as the class's input type (a ``msgspec.Struct`` or a pydantic model);
    ``InvalidInput`` naming the field when they do not fit."""
    plain = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in values.items()}
    if isinstance(record, type) and issubclass(record, msgspec.Struct):
        try:
            return msgspec.convert(plain, record, strict=False)
        except msgspec.ValidationError as exc:
            text = str(exc)
            raise InvalidInput(f"invalid input: {text}", param=_field(text)) from None
    from pydantic import ValidationError

    try:
        return record.model_validate(plain)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or None
        raise InvalidInput(f"invalid input: field '{field}': {first.get('msg')}",
                           param=field) from None


def _field(text: str) -> str | None:
    """The field a msgspec validation error names: ``... - at `$.a.b``` and, for a missing
    one, ``Object missing required field `c```, joined (``a.b.c``)."""
    at = text.rsplit("at `$.", 1)[-1].rstrip("`") if "at `$." in text else None
    marker = "missing required field `"
    if marker not in text:
        return at
    missing = text.split(marker, 1)[1].split("`", 1)[0]
    return f"{at}.{missing}" if at else missing


def check_arguments(signature: inspect.Signature, values: Mapping[str, Any],
                    options: bool) -> None:
    """A function entry's request: its values must be the function's keyword arguments
    (``InvalidInput`` naming what does not fit, before the request is queued)."""
    names = dict.fromkeys(values, None)
    if options:
        names["options"] = None
    try:
        signature.bind(**names)
    except TypeError as exc:
        raise InvalidInput(f"the model's function takes {_params(signature)}; the request "
                           f"does not fit: {exc}") from None


def _params(signature: inspect.Signature) -> str:
    shown = [p.name for p in signature.parameters.values() if p.name != "options"]
    return ", ".join(f"'{n}'" for n in shown) or "no values"


def plain(result: Any) -> Any:
    """A result as plain JSON values (a typed record's fields; arrays as nested lists)."""
    if isinstance(result, msgspec.Struct):
        return msgspec.to_builtins(result)
    if hasattr(result, "model_dump") and not isinstance(result, Mapping):
        return result.model_dump(mode="json")
    if isinstance(result, Mapping):
        return {k: _plain_value(v) for k, v in result.items()}
    return _plain_value(result)


def _plain_value(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v
                    for v in value.reshape(-1).tolist()] if value.ndim <= 1 else \
                _plain_value(np.array([_plain_value(r) for r in value], dtype=object))
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def to_tensors(result: Any, model: str, order: tuple[str, ...] = ()) -> list[Tensor]:
    """A result's outputs as V2 tensors (``order``: the declared outputs' order, which the
    result must give exactly; empty: the result's own)."""
    values = plain(result) if not isinstance(result, Mapping) else result
    if not isinstance(values, Mapping):
        raise BadModelOutput(f"model '{model}': a result of {type(result).__name__} has no "
                             "named outputs for V2 infer")
    if order:
        missing = [n for n in order if n not in values]
        extra = [n for n in values if n not in order]
        if missing or extra:
            what = f"lacks output '{missing[0]}'" if missing else \
                f"has output '{extra[0]}', which its metadata does not name"
            raise BadModelOutput(f"model '{model}': a result {what}")
        names: Any = order
    else:
        names = values
    return [tensor(name, values[name], model) for name in names]


def tensor(name: str, value: Any, model: str) -> Tensor:
    if isinstance(value, (str, bytes)):
        return Tensor(name, BYTES, (1,), [value])
    if isinstance(value, (bool, int, float, np.generic)):
        value = np.asarray([value])
    elif isinstance(value, (list, tuple)):
        try:
            listed = value
            value = np.asarray(value)
        except ValueError:
            value = None
        if value is not None and value.dtype.kind in "US" and not _all_str(listed):
            value = None  # numbers and strings mixed: numpy made them all strings
        if value is None or (value.dtype == object):
            raise BadModelOutput(f"model '{model}': output '{name}' is a list that is no "
                                 "regular tensor (ragged, or mixed types); V2 infer carries "
                                 "tensors (the predict route carries any JSON)")
    if not isinstance(value, np.ndarray):
        raise BadModelOutput(f"model '{model}': output '{name}' is a "
                             f"{type(value).__name__}; V2 infer carries tensors (the predict "
                             "route carries any JSON)")
    shape = tuple(int(d) for d in value.shape)
    if value.dtype.kind in "US":
        return Tensor(name, BYTES, shape, value.reshape(-1).tolist())
    if value.dtype == object:
        items = value.reshape(-1).tolist()
        odd = [v for v in items if not isinstance(v, (str, bytes))][:1]
        if odd:
            raise BadModelOutput(f"model '{model}': output '{name}' is an object array "
                                 f"holding a {type(odd[0]).__name__}; only strings (BYTES) "
                                 "may be")
        return Tensor(name, BYTES, shape, items)
    datatype = _DATATYPE.get(value.dtype.newbyteorder("<") if value.dtype.byteorder == ">"
                             else value.dtype)
    if datatype is None:
        raise BadModelOutput(f"model '{model}': output '{name}' has dtype {value.dtype}, "
                             "which no KServe datatype carries")
    return Tensor(name, datatype, shape, value)


def _all_str(items: Any) -> bool:
    """Every leaf of nested lists is a ``str`` (bounded by the list's own size)."""
    stack = [items]
    while stack:
        for item in stack.pop():
            if isinstance(item, (list, tuple)):
                stack.append(item)
            elif not isinstance(item, str):
                return False
    return True


def digest(values: Any) -> list[str]:
    """What identifies one request's values (the response cache's parts)."""
    if not isinstance(values, Mapping):
        values = plain(values)
        return ["json", hashlib.sha256(_ENCODER.encode(values)).hexdigest()]
    parts: list[str] = []
    for name in sorted(values):
        value = values[name]
        h = hashlib.sha256()
        if isinstance(value, np.ndarray):
            if value.dtype == object:
                for item in value.reshape(-1).tolist():
                    raw = item if isinstance(item, bytes) else \
                        str(item).encode("utf-8", "surrogatepass")
                    h.update(len(raw).to_bytes(8, "little"))
                    h.update(raw)
            else:
                h.update(np.ascontiguousarray(value).tobytes())
            parts += [name, str(value.dtype), repr(value.shape), h.hexdigest()]
        else:
            h.update(_ENCODER.encode(_plain_value(value)))
            parts += [name, "json", h.hexdigest()]
    return parts

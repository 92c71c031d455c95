"""Named tensors as the model contract exchanges them (KServe V2's data model), and one
infer request of them. Pure data: ``server/v2.py`` decodes bodies into these and encodes
them back; a served model's adapter (``from_tensors`` / ``to_tensors``) maps them to and from
what its ``prepare`` takes and its handle's ``result()`` gives.

A tensor's ``data`` is a numpy array (shape ``shape``, the numpy type of ``datatype``) for
every numeric datatype, and a flat list of elements in row-major order for ``BYTES``: ``str``
where the request sent JSON text, ``bytes`` where it sent raw bytes (the binary extension, a
plain upload). What the elements mean (UTF-8 text, an encoded file, base64) is the model's to
say.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

BYTES = "BYTES"
DTYPES: Mapping[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"), "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8")}
"""Every numeric KServe datatype and its numpy type (little-endian, as the binary extension
lays them out)."""
DATATYPES = frozenset({*DTYPES, BYTES})
_NO_PARAMETERS: Mapping[str, Any] = MappingProxyType({})


class Tensor:
    """One named tensor. A plain class (built once per input on the hot path)."""

    __slots__ = ("binary", "data", "datatype", "name", "parameters", "shape")

    def __init__(self, name: str, datatype: str, shape: tuple[int, ...], data: Any,
                 parameters: Mapping[str, Any] = _NO_PARAMETERS, binary: bool = False) -> None:
        self.name = name
        self.datatype = datatype
        self.shape = shape
        self.data = data
        """A numpy array (numeric datatypes) or a flat list of ``str`` / ``bytes`` (BYTES)."""
        self.parameters = parameters
        """The tensor's own parameters as sent (``content_type``, ...)."""
        self.binary = binary
        """It came as raw bytes (the binary extension, a plain upload), not JSON."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tensor):
            return NotImplemented
        same_data = np.array_equal(self.data, other.data) \
            if isinstance(self.data, np.ndarray) or isinstance(other.data, np.ndarray) \
            else self.data == other.data
        return (self.name, self.datatype, self.shape, dict(self.parameters), self.binary) == \
            (other.name, other.datatype, other.shape, dict(other.parameters), other.binary) \
            and bool(same_data)

    __hash__ = None  # type: ignore[assignment]  # (its data is mutable)

    def __repr__(self) -> str:
        return (f"Tensor({self.name!r}, {self.datatype}, {list(self.shape)}, "
                f"binary={self.binary})")


@dataclass(slots=True)
class InferRequest:
    """One V2 infer request, decoded and checked against the model's metadata: the input
    tensors by name (in the order sent), the request's id and parameters, and the outputs
    asked for (name -> whether it goes back as binary data), in the model's order."""

    inputs: dict[str, Tensor]
    request_id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, bool] = field(default_factory=dict)

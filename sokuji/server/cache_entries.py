"""How the response cache keeps a model's output tensors: a model whose one output is
numeric keeps its array (an encoder's rows: the same entry ``/v1/embeddings`` reads); any
other keeps its tensors packed into one byte string (their V2 header, then their binary
data), which the memory and Redis backends both store as they are."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np
import orjson

from sokuji.core.cache import Entry
from sokuji.core.model import ModelMetadata
from sokuji.core.tensor import BYTES, Tensor
from sokuji.server.v2 import binary_data
from sokuji.server.v2_encode import encode_outputs

_LENGTH = struct.Struct("<I")


def entry(outputs: list[Tensor], meta: ModelMetadata, tokens: int) -> Entry:
    """Output tensors (and the request's token count) as a cache entry."""
    if _one_array(meta):
        return Entry(np.asarray(outputs[0].data), tokens)
    return Entry(np.frombuffer(pack(outputs), dtype=np.uint8), tokens)


def tensors(cached: Entry, meta: ModelMetadata) -> list[Tensor]:
    """The output tensors ``entry`` kept."""
    if _one_array(meta):
        spec = meta.outputs[0]
        return [Tensor(spec.name, spec.datatype, cached.output.shape, cached.output)]
    return unpack(cached.output.tobytes())


def _one_array(meta: ModelMetadata) -> bool:
    return len(meta.outputs) == 1 and meta.outputs[0].datatype != BYTES


def pack(outputs: Sequence[Tensor]) -> bytes:
    """Tensors as one byte string (``unpack`` reverses it)."""
    docs, blobs = encode_outputs(outputs, dict.fromkeys((t.name for t in outputs), True))
    head = orjson.dumps(docs)
    return _LENGTH.pack(len(head)) + head + b"".join(blobs)


def unpack(raw: bytes) -> list[Tensor]:
    (n,) = _LENGTH.unpack_from(raw, 0)
    offset, out = 4 + n, []
    for doc in orjson.loads(raw[4:4 + n]):
        size = doc["parameters"]["binary_data_size"]
        shape = tuple(doc["shape"])
        buf = memoryview(raw)[offset:offset + size]
        offset += size
        out.append(Tensor(doc["name"], doc["datatype"], shape, binary_data(
            doc["name"], doc["datatype"], shape, math.prod(shape), buf)))
    return out

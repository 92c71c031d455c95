"""Memory of a replica: weights, KV cache, buffers.

- **Weights**: the model file's size (an ONNX file, or a GGUF: both are mapped or read whole).
- **KV cache** (generators): llama.cpp keeps, for every layer, a key and a value vector per KV
  head for each cell; Sokuji's context has ``slots x context_size`` cells (one sequence per
  slot, ``llm/native.py``), of type f16 unless configured otherwise:
  ``2 x n_layer x cells x n_head_kv x head_dim x bytes(type)``. The shape comes from the
  GGUF's own metadata (read here from the file's header, without llama.cpp).
- **Buffers**: everything else a replica holds (runtime arenas, compute buffers, Python, the
  prefix cache up to its bound): the resident memory measured on a running server less the
  above, when a measurement is given; otherwise unknown (the prefix cache's bound is shown).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from sokuji.errors import ConfigError

MIB = 1 << 20
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32,
                 "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32}
"""Bytes per element of llama.cpp's cache types (quantized types in blocks of 32)."""

# GGUF value types (gguf.md): sizes of the fixed-width ones
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
          12: "d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError
    return data


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in _FIXED:
        fmt = "<" + _FIXED[kind]
        return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]
    if kind == _STRING:
        (n,) = struct.unpack("<Q", _read(f, 8))
        return _read(f, n).decode("utf-8", "replace")
    if kind == _ARRAY:
        item, count = struct.unpack("<IQ", _read(f, 12))
        if item in _FIXED:  # skipped: no array is needed for the memory figures
            f.seek(count * struct.calcsize("<" + _FIXED[item]), 1)
            return None
        for _ in range(count):
            _value(f, item)
        return None
    raise ValueError(f"unknown GGUF value type {kind}")


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The scalar key-value metadata of a GGUF file (arrays are skipped)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            if _read(f, 4) != b"GGUF":
                raise ConfigError(f"--gguf {p}: not a GGUF file")
            version, _tensors, count = struct.unpack("<IQQ", _read(f, 20))
            if version < 2:
                raise ConfigError(f"--gguf {p}: GGUF version {version} is too old")
            meta: dict[str, Any] = {}
            for _ in range(count):
                (n,) = struct.unpack("<Q", _read(f, 8))
                key = _read(f, n).decode("utf-8", "replace")
                (kind,) = struct.unpack("<I", _read(f, 4))
                value = _value(f, kind)
                if value is not None:
                    meta[key] = value
            return meta
    except OSError as exc:
        raise ConfigError(f"--gguf {p}: cannot read it ({exc.strerror or exc})") from None
    except (EOFError, ValueError, struct.error):
        raise ConfigError(f"--gguf {p}: truncated or malformed GGUF header") from None


@dataclass(frozen=True)
class KvShape:
    architecture: str
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    trained_context: int | None

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], where: str) -> KvShape:
        arch = str(meta.get("general.architecture", ""))
        if not arch:
            raise ConfigError(f"{where}: no general.architecture in the GGUF metadata")

        def get(key: str) -> int | None:
            value = meta.get(f"{arch}.{key}")
            return int(value) if isinstance(value, (int, float)) else None

        n_layer, n_head, embd = get("block_count"), get("attention.head_count"), \
            get("embedding_length")
        if not n_layer or not n_head:
            raise ConfigError(f"{where}: the GGUF metadata lacks {arch}.block_count or "
                              f"{arch}.attention.head_count")
        head_k = get("attention.key_length") or (embd // n_head if embd else None)
        if not head_k:
            raise ConfigError(f"{where}: cannot tell the head size (no "
                              f"{arch}.attention.key_length or embedding_length)")
        return cls(arch, n_layer, n_head, get("attention.head_count_kv") or n_head, head_k,
                   get("attention.value_length") or head_k, get("context_length"))

    def bytes_per_cell(self, kv_type: str = "f16") -> float:
        """One token's K and V over every layer."""
        if kv_type not in KV_TYPE_BYTES:
            raise ConfigError(f"--kv-type {kv_type!r}: one of {', '.join(KV_TYPE_BYTES)}")
        width = KV_TYPE_BYTES[kv_type]
        return self.n_layer * self.n_head_kv * (self.head_dim_k + self.head_dim_v) * width


def kv_cache_bytes(shape: KvShape, slots: int, context_size: int, kv_type: str = "f16") -> int:
    """The cache of ``slots`` sequences of ``context_size`` cells each."""
    return round(shape.bytes_per_cell(kv_type) * slots * context_size)


def breakdown(weights: int | None, kv: int | None, rss: int | None,
              bounded: dict[str, int] | None = None) -> dict[str, Any]:
    """A replica's memory in bytes: weights, KV cache, buffers (measured RSS less the two),
    and the total (the RSS when measured, else the sum of what is known)."""
    known = (weights or 0) + (kv or 0)
    out: dict[str, Any] = {"weights_bytes": weights, "kv_cache_bytes": kv,
                           "buffers_bytes": max(0, rss - known) if rss else None,
                           "measured_rss_bytes": rss,
                           "total_bytes": max(rss, known) if rss else (known or None)}
    if bounded:
        out["bounds"] = bounded
    return out

"""The bytes hostile requests are made of: V2 bodies (JSON and the binary tensor extension),
PNG and WAV files built from their fields, so a test can make each field lie on its own."""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import orjson


def v2_json(name: str, datatype: str, data: list[Any], shape: list[Any] | None = None,
            **extra: Any) -> bytes:
    """A V2 JSON infer body of one input (``shape``: its length unless given)."""
    tensor: dict[str, Any] = {"name": name, "datatype": datatype,
                              "shape": [len(data)] if shape is None else shape, "data": data}
    tensor.update(extra.pop("tensor", {}))
    return orjson.dumps({"inputs": [tensor], **extra})


def v2_files(name: str, files: list[bytes], **extra: Any) -> bytes:
    """A V2 JSON body carrying files as base64 BYTES elements."""
    return v2_json(name, "BYTES", [base64.b64encode(f).decode() for f in files],
                   tensor={"parameters": {"content_type": "base64"}}, **extra)


def bytes_elements(elements: list[bytes]) -> bytes:
    """BYTES elements as the binary extension carries them: a 4-byte length before each."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def v2_binary(name: str, datatype: str, shape: list[Any], raw: bytes,
              size: Any = None) -> tuple[bytes, dict[str, str]]:
    """A body of the binary tensor extension (``size``: the declared ``binary_data_size``,
    by default the true one) and its headers."""
    header = orjson.dumps({"inputs": [{
        "name": name, "datatype": datatype, "shape": shape,
        "parameters": {"binary_data_size": len(raw) if size is None else size}}]})
    return header + raw, {"Content-Type": "application/octet-stream",
                          "Inference-Header-Content-Length": str(len(header))}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width: int, height: int, idat_rows: int | None = None) -> bytes:
    """A white grey-scale PNG of ``width`` x ``height`` (``idat_rows``: how many rows its
    pixel data really holds: fewer makes a tiny file whose header claims a huge picture)."""
    rows = height if idat_rows is None else idat_rows
    raw = b"".join(b"\x00" + b"\xff" * width for _ in range(rows))
    return (b"\x89PNG\r\n\x1a\n"
            + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b""))


def wav(rate: int = 16000, channels: int = 1, bits: int = 16, seconds: float = 0.5,
        data_bytes: int | None = None) -> bytes:
    """A PCM WAV of silence whose header says ``rate``, ``channels`` and ``bits`` (each may
    lie: 0, or past what a real file has), and ``data_bytes`` in its data chunk (by default
    the true size of ``seconds`` of 16 kHz mono)."""
    samples = b"\x00\x00" * int(16000 * seconds)
    declared = len(samples) if data_bytes is None else data_bytes
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 1, channels, rate & 0xFFFFFFFF,
                      (rate * block) & 0xFFFFFFFF, block & 0xFFFF, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt \
        + b"data" + struct.pack("<I", declared & 0xFFFFFFFF) + samples
    return b"RIFF" + struct.pack("<I", len(body)) + body

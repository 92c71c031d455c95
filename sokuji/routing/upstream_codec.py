"""What an upstream model sends and reads back, as plain functions (no I/O): the completion
request rebuilt from a decoded one, server-sent events out of arbitrary chunks, and the
outputs of a KServe V2 answer (JSON or Triton's binary extension) or an OpenAI embeddings
answer as float32 rows."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson

from sokuji.core.model import GenerationInput
from sokuji.errors import InvalidInput

DTYPES = {"FP32": "<f4", "FP16": "<f2", "FP64": "<f8", "INT8": "i1", "INT16": "<i2",
          "INT32": "<i4", "INT64": "<i8", "UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4",
          "UINT64": "<u8", "BOOL": "?"}
"""KServe V2 numeric datatypes (little-endian, as the binary extension sends them)."""


def completion_request(inputs: GenerationInput, upstream_model: str) -> tuple[str, bytes]:
    """The upstream's path and streaming request body for ``inputs``."""
    doc: dict[str, Any] = {"model": upstream_model, "stream": True,
                           "stream_options": {"include_usage": True},
                           "temperature": inputs.temperature, "top_p": inputs.top_p}
    if inputs.chat:
        doc["messages"] = inputs.messages
    else:
        doc["prompt"] = inputs.prompt
    if inputs.max_tokens is not None:
        doc["max_tokens"] = inputs.max_tokens
    if inputs.stop:
        doc["stop"] = list(inputs.stop)
    if inputs.seed is not None:
        doc["seed"] = inputs.seed
    if inputs.min_tokens:
        doc["min_tokens"] = inputs.min_tokens
    if inputs.ignore_eos:
        doc["ignore_eos"] = True
    if inputs.logprobs is not None:  # (the relay carries text only)
        raise InvalidInput("'logprobs' is not relayed from an upstream", param="logprobs")
    for name, unset, what in (("grammar", None, "a structured-output constraint"),
                              ("tools", None, "tools"), ("n", 1, "n > 1")):
        if getattr(inputs, name) != unset:  # (the relay carries one choice's text only)
            field = getattr(inputs.grammar, "param", name) if name == "grammar" else name
            raise InvalidInput(f"{what} is not relayed to an upstream (yet)", param=field)
    for key, default in (("top_k", 0), ("min_p", 0.0), ("presence_penalty", 0.0),
                         ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(inputs, key) != default:
            doc[key] = getattr(inputs, key)
    if inputs.logit_bias:
        doc["logit_bias"] = {str(t): b for t, b in inputs.logit_bias}
    user = getattr(inputs, "user", None)
    if user:
        doc["user"] = user
    path = "/v1/chat/completions" if inputs.chat else "/v1/completions"
    return path, orjson.dumps(doc)


class SseParser:
    """Server-sent events out of arbitrary chunks: (event name, data) per event."""

    __slots__ = ("buffer",)

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        buf = (self.buffer + chunk).replace(b"\r\n", b"\n")
        *blocks, self.buffer = buf.split(b"\n\n")
        out: list[tuple[str, str]] = []
        for block in blocks:
            event, data = "message", []
            for line in block.decode("utf-8", "replace").split("\n"):
                if not line or line.startswith(":"):
                    continue  # a comment (Sokuji's ": server-timing ...")
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "data":
                    data.append(value)
                elif name == "event":
                    event = value
            if data:
                out.append((event, "\n".join(data)))
        return out


def embeddings(doc: Any, n: int, name: str) -> np.ndarray:
    """OpenAI embeddings ``data`` as float32 ``[n, d]`` (float lists or base64)."""
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or len(data) != n:
        raise ValueError(f"model '{name}': the upstream gave "
                         f"{len(data) if isinstance(data, list) else 'no'} embeddings for "
                         f"{n} inputs")
    data = sorted(data, key=lambda d: d.get("index", 0))
    rows = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
            if isinstance(d["embedding"], str) else d["embedding"] for d in data]
    return np.asarray(rows, dtype=np.float32).reshape(n, -1)


def v2_output(data: bytes, header_length: str | None, output: str) -> np.ndarray:
    """The tensor named ``output`` of a V2 answer (JSON ``data`` or binary)."""
    length = int(header_length) if header_length is not None else len(data)
    doc = orjson.loads(data[:length])
    blob = memoryview(data)[length:]
    offset = 0
    for tensor in doc["outputs"]:
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if tensor["name"] == output:
            dtype = DTYPES[tensor["datatype"]]
            shape = [int(d) for d in tensor["shape"]]
            if size is not None:
                array = np.frombuffer(blob[offset:offset + int(size)], dtype)
            else:
                array = np.asarray(tensor["data"], dtype=dtype)
            return array.reshape(shape).astype(np.float32, copy=False)
        offset += int(size or 0)
    raise KeyError(output)

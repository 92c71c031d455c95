"""OpenAI-compatible embeddings codec (``POST /v1/embeddings``)."""

from __future__ import annotations

import base64
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from sokuji.errors import InvalidInput, TooManyItems
from sokuji.server.v2 import brief, parse_json

_FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
FORMATS = ("float", "base64")


@dataclass
class EmbeddingsRequest:
    model: str
    texts: list[str]
    encoding_format: str = "float"
    dimensions: int | None = None


def parse_request(body: bytes, fields: AbstractSet[str]) -> tuple[dict[str, Any], str]:
    """The OpenAI request preamble, for every endpoint: a JSON object, no field outside
    ``fields`` (400 naming the first), and a ``model`` string. Returns (the object, model)."""
    doc = parse_json(body)
    if not isinstance(doc, dict):
        raise InvalidInput("request body must be a JSON object")
    extra = sorted(set(doc) - fields)
    if extra:
        raise InvalidInput(f"unrecognized request argument(s): {', '.join(extra)}",
                           param=extra[0])
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidInput("'model' is required and must be a string", param="model")
    return doc, model


def decode_embeddings(body: bytes) -> EmbeddingsRequest:
    doc, model = parse_request(body, _FIELDS)
    raw = doc.get("input")
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list) and all(isinstance(t, str) for t in raw):
        texts = raw
    elif isinstance(raw, list) and raw and all(
            isinstance(t, int) or (isinstance(t, list) and all(isinstance(x, int) for x in t))
            for t in raw):
        raise InvalidInput("token-id input is not supported; send text", param="input")
    elif raw is None:
        raise InvalidInput("'input' is required: a string or a list of strings", param="input")
    else:
        raise InvalidInput("'input' must be a string or a list of strings", param="input")
    if not texts:
        raise InvalidInput("'input' is an empty list: nothing to embed", param="input")
    fmt = doc.get("encoding_format", "float")
    if fmt not in FORMATS:
        raise InvalidInput(f"'encoding_format' {brief(fmt)} is not one of: {', '.join(FORMATS)}",
                           param="encoding_format")
    dims = doc.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise InvalidInput(f"'dimensions' must be a positive integer, got {dims!r}",
                           param="dimensions")
    user = doc.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidInput(f"'user' must be a string, got {type(user).__name__}", param="user")
    return EmbeddingsRequest(model=model, texts=texts, encoding_format=fmt, dimensions=dims)


def check_limits(req: EmbeddingsRequest, max_items: int, dim: int) -> None:
    if len(req.texts) > max_items:
        raise TooManyItems(f"'input' has {len(req.texts)} items; model '{req.model}' takes at "
                           f"most {max_items} per request", param="input")
    if req.dimensions is not None and req.dimensions != dim:
        raise InvalidInput(f"'dimensions' {req.dimensions} is not supported by model "
                           f"'{req.model}', which gives {dim}", param="dimensions")


def encode_embeddings(req: EmbeddingsRequest, embeddings: np.ndarray, num_tokens: int) -> bytes:
    rows = np.ascontiguousarray(embeddings, dtype=np.float32)
    data: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        value: Any = base64.b64encode(row.tobytes()).decode("ascii") \
            if req.encoding_format == "base64" else row
        data.append({"object": "embedding", "index": i, "embedding": value})
    return orjson.dumps({"object": "list", "data": data, "model": req.model,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}},
                        option=orjson.OPT_SERIALIZE_NUMPY)


def error_body(status: int, code: str, message: str, param: str | None) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}})

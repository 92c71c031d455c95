"""Triton's generate extension (``POST /v2/models/{m}/generate[_stream]``): request bodies
as a ``CompletionRequest``, and the answer's JSON.

A body is ``{"text_input": "...", "parameters": {...}}``; each sampling parameter may also
stand at the top level, as Triton allows (the same key in both places: 400). The parameters
are OpenAI's completion fields under the same names (``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``seed``, ``stop``, ...), decoded by ``llm_codec.decode_doc``, so
they are checked, bounded and refused exactly as on ``/v1/completions``. ``text_input`` is
a string, or a list of one string (a BYTES tensor of shape [1], as genai-perf and Triton's
tensor-minded clients send it). ``stream`` is a boolean: ``generate_stream`` always
streams; ``generate`` streams when the body asks (``"stream": true``, as genai-perf's
``--endpoint-type generate --streaming`` sends it). Any other key: 400 naming it.
"""

from __future__ import annotations

from typing import Any

import orjson

from sokuji.errors import InvalidInput
from sokuji.server.llm_codec import CompletionRequest, decode_doc
from sokuji.server.v2 import parse_json

PARAMETERS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                        "min_tokens", "ignore_eos", "min_p", "repetition_penalty",
                        "presence_penalty", "frequency_penalty", "logit_bias", "stream"})
"""The sampling parameters honoured, in ``parameters`` or at the top level."""
_TOP = frozenset({"text_input", "parameters", "id", "model"}) | PARAMETERS


def decode(body: bytes, model: str, stream: bool) -> CompletionRequest:
    """A generate body for ``model`` (the path's); ``stream``: the route streams."""
    doc = parse_json(body)
    if not isinstance(doc, dict):
        raise InvalidInput("request body must be a JSON object")
    return decode_dict(doc, model, stream)


def decode_dict(doc: dict[str, Any], model: str, stream: bool) -> CompletionRequest:
    """A parsed generate body (or gRPC's inputs and parameters gathered as one) for
    ``model``; ``stream``: the route streams (the body's ``"stream": true`` streams too)."""
    extra = sorted(set(doc) - _TOP)
    if extra:
        raise InvalidInput(f"unrecognized field '{extra[0]}'; a generate request takes "
                           f"text_input, parameters and: {', '.join(sorted(PARAMETERS))}",
                           param=extra[0])
    text = doc.get("text_input")
    if isinstance(text, list):
        if len(text) != 1 or not isinstance(text[0], str):
            raise InvalidInput(f"'text_input' as a list holds one string (one prompt per "
                               f"request), got {len(text)} item(s)" if len(text) != 1 else
                               f"'text_input' as a list holds one string, got "
                               f"{type(text[0]).__name__}", param="text_input")
        text = text[0]
    if not isinstance(text, str):
        raise InvalidInput("'text_input' is required and must be a string"
                           if text is None else
                           f"'text_input' must be a string, got {type(text).__name__}",
                           param="text_input")
    params = doc.get("parameters")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be an object", param="parameters")
    unknown = sorted(set(params) - PARAMETERS)
    if unknown:
        raise InvalidInput(f"parameter '{unknown[0]}' is not supported; parameters take: "
                           f"{', '.join(sorted(PARAMETERS))}", param=f"parameters.{unknown[0]}")
    fields: dict[str, Any] = {k: v for k, v in doc.items() if k in PARAMETERS}
    for key, value in params.items():
        if key in fields and fields[key] != value:
            raise InvalidInput(f"'{key}' is given both at the top level and in 'parameters'",
                               param=key)
        fields[key] = value
    wanted = fields.pop("stream", None)
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidInput(f"'stream' must be a boolean, got {wanted!r}", param="stream")
    fields["prompt"] = text
    fields["stream"] = stream or wanted is True
    return decode_doc(fields, model, chat=False)


def answer(model: str, version: str, text: str, **extra: Any) -> bytes:
    """One generate answer (or one streamed event's JSON)."""
    return orjson.dumps({"model_name": model, "model_version": version, "text_output": text,
                         **extra})

"""Generators (``Api.GENERATE``) over gRPC: ``ModelInfer`` and ``ModelStreamInfer`` on a
model whose Triton transaction policy is decoupled (``triton.decoupled``).

- Inputs: ``text_input`` (BYTES, one element: shape ``[1]`` or ``[1, 1]``), and optionally
  any sampling parameter as a one-element tensor of its own name (``max_tokens`` INT32 /
  UINT32 / INT64, ``stream`` BOOL, ``temperature`` FP32, ...), or vLLM's backend's
  ``sampling_parameters`` (BYTES, a JSON object). ``request.parameters`` carry sampling
  parameters too, and ``priority`` / ``timeout`` as on any infer; ``triton_*`` keys are
  Triton's own (``triton_enable_empty_final_response``). All are decoded by
  ``generate_codec`` as the HTTP generate extension's, so checked the same way.
- ``ModelStreamInfer``: one response per token chunk, output ``text_output`` (BYTES,
  ``[1]``); the last has parameter ``triton_final_response: true`` (Triton's decoupled
  convention), with ``finish_reason``, ``prompt_tokens`` and ``completion_tokens``. Asked
  with ``triton_enable_empty_final_response`` (tritonclient's
  ``enable_empty_final_response=True``) the final response is an empty one after the last
  chunk. ``stream: false``: one response, the whole text. An error is the stream's
  ``error_message`` for that request. A client that cancels the call stops the generation.
- ``ModelInfer``: one response with the whole text; an error is the call's status.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from sokuji.core.tensor import BYTES, DTYPES
from sokuji.errors import InvalidInput, SokujiError
from sokuji.llm.request import Delta, Finish
from sokuji.server import generate_codec, grpc_codec, triton, v2
from sokuji.server.failures import to_error

_TYPED = {"BOOL": "bool_contents", "INT32": "int_contents", "INT64": "int64_contents",
          "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
          "FP64": "fp64_contents", BYTES: "bytes_contents"}
_SCHEDULING = ("priority", "timeout")
EMPTY_FINAL = "triton_enable_empty_final_response"
FINAL = "triton_final_response"


def serves(repo: Any, name: str) -> bool:
    """Whether ``name`` is a generator (its infer calls are answered here)."""
    model = repo.models.get(name)
    return model is not None and triton.decoupled(model)


def _scalar(tensor: Any, raw: bytes | None) -> Any:
    """A one-element input's value (BYTES: ``bytes``)."""
    name, datatype, shape = tensor.name, tensor.datatype, tuple(tensor.shape)
    if datatype not in _TYPED:
        raise InvalidInput(f"input '{name}' has datatype {v2.brief(datatype)}; a generator "
                           f"takes {', '.join(sorted(_TYPED))}", param=f"inputs.{name}")
    if int(np.prod(shape)) != 1 or any(d != 1 for d in shape):
        raise InvalidInput(f"input '{name}' has shape {list(shape)}; a generator takes one "
                           "element ([1] or [1, 1]): one prompt per request",
                           param=f"inputs.{name}.shape")
    if raw is not None:
        data = v2.binary_data(name, datatype, shape, 1, memoryview(raw))
        return data[0] if datatype == BYTES else np.asarray(data).ravel()[0].item()
    values = getattr(tensor.contents, _TYPED[datatype])
    if len(values) != 1:
        raise InvalidInput(f"input '{name}' has {len(values)} elements in contents; "
                           "expected 1", param=f"inputs.{name}.contents")
    value = values[0]
    return value if datatype == BYTES else np.asarray(value, DTYPES[datatype]).item()


def _text(value: Any, name: str) -> str:
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"input '{name}' is not valid UTF-8", param=name) from None


def decode(request: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(the generate document, the scheduling parameters, Triton's own ``triton_*`` ones)
    of a ``ModelInferRequest``."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs",
                           param="raw_input_contents")
    params = grpc_codec.parameters(request.parameters)
    sched = {k: params.pop(k) for k in _SCHEDULING if k in params}
    own = {k: params.pop(k) for k in list(params) if k.startswith("triton_")}
    doc: dict[str, Any] = {"parameters": params}
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        if name in doc:
            raise InvalidInput(f"input '{name}' given twice", param="inputs")
        if name == "text_input" and tensor.datatype != BYTES:
            raise InvalidInput(f"input 'text_input' has datatype {v2.brief(tensor.datatype)};"
                               " expected BYTES", param="inputs.text_input.datatype")
        value = _scalar(tensor, raw[i] if raw else None)
        if name == "sampling_parameters":  # (vLLM's Triton backend: one JSON object)
            extra = v2.parse_json(bytes(value), "input 'sampling_parameters'")
            if not isinstance(extra, dict):
                raise InvalidInput("input 'sampling_parameters' must be a JSON object",
                                   param="sampling_parameters")
            for key, v in extra.items():
                if key in params and params[key] != v:
                    raise InvalidInput(f"'{key}' is given twice", param=key)
                params[key] = v
            continue
        if name != "text_input" and name not in generate_codec.PARAMETERS:
            raise InvalidInput(f"unexpected input {v2.brief(name)}; a generator takes "
                               "text_input, sampling_parameters and: "
                               f"{', '.join(sorted(generate_codec.PARAMETERS))}",
                               param="inputs")
        doc[name] = _text(value, name) if isinstance(value, bytes) else value
    if "text_input" not in doc:
        raise InvalidInput("the model needs input 'text_input' (BYTES, shape [1])",
                           param="text_input")
    return doc, sched, own


def _response(request: Any, model: Any, text: str | None) -> Any:
    response = service_pb2.ModelInferResponse(model_name=model.name, id=request.id,
                                              model_version=model.served_version)
    if text is not None:
        data = text.encode("utf-8")
        response.outputs.add(name="text_output", datatype=BYTES, shape=[1])
        response.raw_output_contents.append(struct.pack("<I", len(data)) + data)
    return response


def _end(response: Any, finish: Finish, prompt_tokens: int) -> Any:
    p = response.parameters
    p[FINAL].bool_param = True
    p["finish_reason"].string_param = finish.reason
    p["prompt_tokens"].int64_param = prompt_tokens
    p["completion_tokens"].int64_param = finish.completion_tokens
    return response


async def responses(app: Any, request: Any, headers: dict[str, str], streaming: bool,
                    timing: list[str] | None = None) -> AsyncIterator[Any]:
    """The ``ModelInferResponse``s of one request to a generator (``streaming``: the
    default of ``stream``); a ``SokujiError`` (counted) if it fails, before or during.
    ``timing``: gets the generation's ``server-timing`` (REST's header) once it ended."""
    t0_ns = time.perf_counter_ns()
    name = request.model_name
    path = f"/v2/models/{name}/generate" + ("_stream" if streaming else "")
    trace = None if app.tracer is None else app._sample(headers)
    try:
        tenant = app.inference.auth.authenticate(headers)
    except SokujiError as exc:
        app.accounting.unauthorised(exc)
        raise
    g = app.generation
    model_name = ""
    try:
        model = g.lookup(name, request.model_version or None, tenant)
        model_name = model.name
        g.require(model, path)
        doc, sched, own = decode(request)
        wanted = doc.get("stream", doc["parameters"].get("stream"))
        stream = streaming if wanted is None else wanted
        if stream and not streaming:
            raise InvalidInput("'stream': true needs ModelStreamInfer (the model is "
                               "decoupled)", param="stream")
        req = generate_codec.decode_dict(doc, model.name, stream is True)
        gen = (await g.start(model, req, headers, t0_ns, tenant, sched))[0]
    except Exception as exc:  # noqa: BLE001 - refused before submission: one mapper
        error = to_error(exc, "gRPC", path)
        g.accounting.refused(model_name, tenant.name, error, t0_ns, "text_completion", path,
                             name if model_name else "", trace, exc)
        raise error from None
    empty_final = bool(own.get(EMPTY_FINAL))
    finish: Finish | None = None
    held: Any = None
    texts: list[str] = []
    try:
        while finish is None:
            for event in await gen.next_events():
                if isinstance(event, Finish):
                    finish = event
                elif req.stream:
                    if held is not None:
                        yield held
                    held = _response(request, model, event.text)
                else:
                    assert isinstance(event, Delta)
                    texts.append(event.text)
        if finish.error is not None:
            if held is not None:
                yield held
            app.accounting.generated(model.name, tenant.name, gen, finish, None,
                                     "text_completion", req, path, trace)
            raise finish.error
        if finish.reason == "cancelled":
            return
        if timing is not None:
            timing.append(gen.timing.server_timing())
        if not req.stream:
            yield _end(_response(request, model, "".join(texts)), finish,
                       gen.timing.prompt_tokens)
        elif held is None or empty_final:
            if held is not None:
                yield held
            yield _end(_response(request, model, None), finish, gen.timing.prompt_tokens)
        else:
            yield _end(held, finish, gen.timing.prompt_tokens)
    except (asyncio.CancelledError, GeneratorExit):  # the client went away: 499
        gen.cancel()
        app.accounting.left(model.name)
        raise
    finally:
        gen.cancel()  # a no-op once finished
    app.accounting.generated(model.name, tenant.name, gen, finish, None, "text_completion",
                             req, path, trace)


async def stream(app: Any, request: Any, headers: dict[str, str]) -> AsyncIterator[Any]:
    """``ModelStreamInfer``'s answers to one request: responses, or its error in-stream."""
    try:
        async for response in responses(app, request, headers, True):
            yield service_pb2.ModelStreamInferResponse(infer_response=response)
    except Exception as exc:  # noqa: BLE001 - a SokujiError, or a bug: said in the stream
        error = to_error(exc, "gRPC", "ModelStreamInfer")
        yield service_pb2.ModelStreamInferResponse(
            error_message=error.message, infer_response=service_pb2.ModelInferResponse(
                model_name=request.model_name, id=request.id))


async def infer(app: Any, request: Any, headers: dict[str, str]
                ) -> tuple[Any, tuple[tuple[str, str], ...]]:
    """``ModelInfer``'s one response and its trailing metadata (``server-timing``, as a
    tensor model's); a ``SokujiError`` if it fails."""
    out = None
    timing: list[str] = []
    async for response in responses(app, request, headers, False, timing):
        out = response
    if out is None:
        raise to_error(RuntimeError("the generation ended without an answer"), "gRPC",
                       "ModelInfer")
    return out, tuple(("server-timing", t) for t in timing)


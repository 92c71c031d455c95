"""Triton's generate extension over HTTP, for generators (``Api.GENERATE``):

- ``POST /v2/models/{m}[/versions/{v}]/generate``: one JSON answer,
  ``{"model_name", "model_version", "text_output", "finish_reason", "usage"}`` (a body with
  ``"stream": true`` is answered as ``generate_stream``, as genai-perf expects);
- ``POST /v2/models/{m}[/versions/{v}]/generate_stream``: server-sent events, one
  ``data: {"model_name", "model_version", "text_output"}`` per token chunk, then a last one
  with ``text_output: ""``, ``finish_reason`` and ``usage``. An error once the stream has
  begun is its last event, ``data: {"error": "..."}`` (as Triton writes it).

Bodies are decoded by ``generate_codec`` onto the OpenAI completion fields; the generation
starts, and a disconnect cancels it, exactly as on ``/v1/completions`` (``llm_api``).
Errors before the answer: the V2 format ``{"error": "..."}`` with the same statuses.
"""

from __future__ import annotations

import asyncio
import contextlib

import orjson
from starlette.types import Receive, Send

from sokuji.errors import SokujiError
from sokuji.llm.request import Delta, Finish
from sokuji.observability import tracing
from sokuji.server import generate_codec
from sokuji.server.auth import Tenant
from sokuji.server.failures import ErrorStyle, error_reply, to_error
from sokuji.server.http import ClientGone, Headers, check_content_type, read_body
from sokuji.server.llm_api import (
    INLINE_MAX_BYTES,
    SSE_HEADERS,
    Generation,
    _maybe_off_loop,
    cancel_on_disconnect,
)
from sokuji.server.llm_codec import Encoder

SUFFIXES = ("/generate", "/generate_stream")


def route(path: str) -> tuple[str, str | None, bool] | None:
    """(model, version or None, streams) of a generate path; None: not one."""
    if not path.startswith("/v2/models/") or not path.endswith(SUFFIXES):
        return None
    parts = path.split("/")  # '', 'v2', 'models', name, ['versions', v,] 'generate[_stream]'
    streams = parts[-1] == "generate_stream"
    if len(parts) == 5 and parts[3]:
        return parts[3], None, streams
    if len(parts) == 7 and parts[3] and parts[4] == "versions" and parts[5]:
        return parts[3], parts[5], streams
    return None


class GenerateApi:
    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def __call__(self, path: str, headers: Headers, receive: Receive, send: Send,
                       t0: int, tenant: Tenant, trace: tracing.Trace | None = None) -> None:
        where = route(path)
        assert where is not None
        name, version, streams = where
        g = self.generation
        model_name = ""
        req = None
        try:
            check_content_type(headers, binary_ok=False)
            body = await read_body(receive, headers, g.config.max_request_bytes,
                                   g.body_timeout)
            model = g.lookup(name, version, tenant)
            model_name = model.name
            g.require(model, path)
            req = await _maybe_off_loop(len(body) > INLINE_MAX_BYTES, generate_codec.decode,
                                        body, model.name, streams)
            gen = (await g.start(model, req, headers, t0, tenant))[0]
            streams = req.stream  # the route's, or the body's "stream": true
        except ClientGone:
            return
        except Exception as exc:  # noqa: BLE001 - refused before submission: one mapper
            refusal = to_error(exc, "POST", path)
            await _reply_error(send, refusal)
            g.accounting.refused(model_name, tenant.name, refusal, t0, "text_completion",
                                 path, name if model_name else "", trace, exc)
            return
        watcher = asyncio.create_task(cancel_on_disconnect(receive, gen))
        version_out = model.served_version
        finish: Finish | None = None
        failure: SokujiError | None = None
        started = False
        try:
            texts: list[str] = []
            while finish is None:
                out: list[bytes] = []
                for event in await gen.next_events():
                    if isinstance(event, Delta):
                        if streams:
                            out.append(_event(generate_codec.answer(
                                model.name, version_out, event.text)))
                        else:
                            texts.append(event.text)
                    else:
                        finish = event
                if finish is not None and finish.reason == "cancelled":
                    break
                if finish is not None and finish.error is not None:
                    if not started:
                        failure = finish.error
                        break
                    out.append(_event(orjson.dumps({"error": finish.error.message})))
                elif finish is not None:
                    last = generate_codec.answer(
                        model.name, version_out, "".join(texts),
                        finish_reason=finish.reason,
                        usage=Encoder.usage(gen.timing, finish.completion_tokens))
                    if not streams:
                        await send({"type": "http.response.start", "status": 200, "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(last)).encode()),
                            (b"server-timing", gen.timing.server_timing().encode("latin-1"))]})
                        await send({"type": "http.response.body", "body": last})
                        break
                    out.append(_event(last))
                if streams and (out or finish is not None):
                    if not started:
                        await send({"type": "http.response.start", "status": 200,
                                    "headers": SSE_HEADERS})
                        started = True
                    await send({"type": "http.response.body", "body": b"".join(out),
                                "more_body": finish is None})
        except Exception as exc:  # noqa: BLE001 - a bug while answering: one mapper
            failure = to_error(exc, "POST", path)
        finally:
            gen.cancel()  # a no-op once finished; stops the engine if we got here early
            watcher.cancel()
        if failure is not None and not started:
            await _reply_error(send, failure)
        g.accounting.generated(model_name, tenant.name, gen, finish, failure,
                               "text_completion", req, path, trace)


def _event(doc: bytes) -> bytes:
    return b"data: " + doc + b"\n\n"


async def _reply_error(send: Send, exc: SokujiError) -> None:
    with contextlib.suppress(OSError):
        await error_reply(exc, ErrorStyle.V2).send(send)

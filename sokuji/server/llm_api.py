"""``POST /v1/chat/completions`` and ``POST /v1/completions``: generation over HTTP.

This module only translates: body read (bounded) -> ``llm_codec.decode`` (the OpenAI
fields, honoured or refused by name) -> the model's ``prepare`` (template, tokens, limits:
4xx) and ``submit`` (admission 429, deadline 504, queue) under the model contract
(``core/model.py``) -> tokens as they come, as server-sent events (``stream: true``) or one
JSON body. Bodies over ``INLINE_MAX_BYTES`` are decoded in the ``sokuji-prep`` pool
(``core/offload.py``), never on the event loop (the model prepares large inputs there too).
The response waits for the first event before its status is sent, so a request that fails
in the queue (deadline, shutdown) still gets a proper status code. A client that disconnects
cancels its generation: a task watches ``receive()`` for ``http.disconnect`` for the
request's whole life. The caller was authenticated by the app, once.

Timing: ``Server-Timing`` on non-streaming responses; a streamed response ends with the same
text as an SSE comment (``: server-timing ...``) just before ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from starlette.types import Receive, Send

from sokuji.config import ServerConfig
from sokuji.core import offload
from sokuji.core.model import Api
from sokuji.errors import SokujiError
from sokuji.llm.request import Delta, Finish, GenerationHandle
from sokuji.observability import tracing
from sokuji.observability.metrics import Metrics
from sokuji.repository.models import Model, ModelRepository
from sokuji.server import apis, llm_codec, scheduling
from sokuji.server.auth import Tenant
from sokuji.server.failures import ErrorStyle, error_reply, to_error
from sokuji.server.http import ClientGone, Headers, check_content_type, read_body

log = logging.getLogger(__name__)
PATHS = {"/v1/chat/completions": True, "/v1/completions": False}
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
SERVED_BY = "x-sokuji-served-by"
INLINE_MAX_BYTES = 4 * 1024
"""Bodies up to this size are decoded on the event loop; larger ones in a worker thread."""
P = ParamSpec("P")
T = TypeVar("T")


async def _maybe_off_loop(off: bool, fn: Callable[P, T], *args: P.args,
                          **kwargs: P.kwargs) -> T:
    """``fn`` in the ``sokuji-prep`` pool when ``off``, else inline. (Not asyncio's default
    executor: that one also runs DNS lookups and store I/O.)"""
    if off:
        return await offload.run(fn, *args, **kwargs)
    return fn(*args, **kwargs)


class Generation:
    def __init__(self, config: ServerConfig, repo: ModelRepository, metrics: Metrics) -> None:
        self.config = config
        self.repo = repo
        self.metrics = metrics
        self.tracer: tracing.Tracer | None = None
        """Set by the app when tracing is on (``observability/tracing.py``)."""

    async def __call__(self, path: str, headers: Headers, receive: Receive, send: Send,
                       t0: int, tenant: Tenant, trace: tracing.Trace | None = None) -> None:
        """``POST`` on ``path`` by ``tenant`` (the method and the caller checked by the app);
        ``trace``: the request is traced."""
        model_name = ""
        try:
            check_content_type(headers, binary_ok=False)
            body = await read_body(receive, headers, self.config.max_request_bytes)
            req = await _maybe_off_loop(len(body) > INLINE_MAX_BYTES, llm_codec.decode, body,
                                        PATHS[path])
            tenant.check_model(req.model)  # before the lookup: 403 tells nothing of others
            model = self.repo.get_ready(req.model)
            model_name = model.name
            if Api.GENERATE not in model.apis:
                apis.require(model, Api.GENERATE, path)
            served = model.served
            served.check_admission()
            ctx = scheduling.context(tenant, headers, {}, t0, model.config.default_timeout_ms)
            # Api.GENERATE: the handle is a generation's stream of events.
            gen: GenerationHandle = served.submit(await served.prepare(req, ctx), ctx)  # type: ignore[assignment]
        except ClientGone:
            return
        except Exception as exc:  # noqa: BLE001 - refused before submission: one mapper
            failure = to_error(exc, "POST", path)
            if model_name:  # Triton statistics: a failure, from arrival to the reply
                self.metrics.observe_failure(model_name, time.perf_counter_ns() - t0)
                if self.metrics.slo is not None:
                    self.metrics.observe_slo(model_name, tenant.name, None, failure.status)
            await self._error(send, failure, model_name)
            if trace is not None:  # (tracing: a request refused before submission)
                self._finished(path, req.model if model_name else "", None, None, None,
                               failure.status, trace, exc)
            return
        watcher = asyncio.create_task(self._watch(receive, gen))
        status = 200
        finish = None
        try:
            finish = await self._respond(send, req, gen, model)
        except Exception as exc:  # noqa: BLE001 - a failed generation, or a bug: one mapper
            failure = to_error(exc, "POST", path)
            status = failure.status
            await self._error(send, failure, model_name)
        finally:
            gen.cancel()  # a no-op once finished; stops the engine if we got here early
            watcher.cancel()
        if self.metrics.slo is not None:  # a generator's SLO is on the time to first token
            timing = gen.timing
            first = timing.first_token_ns
            ttft_ms = (first - timing.arrival_ns) / 1e6 if first else None
            if ttft_ms is not None or status != 200:
                self.metrics.observe_slo(model_name, tenant.name, ttft_ms, status)
        self._finished(path, model_name, req, gen, finish, status, trace)

    def _finished(self, path: str, model: str, req: llm_codec.CompletionRequest | None,
                  gen: GenerationHandle | None, finish: Finish | None, status: int,
                  trace: tracing.Trace | None, exc: Exception | None = None) -> None:
        """A generation ended: the GenAI metrics of an answered one (``genai.py``); a traced
        one's spans, made after the reply (``tracing_spans.py``)."""
        operation = "chat" if PATHS[path] else "text_completion"
        if finish is not None and (finish.error is not None or finish.reason == "cancelled"):
            status = finish.error.status if finish.error is not None else 499  # (streamed)
        if status == 200 and gen is not None and not gen.report.cached:
            self.metrics.genai.generation(operation, model, gen.timing)
        if trace is not None:
            assert self.tracer is not None
            asyncio.get_running_loop().call_soon(
                self.tracer.end_generation, trace, operation, model, req,
                gen.timing if gen is not None else None, finish, status, path, exc)

    async def _error(self, send: Send, exc: SokujiError, model: str) -> None:
        if model:
            self.metrics.requests.labels(model, str(exc.status)).inc()
        with contextlib.suppress(OSError):
            await error_reply(exc, ErrorStyle.OPENAI).send(send)

    @staticmethod
    async def _watch(receive: Receive, gen: GenerationHandle) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gen.cancel()
                return

    async def _respond(self, send: Send, req: llm_codec.CompletionRequest,
                       gen: GenerationHandle, model: Model) -> Finish:
        """Answer ``gen``'s events; its ``Finish`` (a failure is raised instead, unless
        the stream had begun)."""
        enc = llm_codec.Encoder(req, model.name, gen.timing)
        first = await gen.next_events()
        report = gen.report  # known once the first events came
        if report.outputs:  # extra outputs (a pipeline's steps): the answer's sources
            enc.extra = {"sources": dict(report.outputs)}
        steps = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in report.headers.items()]
        if report.served_by:
            steps.append((SERVED_BY.encode("latin-1"), report.served_by.encode("latin-1")))
        if isinstance(first[0], Finish):
            failure = first[0].error
            if failure is not None or first[0].reason == "cancelled":
                self._observe(model.name, gen, first[0], error_reply=failure is not None)
                if failure is not None:
                    raise failure
                return first[0]  # cancelled: the client is gone
        if req.stream:
            return await self._stream(send, req, gen, enc, first, model.name, steps)
        texts: list[str] = []
        pending = first
        while True:
            for event in pending:
                if isinstance(event, Delta):
                    texts.append(event.text)
                    continue
                failure = event.error
                self._observe(model.name, gen, event, error_reply=failure is not None)
                if failure is not None:
                    raise failure
                if event.reason == "cancelled":
                    return event
                body = enc.whole("".join(texts), event.reason, gen.timing,
                                 event.completion_tokens)
                headers = [(b"content-type", b"application/json"),
                           (b"content-length", str(len(body)).encode()),
                           (b"server-timing",
                            gen.timing.server_timing().encode("latin-1")), *steps]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return event
            pending = await gen.next_events()

    async def _stream(self, send: Send, req: llm_codec.CompletionRequest,
                      gen: GenerationHandle, enc: llm_codec.Encoder,
                      pending: list[Delta | Finish], model: str,
                      headers: list[tuple[bytes, bytes]]) -> Finish:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*SSE_HEADERS, *headers] if headers else SSE_HEADERS})
        if req.chat:
            await send({"type": "http.response.body", "body": enc.chunk(None, role=True),
                        "more_body": True})
        while True:
            out: list[bytes] = []
            done: Finish | None = None
            for event in pending:
                if isinstance(event, Delta):
                    out.append(enc.chunk(event.text, tokens=event.tokens))
                else:
                    done = event
            if done is not None:
                self._observe(model, gen, done)
                if done.reason == "cancelled":
                    return done
                failure = done.error
                if failure is not None:  # the status is sent: say it in the stream
                    out.append(b"event: error\ndata: " + llm_codec.orjson.dumps(
                        {"error": {"message": failure.message, "code": failure.code}}) + b"\n\n")
                else:
                    out.append(enc.chunk(None, done.reason, tokens=done.completion_tokens))
                    if req.include_usage:
                        out.append(enc.usage_chunk(gen.timing, done.completion_tokens))
                timing = gen.timing.server_timing()
                out.append(f": server-timing {timing}\n\ndata: [DONE]\n\n".encode())
                await send({"type": "http.response.body", "body": b"".join(out),
                            "more_body": False})
                return done
            if out:
                await send({"type": "http.response.body", "body": b"".join(out),
                            "more_body": True})
            pending = await gen.next_events()

    def _observe(self, model: str, gen: GenerationHandle, event: Finish,
                 error_reply: bool = False) -> None:
        """Generation metrics. The request is counted here too, unless it is answered with
        an error reply (``error_reply``), which ``_error`` counts."""
        status = event.error.status if event.error is not None \
            else 499 if event.reason == "cancelled" else 200
        if gen.report.cached:  # a semantic hit: nothing was generated
            if not error_reply:
                self.metrics.requests.labels(model, str(status)).inc()
            return
        asyncio.get_running_loop().call_soon(self.metrics.observe_generation, model,
                                             gen.timing, event.completion_tokens, status,
                                             not error_reply)

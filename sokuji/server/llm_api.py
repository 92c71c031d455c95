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
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, Protocol, TypeVar

from starlette.types import Receive, Send

from sokuji.config import ServerConfig
from sokuji.core import offload
from sokuji.core.events import TokenLogprob
from sokuji.core.model import Api
from sokuji.errors import SokujiError
from sokuji.llm.request import Delta, Finish, GenerationHandle
from sokuji.observability import tracing
from sokuji.repository.models import Model, ModelRepository
from sokuji.server import apis, llm_choices, llm_codec, scheduling
from sokuji.server.accounting import Accounting
from sokuji.server.auth import Tenant
from sokuji.server.failures import ErrorStyle, error_reply, to_error
from sokuji.server.http import (
    BodyTimeout,
    ClientGone,
    Headers,
    check_content_type,
    read_body,
)

log = logging.getLogger(__name__)
PATHS = {"/v1/chat/completions": True, "/v1/completions": False}
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
SERVED_BY = "x-sokuji-served-by"
INLINE_MAX_BYTES = 4 * 1024
"""Bodies up to this size are decoded on the event loop; larger ones in a worker thread."""
P = ParamSpec("P")
T = TypeVar("T")


class Cancellable(Protocol):
    def cancel(self) -> None: ...


async def _maybe_off_loop(off: bool, fn: Callable[P, T], *args: P.args,
                          **kwargs: P.kwargs) -> T:
    """``fn`` in the ``sokuji-prep`` pool when ``off``, else inline. (Not asyncio's default
    executor: that one also runs DNS lookups and store I/O.)"""
    if off:
        return await offload.run(fn, *args, **kwargs)
    return fn(*args, **kwargs)


class Generation:
    def __init__(self, config: ServerConfig, repo: ModelRepository,
                 accounting: Accounting) -> None:
        self.config = config
        self.repo = repo
        self.accounting = accounting
        self.body_timeout = BodyTimeout.of(config)

    async def __call__(self, path: str, headers: Headers, receive: Receive, send: Send,
                       t0: int, tenant: Tenant, trace: tracing.Trace | None = None) -> None:
        """``POST`` on ``path`` by ``tenant`` (the method and the caller checked by the app);
        ``trace``: the request is traced."""
        operation = "chat" if PATHS[path] else "text_completion"
        model_name = ""
        try:
            check_content_type(headers, binary_ok=False)
            body = await read_body(receive, headers, self.config.max_request_bytes,
                                   self.body_timeout)
            req = await _maybe_off_loop(len(body) > INLINE_MAX_BYTES, llm_codec.decode, body,
                                        PATHS[path])
            model = self.lookup(req.model, None, tenant)
            model_name = model.name
            self.require(model, path)
            gens = await self.start(model, req, headers, t0, tenant)
            gen = gens[0]
        except ClientGone:
            return
        except Exception as exc:  # noqa: BLE001 - refused before submission: one mapper
            refusal = to_error(exc, "POST", path)
            await _reply_error(send, refusal)
            self.accounting.refused(model_name, tenant.name, refusal, t0, operation, path,
                                    req.model if model_name else "", trace, exc)
            return
        merged = llm_choices.Merged(gens)
        watcher = asyncio.create_task(cancel_on_disconnect(receive, merged))
        finish: Finish | None = None
        failure: SokujiError | None = None
        try:
            if len(gens) == 1 and req.tools is None:
                finish, answered = await self._respond(send, req, gen, model)
            else:
                finish, answered = await self._respond_choices(send, req, merged, model)
            if not answered:
                failure = finish.error
        except Exception as exc:  # noqa: BLE001 - a bug while answering: one mapper
            failure = to_error(exc, "POST", path)
        finally:
            merged.cancel()  # a no-op once finished; stops the engine if we got here early
            watcher.cancel()
        if failure is not None:
            await _reply_error(send, failure)
        self.accounting.generated(model_name, tenant.name, gen, finish, failure, operation,
                                  req, path, trace)

    def lookup(self, name: str, version: str | None, tenant: Tenant) -> Model:
        """The ready model ``name`` (``version``) that ``tenant`` may use; a 4xx naming why
        not. Whether it generates is ``require``'s: a refusal after the lookup is the model's
        and counted under its name."""
        tenant.check_model(name)  # before the lookup: 403 tells nothing of others
        return self.repo.get_ready(name, version)

    @staticmethod
    def require(model: Model, path: str) -> None:
        """A 400 naming what ``model`` serves unless it generates."""
        if Api.GENERATE not in model.apis:
            apis.require(model, Api.GENERATE, path)

    async def start(self, model: Model, req: llm_codec.CompletionRequest, headers: Headers,
                    t0: int, tenant: Tenant, parameters: Mapping[str, Any] | None = None
                    ) -> list[GenerationHandle]:
        """The one way a generation starts, whatever the protocol (OpenAI, Triton's generate
        over HTTP or gRPC): admission, the model's ``prepare`` (4xx), submission. Returns
        one handle per choice, each a generation's stream of events. ``parameters``: the
        request's scheduling parameters (gRPC's ``priority``, ``timeout``), if any."""
        served = model.served
        served.check_admission()
        ctx = scheduling.context(tenant, headers, parameters or {}, t0,
                                 model.config.default_timeout_ms)
        prepared = await served.prepare(req, ctx)
        return llm_choices.submit(served, prepared, ctx, req.n)

    async def _respond(self, send: Send, req: llm_codec.CompletionRequest,
                       gen: GenerationHandle, model: Model) -> tuple[Finish, bool]:
        """Answer ``gen``'s events: its ``Finish``, and whether it was answered (False: it
        failed before anything was sent, and the caller answers its error)."""
        enc = llm_codec.Encoder(req, model.name, gen.timing)
        first = await gen.next_events()
        report = gen.report  # known once the first events came
        if report.outputs:  # extra outputs (a pipeline's steps): the answer's sources
            enc.extra = {"sources": dict(report.outputs)}
        steps = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in report.headers.items()]
        if report.served_by:
            steps.append((SERVED_BY.encode("latin-1"), report.served_by.encode("latin-1")))
        if isinstance(first[0], Finish):
            if first[0].error is not None:
                return first[0], False
            if first[0].reason == "cancelled":
                return first[0], True  # the client is gone
        if req.stream:
            return await self._stream(send, req, gen, enc, first, steps), True
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        pending = first
        while True:
            for event in pending:
                if isinstance(event, Delta):
                    texts.append(event.text)
                    logprobs.extend(event.logprobs)
                    continue
                if event.error is not None:
                    return event, False
                if event.reason == "cancelled":
                    return event, True
                body = enc.whole("".join(texts), event.reason, gen.timing,
                                 event.completion_tokens, logprobs)
                headers = [(b"content-type", b"application/json"),
                           (b"content-length", str(len(body)).encode()),
                           (b"server-timing",
                            gen.timing.server_timing().encode("latin-1")), *steps]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return event, True
            pending = await gen.next_events()

    async def _respond_choices(self, send: Send, req: llm_codec.CompletionRequest,
                               merged: llm_choices.Merged, model: Model) -> tuple[Finish, bool]:
        """``_respond`` for several choices (``n``) or an answer with tools: each choice
        built by ``llm_choices.Choice``; the first choice's handle gives the timing (the
        choices share the prompt) and the usage counts every choice's tokens. Returns the
        first choice's ``Finish`` (an error's, if one failed) and whether it was answered."""
        lead = merged.gens[0]
        enc = llm_codec.Encoder(req, model.name, lead.timing)
        choices = [llm_choices.Choice(i, req.tools is not None and req.chat)
                   for i in range(len(merged.gens))]
        pending = await merged.next_events()
        report = lead.report
        steps = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in report.headers.items()]
        if report.served_by:
            steps.append((SERVED_BY.encode("latin-1"), report.served_by.encode("latin-1")))
        failed = next((e for _, e in pending if isinstance(e, Finish) and e.error), None)
        if failed is not None:
            return failed, False
        if req.stream:
            return await self._stream_choices(send, req, merged, enc, choices, pending,
                                              steps), True
        while True:
            for i, event in pending:
                if isinstance(event, Delta):
                    choices[i].add(event)
                    continue
                if event.error is not None:
                    return event, False
                if event.reason == "cancelled":
                    return event, True
                choices[i].end(event)
            if not merged.open:
                break
            pending = await merged.next_events()
        tokens = sum(c.finish.completion_tokens for c in choices if c.finish is not None)
        body = enc.whole_choices(choices, lead.timing, tokens)
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()),
                   (b"server-timing", lead.timing.server_timing().encode("latin-1")), *steps]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        first = choices[0].finish
        assert first is not None
        return first, True

    async def _stream_choices(self, send: Send, req: llm_codec.CompletionRequest,
                              merged: llm_choices.Merged, enc: llm_codec.Encoder,
                              choices: list[llm_choices.Choice],
                              pending: list[tuple[int, Delta | Finish]],
                              headers: list[tuple[bytes, bytes]]) -> Finish:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*SSE_HEADERS, *headers] if headers else SSE_HEADERS})
        if req.chat:
            await send({"type": "http.response.body", "more_body": True, "body": b"".join(
                enc.chunk(None, role=True, index=c.index) for c in choices)})
        lead = merged.gens[0]
        while True:
            out: list[bytes] = []
            for i, event in pending:
                choice = choices[i]
                if isinstance(event, Delta):
                    logprobs = event.logprobs if enc.logprobs else None
                    if not req.chat:
                        out.append(enc.chunk(event.text, tokens=event.tokens,
                                             logprobs=logprobs, index=i))
                        continue
                    deltas = choice.add(event)
                    if not deltas and logprobs:
                        deltas = [{}]  # (its tokens' log-probabilities go out now)
                    for k, delta in enumerate(deltas):
                        out.append(enc.chunk(None, tokens=event.tokens, index=i, delta=delta,
                                             logprobs=logprobs if k == 0 else None))
                    continue
                if event.reason == "cancelled":
                    return event
                if event.error is not None:  # the status is sent: say it in the stream
                    out.append(b"event: error\ndata: " + llm_codec.orjson.dumps(
                        {"error": {"message": event.error.message, "code": event.error.code,
                                   "choice": i}}) + b"\n\n")
                    out.append(b"data: [DONE]\n\n")
                    await send({"type": "http.response.body", "body": b"".join(out),
                                "more_body": False})
                    return event
                out.extend(enc.chunk(None, index=i, delta=d) for d in choice.end(event))
                out.append(enc.chunk(None, choice.reason, tokens=event.completion_tokens,
                                     index=i))
            if not merged.open:
                tokens = sum(c.finish.completion_tokens for c in choices
                             if c.finish is not None)
                if req.include_usage:
                    out.append(enc.usage_chunk(lead.timing, tokens))
                timing = lead.timing.server_timing()
                out.append(f": server-timing {timing}\n\ndata: [DONE]\n\n".encode())
                await send({"type": "http.response.body", "body": b"".join(out),
                            "more_body": False})
                first = choices[0].finish
                assert first is not None
                return first
            if out:
                await send({"type": "http.response.body", "body": b"".join(out),
                            "more_body": True})
            pending = await merged.next_events()

    async def _stream(self, send: Send, req: llm_codec.CompletionRequest,
                      gen: GenerationHandle, enc: llm_codec.Encoder,
                      pending: list[Delta | Finish], headers: list[tuple[bytes, bytes]]
                      ) -> Finish:
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
                    out.append(enc.chunk(event.text, tokens=event.tokens,
                                         logprobs=event.logprobs if enc.logprobs else None))
                else:
                    done = event
            if done is not None:
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


async def cancel_on_disconnect(receive: Receive, handle: Cancellable) -> None:
    """Watch ``receive`` for the whole of a streamed answer; the client going away cancels
    ``handle`` (a generation's, or any streaming handle's: ``server/predict.py``)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


async def _reply_error(send: Send, exc: SokujiError) -> None:
    with contextlib.suppress(OSError):
        await error_reply(exc, ErrorStyle.OPENAI).send(send)

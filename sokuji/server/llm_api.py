"""``POST /v1/chat/completions`` and ``POST /v1/completions``: generation over HTTP.

The way through: body read (bounded) -> validation -> chat template -> the prompt's size in
bytes, then tokenise, then its size in tokens (``llm/prompt.py``; 4xx) -> the engine's queue
(429 when full) -> tokens as they come, as server-sent events (``stream: true``) or one JSON
body. Bodies over ``INLINE_MAX_BYTES`` are decoded, templated and tokenised in a worker
thread (the ``sokuji-prep`` pool, ``core/offload.py``), never on the event loop. The
response waits for the first event before its status is sent, so a request that fails in
the queue (deadline, shutdown) still gets a proper status code. A client that disconnects
cancels its generation: a task watches ``receive()`` for ``http.disconnect`` for the
request's whole life.

Timing: ``Server-Timing`` on non-streaming responses; a streamed response ends with the same
text as an SSE comment (``: server-timing ...``) just before ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar, cast

from starlette.types import Receive, Send

from sokuji.config import ServerConfig
from sokuji.core import offload
from sokuji.errors import (
    DeadlineExceeded,
    MethodNotAllowed,
    ModelNotReady,
    RuntimeFailed,
    SokujiError,
)
from sokuji.llm.request import Delta, Finish, GenerationRequest
from sokuji.models.repository import Model, ModelRepository
from sokuji.observability.metrics import Metrics
from sokuji.server import llm_codec, scheduling
from sokuji.server.auth import Authenticator
from sokuji.server.http import ClientGone, Headers, check_content_type, error_reply, read_body

if TYPE_CHECKING:
    from sokuji.llm.prompt import PromptBuilder
    from sokuji.llm.runtime import LlamaRuntime

log = logging.getLogger(__name__)
PATHS = {"/v1/chat/completions": True, "/v1/completions": False}
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
INLINE_MAX_BYTES = 4 * 1024
"""Bodies up to this size are decoded, templated and tokenised on the event loop (under a
millisecond; a short prompt's thread hop would cost more than its tokenisation); larger
ones in a worker thread, so a long prompt never holds up other requests. (SmolLM2's
tokenizer, measured: 16 KiB 3 ms, 3 MiB 0.7 s; prompts over ~40-160 KiB are refused by
their size before that, see ``llm/prompt.py``.)"""
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
    def __init__(self, config: ServerConfig, repo: ModelRepository, metrics: Metrics,
                 auth: Authenticator) -> None:
        self.config = config
        self.repo = repo
        self.metrics = metrics
        self.auth = auth

    async def __call__(self, path: str, method: str, headers: Headers, receive: Receive,
                       send: Send, t0: int) -> None:
        model_name = ""
        try:
            if method != "POST":
                raise MethodNotAllowed(f"{method} is not allowed on {path}; use POST")
            tenant = self.auth.authenticate(headers)
            check_content_type(headers, binary_ok=False)
            body = await read_body(receive, headers, self.config.max_request_bytes)
            large = len(body) > INLINE_MAX_BYTES
            req = await _maybe_off_loop(large, llm_codec.decode, body, PATHS[path])
            tenant.check_model(req.model)  # before the lookup: 403 tells nothing of others
            model = self.repo.get_ready(req.model)
            model_name = model.name
            engine = model.generator()
            engine.check_capacity()
            prompts = cast("LlamaRuntime", model.runtime).prompts
            prompt = await _maybe_off_loop(large, self._prompt, prompts, req)
            params = prompts.sampling(
                len(prompt), chat=req.chat, max_tokens=req.max_tokens,
                max_tokens_field=req.max_tokens_field, min_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos, temperature=req.temperature, top_p=req.top_p,
                seed=req.seed, stop=req.stop)
            gen = GenerationRequest(
                model.name, prompt, params, asyncio.get_running_loop(), arrival_ns=t0,
                priority=scheduling.priority(headers, {}, tenant.priority,
                                             tenant.max_priority),
                deadline_ns=scheduling.deadline_ns(headers, {}, t0,
                                                   model.config.default_timeout_ms),
                tenant=tenant.name)
            gen.timing.submitted_ns = time.perf_counter_ns()
            engine.submit(gen)
        except ClientGone:
            return
        except Exception as exc:  # refused before submission: the error tree, or a logged 500
            failure = exc if isinstance(exc, SokujiError) else None
            if failure is None:
                log.exception("unhandled error on %s", path)
                failure = RuntimeFailed(f"internal error: {type(exc).__name__}")
            if model_name:  # Triton statistics: a failure, from arrival to the reply
                self.metrics.observe_failure(model_name, time.perf_counter_ns() - t0)
            await self._error(send, path, failure, model_name)
            return
        watcher = asyncio.create_task(self._watch(receive, gen))
        try:
            await self._respond(send, req, gen, model)
        except SokujiError as exc:
            await self._error(send, path, exc, model_name)
        except Exception as exc:  # a 500 is a bug: logged
            log.exception("unhandled error on %s", path)
            await self._error(send, path, RuntimeFailed(f"internal error: "
                                                        f"{type(exc).__name__}"), model_name)
        finally:
            gen.cancel()  # a no-op once finished; stops the engine if we got here early
            watcher.cancel()

    async def _error(self, send: Send, path: str, exc: SokujiError, model: str) -> None:
        if exc.status >= 500 and not isinstance(exc, (DeadlineExceeded, ModelNotReady)):
            log.error("POST %s: %s", path, exc.message)
        if model:
            self.metrics.requests.labels(model, str(exc.status)).inc()
        with contextlib.suppress(OSError):
            await error_reply(path, exc.status, exc.code, exc.message, exc.param,
                              exc.headers).send(send)

    @staticmethod
    async def _watch(receive: Receive, gen: GenerationRequest) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gen.cancel()
                return

    @staticmethod
    def _prompt(prompts: PromptBuilder, req: llm_codec.CompletionRequest) -> list[int]:
        if req.chat:
            return prompts.tokens(messages=req.messages)
        if isinstance(req.prompt, list):
            return prompts.tokens(token_ids=req.prompt)
        return prompts.tokens(text=req.prompt)

    @staticmethod
    def _failure(event: Finish) -> SokujiError | None:
        if event.reason == "deadline":
            return DeadlineExceeded(f"deadline exceeded: {event.error}")
        if event.reason == "error":
            if "shutting down" in event.error:
                return ModelNotReady(event.error)
            return RuntimeFailed(event.error)
        return None

    async def _respond(self, send: Send, req: llm_codec.CompletionRequest,
                       gen: GenerationRequest, model: Model) -> None:
        enc = llm_codec.Encoder(req, model.name, gen.timing)
        first = await gen.events()
        if isinstance(first[0], Finish):
            failure = self._failure(first[0])
            if failure is not None or first[0].reason == "cancelled":
                self._observe(model.name, gen, first[0], error_reply=failure is not None)
                if failure is not None:
                    raise failure
                return  # cancelled: the client is gone
        if req.stream:
            await self._stream(send, req, gen, enc, first, model.name)
            return
        texts: list[str] = []
        pending = first
        while True:
            for event in pending:
                if isinstance(event, Delta):
                    texts.append(event.text)
                    continue
                failure = self._failure(event)
                self._observe(model.name, gen, event, error_reply=failure is not None)
                if failure is not None:
                    raise failure
                if event.reason == "cancelled":
                    return
                body = enc.whole("".join(texts), event.reason, gen.timing,
                                 event.completion_tokens)
                headers = [(b"content-type", b"application/json"),
                           (b"content-length", str(len(body)).encode()),
                           (b"server-timing",
                            gen.timing.server_timing().encode("latin-1"))]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            pending = await gen.events()

    async def _stream(self, send: Send, req: llm_codec.CompletionRequest,
                      gen: GenerationRequest, enc: llm_codec.Encoder,
                      pending: list[Delta | Finish], model: str) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
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
                    return
                failure = self._failure(done)
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
                return
            if out:
                await send({"type": "http.response.body", "body": b"".join(out),
                            "more_body": True})
            pending = await gen.events()

    def _observe(self, model: str, gen: GenerationRequest, event: Finish,
                 error_reply: bool = False) -> None:
        """Generation metrics. The request is counted here too, unless it is answered with
        an error reply (``error_reply``), which ``_error`` counts."""
        status = {"deadline": 504, "error": 500, "cancelled": 499}.get(event.reason, 200)
        asyncio.get_running_loop().call_soon(self.metrics.observe_generation, model,
                                             gen.timing, event.completion_tokens, status,
                                             not error_reply)

"""Generation through an OpenAI-compatible upstream (another Sokuji, llama-server, vLLM): a
handle that reads the upstream's server-sent events and yields the same ``Delta`` /
``Finish`` events as a local generation (``core/events.py``), so ``llm_api`` streams it
unchanged. (The request body: ``upstream_codec.completion_request``.)

The upstream is always asked to stream (``stream_options.include_usage`` for its token
counts). Its events are parsed, never piped: its chunks carry its own model name and ids,
and its error events must become our ``Finish(error=...)``. Events are split on blank
lines, whatever the chunking. ``cancel()`` closes the upstream response, which stops the
upstream's generation (Sokuji and llama-server both watch for the disconnect).

Budgets: until the upstream's status and headers arrive (the commit point), the attempt is
bounded by ``timeout_ms`` within what is left of the request's deadline; once streaming, a
deadline no longer applies (as locally: it bounds the start) and ``timeout_ms`` bounds each
gap between two reads (the session's ``sock_read``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from sokuji.core.events import Delta, EventQueue, Finish
from sokuji.core.model import RequestContext
from sokuji.errors import DeadlineExceeded, SokujiError
from sokuji.llm.request import Timing
from sokuji.routing.upstream_codec import SseParser
from sokuji.routing.upstream_errors import UpstreamFailed, UpstreamTimeout, error_message
from sokuji.routing.upstream_http import Attempt, UpstreamClient

log = logging.getLogger(__name__)


class UpstreamGeneration(EventQueue):
    """One generation on the upstream: a ``GenerationHandle`` (``llm/request.py``)."""

    def __init__(self, client: UpstreamClient, path: str, body: bytes, chat: bool,
                 ctx: RequestContext, on_done: Callable[[], None],
                 timing: Timing | None = None, reveal: bool = True) -> None:
        """``reveal``: the upstream's cache hits may reach the caller
        (``UpstreamClient.reveals``); False: its ``cached_tokens`` are not read."""
        self.client = client
        self.chat = chat
        self.reveal = reveal
        self.timing = timing if timing is not None else Timing(arrival_ns=ctx.arrival_ns)
        """A pipeline passes its own (its steps before this generation are its time)."""
        self.timing.submitted_ns = time.perf_counter_ns()
        self.completion_tokens = 0
        self._finished = False
        self._reason: str | None = None
        self._counted = 0
        """Deltas seen (the token count when the upstream gives no usage)."""
        self._on_done = on_done
        super().__init__()
        self._task = asyncio.get_running_loop().create_task(self._run(path, body, ctx))
        self._task.add_done_callback(self._done)

    # -- the caller's side ----------------------------------------------------------------
    def cancel(self) -> None:
        """Close the upstream response (a no-op once finished)."""
        if not self._finished:
            self._task.cancel()

    # -- the upstream's side --------------------------------------------------------------
    def _finish(self, reason: str, error: SokujiError | None = None) -> None:
        """The one ``Finish``; the model's count of requests in flight goes down with it."""
        if self._finished:
            return
        self._finished = True
        self.timing.end_ns = time.perf_counter_ns()
        self.put(Finish(reason, self.completion_tokens, error))
        self._on_done()

    async def _run(self, path: str, body: bytes, ctx: RequestContext) -> None:
        client = self.client
        tried: list[Attempt] = []
        resp: aiohttp.ClientResponse | None = None
        try:
            budget = client.budget_s(ctx)
            async with asyncio.timeout(budget):
                resp = await client.post(path, body, client.headers(ctx, budget), tried,
                                         ctx.trace)
            self.timing.admitted_ns = time.perf_counter_ns()  # its status and headers came
            await self._relay(resp, tried[-1])
            client.report(tried[-1], resp.status)
            resp.release()  # back to the pool if it was read to its end, else closed
            resp = None
        except SokujiError as exc:
            self._finish("deadline" if isinstance(exc, DeadlineExceeded) else "error", exc)
        except TimeoutError as exc:
            client.cut_short(tried, exc)
            self._finish("deadline", UpstreamTimeout(
                f"{client.who}: no answer within {client.options.timeout_ms:.0f} ms or the "
                "request's deadline", before_response=resp is None))
        except asyncio.CancelledError as exc:
            client.cut_short(tried, exc)
            raise
        except Exception as exc:  # a bug: the caller still gets a Finish
            log.exception("%s: the relay failed", client.who)
            self._finish("error", UpstreamFailed(f"{client.who}: {type(exc).__name__}"))
        finally:
            if resp is not None:  # mid-stream: the upstream sees the disconnect and stops
                resp.close()

    def _done(self, task: asyncio.Task[None]) -> None:
        """Whatever ended the task (even a cancellation before it ran): a Finish."""
        if not task.cancelled():
            task.exception()  # retrieved: the relay catches everything it expects
        self._finish("cancelled")

    async def _relay(self, resp: aiohttp.ClientResponse, attempt: Attempt) -> None:
        """The upstream's events as ours, up to its last; a whole JSON answer (a server
        that does not stream) is taken too."""
        who = self.client.who
        if resp.content_type == "application/json":
            try:
                doc = orjson.loads(await self.client.read(resp, attempt))
            except orjson.JSONDecodeError:
                raise UpstreamFailed(f"{who}: the answer is not JSON") from None
            self._on_chunk(doc, whole=True)
            self._finish(self._reason or "stop")
            return
        limit = self.client.options.max_response_bytes
        parser, size, done = SseParser(), 0, False
        try:
            while not done and (chunk := await resp.content.readany()):
                size += len(chunk)
                if size > limit:
                    raise self.client.too_large(attempt)
                for event, data in parser.feed(chunk):
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        doc = orjson.loads(data)
                    except orjson.JSONDecodeError:
                        raise UpstreamFailed(f"{who}: an event is not JSON") from None
                    if event == "error" or (isinstance(doc, dict) and "error" in doc):
                        text, _ = error_message(data.encode())
                        self.client.report(attempt, "stream_error")
                        raise UpstreamFailed(f"{who}: the generation failed: {text}")
                    self._on_chunk(doc)
        except aiohttp.ServerTimeoutError:
            self.client.report(attempt, "timeout")
            raise UpstreamTimeout(f"{who}: the stream stalled for timeout_ms",
                                  before_response=False) from None
        except (aiohttp.ClientError, OSError) as exc:
            self.client.report(attempt, "stream_error")
            raise UpstreamFailed(f"{who}: the stream broke off ({type(exc).__name__})") \
                from None
        if not done and self._reason is None:
            self.client.report(attempt, "stream_error")
            raise UpstreamFailed(f"{who}: the stream ended before the generation finished")
        self._finish(self._reason or "stop")

    def _on_chunk(self, doc: Any, whole: bool = False) -> None:
        if not isinstance(doc, dict):
            return
        usage = doc.get("usage")
        if isinstance(usage, dict):
            self._usage(usage)
        choices = doc.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        if self.chat:
            part = choice.get("message" if whole else "delta")
            text = part.get("content") if isinstance(part, dict) else None
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            now = time.perf_counter_ns()
            if not self.timing.first_token_ns:
                self.timing.first_token_ns = now
            self.timing.token_ns.append(now)
            self._counted += 1
            self.completion_tokens = max(self.completion_tokens, self._counted)
            self.put(Delta(text, self.completion_tokens))
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            self._reason = reason

    def _usage(self, usage: dict[str, Any]) -> None:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            self.timing.prompt_tokens = prompt
        if isinstance(completion, int):
            self.completion_tokens = completion
        if not self.reveal:
            return
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int):
            self.timing.reused_tokens = cached
            self.timing.prefix_lookup = "hit" if cached else "miss"

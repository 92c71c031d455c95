"""``Api.STREAM`` over HTTP: ``POST /v2/models/{m}/infer`` with ``Accept:
application/x-ndjson`` and a body sent in chunks (``Transfer-Encoding: chunked``, e.g. a WAV
from a microphone), for a model that serves it (its ``open_stream``: VAD's segments,
``audio/vad_stream.py``).

Each record is written as one NDJSON line as soon as the model has it, so a client learns of
it while it is still sending; the last line is the model's own summary (``end``).

- The status is sent once the body's head has arrived and passed the model's checks
  (``ready``), so a wrong format or parameter is still a proper 4xx. A problem found later
  (the body past the model's ``max_request_bytes``, a body the model finds wrong or
  truncated) ends the stream with ``{"error": ..., "status": N}`` as its last line.
- Per-request parameters come in the query string (``?threshold=0.6``), checked by the model.
- V2 itself cannot stream its input: a V2 request is one JSON document (or one header plus
  its binary tensors), decoded whole.
- Each chunk is fed in the preparation pool, one chunk at a time per stream; the model counts
  a stream in flight until it is closed.

**What one stream may hold** (``[streams]``, ``config.StreamsConfig``). A stream holds one
of its model's slots (``max_concurrency``) for as long as it lasts, so its time is bounded:
no chunk for ``idle_timeout_s``, or ``total_timeout_s`` since its arrival (waiting for the
client to read included), ends it with 408 (``RequestTimeout``): as its status if none was
sent yet, else as its last line; the connection is then closed (every stream's response
says ``Connection: close``: what is left of the body is never read). Admission (``Streams``),
before the model's own (``open_stream``: 429 at its ``max_concurrency``), in this order:

1. The tenant's streams on the model, at most ``Streams.cap`` (429 at once, Retry-After):
   one tenant cannot hold every slot.
2. Priority, resolved like any request's (``scheduling.context``: the priority header or
   the tenant's class, under its ``max_priority``): a stream cannot wait in the model's
   queue, where interactive work goes first, so at admission a batch-class stream may not
   take a model's last free slot (429): it stays for interactive work.
3. The deadline (``X-Sokuji-Timeout-Ms`` or the model's ``default_timeout_ms``) bounds the
   start, as ``core/policy.py`` says: a stream that cannot start before it is refused 504
   (``check_deadline`` on the model's capacity). A stream that has started is bounded by
   its timeouts, not by its deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl

import orjson
from starlette.types import Message, Receive, Send

from sokuji.config import StreamsConfig
from sokuji.core import offload
from sokuji.core.model import RequestContext, ServedModel
from sokuji.core.policy import check_deadline
from sokuji.core.request import Priority
from sokuji.errors import (
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    RuntimeFailed,
    SokujiError,
)
from sokuji.server.http import Headers

log = logging.getLogger(__name__)
NDJSON = "application/x-ndjson"
_START = [(b"content-type", NDJSON.encode()), (b"cache-control", b"no-cache"),
          (b"x-accel-buffering", b"no"), (b"connection", b"close")]
AUTO_CAP = 4
"""The automatic per-tenant cap (with keys) of a model that sets no ``max_concurrency``."""


def wants_stream(headers: Headers) -> bool:
    return NDJSON in headers.get("accept", "")


class Streams:
    """The streams in flight, per (model, tenant), and their admission (steps 1-3 above).
    ``keyed``: API keys are configured (decided once, at start-up)."""

    def __init__(self, config: StreamsConfig, keyed: bool) -> None:
        self.config = config
        self.keyed = keyed
        self.in_flight: dict[tuple[str, str], int] = {}

    def cap(self, max_concurrency: int) -> int:
        """The most streams one tenant may have on a model of ``max_concurrency``; 0: none
        of its own (the model's bounds them all)."""
        if self.config.max_per_tenant:
            return self.config.max_per_tenant
        if not self.keyed:
            return 0
        return max(1, max_concurrency - 1) if max_concurrency else AUTO_CAP

    @contextmanager
    def admit(self, name: str, model: ServedModel, max_concurrency: int,
              ctx: RequestContext) -> Iterator[None]:
        """Count one stream of ``ctx.tenant`` on model ``name`` while the block runs, or
        refuse it: 429 (the tenant's cap, or a batch-class stream at the last free slot),
        504 (it cannot start before its deadline)."""
        key = (name, ctx.tenant)
        held = self.in_flight.get(key, 0)
        cap = self.cap(max_concurrency)
        if cap and held >= cap:
            raise Overloaded(f"tenant '{ctx.tenant}' has {held} streams in flight on model "
                             f"'{name}' (at most {cap}: streams.max_per_tenant); retry later",
                             retry_after_s=1)
        capacity = model.capacity()
        admitted = capacity.num_waiting + capacity.num_running
        if ctx.priority is Priority.BATCH and max_concurrency >= 2 \
                and admitted >= max_concurrency - 1:
            raise Overloaded(f"model '{name}' has {admitted} of {max_concurrency} slots in "
                             "use; its last one is kept for interactive requests (this "
                             "stream is batch-class); retry later", retry_after_s=1)
        check_deadline(ctx.deadline_ns, time.perf_counter_ns(), float(capacity.num_waiting),
                       capacity.drain_per_s, saturated=capacity.num_running > 0)
        self.in_flight[key] = held + 1
        try:
            yield
        finally:
            left = self.in_flight[key] - 1
            if left:
                self.in_flight[key] = left
            else:
                del self.in_flight[key]


class _Clock:
    """A stream's two timeouts, as loop times: every wait for the client is bounded."""

    def __init__(self, config: StreamsConfig, arrival_ns: int) -> None:
        loop = asyncio.get_running_loop()
        self.config = config
        self.end = loop.time() + config.total_timeout_s \
            - (time.perf_counter_ns() - arrival_ns) / 1e9
        self.loop = loop

    def _expired(self, idle: bool) -> RequestTimeout:
        c = self.config
        if idle:
            return RequestTimeout(f"no chunk of the stream arrived for {c.idle_timeout_s:g} s "
                                  "(streams.idle_timeout_s)")
        return RequestTimeout(f"the stream lasted more than {c.total_timeout_s:g} s "
                              "(streams.total_timeout_s)")

    async def receive(self, receive: Receive) -> Message:
        left = self.end - self.loop.time()
        idle = self.config.idle_timeout_s <= left
        try:
            async with asyncio.timeout(max(0.0, min(self.config.idle_timeout_s, left))):
                return await receive()
        except TimeoutError:
            raise self._expired(idle) from None

    async def send(self, send: Send, message: Message) -> None:
        """``send``, bounded by the total timeout (a client that stops reading blocks it)."""
        try:
            async with asyncio.timeout_at(self.end):
                await send(message)
        except TimeoutError:
            raise self._expired(False) from None


async def relay(model: ServedModel, limit: int, headers: Headers, query: bytes,
                ctx: RequestContext, receive: Receive, send: Send,
                bounds: StreamsConfig) -> None:
    """Answer one streamed body, within ``bounds``' timeouts. Raises a ``SokujiError`` only
    before the status is sent."""
    clock = _Clock(bounds, ctx.arrival_ns)
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of "
                              f"{limit} bytes")
    params = dict(parse_qsl(query.decode("latin-1"), keep_blank_values=True))
    records = model.open_stream(headers.get("content-type", ""), params, ctx)
    t0 = time.perf_counter_ns()
    started = False
    count = total = 0
    work_ns = 0

    async def lines(out: list[dict[str, Any]]) -> None:
        nonlocal count
        count += len(out)
        if out:
            await clock.send(send, {"type": "http.response.body", "more_body": True,
                                    "body": b"".join(orjson.dumps(r) + b"\n" for r in out)})

    async def run(fn: Any, *args: Any) -> list[dict[str, Any]]:
        nonlocal work_ns
        t = time.perf_counter_ns()
        try:
            return list(await offload.run(fn, *args))
        finally:
            work_ns += time.perf_counter_ns() - t

    try:
        more = True
        while more:
            message = await clock.receive(receive)
            if message["type"] == "http.disconnect":
                return
            chunk, more = message.get("body", b""), message.get("more_body", False)
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            out = await run(records.feed, chunk) if chunk else []
            if not started and records.ready:
                await send({"type": "http.response.start", "status": 200, "headers": _START})
                started = True
            if started:
                await lines(out)
        out = await run(records.finish)
        if not started:  # (it did not refuse the body: its head came with the last chunk)
            await send({"type": "http.response.start", "status": 200, "headers": _START})
            started = True
        await lines(out)
        end = records.end(count, (time.perf_counter_ns() - t0) / 1e6, work_ns / 1e6)
        await clock.send(send, {"type": "http.response.body",
                                "body": orjson.dumps(end) + b"\n"})
    except Exception as exc:  # after the status, any failure is the stream's last line
        if not started:
            raise
        if not isinstance(exc, SokujiError):
            log.exception("the stream of model '%s' failed", model.name)
            exc = RuntimeFailed(f"model '{model.name}' failed: {exc!r}")
        last = {"type": "http.response.body", "body": orjson.dumps(
            {"error": exc.message, "status": exc.status}) + b"\n"}
        try:  # a client that reads nothing gets its connection closed without it
            async with asyncio.timeout(bounds.idle_timeout_s):
                await send(last)
        except TimeoutError:
            log.info("a stream of model '%s' ended unread: %s", model.name, exc.message)
    finally:
        records.close()

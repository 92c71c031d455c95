"""HTTP plumbing shared by the inference path and the job service: bounded body reads,
content-type checks, and replies as plain data (status, headers, body). Error replies are
``server/failures.py``'s.

A body is bounded in size (``limit``: refused from its ``Content-Length`` before reading
where it has one) and in time (``BodyTimeout``): a client that sends its headers and then
holds the body open, or trickles it, gets a 408 (``RequestTimeout``, with ``Connection:
close``) naming the bound, instead of holding its request (and what it was admitted to)
open. uvicorn bounds only the time between requests (``timeout_keep_alive``), not a body."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.types import Receive, Send

from sokuji.config import ServerConfig
from sokuji.errors import BadRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType

JSON = "application/json"
Headers = dict[str, str]


@dataclass
class Reply:
    status: int
    body: bytes
    headers: Headers = field(default_factory=dict)

    async def send(self, send: Send) -> None:
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        raw.append((b"content-length", str(len(self.body)).encode()))
        await send({"type": "http.response.start", "status": self.status, "headers": raw})
        await send({"type": "http.response.body", "body": self.body})


def json_reply(doc: object, status: int = 200, headers: Headers | None = None) -> Reply:
    return Reply(status, orjson.dumps(doc), {"content-type": JSON, **(headers or {})})


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class BodyTimeout:
    """How long a request body may take: ``total_s`` for the whole of it (from when reading
    begins), ``idle_s`` at most between two of its pieces (the config's ``body_timeout_s``
    and ``body_idle_timeout_s``).

    A timer per read would cost the hot path 3-10 us (``asyncio.timeout``, uvloop's
    ``call_at``), as much as the rest of decoding a small request; so each wait for a piece
    only notes its task and its limit (a dict entry), and one sweeper task a loop, alive
    while reads wait, cancels the waits past their limit every ``tick_s``. A bound is kept
    to within a tick (an eighth of the smaller bound, at most a second)."""

    __slots__ = ("_expired", "_sweeper", "_waiting", "idle_s", "tick_s", "total_s")

    def __init__(self, total_s: float, idle_s: float) -> None:
        self.total_s = total_s
        self.idle_s = idle_s
        self.tick_s = min(1.0, min(total_s, idle_s) / 8)
        self._waiting: dict[asyncio.Task[Any], tuple[float, bool]] = {}
        """Each waiting read's task: its limit (loop time), and whether it is the idle one."""
        self._expired: dict[asyncio.Task[Any], bool] = {}
        self._sweeper: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, config: ServerConfig) -> BodyTimeout:
        return cls(config.body_timeout_s, config.body_idle_timeout_s)

    def watch(self, task: asyncio.Task[Any], now: float, deadline: float) -> None:
        """``task`` waits for a piece of its body from ``now`` (until the sooner of the idle
        bound and ``deadline``: the whole body's); the sweeper runs while any waits."""
        idle_at = now + self.idle_s
        self._waiting[task] = (idle_at, True) if idle_at <= deadline else (deadline, False)
        sweeper = self._sweeper
        if sweeper is None or sweeper.get_loop() is not task.get_loop():
            self._sweeper = task.get_loop().create_task(self._sweep())

    def unwatch(self, task: asyncio.Task[Any]) -> None:
        del self._waiting[task]
        self._expired.pop(task, None)  # (never left behind, whatever ended the read)

    def expired(self, task: asyncio.Task[Any]) -> RequestTimeout | None:
        """The 408 of ``task`` if the sweeper cancelled it (else None: not ours)."""
        idle = self._expired.pop(task, None)
        if idle is None:
            return None
        task.uncancel()
        if idle:
            return RequestTimeout(f"no part of the request body arrived for {self.idle_s:g} s "
                                  "(body_idle_timeout_s)")
        return RequestTimeout(f"the request body did not arrive within {self.total_s:g} s "
                              "(body_timeout_s)")

    async def _sweep(self) -> None:
        """Cancel the waits past their limit; end once none has waited for a second."""
        loop = asyncio.get_running_loop()
        quiet_since = loop.time()
        while True:
            await asyncio.sleep(self.tick_s)
            now = loop.time()
            if not self._waiting:
                if now - quiet_since >= 1.0:
                    self._sweeper = None
                    return
                continue
            quiet_since = now
            for task, (limit, idle) in list(self._waiting.items()):
                if now >= limit and task not in self._expired:
                    self._expired[task] = idle
                    task.cancel()


async def read_body(receive: Receive, headers: Headers, limit: int,
                    timeout: BodyTimeout) -> bytes:
    """The whole body, refusing more than ``limit`` bytes before reading them where possible,
    and a body slower than ``timeout`` (408)."""
    declared = headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            size = -1
        if size < 0:
            raise BadRequest(f"Content-Length {declared!r} is not a non-negative integer")
        if size > limit:
            raise PayloadTooLarge(f"request body of {size} bytes exceeds the limit of "
                                  f"{limit} bytes")
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported; "
                                   "send the body uncompressed")
    task = asyncio.current_task()
    assert task is not None
    loop = task.get_loop()
    now = loop.time()
    deadline = now + timeout.total_s
    timeout.watch(task, now, deadline)
    try:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body = message.get("body", b"")
        if not message.get("more_body", False):
            if len(body) > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            return body  # the common case: one message
        chunks, total = [body], len(body)
        while message.get("more_body", False):
            timeout.watch(task, loop.time(), deadline)
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    except asyncio.CancelledError:
        late = timeout.expired(task)
        if late is None:
            raise  # not ours: the request itself is cancelled
        raise late from None
    finally:
        timeout.unwatch(task)


def check_content_type(headers: Headers, binary_ok: bool) -> None:
    ctype = headers.get("content-type")
    if ctype is None:
        return
    base = ctype.split(";", 1)[0].strip().lower()
    if base == JSON or (binary_ok and base == "application/octet-stream"):
        return
    accepted = "application/json" + (
        " or application/octet-stream (with Inference-Header-Content-Length)"
        if binary_ok else "")
    raise UnsupportedMediaType(f"Content-Type {ctype!r} is not supported; send {accepted}")

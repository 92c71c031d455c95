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

import orjson
from starlette.types import Message, Receive, Send

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


@dataclass(frozen=True, slots=True)
class BodyTimeout:
    """How long a request body may take: ``total_s`` for the whole of it (from when reading
    begins), ``idle_s`` at most between two of its pieces (the config's ``body_timeout_s``
    and ``body_idle_timeout_s``)."""

    total_s: float
    idle_s: float

    @classmethod
    def of(cls, config: ServerConfig) -> BodyTimeout:
        return cls(config.body_timeout_s, config.body_idle_timeout_s)

    def deadline(self) -> float:
        """The loop time by which the whole body must have arrived."""
        return asyncio.get_running_loop().time() + self.total_s

    async def receive(self, receive: Receive, deadline: float) -> Message:
        """The next message within both bounds, else ``RequestTimeout`` naming the one that
        ran out."""
        left = deadline - asyncio.get_running_loop().time()
        idle = self.idle_s <= left
        try:
            async with asyncio.timeout(max(0.0, min(self.idle_s, left))):
                return await receive()
        except TimeoutError:
            if idle:
                raise RequestTimeout(f"no part of the request body arrived for {self.idle_s:g} "
                                     "s (body_idle_timeout_s)") from None
            raise RequestTimeout(f"the request body did not arrive within {self.total_s:g} s "
                                 "(body_timeout_s)") from None


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
    deadline = timeout.deadline()
    message = await timeout.receive(receive, deadline)
    if message["type"] == "http.disconnect":
        raise ClientGone
    body = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        return body  # the common case: one message
    chunks, total = [body], len(body)
    while message.get("more_body", False):
        message = await timeout.receive(receive, deadline)
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


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

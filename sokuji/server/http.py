"""HTTP plumbing shared by the inference path and the job service: bounded body reads,
content-type checks, and replies as plain data (status, headers, body). Error replies are
``server/failures.py``'s."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from starlette.types import Receive, Send

from sokuji.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

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


async def read_body(receive: Receive, headers: Headers, limit: int) -> bytes:
    """The whole body, refusing more than ``limit`` bytes before reading them where possible."""
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
        message = await receive()
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

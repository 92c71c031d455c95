"""HTTP requests for code that does not run on an event loop (loading a model, ``sokuji
plan``, the Ray launcher): one request run to completion on aiohttp, the library every
async path uses too.

- **Redirects** are never followed: a 3xx is an answer like any other, so a request cannot
  be sent somewhere its caller did not name. No proxy is taken from the environment.
- **Bounded**: the body is read up to ``max_bytes`` (``Response.truncated`` says there was
  more); ``timeout_s`` bounds connecting and each wait for data, as a socket timeout does.
- **Anywhere**: from a thread whose event loop is running (a blocking call made inside a
  coroutine), the request runs on a thread of its own with its own loop.

aiohttp is imported only when a request is made, so importing this module costs nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    truncated: bool = False
    """The body went on past ``max_bytes``: ``body`` is its first ``max_bytes``."""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class Unreachable(OSError):
    """No HTTP answer: no connection, a timeout, a connection that broke, a malformed URL or
    answer. The message names the cause."""


def request(method: str, url: str, *, timeout_s: float, max_bytes: int,
            headers: Mapping[str, str] | None = None, body: bytes | None = None) -> Response:
    """One request and its answer, whatever its status; ``Unreachable`` if none came."""

    def run() -> Response:
        return asyncio.run(_request(method, url, timeout_s, max_bytes, headers, body))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run()
    with ThreadPoolExecutor(1, thread_name_prefix="sokuji-http") as pool:
        return pool.submit(run).result()


async def _request(method: str, url: str, timeout_s: float, max_bytes: int,
                   headers: Mapping[str, str] | None, body: bytes | None) -> Response:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session, \
                session.request(method, url, headers=dict(headers or {}), data=body,
                                allow_redirects=False) as resp:
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_any():
                chunks.append(chunk)
                size += len(chunk)
                if size > max_bytes:
                    return Response(resp.status, b"".join(chunks)[:max_bytes], True)
            return Response(resp.status, b"".join(chunks))
    except (aiohttp.ClientError, OSError, ValueError) as exc:  # (TimeoutError is an OSError)
        raise Unreachable(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                          ) from exc

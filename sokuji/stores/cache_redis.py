"""The response cache's Redis backend (``core/cache.py``'s ``Backend``), shared between
replicas."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from sokuji.core.cache import BackendUnavailable, Entry


class RedisBackend:
    """Entries in Redis under ``sokuji:cache:<key>``, expiring after ``ttl_s``.

    Every call (connection included) is bounded by ``timeout_s``; any Redis or socket error,
    a timeout, or an entry that does not decode raises ``BackendUnavailable``."""

    PREFIX = "sokuji:cache:"

    def __init__(self, url: str, ttl_s: float, timeout_s: float = 0.1) -> None:
        import redis.asyncio as redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import RedisError

        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.timeout_s = timeout_s
        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
        # One immediate retry: a pooled connection that Redis closed (a restart) reconnects
        # within the same call; anything slower is cut by the timeout below anyway.
        self._redis: Any = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1))

    async def _call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await getattr(self._redis, op)(*args, **kwargs)
        except self._errors as exc:
            reason = str(exc) or f"no answer within {self.timeout_s * 1e3:.0f} ms"
            raise BackendUnavailable(f"Redis {op.upper()}: {type(exc).__name__}: "
                                     f"{reason}") from exc

    async def get(self, key: str) -> Entry | None:
        raw = await self._call("get", self.PREFIX + key)
        if raw is None:
            return None
        try:
            return Entry.from_bytes(raw)
        except (ValueError, struct.error, UnicodeDecodeError) as exc:
            raise BackendUnavailable(f"Redis GET: undecodable entry ({exc})") from exc

    async def set(self, key: str, entry: Entry) -> None:
        await self._call("set", self.PREFIX + key, entry.to_bytes(), px=self.ttl_ms)

    async def ping(self) -> None:
        await self._call("ping")

    async def close(self) -> None:
        await self._redis.aclose()

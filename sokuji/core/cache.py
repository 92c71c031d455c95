"""Response cache: model outputs keyed per tenant, with request coalescing.

Key: SHA-256 over (tenant, model, version, the texts), each length-prefixed, so no two
different requests share a key and one tenant can never read another's entry. Only
deterministic computations are cached (an encoder's output for given texts); what varies by
protocol (JSON or base64, V2 or OpenAI) is applied after the cache, so one entry serves all.

Backends: ``MemoryBackend`` (in process: LRU bounded in bytes, with TTL) and ``RedisBackend``
(shared between replicas; entries expire by Redis TTL). Concurrent identical requests are
computed once: the first computes, the others await its result (``coalesced``).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class CacheResult(enum.StrEnum):
    HIT = "hit"
    MISS = "miss"
    COALESCED = "coalesced"
    BYPASS = "bypass"


@dataclass(frozen=True)
class Entry:
    output: np.ndarray
    num_tokens: int

    @property
    def nbytes(self) -> int:
        return int(self.output.nbytes) + 64

    def to_bytes(self) -> bytes:
        arr = np.ascontiguousarray(self.output)
        head = f"{arr.dtype.str}|{','.join(map(str, arr.shape))}|{self.num_tokens}".encode()
        return struct.pack("<H", len(head)) + head + arr.tobytes()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Entry:
        (n,) = struct.unpack_from("<H", raw)
        dtype, shape, tokens = raw[2:2 + n].decode().split("|")
        dims = tuple(int(d) for d in shape.split(",") if d)
        output = np.frombuffer(raw[2 + n:], dtype=np.dtype(dtype)).reshape(dims)
        return cls(output, int(tokens))


def cache_key(tenant: str, model: str, version: str, texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for part in (tenant, model, version, *texts):
        data = part.encode("utf-8", "surrogatepass")
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    h.update(struct.pack("<Q", len(texts)))
    return h.hexdigest()


class Backend(Protocol):
    async def get(self, key: str) -> Entry | None: ...

    async def set(self, key: str, entry: Entry) -> None: ...

    async def close(self) -> None: ...


class MemoryBackend:
    """LRU bounded by ``max_bytes``; entries older than ``ttl_s`` are misses."""

    def __init__(self, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.bytes = 0
        self._data: OrderedDict[str, tuple[float, Entry]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    async def get(self, key: str) -> Entry | None:
        item = self._data.get(key)
        if item is None:
            return None
        stored, entry = item
        if self.clock() - stored > self.ttl_s:
            self._drop(key)
            return None
        self._data.move_to_end(key)
        return entry

    async def set(self, key: str, entry: Entry) -> None:
        if entry.nbytes > self.max_bytes:
            return
        if key in self._data:
            self._drop(key)
        self._data[key] = (self.clock(), entry)
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._data)))

    def _drop(self, key: str) -> None:
        _, entry = self._data.pop(key)
        self.bytes -= entry.nbytes

    async def close(self) -> None:
        self._data.clear()
        self.bytes = 0


class RedisBackend:
    """Entries in Redis under ``sokuji:cache:<key>``, expiring after ``ttl_s``."""

    PREFIX = "sokuji:cache:"

    def __init__(self, url: str, ttl_s: float) -> None:
        import redis.asyncio as redis

        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._redis: Any = redis.Redis.from_url(url)

    async def get(self, key: str) -> Entry | None:
        raw = await self._redis.get(self.PREFIX + key)
        return None if raw is None else Entry.from_bytes(raw)

    async def set(self, key: str, entry: Entry) -> None:
        await self._redis.set(self.PREFIX + key, entry.to_bytes(), px=self.ttl_ms)

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()


class ResponseCache:
    def __init__(self, backend: Backend,
                 on_result: Callable[[str, CacheResult], None] | None = None) -> None:
        self.backend = backend
        self._on_result = on_result
        self._inflight: dict[str, asyncio.Future[Entry]] = {}

    async def get_or_compute(self, model: str, key: str,
                             compute: Callable[[], Awaitable[Entry]], *, read: bool = True,
                             store: bool = True) -> tuple[Entry, CacheResult]:
        """The cached entry for ``key``, or ``compute()``'s, computed once however many
        identical requests are in flight. ``read=False`` skips the lookup (Cache-Control:
        no-cache); ``store=False`` keeps the result out (no-store)."""
        if read:
            entry = await self.backend.get(key)
            if entry is not None:
                return self._report(model, entry, CacheResult.HIT)
            pending = self._inflight.get(key)
            if pending is not None:
                try:
                    return self._report(model, await asyncio.shield(pending),
                                        CacheResult.COALESCED)
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise  # this request itself was cancelled
                    # the leader's client went away: compute for ourselves below
        future: asyncio.Future[Entry] = asyncio.get_running_loop().create_future()
        if read:
            self._inflight[key] = future
        try:
            entry = await compute()
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: followers re-raise it, nobody else must
            raise
        finally:
            if self._inflight.get(key) is future:
                del self._inflight[key]
        future.set_result(entry)
        if store:
            await self.backend.set(key, entry)
        return self._report(model, entry, CacheResult.MISS if read else CacheResult.BYPASS)

    def _report(self, model: str, entry: Entry, result: CacheResult
                ) -> tuple[Entry, CacheResult]:
        if self._on_result is not None:
            self._on_result(model, result)
        return entry, result

    async def close(self) -> None:
        await self.backend.close()

"""Response cache: model outputs keyed per tenant, with request coalescing.

Key (``cache_key``): SHA-256 over whether keys are configured, then (tenant, model, version,
the form of the answer, the texts), each length-prefixed, so no two different requests share
a key whatever separators their parts hold, and one tenant can never read another's entry,
nor a keyed tenant (one named ``anonymous`` included) what an open server stored in a shared
backend. Only
deterministic computations are cached (an encoder's output for given texts); what varies by
protocol (JSON or base64, V2 or OpenAI) is applied after the cache, so one entry serves all.

Backends (``Backend``; in ``sokuji/stores/``): ``MemoryBackend`` (in process: LRU bounded in
bytes, with TTL) and ``RedisBackend`` (shared between replicas; entries expire by Redis TTL).
Concurrent identical requests are computed once: the first computes, the others await its
result (``coalesced``).

The cache is an optimisation, never a dependency: a backend that fails or does not answer
within its timeout (``BackendUnavailable``) makes a lookup a miss and a store a no-op. Each
failure is counted (``on_error``) and logged at most once per ``WARN_INTERVAL_S``; after
``Breaker.threshold`` failures in a row the backend is skipped for ``Breaker.cooldown_s``, so
an outage does not add the timeout to every request.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)


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
        # From the right: a dtype's own string may hold the separator ("|u1": bytes).
        dtype, shape, tokens = raw[2:2 + n].decode().rsplit("|", 2)
        dims = tuple(int(d) for d in shape.split(",") if d)
        output = np.frombuffer(raw[2 + n:], dtype=np.dtype(dtype)).reshape(dims)
        return cls(output, int(tokens))


def cache_key(tenant: str, model: str, version: str, texts: Sequence[str], *,
              keyed: bool = True, form: str = "") -> str:
    """The entry's key. ``keyed``: API keys are configured (the server's, decided at start,
    never from the tenant's name); ``form``: what the entry holds when one input has several
    (``plain``: a JSON document, not the tensors); ``texts``: what identifies the input."""
    h = hashlib.sha256(b"keyed" if keyed else b"open")
    for part in (tenant, model, version, form, *texts):
        data = part.encode("utf-8", "surrogatepass")
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    h.update(struct.pack("<Q", len(texts)))
    return h.hexdigest()


class BackendUnavailable(Exception):
    """The cache backend failed, or did not answer within its timeout. Deliberately outside
    ``SokujiError``: it never reaches a client (``ResponseCache`` turns it into a miss)."""


class Backend(Protocol):
    """``get`` and ``set`` raise only ``BackendUnavailable`` (third-party errors are
    translated inside the backend)."""

    async def get(self, key: str) -> Entry | None: ...

    async def set(self, key: str, entry: Entry) -> None: ...

    async def close(self) -> None: ...


@dataclass
class Breaker:
    """A circuit breaker: after ``threshold`` consecutive failures, calls are skipped for
    ``cooldown_s``; then calls try again, and one more failure opens it again at once."""

    threshold: int = 5
    cooldown_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    failures: int = 0
    open_until: float = 0.0

    def allow(self) -> bool:
        return self.failures < self.threshold or self.clock() >= self.open_until

    def success(self) -> None:
        self.failures = 0

    def failure(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            self.open_until = self.clock() + self.cooldown_s


WARN_INTERVAL_S = 10.0


class ResponseCache:
    """Lookups, coalescing and stores over one backend. ``on_result(model, result)`` sees
    every lookup; ``on_error(op)`` every backend failure (op: ``get`` or ``set``)."""

    def __init__(self, backend: Backend,
                 on_result: Callable[[str, CacheResult], None] | None = None,
                 on_error: Callable[[str], None] | None = None,
                 breaker: Breaker | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self._on_result = on_result
        self._on_error = on_error
        self.breaker = breaker or Breaker(clock=clock)
        self._clock = clock
        self._inflight: dict[str, asyncio.Future[Entry]] = {}
        self._unlogged_errors = 0
        self._last_warning = -float("inf")

    async def get_or_compute(self, model: str, key: str,
                             compute: Callable[[], Awaitable[Entry]], *, read: bool = True,
                             store: bool = True) -> tuple[Entry, CacheResult]:
        """The cached entry for ``key``, or ``compute()``'s, computed once however many
        identical requests are in flight. ``read=False`` skips the lookup (Cache-Control:
        no-cache); ``store=False`` keeps the result out (no-store)."""
        if read:
            entry = await self._get(key)
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
            await self._set(key, entry)
        return self._report(model, entry, CacheResult.MISS if read else CacheResult.BYPASS)

    async def _get(self, key: str) -> Entry | None:
        """The backend's entry; None when it has none, fails, or is being skipped."""
        if not self.breaker.allow():
            return None
        try:
            entry = await self.backend.get(key)
        except BackendUnavailable as exc:
            self._failed("get", exc)
            return None
        self.breaker.success()
        return entry

    async def _set(self, key: str, entry: Entry) -> None:
        """Store ``entry``; a failing (or skipped) backend just does not keep it."""
        if not self.breaker.allow():
            return
        try:
            await self.backend.set(key, entry)
        except BackendUnavailable as exc:
            self._failed("set", exc)
            return
        self.breaker.success()

    def _failed(self, op: str, exc: BackendUnavailable) -> None:
        self.breaker.failure()
        if self._on_error is not None:
            self._on_error(op)
        # One line per WARN_INTERVAL_S, not one per request: an outage under load would
        # otherwise flood the log.
        self._unlogged_errors += 1
        now = self._clock()
        if now - self._last_warning < WARN_INTERVAL_S:
            return
        skipping = "" if self.breaker.allow() else \
            f"; skipping the cache for {self.breaker.cooldown_s:g} s"
        log.warning("response cache unavailable, serving misses: %s (%d cache error(s) since "
                    "the last warning)%s", exc, self._unlogged_errors, skipping)
        self._unlogged_errors = 0
        self._last_warning = now

    def _report(self, model: str, entry: Entry, result: CacheResult
                ) -> tuple[Entry, CacheResult]:
        if self._on_result is not None:
            self._on_result(model, result)
        return entry, result

    async def close(self) -> None:
        await self.backend.close()

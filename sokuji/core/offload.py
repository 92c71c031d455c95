"""Preparation that must not run on the event loop, and waiting for it before freeing.

- ``run(fn, *args)`` runs ``fn`` (tokenising a long input, decoding a large body) in a small
  dedicated pool of threads named ``sokuji-prep``, not in asyncio's default executor: that
  one is shared with DNS lookups and store I/O, so a burst of either could otherwise delay
  the other.
- ``Lane``: heavy preparation (decoding and resizing an image, decoding and resampling
  audio: tens of milliseconds to seconds, however bounded) in a lane of its own, so
  ``run``'s light jobs never wait behind it. A lane has its own few threads, a bound on the
  jobs it holds (running + waiting: past it a fast ``Overloaded``, 429 with Retry-After)
  and a bound per tenant, so one tenant's burst cannot fill it for everyone.
  ``media_lane()`` is the media models' lane (``sokuji-media``).
- ``CallGate`` counts calls into a native resource (a llama.cpp vocabulary) in flight, from
  any thread. ``close(timeout_s)`` refuses new calls and waits for those in flight, so the
  resource is freed only after the last one returned. A cancelled request task does not stop
  its worker thread; the gate is what makes freeing safe after such a cancel.

Pure: no HTTP, no runtime imports.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import ParamSpec, TypeVar

from sokuji.errors import ModelNotReady, Overloaded

P = ParamSpec("P")
T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def pool_size() -> int:
    """Threads of the preparation pool: 2 to 4. Its jobs are light (tokenising, a body's
    decoding: milliseconds, bounded by the size checks before them; heavy media work goes
    to a ``Lane``), so a few threads keep up; more would only take cores from inference."""
    return max(2, min(4, _cores()))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(pool_size(), thread_name_prefix="sokuji-prep")
        return _pool


async def run(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` in the preparation pool; its result or its exception."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))


class Lane:
    """A bounded lane for heavy preparation: ``threads`` threads of its own, at most
    ``threads + max_waiting`` jobs held (running or waiting), at most ``per_tenant`` of
    them one tenant's. A job past either bound is refused at once (``Overloaded``, 429,
    Retry-After from the lane's mean job time), before it is queued.

    A job counts until its thread returns (a cancelled caller does not free its slot while
    the work still runs). Counting is under one lock: the lane may be used from any loop."""

    def __init__(self, name: str, threads: int, max_waiting: int, per_tenant: int) -> None:
        if threads < 1 or max_waiting < 0 or per_tenant < 1:
            raise ValueError("a lane needs a thread, a waiting room >= 0, a tenant bound >= 1")
        self.name = name
        self.threads = threads
        self.max_waiting = max_waiting
        self.per_tenant = per_tenant
        self._lock = threading.Lock()
        self._held = 0
        self._by_tenant: dict[str, int] = {}
        self._mean_s = 0.0
        self._pool: ThreadPoolExecutor | None = None

    @property
    def held(self) -> int:
        """Jobs running or waiting."""
        return self._held

    def held_by(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:  # under self._lock
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
        return self._pool

    def _retry_after_s(self) -> int:
        waiting = max(1, self._held - self.threads + 1)
        return max(1, min(60, math.ceil(waiting * self._mean_s / self.threads)))

    def _admit(self, tenant: str) -> None:
        """Count one more of ``tenant``'s jobs, or refuse it (under ``self._lock``)."""
        if self._held >= self.threads + self.max_waiting:
            raise Overloaded(f"the {self.name} lane is full ({self._held} jobs running or "
                             f"waiting, at most {self.threads + self.max_waiting}); retry "
                             "later", retry_after_s=self._retry_after_s())
        mine = self._by_tenant.get(tenant, 0)
        if mine >= self.per_tenant:
            raise Overloaded(f"this tenant already has {mine} jobs in the {self.name} lane "
                             f"(at most {self.per_tenant}); retry later",
                             retry_after_s=self._retry_after_s())
        self._held += 1
        self._by_tenant[tenant] = mine + 1

    def _uncount(self, tenant: str) -> None:
        """Under ``self._lock``."""
        self._held -= 1
        left = self._by_tenant[tenant] - 1
        if left:
            self._by_tenant[tenant] = left
        else:
            del self._by_tenant[tenant]

    def _release(self, tenant: str, took_s: float | None) -> None:
        with self._lock:
            self._uncount(tenant)
            if took_s is not None:
                self._mean_s = took_s if self._mean_s == 0.0 else \
                    0.8 * self._mean_s + 0.2 * took_s

    async def run(self, tenant: str, fn: Callable[P, T], *args: P.args,
                  **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` in the lane, counted against ``tenant``; its result or
        its exception; ``Overloaded`` at once past a bound."""
        started: list[float] = []

        def job() -> T:
            started.append(time.perf_counter())
            return fn(*args, **kwargs)

        def finished(_: Future[T]) -> None:
            self._release(tenant, time.perf_counter() - started[0] if started else None)

        with self._lock:
            self._admit(tenant)
            try:
                cf = self._executor().submit(job)
            except BaseException:
                self._uncount(tenant)
                raise
        cf.add_done_callback(finished)
        return await asyncio.wrap_future(cf)


_media: Lane | None = None


def media_lane() -> Lane:
    """The media models' lane (``sokuji-media``): 1 thread on up to 3 cores, else 2; up to
    16 jobs waiting; 8 in flight per tenant (a job: one request's files)."""
    global _media
    with _pool_lock:
        if _media is None:
            _media = Lane("sokuji-media", threads=max(1, min(2, _cores() // 2)),
                          max_waiting=16, per_tenant=8)
        return _media


class CallGate:
    """Calls in flight into something that ``close`` will free.

    ``with gate:`` around each call; it raises ``ModelNotReady`` (503) once closing began.
    Entering and leaving cost one uncontended lock each (well under a microsecond)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._cond = threading.Condition(threading.Lock())
        self._in_flight = 0
        self._closed = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def __enter__(self) -> CallGate:
        with self._cond:
            if self._closed:
                raise ModelNotReady(f"{self.what} is shutting down")
            self._in_flight += 1
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._cond:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._cond.notify_all()

    def close(self, timeout_s: float) -> bool:
        """Refuse new calls, then wait up to ``timeout_s`` for those in flight; True when
        none is left (the resource may be freed), False when some still run."""
        with self._cond:
            self._closed = True
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout=timeout_s)

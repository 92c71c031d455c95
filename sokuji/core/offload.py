"""Preparation that must not run on the event loop, and waiting for it before freeing.

- ``run(fn, *args)`` runs ``fn`` (tokenising a long input, decoding a large body) in a small
  dedicated pool of threads named ``sokuji-prep``, not in asyncio's default executor: that
  one is shared with DNS lookups and store I/O, so a burst of either could otherwise delay
  the other.
- ``CallGate`` counts calls into a native resource (a llama.cpp vocabulary) in flight, from
  any thread. ``close(timeout_s)`` refuses new calls and waits for those in flight, so the
  resource is freed only after the last one returned. A cancelled request task does not stop
  its worker thread; the gate is what makes freeing safe after such a cancel.

Pure: no HTTP, no runtime imports.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import ParamSpec, TypeVar

from sokuji.errors import ModelNotReady

P = ParamSpec("P")
T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def pool_size() -> int:
    """Threads of the preparation pool: 2 to 4. Every job in it is bounded by the size
    checks that come before it (milliseconds), so a few threads keep up; more would only
    take cores from inference."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(2, min(4, cores))


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

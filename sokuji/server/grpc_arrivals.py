"""Which gRPC inference calls are in flight: so that a call does not run on the event loop
(``core/inline.py``) while others wait behind it.

Over HTTP, requests that arrive while a lone request holds the loop are read in the loop's
next turn, all at once, and ``LoopGate`` keeps the model from running the first of them on
the loop until that burst is queued: it forms one batch. grpc.aio accepts calls one at a
time, each step a round trip through its completion-queue poller thread (the call, then its
message), so such a burst reaches its handlers over several turns and thread wake-ups, after
the gate has opened again: measured on minilm at 32 concurrent calls, every request then ran
alone on the loop (mean batch 1.0 against REST's 7.8, 0.84 of REST's throughput).

A server interceptor sees a call as soon as grpc.aio has its method, before its message is
read; the call counts until its handler returns. A handler that finds another call in
flight marks its request as having company (``scheduling.company``): it is queued for a
worker instead of run on the loop, and the calls around it batch with it. A lone call
(c=1: the next starts after this one's answer) finds none and runs on the loop as over HTTP.
A call cancelled before its handler never leaves: entries older than ``STALE_S`` are
dropped, so such a call costs others the loop for at most that long.
"""

from __future__ import annotations

import contextvars
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

__all__ = ["STALE_S", "Arrivals"]

STALE_S = 1.0
"""How long an arrival that never reached its handler is counted (a cancelled call)."""

_own: contextvars.ContextVar[int] = contextvars.ContextVar("sokuji_grpc_arrival", default=0)


class Arrivals(grpc.aio.ServerInterceptor):
    """Calls of the ``methods`` counted from their start until their handler returns."""

    def __init__(self, methods: frozenset[str]) -> None:
        self.methods = methods
        self._pending: dict[int, int] = {}
        """Arrival number -> its start (``perf_counter_ns``), until its handler returns."""
        self._numbers = itertools.count(1)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
            details: grpc.HandlerCallDetails) -> Any:
        if details.method in self.methods:
            number = next(self._numbers)
            self._pending[number] = time.perf_counter_ns()
            _own.set(number)  # the handler runs in this task: it finds its number here
        return await continuation(details)

    def company(self) -> bool:
        """Whether calls other than this one (the handler's own task) are in flight."""
        own = _own.get()
        if len(self._pending) <= (own in self._pending):
            return False
        oldest = time.perf_counter_ns() - int(STALE_S * 1e9)
        for number in [n for n, t in self._pending.items() if t < oldest and n != own]:
            del self._pending[number]
        return len(self._pending) > (own in self._pending)

    def leave(self) -> None:
        """The handler's call is done (answered or failed)."""
        self._pending.pop(_own.get(), None)

    @property
    def pending(self) -> int:
        """Calls counted in flight now (stale ones included until the next ask)."""
        return len(self._pending)

"""Which gRPC inference calls are on their way to their handler: so that a call does not run
on the event loop (``core/inline.py``) while others wait to be read behind it.

Over HTTP, requests that arrive while a lone request holds the loop are read in the loop's
next turn, all at once, and ``LoopGate`` keeps the model from running the first of them on
the loop until that burst is queued: it forms one batch. grpc.aio delivers a call in steps,
each a round trip through its completion-queue poller thread (the call, then its message),
so such a burst reaches its handlers over several turns and thread wake-ups, after the gate
has opened again: measured on minilm at 32 concurrent calls, every request then ran alone
on the loop (mean batch 1.0 against REST's 7.8, 0.84 of REST's throughput).

A server interceptor sees a call as soon as grpc.aio has its method, before its message is
read. ``Arrivals`` keeps those not yet at their handler; a handler that finds any marks its
request as having company (``scheduling.company``): it is queued for a worker instead, and
the calls behind it batch with it. A lone call (c=1) finds none and runs on the loop as
over HTTP. A call cancelled before its handler never removes itself: entries older than
``STALE_S`` are dropped, so such a call costs others the loop for at most that long.
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
    """Calls of the ``methods`` counted from their start until their handler asks."""

    def __init__(self, methods: frozenset[str]) -> None:
        self.methods = methods
        self._pending: dict[int, int] = {}
        """Arrival number -> its start (``perf_counter_ns``), until its handler asks."""
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
        """Called once by a handler: whether other calls are on their way to theirs. Removes
        this call's own arrival (and arrivals gone stale)."""
        self._pending.pop(_own.get(), None)
        if not self._pending:
            return False
        oldest = time.perf_counter_ns() - int(STALE_S * 1e9)
        for number in [n for n, t in self._pending.items() if t < oldest]:
            del self._pending[number]
        return bool(self._pending)

    @property
    def pending(self) -> int:
        """Calls counted as on their way now (stale ones included until the next ask)."""
        return len(self._pending)

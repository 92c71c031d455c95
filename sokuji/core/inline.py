"""When a lone request may run on the event loop thread itself, and what it is expected to cost.

Handing a batch to a worker thread and its result back to the event loop costs two thread
wake-ups, each with cold caches right after a model call: ~0.1 ms a request measured here,
0.23 ms for the hand-back alone on a machine with slow wake-ups, as much as everything else
Sokuji does for a short text. A request that finds its model idle has nobody to overlap with,
so ``DynamicBatcher`` runs it on the event loop thread (the runtime releases the GIL while it
computes, so other threads go on). It starts at once, so it meets its deadline; like any
batch that has started, it is not cancelled when its client goes away.

The price: the event loop does nothing else meanwhile. Requests arriving in that time wait
in the socket buffers (they would have waited for the model anyway; that wait is not in
their Server-Timing, which starts when a request is read, only in what the client sees),
and the control plane, refusals and other models' replies wait too. So a request runs there
only when its expected run time is at most ``inline_max_ms``, expected from measurement:
``LoneCosts`` keeps, per size class (padded tokens rounded up to a power of two), the moving
average of how long lone requests of that class took to run (on the loop or in a worker;
the runtime's call alone). A class not measured yet runs in a worker first, so a model
whose single request is slow never holds the loop, whatever its configuration. A run that
turns out slow (a stall) holds it for as long as it takes: there is no preempting it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["LoneCosts", "LoopGate"]

_CLASSES = 32
"""Size classes: padded tokens up to 2**31; anything larger is the last class."""


class LoneCosts:
    """Measured seconds of a lone request, by size class (padded positions, power of two)."""

    __slots__ = ("_seconds",)

    def __init__(self) -> None:
        self._seconds: list[float] = [0.0] * _CLASSES
        """Moving average per class; 0: not measured yet."""

    @staticmethod
    def size_class(padded_tokens: int) -> int:
        """The power of two at or above ``padded_tokens``, as its exponent."""
        return min(_CLASSES - 1, max(0, padded_tokens - 1).bit_length())

    def observe(self, padded_tokens: int, seconds: float) -> None:
        """A lone request (alone in its batch) of ``padded_tokens`` ran in ``seconds``. One
        stall of a busy machine counts as at most twice the average: a class is not sent off
        the loop by one outlier, only by runs that stay slow."""
        if seconds <= 0:
            return
        k = self.size_class(padded_tokens)
        old = self._seconds[k]
        self._seconds[k] = seconds if not old else 0.75 * old + 0.25 * min(seconds, 2 * old)

    def expected_s(self, padded_tokens: int) -> float | None:
        """The moving average of its class; None until a request of the class has run."""
        seconds = self._seconds[self.size_class(padded_tokens)]
        return seconds or None

    def fits(self, padded_tokens: int, limit_s: float) -> bool:
        """Whether a request of ``padded_tokens`` is measured to run within ``limit_s``."""
        seconds = self._seconds[self.size_class(padded_tokens)]
        return 0 < seconds <= limit_s


class LoopGate:
    """Whether a lone request may run on the event loop now (one per batcher):
    - runs there are enabled (``limit_s`` > 0: ``inline_max_ms``, one instance);
    - its size class was measured to run within ``limit_s`` (``costs``);
    - nothing else served by this loop has work in flight (``others_busy``, set by whoever
      serves other models on it: their replies, a generation's tokens, would wait);
    - the loop is ``fresh``: no run has held it since it last read what arrived. Requests
      that arrived during a run are read in the loop's next turn, all at once, and their
      tasks queue them in the turn after; until then (``held``) a request at an idle model
      waits one turn instead of running at once, so such a burst forms one batch.
    """

    __slots__ = ("_epoch", "costs", "fresh", "limit_s", "others_busy")

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.costs = LoneCosts()
        self.fresh = True
        self.others_busy: Callable[[], bool] | None = None
        self._epoch = 0

    def allows(self, padded_tokens: int) -> bool:
        """Measured quick enough, and nobody else waits for the loop (``fresh`` apart)."""
        return self.costs.fits(padded_tokens, self.limit_s) and \
            not (self.others_busy is not None and self.others_busy())

    def held(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """A run has just held the loop: not fresh until two turns have gone by."""
        self.fresh = False
        self._epoch += 1
        if loop is not None:
            loop.call_soon(loop.call_soon, self._refresh, self._epoch)

    def _refresh(self, epoch: int) -> None:
        if epoch == self._epoch:  # no later run held the loop meanwhile
            self.fresh = True

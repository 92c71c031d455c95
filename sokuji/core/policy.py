"""The one scheduling policy every model's queue follows: the encoder batcher's and the
generation engine's alike. Pure functions and small objects; no clock, no threads.

- **Admission.** A request is refused at once (``Overloaded``: 429 with ``Retry-After``) when
  the model already has ``max_queue_depth`` requests waiting, or ``max_concurrency``
  admitted (waiting or running; 0: no such limit). The same check runs before the body is
  read (the cheap early refusal) and again on submission: one function, two call sites.
- **Retry-After** is one estimator: the work queued now divided by the measured drain rate
  (``DrainRate``), rounded up, at least 1 s; 1 s until a rate has been measured.
- **Deadlines bound the start.** A deadline is the latest time a request may *start*:
  for an encoder request, its batch's dispatch; for a generation, its admission to a slot
  (before prefill). A request that cannot start in time is refused at submission when the
  work queued ahead of it, at the measured drain rate, would outlast the time left
  (``DeadlineExceeded``: 504, never computed), and failed with the same error if it is still
  waiting when its deadline passes. Work that has started is never killed by its deadline:
  an encoder batch runs to the end, and so does a generation (its client bounds its length
  with ``max_tokens`` and cancels it by disconnecting).
- **Priorities age.** Interactive requests go before batch-class ones; a request that has
  waited ``priority_aging_ms`` in the queue counts as interactive, so batch-class work never
  starves. ``priority_aging_ms = 0`` therefore means that every request counts as
  interactive at once: plain arrival order. Among equals, the oldest goes first.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sokuji.core.request import Priority
from sokuji.errors import DeadlineExceeded, Overloaded


def rank(priority: Priority, waited_ns: int, aging_ns: int) -> int:
    """The class a request competes in now: ``INTERACTIVE`` (0) once it has waited
    ``aging_ns`` (so always when ``aging_ns`` is 0), else its own. Lower goes first; break
    ties by arrival."""
    return 0 if waited_ns >= aging_ns else int(priority)


def aging_ns(priority_aging_ms: float) -> int:
    return max(0, int(priority_aging_ms * 1e6))


class DrainRate:
    """EWMA of the rate at which one server (a model instance, a generation slot) completes
    work, in units per second (items for encoders, generations for the engine); times the
    number of servers, the rate at which a full queue drains. 0 until measured."""

    __slots__ = ("per_server_s", "servers")

    def __init__(self, servers: int) -> None:
        self.servers = servers
        self.per_server_s = 0.0

    def observe(self, units: float, seconds: float) -> None:
        """One server completed ``units`` of work in ``seconds`` of service."""
        if seconds <= 0:
            return
        rate = units / seconds
        old = self.per_server_s
        self.per_server_s = rate if not old else 0.8 * old + 0.2 * rate

    @property
    def per_s(self) -> float:
        return self.per_server_s * self.servers


def retry_after_s(queued_work: float, rate_per_s: float) -> int:
    """Seconds until the work queued now has drained (at least 1; 1 when unmeasured)."""
    return max(1, math.ceil(queued_work / rate_per_s)) if rate_per_s > 0 else 1


class Admission:
    """The queue limits of one model; ``check`` raises ``Overloaded`` when a request arriving
    now would be refused."""

    __slots__ = ("max_concurrency", "max_queue_depth", "name", "what")

    def __init__(self, name: str, max_queue_depth: int, max_concurrency: int = 0,
                 what: str = "requests") -> None:
        self.name = name
        self.max_queue_depth = max_queue_depth
        self.max_concurrency = max_concurrency
        self.what = what

    def refuses(self, num_waiting: int, num_admitted: int) -> bool:
        """Whether ``check`` would raise (the accepted case costs two comparisons)."""
        return num_waiting >= self.max_queue_depth or bool(
            self.max_concurrency and num_admitted >= self.max_concurrency)

    def check(self, num_waiting: int, num_admitted: int, queued_work: Callable[[], float],
              rate_per_s: float) -> None:
        """``queued_work`` is called only to word a refusal (the common case pays nothing
        for it)."""
        if num_waiting >= self.max_queue_depth:
            raise Overloaded(f"model '{self.name}' has {num_waiting} {self.what} queued "
                             f"(max_queue_depth {self.max_queue_depth}); retry later",
                             retry_after_s=retry_after_s(queued_work(), rate_per_s))
        if self.max_concurrency and num_admitted >= self.max_concurrency:
            raise Overloaded(f"model '{self.name}' has {num_admitted} {self.what} in flight "
                             f"(max_concurrency {self.max_concurrency}); retry later",
                             retry_after_s=retry_after_s(queued_work(), rate_per_s))


def check_deadline(deadline_ns: int | None, now_ns: int, work_ahead: float,
                   rate_per_s: float, saturated: bool) -> None:
    """Refuse (``DeadlineExceeded``) a request that cannot start before its deadline:
    already past, or, while every server is busy (``saturated``), more work queued ahead of
    it (``work_ahead``, of its class or better) than drains in the time left. The running
    work is not counted, so the estimate errs toward admitting."""
    if deadline_ns is None:
        return
    left_ms = (deadline_ns - now_ns) / 1e6
    if left_ms <= 0:
        raise DeadlineExceeded("the request's deadline passed before it was queued")
    if saturated and rate_per_s > 0:
        wait_ms = work_ahead / rate_per_s * 1e3
        if wait_ms > left_ms:
            raise DeadlineExceeded(
                f"cannot start before its deadline: ~{wait_ms:.0f} ms of work is queued "
                f"ahead and {left_ms:.0f} ms are left")

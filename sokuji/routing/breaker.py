"""A circuit breaker per routing target: closed -> open -> half-open with exactly one probe.

A target that keeps failing is skipped for a cool-down instead of costing every request a
failed attempt first (LiteLLM's reported gap, BerriAI/litellm#40405: a lone deployment was
never cooled down). The breaker applies to a target whether or not it has fallbacks; when no
target is left the router answers 503 with ``Retry-After`` = :meth:`Breaker.retry_after_s`.

- **closed**: every request may try. ``opts.failures`` failures in a row open it for
  ``opts.cooldown_s``.
- **open**: :meth:`Breaker.acquire` is False (the target is skipped in O(1), no connect
  attempt) until the cool-down is over; then the breaker is half-open (computed lazily when
  the state is read: no timer).
- **half-open**: exactly one request (the probe) may try; the others are refused until it
  reports. Its success closes the breaker (cool-down back to ``cooldown_s``); its failure opens
  it again with the cool-down doubled, up to ``max_cooldown_s``. An attempt that ends without
  a verdict (the client cancelled, a 4xx that is the client's fault) calls
  :meth:`Breaker.release`, which frees the probe's slot and counts nothing. A probe that has
  not reported after ``max_cooldown_s`` is taken as lost (a bug should not keep a target
  skipped for ever): the next request becomes the probe.
- **Retry-After**: a target that answers 429 / 503 with ``Retry-After`` opens at once for that
  long (capped at ``max_cooldown_s``): the target said so (``core/retry_after.py`` reads
  the header).

Decisions are pure: time comes from the injected ``clock``; no threads or asyncio (the router
calls it from its event loop). Each transition is logged once (WARNING when it opens, INFO
otherwise) and reported to ``on_transition(name, state)`` (metrics).

Two choices beyond the state machine above: a success that arrives while the breaker is open
(an attempt that started before it opened) resets the count of failures but does not close
it: the cool-down, or the upstream's Retry-After, stands, and the probe decides. A failure
while open (a straggler) counts nothing, except that a Retry-After longer than the time left
extends the open period.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable

from sokuji.routing.config import BreakerOptions

log = logging.getLogger("sokuji.routing.breaker")


class BreakerState(enum.IntEnum):
    """The value is the ``sokuji_breaker_state`` gauge's."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class Breaker:
    def __init__(self, name: str, opts: BreakerOptions,
                 clock: Callable[[], float] = time.monotonic,
                 on_transition: Callable[[str, BreakerState], None] | None = None) -> None:
        self.name = name
        self.opts = opts
        self._clock = clock
        self._on_transition = on_transition
        self._state = BreakerState.CLOSED
        self._failures = 0
        """Failures in a row while closed."""
        self._cooldown = opts.cooldown_s
        """The cool-down a failed probe doubles (back to ``cooldown_s`` on success)."""
        self._open_until = 0.0
        self._probing = False
        self._probe_started = 0.0

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() >= self._open_until:
            self._probing = False
            self._move(BreakerState.HALF_OPEN, "cool-down over, one probe may try")
        return self._state

    @property
    def failures(self) -> int:
        """Failures in a row so far (while closed)."""
        return self._failures

    @property
    def cooldown_s(self) -> float:
        """The cool-down the next failed probe starts from (doubled then, capped)."""
        return self._cooldown

    def acquire(self) -> bool:
        """May a request try this target now? Closed: yes. Open: no. Half-open: the first
        caller becomes the probe (True); the others get False until it reports with
        :meth:`success`, :meth:`failure` or :meth:`release`."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN:
            now = self._clock()
            if not self._probing or now - self._probe_started >= self.opts.max_cooldown_s:
                self._probing, self._probe_started = True, now
                return True
        return False

    def success(self) -> None:
        """An attempt succeeded: the target works."""
        self._failures = 0
        if self.state is BreakerState.OPEN:
            return  # a straggler: the cool-down stands and the probe decides
        self._probing = False
        self._cooldown = self.opts.cooldown_s
        if self._state is not BreakerState.CLOSED:
            self._move(BreakerState.CLOSED, "a request succeeded")

    def failure(self, retry_after_s: float | None = None) -> None:
        """An attempt failed (connect error, timeout, 5xx, a 429). ``retry_after_s``: the
        target's own Retry-After, when it sent one: open at once for that long (capped).
        None, zero, negative or not finite: an ordinary failure."""
        now = self._clock()
        told_s = 0.0
        if retry_after_s is not None and math.isfinite(retry_after_s) and retry_after_s > 0:
            told_s = min(float(retry_after_s), self.opts.max_cooldown_s)
        told = told_s > 0
        state = self.state
        if state is BreakerState.OPEN:
            if told and now + told_s > self._open_until:
                self._open_until = now + told_s
            return
        if state is BreakerState.HALF_OPEN:
            self._cooldown = min(self._cooldown * 2, self.opts.max_cooldown_s)
            self._open(now, told_s if told else self._cooldown,
                       f"the probe failed{self._told(told, told_s)}")
            return
        self._failures += 1
        if told:
            self._open(now, told_s, f"the target asked to wait{self._told(told, told_s)}")
        elif self._failures >= self.opts.failures:
            self._open(now, self._cooldown, f"{self._failures} failures in a row")

    def release(self) -> None:
        """An attempt ended without a verdict (client cancelled, the client's own 4xx): frees
        the half-open probe's slot; counts nothing."""
        if self._state is BreakerState.HALF_OPEN:
            self._probing = False

    def retry_after_s(self) -> int:
        """Whole seconds until a request may try this target: 0 when it may now, at least 1
        while open (or half-open with the probe out), rounded up."""
        state = self.state
        if state is BreakerState.CLOSED:
            return 0
        if state is BreakerState.HALF_OPEN:
            return 1 if self._probing else 0
        return max(1, math.ceil(self._open_until - self._clock()))

    def snapshot(self) -> dict[str, object]:
        """For logs and a status endpoint."""
        state = self.state
        return {"target": self.name, "state": state.name.lower(), "failures": self._failures,
                "cooldown_s": self._cooldown, "retry_after_s": self.retry_after_s(),
                "probing": self._probing}

    def _open(self, now: float, duration_s: float, why: str) -> None:
        self._open_until = now + duration_s
        self._probing = False
        self._failures = 0
        self._move(BreakerState.OPEN, f"{why}; skipped for {duration_s:g} s")

    @staticmethod
    def _told(told: bool, told_s: float) -> str:
        return f" (Retry-After {told_s:g} s)" if told else ""

    def _move(self, state: BreakerState, why: str) -> None:
        self._state = state
        level = logging.WARNING if state is BreakerState.OPEN else logging.INFO
        log.log(level, "breaker %s %s: %s", self.name, state.name.lower().replace("_", "-"),
                why)
        if self._on_transition is not None:
            self._on_transition(self.name, state)

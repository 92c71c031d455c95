"""The canary controller: which version a request goes to, and when a canary step passes,
holds or rolls back. Pure decision logic (the router records outcomes and acts on it).

Every check compares the canary with the **live stable version** over the same sliding window
of ``window_s`` seconds of completed requests (never with absolute thresholds, as Flagger
does), with exact tests that stay valid on the small counts a window holds:

- **Errors** (5xx, 504, internal failures; the router records no 4xx or 429): a one-sided
  Fisher exact test on (canary errors, canary ok; stable errors, stable ok). A breach needs
  p < ``alpha`` **and** at least ``min_failures`` canary errors **and** a canary error rate at
  least ``error_tolerance`` above stable's: without the count floor one unlucky request among
  a handful would roll back.
- **Latency**: q = stable's p99 in the window (>= 100 successful stable requests, else no
  test): the r-th largest of its m successes, r = m + 1 - ceil(0.99 (m + 1)). A canary
  request is slow above q x ``p99_slack``. If the canary is no slower, the number X of its n
  successes above q has the exceedance law C(x + r - 1, x) C(n - x + m - r, n - x) /
  C(n + m, n), exact although q is estimated (Binomial(n, 0.01) is not: at m = 100 it
  rejects several times too often). A breach needs P(X >= x) < ``alpha`` and x >=
  ``min_failures``. Failed requests are judged by the error test only.
- **Decisive evidence rolls back at once**, whatever the number of samples: weight 0, state
  ``rolled_back`` with the reason (test, counts, p-value), a WARNING line, an event. It stays
  rolled back (the router keeps sending everything to stable) until a config reload.
- **Too few samples never fails**: fewer than ``min_samples`` canary requests in the window
  and no breach is a *hold*. A step passes when the window has ``min_samples`` canary
  requests, neither test is breached, and the step has lasted ``window_s``: the next weight
  applies and both windows restart; after the last step the canary is promoted.
  ``max_hold_windows`` windows of holding in a row apply ``on_no_traffic``: ``hold`` (keep
  holding; an event each time the limit is reached again), ``promote`` (the step passes, as
  if it had been judged) or ``rollback``.
- When stable has no live traffic (the 100% step), the stable figures of the previous step's
  window (saved when it passed) stand in for it.

The router calls :meth:`CanaryController.evaluate` after each recorded request and from a
1 s timer; a call with nothing new within a second returns None, so the checks are counted
once. Checks are cheap: counts are kept as requests come and go, stable's p99 is recomputed
at most once a second, and a test runs only when its count floor is met. Windows hold what
``window_s`` covers, at most 100 000 requests each. Randomness comes from the injected
``rng`` (seeded from ``opts.seed``), time from ``clock``.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

from sokuji.routing import stats
from sokuji.routing.config import CanaryOptions

log = logging.getLogger("sokuji.routing.canary")

MAX_WINDOW = 100_000
"""Requests kept per window, at most (the oldest go first)."""
MIN_STABLE_FOR_P99 = 100
P99_EXCEED = 0.01
RECHECK_S = 1.0
"""With nothing recorded, a check at most this often; also how old stable's p99 may get."""

Arm = Literal["canary", "stable"]
State = Literal["running", "promoted", "rolled_back"]
Result = Literal["pass", "hold", "fail"]


@dataclasses.dataclass(frozen=True)
class CanaryEvent:
    """What the router turns into logs and metrics. ``reason`` is short (a metric label):
    ``passed``, ``errors``, ``latency`` or ``no_traffic``; ``detail`` has the full
    ``message`` and the check's figures."""

    kind: Literal["step", "promoted", "rolled_back", "hold"]
    router: str
    weight: float
    reason: str
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CanaryCheck:
    result: Result
    reason: str
    """"" on pass; the test breached (``errors``, ``latency``) on fail; why on hold."""
    step: int
    weight: float
    canary_n: int
    canary_errors: int
    stable_n: int
    stable_errors: int
    baseline: bool
    """The stable figures are the previous step's (stable had too little live traffic)."""
    error_p: float | None
    """Fisher's p-value; None when not needed: the count floor or the tolerance was not met,
    or the probability of exactly this many canary errors is already >= alpha."""
    slow: int | None
    """Successful canary requests slower than ``threshold_s``; None: no latency test."""
    threshold_s: float | None
    latency_p: float | None
    """The binomial tail P(X >= slow); None when not needed (as ``error_p``)."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Window:
    """One arm's completed requests (time, ok, latency) with running counts: errors, and
    successes slower than ``threshold``."""

    __slots__ = ("entries", "errors", "slow", "threshold")

    def __init__(self) -> None:
        self.entries: deque[tuple[float, bool, float]] = deque()
        self.errors = 0
        self.slow = 0
        self.threshold: float | None = None

    @property
    def n(self) -> int:
        return len(self.entries)

    def add(self, t: float, ok: bool, latency_s: float) -> None:
        if len(self.entries) >= MAX_WINDOW:
            self._pop()
        self.entries.append((t, ok, latency_s))
        if not ok:
            self.errors += 1
        elif self.threshold is not None and latency_s > self.threshold:
            self.slow += 1

    def expire(self, cutoff: float) -> None:
        while self.entries and self.entries[0][0] <= cutoff:
            self._pop()

    def _pop(self) -> None:
        _, ok, latency_s = self.entries.popleft()
        if not ok:
            self.errors -= 1
        elif self.threshold is not None and latency_s > self.threshold:
            self.slow -= 1

    def set_threshold(self, threshold: float | None) -> None:
        if threshold != self.threshold:
            self.threshold = threshold
            self.slow = 0 if threshold is None else sum(
                1 for _, ok, lat in self.entries if ok and lat > threshold)

    def p99(self) -> tuple[float, int, int] | None:
        """Successful requests' latency at rank ceil(0.99 (n + 1)) (<= n), n, rank from top."""
        ok = [lat for _, good, lat in self.entries if good]
        n = len(ok)
        if n < MIN_STABLE_FOR_P99:
            return None
        top = n - min(n, math.ceil((1 - P99_EXCEED) * (n + 1))) + 1
        return heapq.nlargest(top, ok)[-1], n, top

    def clear(self) -> None:
        self.entries.clear()
        self.errors = self.slow = 0
        self.threshold = None


class CanaryController:
    def __init__(self, router: str, opts: CanaryOptions,
                 clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None,
                 on_event: Callable[[CanaryEvent], None] | None = None) -> None:
        self.router = router
        self.opts = opts
        self._clock = clock
        self._rng = rng if rng is not None else random.Random(opts.seed)
        self._on_event = on_event
        self.state: State = "running"
        self.step = 0
        """Index into ``opts.steps`` of the current step (the last one once promoted)."""
        self.reason = ""
        """Why it was rolled back (or promoted without traffic): test, counts, p-value."""
        self._canary = _Window()
        self._stable = _Window()
        self._step_started = clock()
        self._hold_since: float | None = None
        self._baseline: tuple[int, int, tuple[float, int, int] | None] | None = None
        """The previous step's stable (n, errors, p99), for a step where stable is idle."""
        self._q: tuple[float, int, int] | None = None
        self._q_at = -math.inf
        self._new = True
        self._checked_at = -math.inf
        self.last_check: CanaryCheck | None = None
        self.checks: dict[str, int] = {"pass": 0, "hold": 0, "fail": 0}

    @property
    def weight(self) -> float:
        """The canary's share of requests now, in percent."""
        if self.state == "rolled_back":
            return 0.0
        if self.state == "promoted":
            return 100.0
        return float(self.opts.steps[self.step])

    def choose(self) -> Arm:
        """Which version this request goes to."""
        if self.state != "running":
            return "canary" if self.state == "promoted" else "stable"
        return "canary" if self._rng.random() * 100.0 < self.weight else "stable"

    def record(self, arm: str, ok: bool, latency_s: float) -> None:
        """A completed request: ``ok`` False for a 5xx / 504 / internal failure (the router
        records no 4xx or 429). Ignored once promoted or rolled back."""
        if arm not in ("canary", "stable"):
            raise ValueError(f"arm must be 'canary' or 'stable', not {arm!r}")
        if not math.isfinite(latency_s):
            raise ValueError(f"latency must be finite, not {latency_s!r}")
        if self.state != "running":
            return
        now = self._clock()
        self._expire(now)
        (self._canary if arm == "canary" else self._stable).add(now, ok, max(0.0, latency_s))
        self._new = True

    def evaluate(self) -> CanaryCheck | None:
        """Run the checks now and act on them (roll back, advance, apply ``on_no_traffic``).
        None when there is nothing to judge: not running, or nothing recorded since a check
        less than a second ago."""
        if self.state != "running":
            return None
        now = self._clock()
        self._expire(now)
        if not self._new and now - self._checked_at < RECHECK_S:
            return None
        self._new, self._checked_at = False, now
        check = self._check(now)
        self.last_check = check
        self.checks[check.result] += 1
        if check.result == "fail":
            self._roll_back(check.reason, self._breach_message(check), check)
        elif check.result == "hold":
            if self._hold_since is None:
                self._hold_since = now
            if now - self._hold_since >= self.opts.max_hold_windows * self.opts.window_s:
                self._no_traffic(now, check)
        else:
            self._hold_since = None
            if now - self._step_started >= self.opts.window_s:
                self._advance(now, "passed", "", check)
        return check

    def snapshot(self) -> dict[str, Any]:
        now = self._clock()
        return {
            "router": self.router, "state": self.state, "step": self.step,
            "steps": list(self.opts.steps), "weight": self.weight, "reason": self.reason,
            "step_age_s": round(now - self._step_started, 3),
            "holding_s": 0.0 if self._hold_since is None else round(now - self._hold_since, 3),
            "canary": {"n": self._canary.n, "errors": self._canary.errors},
            "stable": {"n": self._stable.n, "errors": self._stable.errors},
            "checks": dict(self.checks),
            "last_check": None if self.last_check is None else self.last_check.as_dict(),
        }

    # -- the checks ---------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        cutoff = now - self.opts.window_s
        self._canary.expire(cutoff)
        self._stable.expire(cutoff)

    def _check(self, now: float) -> CanaryCheck:
        opts, c, s = self.opts, self._canary, self._stable
        n_c, e_c = c.n, c.errors
        base = self._baseline
        baseline = base is not None and s.n < opts.min_samples
        if base is not None and baseline:
            n_s, e_s, q = base
        else:
            n_s, e_s = s.n, s.errors
            q = None
        if (self._q is None and s.n - s.errors >= MIN_STABLE_FOR_P99) \
                or now - self._q_at >= RECHECK_S:
            self._q, self._q_at = s.p99(), now
        if self._q is not None:
            q = self._q
        breach = ""
        error_p = None
        rate_c = e_c / n_c if n_c else 0.0
        rate_s = e_s / n_s if n_s else 0.0
        log_alpha = math.log(opts.alpha) + 1e-9  # rounding never skips a breach
        if e_c >= opts.min_failures and rate_c - rate_s >= opts.error_tolerance \
                and _log_hypergeom_pmf(e_c, n_c, e_c + e_s, n_c + n_s) < log_alpha:
            error_p = stats.fisher_greater(e_c, n_c - e_c, e_s, n_s - e_s)
            if error_p < opts.alpha:
                breach = "errors"
        threshold = None if q is None else q[0] * opts.p99_slack
        c.set_threshold(threshold)
        slow = None if threshold is None else c.slow
        latency_p = None
        ok_c = n_c - e_c
        if q is not None and slow is not None and slow >= opts.min_failures \
                and slow * (q[1] + 1) > ok_c * q[2] \
                and stats.exceedance_log_pmf(slow, ok_c, q[1], q[2]) < log_alpha:
            latency_p = stats.exceedance_sf(slow, ok_c, q[1], q[2])
            if latency_p < opts.alpha and not breach:
                breach = "latency"
        result: Result
        if breach:
            result, reason = "fail", breach
        elif n_c < opts.min_samples:
            result = "hold"
            reason = f"{n_c} canary requests in the window, {opts.min_samples} needed"
        elif q is None:  # a step never passes unjudged on latency
            result, reason = "hold", f"stable has < {MIN_STABLE_FOR_P99} successes: no p99 yet"
        else:
            result, reason = "pass", ""
        return CanaryCheck(result=result, reason=reason, step=self.step, weight=self.weight,
                           canary_n=n_c, canary_errors=e_c, stable_n=n_s, stable_errors=e_s,
                           baseline=baseline, error_p=error_p, slow=slow,
                           threshold_s=threshold, latency_p=latency_p)

    def _breach_message(self, check: CanaryCheck) -> str:
        stable = "the previous step's stable" if check.baseline else "stable"
        if check.reason == "errors":
            return (f"errors: canary {check.canary_errors}/{check.canary_n} failed vs "
                    f"{stable} {check.stable_errors}/{check.stable_n}, Fisher p="
                    f"{check.error_p:.3g} < alpha {self.opts.alpha:g}")
        ok_c = check.canary_n - check.canary_errors
        return (f"latency: {check.slow} of {ok_c} canary requests slower than "
                f"{check.threshold_s:.4g} s ({stable} p99 x {self.opts.p99_slack:g}), "
                f"exceedance p={check.latency_p:.3g} < alpha {self.opts.alpha:g}")

    # -- acting on them -----------------------------------------------------------------------

    def _no_traffic(self, now: float, check: CanaryCheck) -> None:
        held = now - (self._hold_since or now)
        message = (f"no_traffic: fewer than {self.opts.min_samples} canary requests in the "
                   f"window for {held:g} s ({self.opts.max_hold_windows} windows)")
        action = self.opts.on_no_traffic
        if action == "rollback":
            self._roll_back("no_traffic", message, check)
        elif action == "promote":
            self._advance(now, "no_traffic", message, check)
        else:
            self._hold_since = now  # report again after as many windows
            log.warning("canary %s holds at %g%% (step %d): %s", self.router, self.weight,
                        self.step, message)
            self._emit("hold", "no_traffic", message, check)

    def _roll_back(self, why: str, message: str, check: CanaryCheck) -> None:
        weight = self.weight
        self.state, self.reason = "rolled_back", message
        log.warning("canary %s rolled back at %g%% (step %d of %d): %s", self.router, weight,
                    self.step + 1, len(self.opts.steps), message)
        self._canary.clear()
        self._stable.clear()
        self._emit("rolled_back", why, message, check)

    def _advance(self, now: float, why: str, message: str, check: CanaryCheck) -> None:
        s = self._stable
        if s.n >= self.opts.min_samples:
            self._baseline = (s.n, s.errors, self._q if self._q is not None else s.p99())
        if why != "passed":
            self.reason = message
        self._canary.clear()
        s.clear()
        self._q, self._q_at = None, -math.inf
        self._hold_since = None
        self._step_started = now
        self._new = True
        if self.step + 1 >= len(self.opts.steps):
            self.state = "promoted"
            log.info("canary %s promoted (%s)", self.router, why)
            self._emit("promoted", why, message, check)
            return
        self.step += 1
        log.info("canary %s step %d of %d: weight %g%% (%s)", self.router, self.step + 1,
                 len(self.opts.steps), self.weight, why)
        self._emit("step", why, message, check)

    def _emit(self, kind: Literal["step", "promoted", "rolled_back", "hold"], why: str,
              message: str, check: CanaryCheck) -> None:
        if self._on_event is not None:
            detail = {"message": message, "check": check.as_dict()}
            self._on_event(CanaryEvent(kind=kind, router=self.router, weight=self.weight,
                                       reason=why, detail=detail))


# A tail is at least its first term: when P(X = x) alone is >= alpha there is no breach, and
# the exact tail (O(n) terms) is not computed. This keeps a check O(1) on the common path.
def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _log_hypergeom_pmf(a: int, n_row1: int, n_err: int, total: int) -> float:
    """log P(first row has ``a`` of the ``n_err`` errors), margins fixed (Fisher's table)."""
    if not 0 <= a <= min(n_row1, n_err) or n_row1 - a > total - n_err:
        return -math.inf
    return (_log_comb(n_err, a) + _log_comb(total - n_err, n_row1 - a)
            - _log_comb(total, n_row1))

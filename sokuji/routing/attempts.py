"""One request's attempts at a router's targets, in order, until one answers; the request
as the router keeps it meanwhile (``PreparedRoute``) and the route it reports (``RouteInfo``).

- One attempt per target (no retries of the same target inside a request: LiteLLM's users
  paid three failed attempts at a dead deployment per request, BerriAI/litellm#40405).
- A target whose circuit breaker is open is skipped without being called; a half-open one
  lets one probe through.
- Each attempt is bounded: by ``attempt_timeout_ms``, and, when the request has a deadline
  and a fallback remains, by what is left of it less a reserve for the fallback (``reserve_ms``
  or the fallback's measured median), so the first target cannot eat the whole deadline.
- What counts against a target (its breaker): errors (5xx), its own timeouts, network
  failures. What does not: the client's own faults (4xx: raised at once, no fallback, since
  another target would refuse them too), refusals for capacity (429, a queue that cannot
  start the request in time), a cancelled request.
- With no target left: the last failure (its status: 429, 502, 503, 504), or 503 with
  ``Retry-After`` when every target was cooling down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sokuji.core import timing
from sokuji.core.model import RequestContext, ServedModel
from sokuji.errors import DeadlineExceeded, Overloaded, RouteUnavailable, SokujiError
from sokuji.routing.breaker import Breaker, BreakerState
from sokuji.routing.config import RouterOptions

T = TypeVar("T")
EWMA = 0.2


@dataclass(eq=False)
class Target:
    """A model a router may send requests to, its breaker (shared by every router that uses
    the model) and its measured latency."""

    name: str
    model: ServedModel
    breaker: Breaker
    latency_ms: float = 0.0
    """EWMA of successful attempts."""
    on_outcome: Callable[[Target, bool, float], None] | None = None

    def available(self) -> bool:
        return self.breaker.state is not BreakerState.OPEN

    def observe(self, ms: float) -> None:
        self.latency_ms = ms if not self.latency_ms else (1 - EWMA) * self.latency_ms + EWMA * ms


@dataclass
class RouteInfo:
    served_by: str = ""
    reason: str = ""
    detail: str = ""
    """What decided, e.g. a cascade's margins."""
    attempts: list[tuple[str, str, float]] = field(default_factory=list)
    """(target, outcome, milliseconds) in order: ok, error, timeout, refused, open."""

    def timing_entry(self) -> timing.Entry:
        tried = "; ".join(f"{t} {o}" + (f" {ms:.1f}ms" if ms else "")
                          for t, o, ms in self.attempts if o != "ok")
        words = " ".join(w for w in (self.served_by, self.reason, self.detail) if w)
        total = sum(ms for _, _, ms in self.attempts)
        return ("route", total, f"{words}; {tried}" if tried else words)


@dataclass
class PreparedRoute:
    """A request as the router keeps it until a target takes it: its inputs as the targets'
    ``prepare`` takes them (texts, or a completion request), and what rules look at."""

    inputs: Any
    chars: int
    task: str
    num_items: int = 0
    num_tokens: int = 0
    """Filled from the target that answered (usage)."""
    route: RouteInfo = field(default_factory=RouteInfo)


class Attempts:
    def __init__(self, router: str, ctx: RequestContext, options: RouterOptions) -> None:
        self.router = router
        self.ctx = ctx
        self.options = options

    async def run(self, plan: list[tuple[Target, str]], info: RouteInfo,
                  call: Callable[[Target], Awaitable[T]]) -> T:
        """``call(target)`` for each target of ``plan`` in turn until one succeeds."""
        last: BaseException | None = None
        cause = ""
        for i, (target, reason) in enumerate(plan):
            breaker = target.breaker
            if not breaker.acquire():
                info.attempts.append((target.name, "open", 0.0))
                cause = cause or "breaker_open"
                if target.on_outcome is not None:
                    # A canary arm skipped by its open breaker failed this request too: the
                    # controller must see it, or a broken canary looks healthy (and passes).
                    target.on_outcome(target, False, 0.0)
                continue
            budget = self._budget([t for t, _ in plan[i + 1:]])
            t0 = time.perf_counter_ns()
            try:
                if budget is None:
                    out = await call(target)
                else:
                    out = await asyncio.wait_for(call(target), budget)
            except asyncio.CancelledError:
                breaker.release()
                raise
            except Exception as exc:
                ms = (time.perf_counter_ns() - t0) / 1e6
                outcome = self._judge(target, exc, ms)
                info.attempts.append((target.name, outcome, ms))
                if outcome == "client":
                    raise
                last, cause = exc, cause or outcome
                continue
            ms = (time.perf_counter_ns() - t0) / 1e6
            breaker.success()
            target.observe(ms)
            if target.on_outcome is not None:
                target.on_outcome(target, True, ms)
            info.attempts.append((target.name, "ok", ms))
            info.served_by = target.name
            info.reason = reason if i == 0 or not cause else f"fallback:{cause}"
            return out
        tried = ", ".join(f"{t} {o}" for t, o, _ in info.attempts)
        if last is None:  # nothing was tried: every breaker open
            wait = min((t.breaker.retry_after_s() for t, _ in plan), default=1)
            raise RouteUnavailable(f"router '{self.router}': every target is cooling down "
                                   f"after failures ({tried})", retry_after_s=max(1, wait))
        if isinstance(last, SokujiError):
            last.message = f"router '{self.router}' ({tried}): {last.message}"
            last.args = (last.message,)
            raise last
        if isinstance(last, TimeoutError):
            raise DeadlineExceeded(f"router '{self.router}': no target answered in time "
                                   f"({tried})")
        raise RouteUnavailable(f"router '{self.router}': every target failed ({tried})")

    def _judge(self, target: Target, exc: BaseException, ms: float) -> str:
        """The attempt's outcome, and its effect on the target's breaker."""
        breaker = target.breaker
        if isinstance(exc, TimeoutError) or (isinstance(exc, DeadlineExceeded) and getattr(
                exc, "target_fault", False)):  # our bound on the attempt, or an upstream's
            breaker.failure()
            outcome = "timeout"
        elif isinstance(exc, SokujiError) and exc.status < 500 and exc.status != 429:
            breaker.release()
            return "client"
        elif isinstance(exc, Overloaded) or (isinstance(exc, DeadlineExceeded)
                                             and not getattr(exc, "target_fault", False)):
            # Full, or could not start it in time: the target is busy, not broken.
            retry = getattr(exc, "retry_after_s", None)
            if getattr(exc, "target_fault", False) and retry:
                breaker.failure(float(retry))  # an upstream said so: believe it
            else:
                breaker.release()
            return "refused"
        else:
            status = getattr(exc, "status", 500)
            retry = getattr(exc, "retry_after_s", None) if status == 503 else None
            breaker.failure(float(retry) if retry else None)
            outcome = "error"
        if target.on_outcome is not None:
            target.on_outcome(target, False, ms)
        return outcome

    def _budget(self, rest: list[Target]) -> float | None:
        """Seconds this attempt may take; None: unbounded here."""
        limit = self.options.attempt_timeout_ms / 1e3 or None
        deadline = self.ctx.deadline_ns
        if deadline is None or not rest:
            return limit
        left = (deadline - time.perf_counter_ns()) / 1e9
        nxt = next((t for t in rest if t.available()), None)
        if nxt is None:
            return limit
        reserve = self.options.reserve_ms / 1e3 or nxt.latency_ms / 1e3
        share = left - reserve if left - reserve > 0.001 else left
        share = max(share, 0.001)
        return share if limit is None else min(limit, share)


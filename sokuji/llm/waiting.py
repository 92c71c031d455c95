"""The generation engine's queue: generations admitted but not yet in a slot, under the
scheduling policy (``core/policy.py``), with work counted in generations.

On the event loop: admission (``max_queue_depth`` waiting, ``max_concurrency`` admitted:
429 at once, Retry-After from the measured rate at which slots free up) and the deadline
check (504 at once when the work queued ahead cannot drain before it), then the request is
appended to the intake under a condition variable that wakes the engine thread. On the
engine thread: the intake moves to the waiting list, cancelled requests and those whose
deadline passed while waiting are answered, and the best one is taken by the policy's rank
(class after aging, then oldest). Closing (the thread is ending) takes everything under the
same lock, so no submission slips in after it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from sokuji.core import policy
from sokuji.core.slo_budgets import SloBudgets
from sokuji.errors import DeadlineExceeded, ModelNotReady, Overloaded
from sokuji.llm.request import Finish, GenerationRequest, now_ns


class WaitingRoom:
    def __init__(self, name: str, slots: int, max_queue_depth: int, max_concurrency: int,
                 priority_aging_ms: float) -> None:
        self.name = name
        self.slots = slots
        self.cond = threading.Condition()
        self.intake: list[GenerationRequest] = []
        """Appended on the event loop, under ``cond``."""
        self.waiting: list[GenerationRequest] = []
        """The engine thread's own list."""
        self.closed = False
        self.admission = policy.Admission(name, max_queue_depth, max_concurrency,
                                          what="generations")
        self.drain = policy.DrainRate(slots)
        """Generations completed per second of a slot's time, times the slots."""
        self._aging_ns = policy.aging_ns(priority_aging_ms)
        self.slo = SloBudgets()
        self.refused = 0
        """Time-to-first-token targets for admission by time (set by the repository)."""

    def __len__(self) -> int:
        return len(self.waiting) + len(self.intake)

    # -- event loop -----------------------------------------------------------------------
    def check(self, running: int) -> None:
        waiting = len(self)
        self.admission.check(waiting, waiting + running, lambda: waiting, self.drain.per_s)

    def put(self, req: GenerationRequest, running: int) -> None:
        """Admit (``Overloaded``, ``DeadlineExceeded`` at once) and queue ``req``."""
        self.check(running)
        now = now_ns()
        if req.deadline_ns is not None:
            rate = self.drain.per_s
            ahead = sum(1 for r in (*self.waiting, *self.intake)
                        if r.priority <= req.priority) if rate > 0 else 0
            policy.check_deadline(req.deadline_ns, now, ahead, rate,
                                  saturated=running >= self.slots)
        if self.slo and running >= self.slots:
            self._check_slo(req, now)
        req.timing.submitted_ns = now
        with self.cond:
            if self.closed:  # the thread failed everyone and is ending: nobody would read it
                raise ModelNotReady(f"model '{self.name}': its generation engine is not "
                                    "running")
            self.intake.append(req)
            self.cond.notify()

    def _check_slo(self, req: GenerationRequest, now: int) -> None:
        """Admission by time: with every slot busy, refuse (429) a generation that would
        wait for a slot longer than its time-to-first-token target leaves (slots free up at
        the measured rate; prefill is not predicted, so this errs toward admitting)."""
        budget_ms, rate = self.slo.budget_ms(req.tenant), self.drain.per_s
        if budget_ms is None or rate <= 0:
            return
        ahead = 1 + sum(1 for r in (*self.waiting, *self.intake)
                        if r.priority <= req.priority)
        wait_ms = ahead / rate * 1e3
        left_ms = (req.timing.arrival_ns - now) / 1e6 + budget_ms
        if wait_ms > left_ms:
            self.refused += 1
            raise Overloaded(
                f"model '{self.name}' would start this generation in ~{wait_ms:.0f} ms and "
                f"its SLO leaves {max(0.0, left_ms):.0f} ms; retry later",
                retry_after_s=policy.retry_after_s(ahead, rate))

    # -- engine thread --------------------------------------------------------------------
    def take_intake(self) -> None:
        """Under ``cond``: the intake joins the waiting list."""
        if self.intake:
            self.waiting.extend(self.intake)
            self.intake = []

    def reap(self, now: int) -> None:
        keep = []
        for req in self.waiting:
            if req.cancelled:
                req.push(Finish("cancelled", 0))
            elif req.deadline_ns is not None and now >= req.deadline_ns:
                waited_ms = (now - req.timing.submitted_ns) / 1e6
                req.push(Finish("deadline", 0, DeadlineExceeded(
                    f"deadline exceeded: waited {waited_ms:.0f} ms for a free slot; the "
                    "deadline passed before it could start")))
            else:
                keep.append(req)
        self.waiting = keep

    def rank(self, req: GenerationRequest, now: int) -> tuple[int, int]:
        """The policy's rank (class after aging), then the time it was queued."""
        queued = req.timing.submitted_ns
        return policy.rank(req.priority, now - queued, self._aging_ns), queued

    def pop_best(self, now: int, waits: Callable[[GenerationRequest], bool] | None = None
                 ) -> GenerationRequest | None:
        """The best waiting request by rank, among those ``waits`` lets start (the choices
        of an ``n`` > 1 request wait for their leader's prefill); None: none may."""
        candidates = self.waiting if waits is None else [r for r in self.waiting
                                                         if not waits(r)]
        if not candidates:
            return None
        req = min(candidates, key=lambda r: self.rank(r, now))
        self.waiting.remove(req)
        return req

    def close(self) -> list[GenerationRequest]:
        """Take no more submissions; returns everything that was waiting."""
        with self.cond:
            self.closed = True
            waiting = self.waiting + self.intake
            self.waiting, self.intake = [], []
        return waiting

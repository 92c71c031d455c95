"""Admission by time: a request joins an encoder's queue only if it is predicted to be
answered within its SLO, and a batch is never larger than its most urgent member can afford.

The count bound (``max_queue_depth``) says nothing about time: 64 queued long texts wait far
longer than 64 short ones. With an SLO (``config_ops.SloConfig``, ``admission = true``; its
targets reach the core as ``SloBudgets``) each request gets a **due time**: its arrival plus
the tightest p99 target that covers it (the model's own, its tenant's), or its deadline's, if
sooner. Then:

- **Prediction.** Work is counted in padded positions (items x the request's own length). The
  time to answer a request arriving now is what is left of the running batches, plus the work
  queued ahead of it and its own in whole batches of the usual size (an EWMA of batches'
  positions; its own batch may be partial and still takes a batch's time), at the measured
  rate (positions per second per instance, an EWMA over batches, padding and per-batch
  costs included); the time already spent (reading, tokenising) counts against its SLO.
- **Calibration.** Each admitted request's prediction is compared with what happened
  (``actual / predicted`` from admission to the batch's end). The 99th percentile of that
  ratio over the last 512 requests scales every prediction, so that the requests admitted
  meet the due time 99% of the time, whatever the predictor's own bias on this machine (a
  busy neighbour, length mix, batching efficiency). It is a conformal bound, not a model.
- **Refusal.** A request whose scaled prediction overshoots its due time gets ``Overloaded``
  (429, Retry-After) at once, before it costs a slot: the same answer as a full queue.
  Before any batch has been measured nothing is refused by time.
- **Slack in batching.** The batch forms around the request due first (``core/forming.py``):
  a request with slack (a looser SLO, a tenant's or none) yields to one without. And a batch
  may take at most ``batch_share`` (0.25) of the target at the measured rate: one batch of
  long texts would otherwise take most of the budget and leave no room to queue (MiniLM,
  mixed lengths: batches of up to ~1.7 s against a 2 s target). Cutting a
  batch short so that a late head could still make it was tried and measured worse: at 3x
  overload on a model with a per-batch cost, goodput fell 10% and the admitted p99 rose 30%
  (smaller batches drain the queue slower than admission predicted).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from sokuji.core import policy
from sokuji.core.request import InferenceRequest
from sokuji.core.slo_budgets import SloBudgets
from sokuji.errors import Overloaded

_RATIOS = 512
_REFRESH = 32
_MAX_SCALE = 4.0


class BatchCost:
    """A batch's run time as a fixed cost plus a cost per position, fitted by exponentially
    weighted least squares over recent batches (a per-batch cost makes small batches dear:
    a cap drawn from the average rate alone would shrink batches, lower the rate, and shrink
    them again)."""

    DECAY = 0.98

    def __init__(self) -> None:
        self.n = self.x = self.y = self.xx = self.xy = 0.0

    def observe(self, positions: float, seconds: float) -> None:
        d = self.DECAY
        self.n = d * self.n + 1.0
        self.x = d * self.x + positions
        self.y = d * self.y + seconds
        self.xx = d * self.xx + positions * positions
        self.xy = d * self.xy + positions * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per position), or None until batches of different sizes
        have been seen."""
        if self.n < 2:
            return None
        mx, my = self.x / self.n, self.y / self.n
        var = self.xx / self.n - mx * mx
        if var <= (0.05 * mx) ** 2:  # (nearly) one batch size: no slope to fit; by the rate
            return (0.0, my / mx) if mx > 0 and my > 0 else None
        slope = (self.xy / self.n - mx * my) / var
        if slope <= 0:
            return None
        return max(0.0, my - slope * mx), slope


class TimeAdmission:
    """One encoder queue's admission by time (see the module docstring). Event loop only."""

    def __init__(self, name: str, budgets: SloBudgets, instances: int) -> None:
        self.name = name
        self.budgets = budgets
        self.instances = instances
        self.rate = policy.DrainRate(instances)  # positions / s
        self.running: dict[int, tuple[int, float]] = {}
        """Batches in flight: key -> (dispatch ns, positions)."""
        self._ratios: deque[float] = deque(maxlen=_RATIOS)
        self._since_refresh = 0
        self.scale = 1.0
        """The 99th percentile of actual / predicted (1 until measured)."""
        self.refused = 0
        self.batch_work = 0.0
        """EWMA of a batch's positions: how much work one batch takes off the queue."""
        self.cost = BatchCost()
        """A batch's run time by its positions, for the batch cap."""

    def due_ns(self, tenant: str, arrival_ns: int, deadline_ns: int | None) -> int | None:
        budget = self.budgets.budget_ms(tenant)
        due = arrival_ns + int(budget * 1e6) if budget is not None else None
        if deadline_ns is not None and due is not None:
            return min(due, deadline_ns)
        return due

    def predict_s(self, now_ns: int, work_ahead: float, own: float) -> float | None:
        """Seconds from now until a request with ``own`` positions, queued behind
        ``work_ahead``, is answered (unscaled); None before the rate is measured."""
        per = self.rate.per_server_s
        if per <= 0:
            return None
        left = 0.0
        for dispatched_ns, work in self.running.values():
            left += max(0.0, work / per - (now_ns - dispatched_ns) / 1e9)
        # Batches run whole: beyond one batch, the work ahead and its own take whole batches
        # of the usual size (its own may be partial, and still takes a batch's time).
        size, total = max(self.batch_work, own, 1.0), work_ahead + own
        if total <= size:
            return left / self.instances + total / per
        return left / self.instances \
            + math.ceil(math.ceil(total / size) / self.instances) * size / per

    def check(self, due_ns: int, now_ns: int, work_ahead: float, own: float) -> float | None:
        """Raise ``Overloaded`` if the request cannot be answered by ``due_ns``; else the
        unscaled prediction in seconds (None: nothing measured yet)."""
        predicted = self.predict_s(now_ns, work_ahead, own)
        if predicted is None or (not work_ahead and not self.running):
            # An idle model always takes the request: refusing it helps nobody, and only
            # what runs corrects a rate measured in a bad moment (else nothing would).
            return predicted
        left_s = (due_ns - now_ns) / 1e9
        if predicted * self.scale > left_s:
            self.refused += 1
            raise Overloaded(
                f"model '{self.name}' would answer in ~{predicted * self.scale * 1e3:.0f} ms "
                f"(queued work at the measured rate) and its SLO leaves {max(0, left_s) * 1e3:.0f}"
                " ms; retry later",
                retry_after_s=policy.retry_after_s(work_ahead, self.rate.per_s))
        return predicted

    def check_early(self, queue: Iterable[InferenceRequest], now_ns: int) -> None:
        """Before a request is even read: refuse it if the work queued now already outlasts
        the loosest target any request of this model can have (the cheap refusal; the
        exact check, with its own size and tenant, follows on submission)."""
        loosest = self.budgets.loosest_ms
        if loosest is None or self.rate.per_server_s <= 0:
            return
        self.check(now_ns + int(loosest * 1e6), now_ns,
                   sum(r.num_items * r.length for r in queue), 0.0)

    def batch_cap(self) -> int | None:
        """The most positions one batch may hold: what runs within ``batch_share`` of the
        loosest target by the fitted batch cost (None: no cap, or not fitted yet)."""
        loosest = self.budgets.loosest_ms
        if not self.budgets.batch_share or loosest is None:
            return None
        fit = self.cost.fit()
        if fit is None:
            return None
        fixed_s, per_position_s = fit
        room_s = loosest / 1e3 * self.budgets.batch_share - fixed_s
        return max(1, int(room_s / per_position_s))

    # --- the batcher's calls -------------------------------------------------------------

    def admit(self, request: InferenceRequest, queue: Iterable[InferenceRequest],
              now_ns: int) -> None:
        """Set ``request``'s due time and refuse it (``Overloaded``) if it cannot make it;
        ``queue``: the requests waiting now."""
        due = self.due_ns(request.tenant, request.timeline.start_ns, request.deadline_ns)
        request.due_ns = due
        if due is None:
            return
        ahead = sum(r.num_items * r.length for r in queue if r.priority <= request.priority)
        predicted = self.check(due, now_ns, ahead, request.num_items * request.length)
        request.predicted_s = predicted or 0.0

    def dispatched(self, key: int, batch: Sequence[InferenceRequest], at_ns: int) -> None:
        self.running[key] = (at_ns, float(sum(r.num_items * r.length for r in batch)))

    def completed(self, key: int, batch: Sequence[InferenceRequest], done_ns: int,
                  ok: bool) -> None:
        """A batch ended: the rate, and each request's prediction against what happened."""
        dispatched_ns, work = self.running.pop(key, (done_ns, 0.0))
        if not ok:
            return
        self.rate.observe(work, (done_ns - dispatched_ns) / 1e9)
        self.cost.observe(work, (done_ns - dispatched_ns) / 1e9)
        self.batch_work = work if not self.batch_work else 0.8 * self.batch_work + 0.2 * work
        for r in batch:
            if r.predicted_s > 0 and r.due_ns is not None:
                self.observe(r.enqueued_ns, done_ns, r.predicted_s,
                             (r.due_ns - r.enqueued_ns) / 1e9)

    def observe(self, admitted_ns: int, done_ns: int, predicted_s: float,
                budget_s: float) -> None:
        """One admitted request answered: how far off its prediction was. Only predictions
        of at least a tenth of the budget count: the regime where refusals are decided (a
        near-empty queue's tiny predictions are dominated by fixed costs and would inflate
        the scale)."""
        if predicted_s <= 0 or predicted_s < 0.1 * budget_s:
            return
        self._ratios.append((done_ns - admitted_ns) / 1e9 / predicted_s)
        self._since_refresh += 1
        if self._since_refresh >= _REFRESH or len(self._ratios) < _REFRESH:
            self._since_refresh = 0
            # Bounded: a stall (a cold start, a busy neighbour's burst) is no prediction
            # error, and while fewer than ~100 are in, the 99th percentile is the maximum.
            q = float(np.percentile(np.fromiter(self._ratios, float), 99))
            self.scale = min(_MAX_SCALE, max(0.5, q)) if math.isfinite(q) else 1.0

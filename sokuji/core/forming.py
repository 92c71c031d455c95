"""Which queued requests form the next batch. Pure: requests in, a choice out; no clock.

- The batch always holds the request that goes first: the best ``policy.rank`` (priority
  class, after aging), then the one due first: by its SLO's due time, or, without an SLO,
  ``priority_aging_ms`` after it was queued (so without SLOs: the oldest). A request whose
  SLO leaves it slack yields to one whose SLO does not; nothing starves, since a request
  without an SLO becomes due too.
- It is filled, within ``max_batch_size`` items and ``max_batch_tokens`` padded positions
  (items x the longest length), with the others in rank order and then, for policy
  ``length``, nearest to the first one's length (low padding), or, for ``fifo``, in arrival
  order, stopping at the first that does not fit.
- A single request larger than the token budget still runs, alone.
- Only requests of the head's ``group`` join it (a tensor model's requests of other shapes
  wait for a batch of their own shape).
- With ``preferred`` batch sizes (Triton's ``preferred_batch_size``), a batch larger than
  the smallest preferred size is cut back to the largest preferred size it reaches, so the
  model runs the sizes it was tuned for; the rest stay queued for the next batch.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from sokuji.core import policy
from sokuji.core.request import InferenceRequest


class BatchPolicy(enum.StrEnum):
    """How a batch is filled around its first request (a model's ``batching``)."""

    LENGTH = "length"
    """The others nearest to its length: least padding."""
    FIFO = "fifo"
    """The others in arrival order, stopping at the first that does not fit."""


@dataclass(frozen=True)
class BatchInfo:
    """What one dispatched batch looked like; published as metrics."""

    num_requests: int
    num_items: int
    padded_tokens: int
    real_tokens: int


@dataclass(frozen=True, slots=True)
class Choice:
    indices: list[int]
    """Positions in the queue given, in the batch's order."""
    items: int
    longest: int


def choose(queue: Sequence[InferenceRequest], batch_policy: BatchPolicy, max_batch_size: int,
           max_batch_tokens: int, aging_ns: int, now_ns: int,
           preferred: Sequence[int] = ()) -> Choice:
    """The next batch out of ``queue`` (non-empty); ``preferred``: batch sizes in items,
    ascending (empty: any size up to ``max_batch_size``)."""
    if len(queue) == 1:
        only = queue[0]
        return Choice([0], only.num_items, only.length)
    prank = policy.rank
    ranks = [prank(r.priority, now_ns - r.enqueued_ns, aging_ns) for r in queue]
    # Among equals the one due first: its SLO's due time (``core/slo_admission.py``), or for
    # a request without one, the aging time after it was queued.
    dues = [r.due_ns if r.due_ns is not None else r.enqueued_ns + aging_ns for r in queue]
    head = min(range(len(queue)), key=lambda i: (ranks[i], dues[i]))
    group = queue[head].group
    rest = [i for i in range(len(queue)) if i != head and queue[i].group == group]
    if batch_policy is BatchPolicy.LENGTH:
        anchor = queue[head].length
        rest.sort(key=lambda i: (ranks[i], abs(queue[i].length - anchor)))
    else:
        rest.sort(key=lambda i: (ranks[i], queue[i].enqueued_ns))
    chosen = [head]
    items, longest = queue[head].num_items, queue[head].length
    strict = batch_policy is BatchPolicy.FIFO
    for i in rest:
        if items >= max_batch_size:
            break
        req = queue[i]
        new_items = items + req.num_items
        new_longest = max(longest, req.length)
        if new_items > max_batch_size or new_items * new_longest > max_batch_tokens:
            if strict:
                break
            continue
        chosen.append(i)
        items, longest = new_items, new_longest
    if preferred and items > preferred[0] and items not in preferred:
        return _cut(queue, chosen, max(p for p in preferred if p <= items))
    return Choice(chosen, items, longest)


def _cut(queue: Sequence[InferenceRequest], chosen: list[int], size: int) -> Choice:
    """``chosen`` cut back (from its end, the head kept) to at most ``size`` items."""
    kept: list[int] = []
    items = longest = 0
    for i in chosen:
        req = queue[i]
        if kept and items + req.num_items > size:
            continue
        kept.append(i)
        items += req.num_items
        longest = max(longest, req.length)
    return Choice(kept, items, longest)

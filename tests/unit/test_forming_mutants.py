"""Batch forming (``core/forming.py``) against the mutants mutmut left alive there
(docs/mutation.md): each test names the mutant(s) it kills, by mutmut's name."""

from __future__ import annotations

from sokuji.core import forming
from sokuji.core.forming import BatchPolicy
from sokuji.core.request import InferenceRequest, Priority, Timeline

AGING_NS = 1_000_000_000
NOW_NS = 10_000_000_000
MS = 1_000_000


def _req(age_ms: int, *, length: int = 1, items: int = 1,
         priority: Priority = Priority.INTERACTIVE, due_in_ms: int | None = None
         ) -> InferenceRequest:
    """A request queued ``age_ms`` before NOW_NS (all younger than the aging time)."""
    r = InferenceRequest(model="m", payload=None, num_items=items, length=length,
                         timeline=Timeline(0), priority=priority)
    r.enqueued_ns = NOW_NS - age_ms * MS
    if due_in_ms is not None:
        r.due_ns = NOW_NS + due_in_ms * MS
    return r


def _choose(queue: list[InferenceRequest], policy: BatchPolicy = BatchPolicy.LENGTH, *,
            max_batch: int = 64, max_tokens: int = 1 << 30,
            preferred: tuple[int, ...] = ()) -> forming.Choice:
    return forming.choose(queue, policy, max_batch, max_tokens, AGING_NS, NOW_NS, preferred)


def test_a_lone_request_is_its_own_batch_with_its_size_and_length() -> None:
    """Kills ``x_choose__mutmut_6``, ``_7`` and ``_11`` (the one-request shortcut answering
    position 1, or no item count, or no length)."""
    choice = _choose([_req(5, length=17, items=3)])
    assert (choice.indices, choice.items, choice.longest) == ([0], 3, 17)


def test_two_requests_that_fit_run_together() -> None:
    """Kills ``x_choose__mutmut_2`` (the shortcut taken for a queue of two, which would run
    the first alone) and ``x_choose__mutmut_83`` (the batch's item count lost)."""
    choice = _choose([_req(5, length=4, items=2), _req(3, length=9)])
    assert (choice.indices, choice.items, choice.longest) == ([0, 1], 3, 9)


def test_an_interactive_request_goes_ahead_of_an_older_batch_one_not_yet_aged() -> None:
    """Kills ``x_choose__mutmut_20`` (the wait computed as now + enqueued: every request
    looks aged, so the older batch-class one would head the batch) and ``_28`` / ``_30``
    (the head taken as the queue's first position)."""
    queue = [_req(500, priority=Priority.BATCH), _req(1)]
    assert _choose(queue, max_batch=1).indices == [1]


def test_a_request_due_sooner_by_its_slo_heads_an_older_one_without_an_slo() -> None:
    """The one without an SLO is due ``aging`` after it was queued (990 ms from now); the
    younger one's SLO makes it due in 100 ms, so it goes first. Kills ``x_choose__mutmut_22``
    (the SLO's due time ignored), ``_23`` and ``_24`` (a missing due time used as one: a
    TypeError), and ``_25`` (due ``aging`` *before* it was queued)."""
    queue = [_req(10), _req(1, due_in_ms=100)]
    assert _choose(queue, max_batch=1).indices == [1]


def test_fifo_fills_in_rank_order_before_arrival_order() -> None:
    """An older batch-class request does not take the place of a younger interactive one.
    Kills ``x_choose__mutmut_45`` (FIFO's others in queue order, whatever their class)."""
    queue = [_req(30), _req(20, priority=Priority.BATCH), _req(10)]
    assert _choose(queue, BatchPolicy.FIFO, max_batch=2).indices == [0, 2]


def test_length_policy_skips_one_that_does_not_fit_and_takes_the_next() -> None:
    """The nearest in length (12) has too many items; the next nearest (14) fits. Kills
    ``x_choose__mutmut_66`` (stopping at the first that does not fit, as FIFO does)."""
    queue = [_req(30, length=10), _req(20, length=12, items=5), _req(10, length=14)]
    choice = _choose(queue, max_batch=4)
    assert (choice.indices, choice.items, choice.longest) == ([0, 2], 2, 14)


def test_a_cut_batch_reports_the_longest_of_what_it_kept() -> None:
    """Cut back from 3 items to the preferred 2, the batch's length is that of the two kept
    (5), not of the one cut (9) and not missing. Kills ``x__cut__mutmut_12`` and ``_19``."""
    queue = [_req(30, length=5), _req(20, length=4), _req(10, length=9)]
    choice = _choose(queue, BatchPolicy.FIFO, preferred=(2,))
    assert (choice.indices, choice.items, choice.longest) == ([0, 1], 2, 5)

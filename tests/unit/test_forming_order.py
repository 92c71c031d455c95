"""Length-aware batch forming (``core/forming.py``): the head is the oldest request whatever
its length, and the rest join nearest to the head's length, not longest (or shortest) first
and not in arrival order."""

from __future__ import annotations

from sokuji.core import forming
from sokuji.core.forming import BatchPolicy
from sokuji.core.request import InferenceRequest, Timeline

AGING_NS = 1_000_000_000
NOW_NS = 10_000_000_000


def _queue(lengths: list[int]) -> list[InferenceRequest]:
    """One single-item request per length, in arrival order (the first is the oldest)."""
    queue = []
    for i, length in enumerate(lengths):
        r = InferenceRequest(model="m", payload=None, num_items=1, length=length,
                             timeline=Timeline(0))
        r.enqueued_ns = NOW_NS - 1_000_000 * (len(lengths) - i)  # all younger than aging
        queue.append(r)
    return queue


def test_the_oldest_request_heads_the_batch_even_when_it_is_the_shortest() -> None:
    """Kills the mutant: choosing the head as the longest (or the shortest, or the newest)
    request instead of the oldest in ``core/forming.py`` ``choose``."""
    lengths = [3, 40, 1, 38, 39, 2]  # the oldest is short; the longest and shortest are not it
    queue = _queue(lengths)
    for policy in BatchPolicy:
        # Room for the head and little else: 2 items of the head's length at most.
        choice = forming.choose(queue, policy, 64, 6, AGING_NS, NOW_NS)
        assert choice.indices[0] == 0 and choice.longest == 3, policy
    # length: the head and the 2 (2 x 3 positions); fifo stops at the 40 behind it.
    assert forming.choose(queue, BatchPolicy.LENGTH, 64, 6, AGING_NS, NOW_NS).indices == [0, 5]
    assert forming.choose(queue, BatchPolicy.FIFO, 64, 6, AGING_NS, NOW_NS).indices == [0]
    # Without a token limit the head is still the oldest, not the longest.
    assert forming.choose(queue, BatchPolicy.LENGTH, 3, 1 << 30, AGING_NS,
                          NOW_NS).indices[0] == 0


def test_length_policy_fills_nearest_to_the_heads_length() -> None:
    """Kills the mutant: sorting the rest longest-first (or shortest-first, or in arrival
    order) instead of nearest to the head's length in ``core/forming.py`` ``choose``."""
    # Head 10 (the oldest); nearest are 9 and 11, queued after the far ones.
    lengths = [10, 50, 1, 30, 2, 9, 11]
    queue = _queue(lengths)
    choice = forming.choose(queue, BatchPolicy.LENGTH, 3, 1 << 30, AGING_NS, NOW_NS)
    assert choice.indices == [0, 5, 6]  # the head, then 9 and 11 (tie: arrival order)
    assert choice.longest == 11
    # Under a token budget (items x longest <= 48) the order still decides: 9, 11, then 2
    # (distance 8) fit; 1 no longer does (5 x 11), nor the long ones.
    choice = forming.choose(queue, BatchPolicy.LENGTH, 64, 48, AGING_NS, NOW_NS)
    assert choice.indices == [0, 5, 6, 4] and choice.longest == 11
    # FIFO for contrast: arrival order, stopping at the first that does not fit.
    fifo = forming.choose(queue, BatchPolicy.FIFO, 3, 1 << 30, AGING_NS, NOW_NS)
    assert fifo.indices == [0, 1, 2]

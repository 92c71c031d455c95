"""Batch forming for tensor models: requests of another group (shape) never join a batch,
and preferred batch sizes cut a batch back (``core/forming.py``)."""

from __future__ import annotations

import time

from sokuji.core import forming
from sokuji.core.forming import BatchPolicy
from sokuji.core.request import InferenceRequest, Timeline

AGING_NS = 1_000_000_000


def _req(items: int, group: object = None, age_ms: float = 0.0) -> InferenceRequest:
    now = time.perf_counter_ns()
    r = InferenceRequest(model="m", payload=None, num_items=items, length=1,
                         timeline=Timeline(now), group=group)
    r.enqueued_ns = now - int(age_ms * 1e6)
    return r


def _choose(queue: list[InferenceRequest], max_batch: int = 64,
            preferred: tuple[int, ...] = (), policy: BatchPolicy = BatchPolicy.LENGTH
            ) -> list[int]:
    return forming.choose(queue, policy, max_batch, 1 << 30, AGING_NS,
                          time.perf_counter_ns(), preferred).indices


def test_only_the_heads_group_joins_it() -> None:
    a, b = ("x", (4,)), ("x", (8,))
    queue = [_req(1, a, age_ms=5), _req(1, b, age_ms=4), _req(2, a, age_ms=3), _req(1, b)]
    assert sorted(_choose(queue)) == [0, 2]  # the oldest is a: b waits for its own batch
    assert sorted(_choose(queue[1:])) == [0, 2]  # then b's, without a's
    for policy in BatchPolicy:
        assert sorted(_choose(queue, policy=policy)) == [0, 2]


def test_no_group_batches_everything_together() -> None:
    queue = [_req(1), _req(3), _req(2)]
    assert sorted(_choose(queue)) == [0, 1, 2]


def test_preferred_sizes_cut_a_batch_back_to_the_largest_reached() -> None:
    queue = [_req(1, age_ms=10 - i) for i in range(7)]
    chosen = _choose(queue, preferred=(2, 4))
    assert len(chosen) == 4 and chosen[0] == 0  # 7 reached: cut to 4, the head kept
    assert len(_choose(queue[:3], preferred=(2, 4))) == 2
    assert len(_choose(queue[:4], preferred=(2, 4))) == 4  # a preferred size: as it is
    assert len(_choose(queue[:1], preferred=(2, 4))) == 1  # under the smallest: runs anyway
    assert len(_choose(queue, preferred=())) == 7


def test_a_cut_keeps_requests_whole() -> None:
    queue = [_req(3, age_ms=3), _req(3, age_ms=2), _req(1, age_ms=1)]
    choice = forming.choose(queue, BatchPolicy.FIFO, 64, 1 << 30, AGING_NS,
                            time.perf_counter_ns(), (4,))
    assert choice.indices == [0, 2] and choice.items == 4  # 3 + 1: the second 3 waits

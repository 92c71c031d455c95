"""Batches of a coroutine ``run_batch`` run as tasks on the event loop (``core/loop_runs.py``):
up to ``instances`` at once, queueing and admission as in threads, a failure its batch's
alone, and a batch whose every request went away cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from sokuji.core.batcher import BatcherConfig, DynamicBatcher
from sokuji.errors import Overloaded, RuntimeFailed
from sokuji.runtimes.base import Prepared
from tests.unit.test_batcher import make_request

WAIT_S = 10


class AsyncRuntime:
    """Each batch waits on its own gate (an asyncio.Event) the test opens."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gates: list[asyncio.Event] = []
        self.cancelled: list[list[str]] = []
        self.started = asyncio.Queue[int]()

    async def run_batch(self, batch: Sequence[Prepared]) -> list[Any]:
        texts = [t for p in batch for t in p.data]
        gate = asyncio.Event()
        self.batches.append(texts)
        self.gates.append(gate)
        self.started.put_nowait(len(self.batches) - 1)
        try:
            await gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append(texts)
            raise
        if "bad" in texts:
            raise RuntimeFailed("bad item")
        return [[t.upper() for t in p.data] for p in batch]

    async def next_batch(self) -> list[str]:
        return self.batches[await asyncio.wait_for(self.started.get(), WAIT_S)]


async def start(rt: AsyncRuntime, **kw: Any) -> DynamicBatcher:
    b = DynamicBatcher("m", rt.run_batch, BatcherConfig(**kw))
    assert b.on_loop
    b.start()
    return b


async def test_batches_run_concurrently_up_to_instances() -> None:
    rt = AsyncRuntime()
    b = await start(rt, instances=2, max_batch_size=1, max_queue_delay_ms=0.0)
    entries = [b.enqueue(make_request([t])) for t in ("a", "b", "c")]
    assert await rt.next_batch() == ["a"] and await rt.next_batch() == ["b"]
    assert b.num_running_batches == 2 and b.num_waiting == 1  # the third waits its turn
    rt.gates[0].set()
    assert await entries[0].result() == ["A"]
    assert await rt.next_batch() == ["c"]
    rt.gates[1].set()
    rt.gates[2].set()
    assert [await e.result() for e in entries[1:]] == [["B"], ["C"]]
    await b.stop()


async def test_a_failing_batch_fails_only_its_requests_and_a_full_queue_refuses() -> None:
    rt = AsyncRuntime()
    b = await start(rt, instances=1, max_batch_size=1, max_queue_depth=1)
    bad = b.enqueue(make_request(["bad"]))
    await rt.next_batch()
    good = b.enqueue(make_request(["good"]))
    with pytest.raises(Overloaded):
        b.enqueue(make_request(["refused"]))
    rt.gates[0].set()
    with pytest.raises(RuntimeFailed, match="bad item"):
        await bad.result()
    await rt.next_batch()
    rt.gates[1].set()
    assert await good.result() == ["GOOD"]
    await b.stop()


async def test_a_batch_nobody_waits_for_is_cancelled_and_frees_its_slot() -> None:
    """Mutant: ``_Entry.cancel`` not calling ``drop_unwanted``: the batch would wait on its
    gate forever and the next request never start."""
    rt = AsyncRuntime()
    b = await start(rt, instances=1, max_batch_size=1)
    first = b.enqueue(make_request(["gone"]))
    await rt.next_batch()
    waiter = asyncio.ensure_future(first.result())
    await asyncio.sleep(0)
    waiter.cancel()  # its caller went away (a timeout, a disconnect)
    with pytest.raises(asyncio.CancelledError):
        await waiter
    second = b.enqueue(make_request(["next"]))
    assert await rt.next_batch() == ["next"]
    assert rt.cancelled == [["gone"]]
    rt.gates[1].set()
    assert await second.result() == ["NEXT"]
    await b.stop()

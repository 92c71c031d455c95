"""The dynamic batcher, driven by a gated fake runtime: no sleeps, no wall-clock waits."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from sokuji.core.batcher import BatcherConfig, BatchInfo, DynamicBatcher
from sokuji.core.forming import BatchPolicy
from sokuji.core.request import STAGES, InferenceRequest, Priority, Stage, Timeline
from sokuji.errors import DeadlineExceeded, ModelNotReady, Overloaded, RuntimeFailed
from sokuji.runtimes.base import Prepared

WAIT_S = 10  # a safety net against hangs; no test relies on it elapsing


class GatedRuntime:
    """Records every batch; each batch blocks until the test opens its gate."""

    def __init__(self, loop: asyncio.AbstractEventLoop, gated: bool = True) -> None:
        self.loop = loop
        self.batches: list[list[str]] = []
        self.gates: list[threading.Event] = []
        self.started = asyncio.Queue[int]()
        self.gated = gated
        self.fail_on: str | None = None
        self.crash_on: str | None = None

    def run_batch(self, batch: Sequence[Prepared]) -> list[np.ndarray]:
        texts = [t for p in batch for t in p.data]
        gate = threading.Event()
        self.batches.append(texts)
        self.gates.append(gate)
        self.loop.call_soon_threadsafe(self.started.put_nowait, len(self.batches) - 1)
        if self.gated:
            gate.wait(WAIT_S)
        if self.fail_on in texts:
            raise RuntimeFailed(f"bad item {self.fail_on}")
        if self.crash_on in texts:
            raise ZeroDivisionError("runtime bug")
        return [np.asarray([[float(len(t))] for t in p.data]) for p in batch]

    async def next_batch(self) -> list[str]:
        index = await asyncio.wait_for(self.started.get(), WAIT_S)
        return self.batches[index]

    def open(self, index: int) -> None:
        self.gates[index].set()


def make_request(texts: list[str], length: int | None = None) -> InferenceRequest:
    n = length if length is not None else max(len(t) for t in texts)
    prepared = Prepared(data=texts, num_items=len(texts), length=n, num_tokens=n * len(texts))
    return InferenceRequest(model="m", payload=prepared, num_items=len(texts), length=n,
                            timeline=Timeline())


@pytest.fixture
async def rt() -> GatedRuntime:
    return GatedRuntime(asyncio.get_running_loop())


async def start(rt: GatedRuntime, **kw: object) -> tuple[DynamicBatcher, list[BatchInfo]]:
    """A batcher whose batches all run in worker threads (a gated batch on the event loop
    would block the test that opens its gate); the loop's own runs: test_batcher_inline."""
    infos: list[BatchInfo] = []
    kw.setdefault("inline_max_ms", 0.0)
    b = DynamicBatcher("m", rt.run_batch, BatcherConfig(**kw), on_batch=infos.append)  # type: ignore[arg-type]
    b.start()
    return b, infos


async def test_idle_model_starts_a_request_at_once(rt: GatedRuntime) -> None:
    b, _ = await start(rt, max_batch_size=8, max_queue_delay_ms=10_000)
    task = asyncio.create_task(b.submit(make_request(["alone"])))
    assert await rt.next_batch() == ["alone"]  # dispatched without waiting the 10 s delay
    rt.open(0)
    assert (await task).tolist() == [[5.0]]
    await b.stop()


async def test_arrivals_during_a_batch_form_the_next_batch(rt: GatedRuntime) -> None:
    b, infos = await start(rt, max_batch_size=8)
    first = asyncio.create_task(b.submit(make_request(["a"])))
    await rt.next_batch()
    later = [asyncio.create_task(b.submit(make_request([f"r{i}"]))) for i in range(5)]
    await asyncio.sleep(0)  # let the submits enqueue (a scheduling yield, not a timed wait)
    assert b.num_waiting == 5
    rt.open(0)
    assert sorted(await rt.next_batch()) == [f"r{i}" for i in range(5)]
    rt.open(1)
    await asyncio.gather(first, *later)
    assert [i.num_items for i in infos] == [1, 5]
    await b.stop()


async def test_max_batch_size_splits_the_queue(rt: GatedRuntime) -> None:
    rt.gated = False
    b, infos = await start(rt, max_batch_size=4, policy=BatchPolicy.FIFO)
    blocker = threading.Event()
    original = rt.run_batch

    def first_blocks(batch: Sequence[Prepared]) -> list[np.ndarray]:
        if not rt.batches:
            rt.batches.append([])
            blocker.wait(WAIT_S)
            return [np.zeros((p.num_items, 1)) for p in batch]
        return original(batch)

    b._run_batch = first_blocks
    head = asyncio.create_task(b.submit(make_request(["h"])))
    await asyncio.sleep(0)
    tasks = [asyncio.create_task(b.submit(make_request([f"x{i}"]))) for i in range(10)]
    await asyncio.sleep(0)
    blocker.set()
    await asyncio.gather(head, *tasks)
    assert [i.num_items for i in infos] == [1, 4, 4, 2]
    assert rt.batches[1:] == [["x0", "x1", "x2", "x3"], ["x4", "x5", "x6", "x7"], ["x8", "x9"]]
    await b.stop()


async def test_results_come_back_in_each_requests_item_order(rt: GatedRuntime) -> None:
    rt.gated = False
    b, _ = await start(rt, max_batch_size=16)
    outs = await asyncio.gather(b.submit(make_request(["a", "bbb", "cc"])),
                                b.submit(make_request(["dddd", "e"])))
    assert outs[0].ravel().tolist() == [1.0, 3.0, 2.0]
    assert outs[1].ravel().tolist() == [4.0, 1.0]
    await b.stop()


async def test_length_aware_groups_similar_lengths_with_the_oldest(rt: GatedRuntime) -> None:
    b, _ = await start(rt, max_batch_size=3, policy=BatchPolicy.LENGTH)
    first = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    lengths = {"L50": 50, "s5": 5, "L48": 48, "s6": 6, "L52": 52, "s4": 4}
    tasks = [asyncio.create_task(b.submit(make_request([name], n)))
             for name, n in lengths.items()]
    await asyncio.sleep(0)
    rt.open(0)
    assert sorted(await rt.next_batch()) == ["L48", "L50", "L52"]  # the oldest is L50
    rt.open(1)
    assert sorted(await rt.next_batch()) == ["s4", "s5", "s6"]
    rt.open(2)
    await asyncio.gather(first, *tasks)
    await b.stop()


async def test_fifo_takes_arrival_order(rt: GatedRuntime) -> None:
    b, _ = await start(rt, max_batch_size=3, policy=BatchPolicy.FIFO)
    first = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    names = ["L50", "s5", "L48", "s6"]
    tasks = [asyncio.create_task(b.submit(make_request([n], 50 if n[0] == "L" else 5)))
             for n in names]
    await asyncio.sleep(0)
    rt.open(0)
    assert await rt.next_batch() == ["L50", "s5", "L48"]
    rt.open(1)
    assert await rt.next_batch() == ["s6"]
    rt.open(2)
    await asyncio.gather(first, *tasks)
    await b.stop()


async def test_token_budget_bounds_a_batch(rt: GatedRuntime) -> None:
    b, infos = await start(rt, max_batch_size=32, max_batch_tokens=100,
                           policy=BatchPolicy.LENGTH)
    first = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    tasks = [asyncio.create_task(b.submit(make_request([f"t{i}"], 40))) for i in range(5)]
    huge = asyncio.create_task(b.submit(make_request(["huge"], 500)))
    await asyncio.sleep(0)
    rt.open(0)
    for i in range(1, 5):  # [t0 t1] [t2 t3] [t4] [huge], in some order
        await rt.next_batch()
        rt.open(i)
    await asyncio.gather(first, huge, *tasks)
    sizes = [(i.num_items, i.padded_tokens) for i in infos[1:]]
    assert all(tokens <= 100 for n, tokens in sizes if n > 1)
    assert (1, 500) in sizes  # an oversized request still runs, alone
    assert sum(n for n, _ in sizes) == 6
    await b.stop()


async def test_a_failing_batch_fails_only_its_own_requests(rt: GatedRuntime) -> None:
    rt.fail_on = "bad"
    b, _ = await start(rt, max_batch_size=2, policy=BatchPolicy.FIFO)
    first = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    doomed = [asyncio.create_task(b.submit(make_request([t]))) for t in ("bad", "x")]
    fine = [asyncio.create_task(b.submit(make_request([t]))) for t in ("y", "z")]
    await asyncio.sleep(0)
    for i in range(3):
        rt.open(i)
        if i < 2:
            await rt.next_batch()
    results = await asyncio.gather(*doomed, *fine, first, return_exceptions=True)
    assert all(isinstance(r, RuntimeFailed) for r in results[:2])
    assert [r.ravel().tolist() for r in results[2:4]] == [[1.0], [1.0]]  # type: ignore[union-attr]
    await b.stop()


async def test_an_unexpected_runtime_exception_becomes_runtime_failed(rt: GatedRuntime) -> None:
    rt.gated, rt.crash_on = False, "boom"
    b, _ = await start(rt)
    with pytest.raises(RuntimeFailed, match="ZeroDivisionError"):
        await b.submit(make_request(["boom"]))
    assert (await b.submit(make_request(["ok"]))).tolist() == [[2.0]]  # the loop survived
    await b.stop()


async def test_a_cancelled_request_leaves_the_queue(rt: GatedRuntime) -> None:
    b, _ = await start(rt)
    first = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    gone = asyncio.create_task(b.submit(make_request(["gone"])))
    kept = asyncio.create_task(b.submit(make_request(["kept"])))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert b.num_waiting == 1
    rt.open(0)
    assert await rt.next_batch() == ["kept"]
    rt.open(1)
    await asyncio.gather(first, kept)
    await b.stop()


async def test_with_a_busy_instance_a_partial_batch_waits_for_company(rt: GatedRuntime) -> None:
    b, _ = await start(rt, max_batch_size=2, instances=2, max_queue_delay_ms=60_000)
    first = asyncio.create_task(b.submit(make_request(["one"])))
    await rt.next_batch()
    second = asyncio.create_task(b.submit(make_request(["two"])))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(rt.batches) == 1 and b.num_waiting == 1  # waiting, not dispatched alone
    third = asyncio.create_task(b.submit(make_request(["three"])))
    assert sorted(await rt.next_batch()) == ["three", "two"]  # full batch: goes at once
    rt.open(0)
    rt.open(1)
    await asyncio.gather(first, second, third)
    await b.stop()


async def test_timeline_stages_tile_the_request(rt: GatedRuntime) -> None:
    rt.gated = False
    b, _ = await start(rt)
    req = make_request(["abc"])
    req.timeline.mark(Stage.DECODE)
    req.timeline.mark(Stage.CACHE)
    req.timeline.mark(Stage.PREPROCESS)
    await b.submit(req)
    req.timeline.mark(Stage.POSTPROCESS)
    req.timeline.mark(Stage.ENCODE)
    tl = req.timeline
    assert set(tl.durations_ns) == set(STAGES)
    assert sum(tl.durations_ns.values()) == tl.total_ns
    assert all(v >= 0 for v in tl.durations_ns.values())
    await b.stop()


async def test_stop_fails_what_is_still_queued(rt: GatedRuntime) -> None:
    b, _ = await start(rt)
    first = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    queued = asyncio.create_task(b.submit(make_request(["queued"])))
    await asyncio.sleep(0)
    stopping = asyncio.create_task(b.stop())
    await asyncio.sleep(0)
    rt.open(0)
    await stopping
    assert (await first).tolist() == [[4.0]]  # the running batch finished
    with pytest.raises(RuntimeFailed, match="stopped"):
        await queued


# --- priorities, admission, deadlines -------------------------------------------------------

def prio_request(name: str, priority: Priority, deadline_ns: int | None = None
                 ) -> InferenceRequest:
    req = make_request([name])
    req.priority, req.deadline_ns = priority, deadline_ns
    return req


async def test_an_interactive_request_overtakes_queued_batch_requests(rt: GatedRuntime) -> None:
    b, _ = await start(rt, max_batch_size=1)
    first = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    bulk = [asyncio.create_task(b.submit(prio_request(f"bulk{i}", Priority.BATCH)))
            for i in range(5)]
    await asyncio.sleep(0)
    urgent = asyncio.create_task(b.submit(prio_request("urgent", Priority.INTERACTIVE)))
    await asyncio.sleep(0)
    rt.open(0)
    assert await rt.next_batch() == ["urgent"]
    for i in range(1, 7):
        rt.open(i)
        if i < 6:
            assert await rt.next_batch() == [f"bulk{i - 1}"]
    await asyncio.gather(first, urgent, *bulk)
    await b.stop()


async def test_batch_requests_age_into_interactive(rt: GatedRuntime) -> None:
    b, _ = await start(rt, max_batch_size=1, priority_aging_ms=0)  # everything has aged
    first = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    old = asyncio.create_task(b.submit(prio_request("old-bulk", Priority.BATCH)))
    await asyncio.sleep(0)
    new = asyncio.create_task(b.submit(prio_request("new-urgent", Priority.INTERACTIVE)))
    await asyncio.sleep(0)
    rt.open(0)
    assert await rt.next_batch() == ["old-bulk"]  # aged: its age wins
    rt.open(1)
    assert await rt.next_batch() == ["new-urgent"]
    rt.open(2)
    await asyncio.gather(first, old, new)
    await b.stop()


async def test_a_full_queue_rejects_at_once_with_retry_after(rt: GatedRuntime) -> None:
    b, _ = await start(rt, max_batch_size=1, max_queue_depth=2)
    first = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    queued = [asyncio.create_task(b.submit(make_request([f"q{i}"]))) for i in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="max_queue_depth 2") as err:
        await b.submit(make_request(["one too many"]))
    assert err.value.status == 429 and err.value.headers["retry-after"] == "1"
    for i in range(3):
        rt.open(i)
        if i < 2:
            await rt.next_batch()
    await asyncio.gather(first, *queued)
    await b.stop()


async def test_max_concurrency_counts_running_and_queued(rt: GatedRuntime) -> None:
    b, _ = await start(rt, max_batch_size=1, max_concurrency=2)
    first = asyncio.create_task(b.submit(make_request(["running"])))
    await rt.next_batch()
    second = asyncio.create_task(b.submit(make_request(["queued"])))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="max_concurrency 2"):
        await b.submit(make_request(["third"]))
    rt.open(0)
    await rt.next_batch()
    rt.open(1)
    await asyncio.gather(first, second)
    rt.gated = False
    assert (await b.submit(make_request(["later"]))).tolist() == [[5.0]]  # admitted again
    await b.stop()


async def test_retry_after_follows_the_measured_drain_rate(rt: GatedRuntime) -> None:
    b, _ = await start(rt, max_batch_size=1, max_queue_depth=3)
    first = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    queued = [asyncio.create_task(b.submit(make_request([f"q{i}"]))) for i in range(3)]
    await asyncio.sleep(0)
    b._drain.per_server_s = 0.5  # as if one item took 2 s: 3 queued items drain in 6 s
    with pytest.raises(Overloaded) as err:
        await b.submit(make_request(["x"]))
    assert err.value.retry_after_s == 6
    for i in range(4):
        rt.open(i)
        if i < 3:
            await rt.next_batch()
    await asyncio.gather(first, *queued)
    await b.stop()


async def test_retry_after_comes_from_measured_completions() -> None:
    """Kills the mutant: deleting ``self._drain.observe(...)`` in ``core/batcher.py``
    ``_complete`` (the drain rate then stays unmeasured and every Retry-After is 1).

    Two models measured in this test: one whose batch is answered at once, one whose batch
    is held ``HOLD_S`` (a lower bound: a sleep never ends early). Then each has one batch
    running and 10 items queued: its Retry-After is those items over its measured rate, so
    at least ``10 * HOLD_S`` seconds for the slow one."""
    hold_s = 0.3
    loop = asyncio.get_running_loop()
    found: dict[float, tuple[int, float]] = {}
    for held in (0.0, hold_s):
        rt = GatedRuntime(loop)
        b, _ = await start(rt, max_batch_size=8, max_queue_depth=2)
        assert b.drain_items_per_s == 0.0
        measured = asyncio.create_task(b.submit(make_request(["m"])))
        await rt.next_batch()
        await asyncio.sleep(held)
        rt.open(0)
        await measured
        rate = b.drain_items_per_s
        assert 0 < rate <= (1 / held if held else float("inf"))
        busy = asyncio.create_task(b.submit(make_request(["busy"])))
        await rt.next_batch()
        queued = [asyncio.create_task(b.submit(make_request(["q"] * 5))) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as err:
            await b.submit(make_request(["x"]))
        assert b.drain_items_per_s == rate  # nothing completed meanwhile
        found[held] = (err.value.retry_after_s, rate)
        assert err.value.retry_after_s == math.ceil(10 / rate)
        rt.gated = False
        for gate in rt.gates:
            gate.set()
        await asyncio.gather(busy, *queued)
        await b.stop()
    assert found[hold_s][0] >= math.ceil(10 * hold_s)  # 3 s at least: measured, not 1


async def test_a_deadline_that_cannot_be_met_is_rejected_without_computing(rt: GatedRuntime
                                                                           ) -> None:
    b, _ = await start(rt, max_batch_size=1)
    first = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    queued = [asyncio.create_task(b.submit(make_request([f"q{i}"]))) for i in range(5)]
    await asyncio.sleep(0)
    b._drain.per_server_s = 10.0  # 5 items ahead: ~500 ms of work
    soon = time.perf_counter_ns() + 250_000_000  # well short of it, even after a long pause
    with pytest.raises(DeadlineExceeded, match="~500 ms of work is queued ahead"):
        await b.submit(prio_request("hurry", Priority.INTERACTIVE, soon))
    with pytest.raises(DeadlineExceeded, match="passed before it was queued"):
        await b.submit(prio_request("late", Priority.INTERACTIVE, time.perf_counter_ns() - 1))
    for i in range(6):
        rt.open(i)
        if i < 5:
            await rt.next_batch()
    await asyncio.gather(first, *queued)
    assert all("hurry" not in batch and "late" not in batch for batch in rt.batches)
    await b.stop()


async def test_a_queued_request_fails_at_its_deadline_and_never_runs(rt: GatedRuntime) -> None:
    b, _ = await start(rt, max_batch_size=4)
    first = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    # 100 ms: long enough that no pause of a busy machine lets the deadline pass before the
    # request is even queued (that is another error, tested above); the batch ahead is held
    # by the gate, so the request cannot start before its deadline either way.
    doomed = asyncio.create_task(b.submit(
        prio_request("doomed", Priority.INTERACTIVE, time.perf_counter_ns() + 100_000_000)))
    kept = asyncio.create_task(b.submit(make_request(["kept"])))
    with pytest.raises(DeadlineExceeded, match="deadline passed before it could start"):
        await doomed  # fails when its 100 ms are up, while the batch ahead still runs
    assert b.num_waiting == 1
    rt.open(0)
    assert await rt.next_batch() == ["kept"]
    rt.open(1)
    await asyncio.gather(first, kept)
    await b.stop()


async def test_a_handle_cancelled_while_queued_ends_and_frees_its_admission(
        rt: GatedRuntime) -> None:
    b, _ = await start(rt, max_concurrency=2)
    first = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    handle = b.enqueue(make_request(["gone"]))
    assert b.num_admitted == 2
    handle.cancel()  # the caller went away without awaiting
    assert b.num_waiting == 0 and b.num_admitted == 1
    with pytest.raises(asyncio.CancelledError):
        await handle.result()  # a cancelled handle never hangs
    assert b.num_admitted == 1  # released once, not twice
    rt.open(0)
    await first
    assert b.num_admitted == 0
    await b.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_worker_that_dies_mid_batch_fails_its_batch_and_the_queue(
        rt: GatedRuntime) -> None:
    class Died(BaseException):
        """Escapes the worker's error handling, as a thread-killing failure would."""

    def run_batch(batch: Sequence[Prepared]) -> list[np.ndarray]:
        rt.run_batch(batch)
        raise Died

    b = DynamicBatcher("m", run_batch, BatcherConfig())
    b.start()
    running = asyncio.create_task(b.submit(make_request(["running"])))
    await rt.next_batch()
    queued = asyncio.create_task(b.submit(make_request(["queued"])))
    await asyncio.sleep(0)
    rt.open(0)
    for task in (running, queued):
        with pytest.raises(ModelNotReady):
            await asyncio.wait_for(task, WAIT_S)
    assert not b.alive

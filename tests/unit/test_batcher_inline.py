"""A lone request at an idle model runs on the event loop thread (core/inline.py); everything
else still runs in a worker. Where a batch ran is recorded by the runtime itself: no timing."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from sokuji import config as cfg
from sokuji.core.batcher import BatcherConfig, DynamicBatcher
from sokuji.core.inline import LoneCosts
from sokuji.core.request import STAGES, InferenceRequest, Stage, Timeline
from sokuji.errors import RuntimeFailed
from sokuji.repository.models import ModelRepository
from sokuji.runtimes.base import Prepared

FAR_MS = 60_000.0  # a bound no run here comes near, however busy the machine
WAIT_S = 10  # a safety net against hangs; no test relies on it elapsing


class Recorder:
    """Records the thread each batch ran on and its texts; ``sleep_s`` makes each batch take
    at least that long."""

    def __init__(self, sleep_s: float = 0.0) -> None:
        self.calls: list[tuple[int, list[str]]] = []
        self.sleep_s = sleep_s

    def run_batch(self, batch: Sequence[Prepared]) -> list[np.ndarray]:
        texts = [t for p in batch for t in p.data]
        self.calls.append((threading.get_ident(), texts))
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if "boom" in texts:
            raise ZeroDivisionError("runtime bug")
        return [np.asarray([[float(len(t))] for t in p.data]) for p in batch]

    def on_loop(self, index: int) -> bool:
        return self.calls[index][0] == threading.get_ident()


def request(texts: list[str], length: int = 8) -> InferenceRequest:
    prepared = Prepared(data=texts, num_items=len(texts), length=length,
                        num_tokens=length * len(texts))
    return InferenceRequest(model="m", payload=prepared, num_items=len(texts), length=length,
                            timeline=Timeline())


def batcher(rt: Recorder, **kw: object) -> DynamicBatcher:
    kw.setdefault("inline_max_ms", FAR_MS)
    b = DynamicBatcher("m", rt.run_batch, BatcherConfig(**kw))  # type: ignore[arg-type]
    b.start()
    return b


async def test_a_lone_request_runs_on_the_loop_once_its_size_was_measured() -> None:
    rt = Recorder()
    b = batcher(rt)
    assert (await b.submit(request(["first"]))).tolist() == [[5.0]]
    assert not rt.on_loop(0)  # its size class had never run: a worker measures it first
    assert (await b.submit(request(["second"]))).tolist() == [[6.0]]
    assert rt.on_loop(1)
    await b.submit(request(["long one"], length=100))  # another size class: measured first
    assert not rt.on_loop(2)
    await b.submit(request(["long two"], length=120))  # the same class (65 to 128 tokens)
    assert rt.on_loop(3)
    await b.stop()


async def turns(n: int = 3) -> None:
    """Let the event loop go round ``n`` times (scheduling yields, not timed waits)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def held(b: DynamicBatcher) -> None:
    """Measure the size class, then run one request on the loop: the loop has been held."""
    await b.submit(request(["measure"]))
    handle = b.enqueue(request(["held"]))
    assert b.num_waiting == 0 and b.num_running_batches == 0  # it ran before enqueue returned
    await handle.result()


async def test_at_a_fresh_loop_a_lone_request_runs_before_submit_returns() -> None:
    rt = Recorder()
    b = batcher(rt)
    await held(b)
    assert rt.on_loop(1)
    await turns()  # the loop read what arrived meanwhile: nothing
    handle = b.enqueue(request(["next"]))
    assert b.num_waiting == 0 and rt.calls[-1][1] == ["next"] and rt.on_loop(2)
    assert (await handle.result()).tolist() == [[4.0]]
    await b.stop()


async def test_a_burst_read_after_a_run_on_the_loop_forms_one_batch_in_a_worker() -> None:
    rt = Recorder()
    b = batcher(rt, max_batch_size=8)
    await held(b)
    # What arrived while the loop was held is read in one turn: none runs alone.
    handles = [b.enqueue(request([f"r{i}"])) for i in range(4)]
    assert b.num_running_batches == 0 and b.num_waiting == 4  # the start waits one turn
    outs = await asyncio.gather(*(h.result() for h in handles))
    assert [o.tolist() for o in outs] == [[[2.0]]] * 4
    assert rt.calls[2][1] == ["r0", "r1", "r2", "r3"] and not rt.on_loop(2)
    await b.stop()


async def test_a_burst_at_a_fresh_loop_runs_its_first_at_once_and_batches_the_rest() -> None:
    rt = Recorder()
    b = batcher(rt, max_batch_size=8)
    await b.submit(request(["measure"]))
    handles = [b.enqueue(request([f"r{i}"])) for i in range(4)]
    await asyncio.gather(*(h.result() for h in handles))
    assert [texts for _, texts in rt.calls[1:]] == [["r0"], ["r1", "r2", "r3"]]
    assert rt.on_loop(1) and not rt.on_loop(2)
    await b.stop()


async def test_a_size_measured_slower_than_the_bound_stays_in_a_worker() -> None:
    rt = Recorder(sleep_s=0.002)
    b = batcher(rt, inline_max_ms=0.5)  # every batch takes at least 2 ms
    for i in range(3):
        await b.submit(request([f"r{i}"]))
    assert not any(rt.on_loop(i) for i in range(3))
    await b.stop()


@pytest.mark.parametrize("kw", [{"inline_max_ms": 0.0}, {"instances": 2}])
async def test_never_on_the_loop_when_off_or_with_several_instances(kw: dict[str, object]
                                                                    ) -> None:
    rt = Recorder()
    b = batcher(rt, **kw)
    for i in range(3):
        handle = b.enqueue(request([f"r{i}"]))
        assert b.num_running_batches == 1  # dispatched at once, as before: no deferred start
        await handle.result()
    assert not any(rt.on_loop(i) for i in range(3))
    await b.stop()


async def test_a_failure_on_the_loop_fails_only_its_request() -> None:
    rt = Recorder()
    b = batcher(rt)
    await b.submit(request(["ok"]))
    with pytest.raises(RuntimeFailed, match="ZeroDivisionError"):
        await b.submit(request(["boom"]))
    assert rt.on_loop(1)
    assert (await b.submit(request(["fine"]))).tolist() == [[4.0]]
    assert b.alive and b.num_admitted == 0 and b.num_running_batches == 0
    await b.stop()


async def test_a_request_cancelled_before_its_start_never_runs() -> None:
    rt = Recorder()
    b = batcher(rt, max_concurrency=1)
    await held(b)
    handle = b.enqueue(request(["gone"]))
    handle.cancel()
    assert b.num_admitted == 0
    await asyncio.sleep(0)  # the turn in which it would have started
    with pytest.raises(asyncio.CancelledError):
        await handle.result()
    assert len(rt.calls) == 2
    await b.stop()


async def test_a_stop_before_the_start_fails_the_request_and_runs_nothing() -> None:
    rt = Recorder()
    b = batcher(rt)
    await held(b)
    handle = b.enqueue(request(["late"]))
    await b.stop()
    with pytest.raises(RuntimeFailed, match="stopped"):
        await handle.result()
    assert len(rt.calls) == 2


async def test_timeline_stages_tile_a_request_run_on_the_loop() -> None:
    rt = Recorder()
    b = batcher(rt)
    await b.submit(request(["measure"]))
    req = request(["abc"])
    for stage in (Stage.DECODE, Stage.CACHE, Stage.PREPROCESS):
        req.timeline.mark(stage)
    await b.submit(req)
    assert rt.on_loop(1)
    for stage in (Stage.POSTPROCESS, Stage.ENCODE):
        req.timeline.mark(stage)
    tl = req.timeline
    assert set(tl.durations_ns) == set(STAGES)
    assert sum(tl.durations_ns.values()) == tl.total_ns
    assert all(v >= 0 for v in tl.durations_ns.values())
    await b.stop()


def test_lone_costs_by_size_class() -> None:
    costs = LoneCosts()
    assert [costs.size_class(n) for n in (1, 2, 3, 4, 5, 128, 129)] == [0, 1, 2, 2, 3, 7, 8]
    assert costs.expected_s(100) is None and not costs.fits(100, 1.0)  # never measured
    costs.observe(100, 0.010)
    assert costs.expected_s(128) == 0.010 and costs.fits(65, 0.010)
    assert not costs.fits(65, 0.009) and not costs.fits(129, 1.0)
    costs.observe(70, 0.030)  # a moving average: a slow run raises it, one run does not rule
    assert 0.010 < (costs.expected_s(100) or 0) < 0.030
    costs.observe(100, 60.0)  # one stall counts as at most twice the average
    assert (costs.expected_s(100) or 0) < 0.030
    for _ in range(20):  # runs that stay slow move it all the way
        costs.observe(100, 0.5)
    assert (costs.expected_s(100) or 0) > 0.4


async def test_nothing_runs_on_the_loop_while_another_model_has_work() -> None:
    rt = Recorder()
    b = batcher(rt)
    busy = [True]
    b.gate.others_busy = lambda: busy[0]
    await b.submit(request(["measure"]))
    await b.submit(request(["while busy"]))
    assert not rt.on_loop(1)  # another model's replies would have waited for it
    busy[0] = False
    await b.submit(request(["now quiet"]))
    assert rt.on_loop(2)
    await b.stop()


async def test_the_repository_tells_each_encoder_when_the_others_are_busy() -> None:
    models = tuple(cfg.ModelConfig(name=n, runtime="synthetic", options={"base_ms": 0.0})
                   for n in ("a", "b"))
    config = cfg.validate(cfg.ServerConfig(models=models, cache_dir=tempfile.mkdtemp()))
    repo = ModelRepository.load(config)
    repo.start()
    a, b = (repo.models[n].served.batcher for n in ("a", "b"))  # type: ignore[attr-defined]
    assert a.gate.others_busy is not None and not a.gate.others_busy()
    gate = threading.Event()
    b._run_batch = lambda batch: (gate.wait(WAIT_S), [np.zeros((1, 1))])[1]
    handle = b.enqueue(request(["slow"]))
    assert a.gate.others_busy() and not b.gate.others_busy()
    gate.set()
    await handle.result()
    assert not a.gate.others_busy()
    await repo.stop()
    alone = ModelRepository.load(cfg.validate(cfg.ServerConfig(
        models=models[:1], cache_dir=tempfile.mkdtemp())))
    alone.start()
    assert alone.models["a"].served.batcher.gate.others_busy is None  # type: ignore[attr-defined]
    await alone.stop()


async def test_a_request_with_company_runs_in_a_worker_and_batches_with_those_behind() -> None:
    """``InferenceRequest.inline`` False (its front end knew of others on their way: gRPC's,
    ``server/grpc_arrivals.py``): at an idle, fresh loop it still goes to a worker, and the
    requests that come while it runs batch together. Catches: the flag ignored (it would
    run on the loop before enqueue returned)."""
    rt = Recorder(sleep_s=0.05)
    b = batcher(rt)
    await held(b)
    await turns()  # fresh again: a request without company would run on the loop now
    first = request(["first"])
    first.inline = False
    handle = b.enqueue(first)
    assert b.num_waiting == 1  # not run before enqueue returned
    while b.num_running_batches == 0:
        await asyncio.sleep(0.001)
    rest = [b.enqueue(request([f"r{i}"])) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(handle.result(), *(h.result() for h in rest)),
                           WAIT_S)
    assert not rt.on_loop(2) and rt.calls[2][1] == ["first"]
    assert rt.calls[3][1] == ["r0", "r1", "r2"]  # one batch, behind it
    await b.stop()

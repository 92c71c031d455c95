"""One scheduling policy (``core/policy.py``) for both queues: the encoder batcher and the
generation engine follow the same aging rule (0: plain arrival order), the same deadline
meaning (it bounds the start: a running generation is not killed by it), the same
Retry-After estimator; failures of the engine are typed. The engine runs over a stand-in
for llama.cpp: no sleeps, gates instead."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from sokuji.core import policy
from sokuji.core.request import Priority
from sokuji.errors import DeadlineExceeded, ModelNotReady, Overloaded, RuntimeFailed
from sokuji.llm.engine import EngineConfig, GenerationEngine
from sokuji.llm.request import Delta, Finish, GenerationRequest, SamplingParams
from tests.unit.test_batcher import GatedRuntime, make_request, start

WAIT_S = 10  # a safety net against hangs; no test relies on it elapsing
MS = 1_000_000


class FakeLlama:
    """Always generates "a" (greedy); ``gate`` (when set) holds every decode from the
    ``hold_from``-th on until the test opens it; ``broken`` makes decode raise."""

    n_vocab = 4
    eog_ids = np.array([0])

    def __init__(self, slots: int = 1) -> None:
        self.shape = SimpleNamespace(slots=slots)
        self.rows = 0
        self.calls = 0
        self.hold_from: int | None = None
        self.gate = threading.Event()
        self.held = threading.Event()
        self.broken = False

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> int:
        self.calls += 1
        if self.broken:
            raise ZeroDivisionError("a bug inside the engine's step")
        if self.hold_from is not None and self.calls >= self.hold_from:
            self.held.set()
            assert self.gate.wait(WAIT_S)
        self.rows = len(entries)
        return 0

    def logits(self, index: int) -> np.ndarray:
        return np.array([0.0, 2.0, 1.0, 0.0], dtype=np.float32)

    def ban_eog(self, index: int) -> None:
        pass

    def is_eog(self, token: int) -> bool:
        return token == 0

    def piece(self, token: int) -> bytes:
        return b"a"

    def forget(self, seq: int, from_pos: int = 0) -> None:
        pass


def engine(slots: int = 1, **config: object) -> tuple[GenerationEngine, FakeLlama]:
    model = FakeLlama(slots)
    cfg = EngineConfig(prefix_cache_bytes=0, **config)  # type: ignore[arg-type]
    return GenerationEngine("m", model, cfg), model  # type: ignore[arg-type]


def gen_request(loop: asyncio.AbstractEventLoop, priority: Priority = Priority.INTERACTIVE,
                max_tokens: int = 3, deadline_ns: int | None = None) -> GenerationRequest:
    return GenerationRequest("m", [1, 2], SamplingParams(max_tokens=max_tokens, temperature=0),
                             loop, arrival_ns=time.perf_counter_ns(), priority=priority,
                             deadline_ns=deadline_ns)


async def finish_of(req: GenerationRequest) -> tuple[str, Finish]:
    text = []
    async with asyncio.timeout(WAIT_S):
        async for event in req.events():
            if isinstance(event, Delta):
                text.append(event.text)
            else:
                return "".join(text), event
    raise AssertionError("no finish")


# -- the rule itself --------------------------------------------------------------------------
def test_the_aging_rule() -> None:
    assert policy.rank(Priority.BATCH, waited_ns=0, aging_ns=0) == 0  # 0: aged at once
    assert policy.rank(Priority.BATCH, waited_ns=5 * MS, aging_ns=10 * MS) == 1
    assert policy.rank(Priority.BATCH, waited_ns=10 * MS, aging_ns=10 * MS) == 0
    assert policy.rank(Priority.INTERACTIVE, waited_ns=0, aging_ns=10 * MS) == 0
    assert policy.aging_ns(0) == 0 and policy.aging_ns(1.5) == 1_500_000


def test_retry_after_is_queued_work_over_the_drain_rate() -> None:
    assert policy.retry_after_s(6, 0.0) == 1  # not measured yet
    assert policy.retry_after_s(6, 1.0) == 6
    assert policy.retry_after_s(1, 100.0) == 1  # at least a second
    rate = policy.DrainRate(servers=4)
    rate.observe(1, 2.0)  # one server: 0.5/s
    assert rate.per_s == 2.0


# -- priority_aging_ms = 0 means the same in both queues: plain arrival order ----------------
def engine_order(loop: asyncio.AbstractEventLoop, aging_ms: float,
                 waited_ms: tuple[float, float]) -> list[Priority]:
    """Which of a batch-class request (queued ``waited_ms[0]`` ago) and an interactive one
    (``waited_ms[1]`` ago) the engine's one slot takes first, then second."""
    eng, _ = engine(priority_aging_ms=aging_ms)
    now = time.perf_counter_ns()
    batch, inter = gen_request(loop, Priority.BATCH), gen_request(loop, Priority.INTERACTIVE)
    batch.timing.submitted_ns = now - int(waited_ms[0] * MS)
    inter.timing.submitted_ns = now - int(waited_ms[1] * MS)
    eng.queue.waiting = [inter, batch]
    order = []
    for _ in range(2):
        eng._admit(now)
        seq = eng._active.pop()
        eng._free.append(seq.slot)
        order.append(seq.req.priority)
    return order


async def batcher_order(aging_ms: float) -> list[str]:
    rt = GatedRuntime(asyncio.get_running_loop())
    b, _ = await start(rt, max_batch_size=1, priority_aging_ms=aging_ms)
    busy = asyncio.create_task(b.submit(make_request(["busy"])))
    await rt.next_batch()
    low = make_request(["batch"])
    low.priority = Priority.BATCH
    tasks = [asyncio.create_task(b.submit(low))]
    await asyncio.sleep(0)  # (queued first)
    tasks.append(asyncio.create_task(b.submit(make_request(["inter"]))))
    await asyncio.sleep(0)
    order = []
    for i in range(3):
        rt.open(i)
        if i < 2:
            order += await rt.next_batch()
    await asyncio.gather(busy, *tasks)
    await b.stop()
    return order


async def test_aging_zero_is_arrival_order_in_the_batcher_and_the_engine() -> None:
    loop = asyncio.get_running_loop()
    assert await batcher_order(0) == ["batch", "inter"]
    assert engine_order(loop, 0, (2.0, 1.0)) == [Priority.BATCH, Priority.INTERACTIVE]
    # and with aging far away, interactive goes first in both
    assert await batcher_order(60_000) == ["inter", "batch"]
    assert engine_order(loop, 60_000, (2.0, 1.0)) == [Priority.INTERACTIVE, Priority.BATCH]


def test_batch_class_generations_do_not_starve() -> None:
    loop = asyncio.new_event_loop()
    try:
        # The batch-class request has waited past aging (5 ms > 1 ms): it now counts as
        # interactive and, being older, goes before a fresh interactive one.
        assert engine_order(loop, 1, (5.0, 0.0)) == [Priority.BATCH, Priority.INTERACTIVE]
        # Not yet aged: interactive first.
        assert engine_order(loop, 60_000, (5.0, 0.0)) == [Priority.INTERACTIVE,
                                                          Priority.BATCH]
    finally:
        loop.close()


# -- deadlines bound the start -----------------------------------------------------------------
async def test_a_running_generation_is_not_killed_by_its_deadline() -> None:
    loop = asyncio.get_running_loop()
    eng, model = engine()
    model.hold_from = 2  # prefill runs; the first decode step waits for the gate
    eng.start()
    try:
        req = gen_request(loop, max_tokens=5, deadline_ns=time.perf_counter_ns() + 60_000 * MS)
        eng.submit(req)
        assert await asyncio.to_thread(model.held.wait, WAIT_S)
        req.deadline_ns = time.perf_counter_ns() - 1  # its deadline passes while it runs
        model.gate.set()
        text, finish = await finish_of(req)
    finally:
        await eng.stop()
    assert (text, finish.reason, finish.completion_tokens, finish.error) == \
        ("aaaaa", "length", 5, None)


async def test_a_waiting_generation_fails_at_its_deadline_with_a_typed_error() -> None:
    loop = asyncio.get_running_loop()
    eng, model = engine()
    model.hold_from = 1
    eng.start()
    try:
        first = gen_request(loop, max_tokens=2)
        eng.submit(first)
        assert await asyncio.to_thread(model.held.wait, WAIT_S)
        late = gen_request(loop, deadline_ns=time.perf_counter_ns() + 60_000 * MS)
        eng.submit(late)
        late.deadline_ns = time.perf_counter_ns() - 1  # passes while it waits for the slot
        model.gate.set()
        _, finish = await finish_of(late)
        await finish_of(first)
    finally:
        await eng.stop()
    assert finish.reason == "deadline" and isinstance(finish.error, DeadlineExceeded)
    assert "before it could start" in finish.error.message


async def test_a_deadline_the_queue_cannot_meet_is_refused_at_submission() -> None:
    loop = asyncio.get_running_loop()
    eng, model = engine()
    model.hold_from = 1
    eng.start()
    try:
        running, waiting = gen_request(loop), gen_request(loop)
        eng.submit(running)
        assert await asyncio.to_thread(model.held.wait, WAIT_S)
        eng.submit(waiting)
        eng.drain.per_server_s = 1.0  # one generation a second: ~1 s of work ahead
        with pytest.raises(DeadlineExceeded, match="queued ahead"):
            eng.submit(gen_request(loop, deadline_ns=time.perf_counter_ns() + 500 * MS))
        ok = gen_request(loop, deadline_ns=time.perf_counter_ns() + 60_000 * MS)
        eng.submit(ok)  # time enough: admitted
        model.gate.set()
        for req in (running, waiting, ok):
            assert (await finish_of(req))[1].reason == "length"
    finally:
        await eng.stop()


# -- admission and Retry-After: the same estimator ---------------------------------------------
def test_the_engines_retry_after_comes_from_the_measured_drain_rate() -> None:
    loop = asyncio.new_event_loop()
    try:
        eng, _ = engine(max_queue_depth=2)
        eng.queue.waiting = [gen_request(loop), gen_request(loop)]
        with pytest.raises(Overloaded, match="max_queue_depth 2") as err:
            eng.check_capacity()
        assert err.value.retry_after_s == 1  # nothing measured yet
        eng.drain.per_server_s = 0.5  # a generation takes 2 s: 2 queued drain in 4 s
        with pytest.raises(Overloaded) as err:
            eng.check_capacity()
        assert err.value.retry_after_s == 4
        eng, _ = engine(max_queue_depth=10, max_concurrency=2)
        eng.queue.waiting = [gen_request(loop), gen_request(loop)]
        with pytest.raises(Overloaded, match="max_concurrency 2"):
            eng.check_capacity()
    finally:
        loop.close()


async def test_the_engines_retry_after_is_measured_from_finished_generations() -> None:
    """Kills the mutant: deleting ``self.drain.observe(...)`` in ``llm/engine.py``
    ``_finish`` (the rate stays unmeasured: every Retry-After 1). One generation is held
    ``hold_s`` in its decode (a lower bound: the wait never ends early), so the measured
    rate is at most ``1 / hold_s`` and 8 queued generations drain in ``8 * hold_s`` at
    least."""
    hold_s = 0.3
    loop = asyncio.get_running_loop()
    eng, model = engine(max_queue_depth=8)
    model.hold_from = 1
    eng.start()
    try:
        req = gen_request(loop, max_tokens=1)
        eng.submit(req)
        assert await asyncio.to_thread(model.held.wait, WAIT_S)
        await asyncio.sleep(hold_s)
        model.gate.set()
        assert (await finish_of(req))[1].reason == "length"
    finally:
        await eng.stop()
    rate = eng.drain.per_s
    assert 0 < rate <= 1 / hold_s
    eng.queue.waiting = [gen_request(loop) for _ in range(8)]
    with pytest.raises(Overloaded) as err:
        eng.check_capacity()
    assert err.value.retry_after_s == math.ceil(8 / rate) >= math.ceil(8 * hold_s)


# -- failures are typed ------------------------------------------------------------------------
async def test_shutdown_fails_generations_with_model_not_ready() -> None:
    loop = asyncio.get_running_loop()
    eng, model = engine()
    model.hold_from = 1
    eng.start()
    running, waiting = gen_request(loop, max_tokens=50), gen_request(loop)
    eng.submit(running)
    assert await asyncio.to_thread(model.held.wait, WAIT_S)
    eng.submit(waiting)
    stopping = asyncio.create_task(eng.stop())
    await asyncio.sleep(0)
    model.gate.set()
    await stopping
    _, finish = await finish_of(running)
    assert finish.reason == "error" and isinstance(finish.error, ModelNotReady)
    with pytest.raises(ModelNotReady, match="shutting down"):  # result(): the typed error
        await asyncio.wait_for(waiting.result(), WAIT_S)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_bug_in_the_engine_fails_its_requests_and_the_engine_is_no_longer_alive(
        ) -> None:
    loop = asyncio.get_running_loop()
    eng, model = engine()
    model.broken = True
    eng.start()
    assert eng.alive
    req = gen_request(loop)
    eng.submit(req)
    _, finish = await finish_of(req)
    assert finish.reason == "error" and isinstance(finish.error, RuntimeFailed)
    assert eng._thread is not None
    await asyncio.to_thread(eng._thread.join, WAIT_S)
    assert not eng.alive
    with pytest.raises(ModelNotReady):
        eng.submit(gen_request(loop))
    await eng.stop()


@pytest.mark.parametrize(("waiting", "admitted", "depth", "concurrency"), [
    (0, 0, 4, 0), (3, 9, 4, 0), (4, 4, 4, 0), (1, 2, 4, 2), (1, 1, 4, 2), (0, 5, 1, 0)])
def test_the_fast_admission_test_agrees_with_the_check(waiting: int, admitted: int,
                                                       depth: int, concurrency: int) -> None:
    adm = policy.Admission("m", depth, concurrency)
    try:
        adm.check(waiting, admitted, lambda: 0.0, 0.0)
        refused = False
    except Overloaded:
        refused = True
    assert adm.refuses(waiting, admitted) is refused

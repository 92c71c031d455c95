"""sokuji/media/batching.py: StageWorker with a fake run function (gated, no sleeping)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from sokuji.core.request import Priority
from sokuji.errors import DeadlineExceeded, ModelNotReady
from sokuji.media.batching import Item, StageWorker

WAIT_S = 10.0


class Fake:
    """Records batches; the first batch blocks on ``gate`` so later items queue up."""

    def __init__(self, hold_first: bool = True) -> None:
        self.batches: list[list[str]] = []
        self.failed: list[tuple[str, type[BaseException]]] = []
        self.gate = threading.Event()
        self.started = threading.Event()
        self.hold_first = hold_first
        self.cond = threading.Condition()

    def run(self, batch: list[Item]) -> None:
        if not self.batches and self.hold_first:
            self.started.set()
            assert self.gate.wait(WAIT_S)
        with self.cond:
            self.batches.append([i.payload for i in batch])
            self.cond.notify_all()
        if any(i.payload == "explode" for i in batch):
            raise ValueError("bug in a stage")

    def fail(self, items: Sequence[Item], error: BaseException) -> None:
        with self.cond:
            self.failed.extend((i.payload, type(error)) for i in items)
            self.cond.notify_all()

    def wait_for(self, n_batches: int = 0, n_failed: int = 0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.batches) >= n_batches
                                      and len(self.failed) >= n_failed, WAIT_S)


def worker(fake: Fake, **kw: object) -> StageWorker:
    args: dict[str, object] = {"max_items": 4, "max_pixels": None}
    args.update(kw)
    w = StageWorker("test", fake.run, fake.fail, **args)  # type: ignore[arg-type]
    w.start()
    return w


def item(name: str, key: object = "k", width: int = 1, arrival_ns: int = 0,
         priority: Priority = Priority.INTERACTIVE, deadline_ns: int | None = None) -> Item:
    return Item(key, width, name, priority, arrival_ns, deadline_ns)


def blocked(fake: Fake, w: StageWorker) -> None:
    """Occupy the worker with a first item, so later ones queue together."""
    w.put(item("first", key="other"))
    assert fake.started.wait(WAIT_S)


def test_lone_item_runs_at_once() -> None:
    fake = Fake(hold_first=False)
    w = worker(fake)
    try:
        w.put(item("a"))
        fake.wait_for(1)
        assert fake.batches == [["a"]]
    finally:
        w.stop()


def test_equal_keys_batch_different_keys_never_mix() -> None:
    fake = Fake()
    w = worker(fake, max_items=8)
    try:
        blocked(fake, w)
        for i, key in enumerate(["x", "y", "x", "y", "x"]):
            w.put(item(f"{key}{i}", key=key, arrival_ns=i + 1))
        fake.gate.set()
        fake.wait_for(3)
        assert fake.batches[1:] == [["x0", "x2", "x4"], ["y1", "y3"]]
    finally:
        w.stop()


def test_item_and_pixel_budgets() -> None:
    fake = Fake()
    w = worker(fake, max_items=3, max_pixels=1000)
    try:
        blocked(fake, w)
        for i in range(5):
            w.put(item(f"a{i}", width=320, arrival_ns=i + 1))
        w.put(item("big", key="wide", width=5000, arrival_ns=9))
        fake.gate.set()
        fake.wait_for(4)
        # 3 x 320 = 960 fits 1000; then the remaining two; the wide one runs alone over budget
        assert fake.batches[1:] == [["a0", "a1", "a2"], ["a3", "a4"], ["big"]]
        assert max(len(b) for b in fake.batches) <= 3
    finally:
        w.stop()


def test_per_key_limits() -> None:
    fake = Fake()
    w = worker(fake, max_items=8, limits=lambda key: (2, None) if key == "small" else (8, None))
    try:
        blocked(fake, w)
        for i in range(3):
            w.put(item(f"s{i}", key="small", arrival_ns=i + 1))
        fake.gate.set()
        fake.wait_for(3)
        assert fake.batches[1:] == [["s0", "s1"], ["s2"]]
    finally:
        w.stop()


def test_order_by_priority_then_arrival() -> None:
    fake = Fake()
    w = worker(fake, max_items=1, aging_ns=10**15)  # no aging within the test
    try:
        blocked(fake, w)
        now = time.perf_counter_ns()
        w.put(item("batch-old", priority=Priority.BATCH, arrival_ns=now - 3))
        w.put(item("inter-late", arrival_ns=now - 1))
        w.put(item("inter-early", arrival_ns=now - 2))
        fake.gate.set()
        fake.wait_for(4)
        assert fake.batches[1:] == [["inter-early"], ["inter-late"], ["batch-old"]]
    finally:
        w.stop()


def test_aged_batch_item_counts_as_interactive() -> None:
    fake = Fake()
    w = worker(fake, max_items=1, aging_ns=1)
    try:
        blocked(fake, w)
        now = time.perf_counter_ns()
        w.put(item("batch-old", priority=Priority.BATCH, arrival_ns=now - 10**9))
        w.put(item("inter-new", arrival_ns=now))
        fake.gate.set()
        fake.wait_for(3)
        assert fake.batches[1:] == [["batch-old"], ["inter-new"]]
    finally:
        w.stop()


def test_expired_items_fail_without_running() -> None:
    fake = Fake()
    w = worker(fake)
    try:
        blocked(fake, w)
        w.put(item("late", deadline_ns=time.perf_counter_ns() - 1))
        w.put(item("fine", deadline_ns=time.perf_counter_ns() + 60 * 10**9))
        fake.gate.set()
        fake.wait_for(2, 1)
        assert fake.failed == [("late", DeadlineExceeded)]
        assert ["late"] not in fake.batches and fake.batches[1] == ["fine"]
    finally:
        w.stop()


def test_an_item_fails_at_its_deadline_while_the_worker_is_busy() -> None:
    fake = Fake()
    w = worker(fake)
    try:
        blocked(fake, w)
        w.put(item("never-started", deadline_ns=time.perf_counter_ns() + 50 * 10**6))
        fake.wait_for(0, 1)  # while the first batch still holds the worker
        assert fake.failed == [("never-started", DeadlineExceeded)]
        assert fake.batches == [] and w.num_waiting == 0
        fake.gate.set()
        fake.wait_for(1)
        assert fake.batches == [["first"]]
    finally:
        fake.gate.set()
        w.stop()


def test_a_failing_batch_fails_only_its_items_and_the_worker_survives() -> None:
    fake = Fake(hold_first=False)
    w = worker(fake)
    try:
        w.put(item("explode"))
        fake.wait_for(1, 1)
        assert fake.failed == [("explode", ValueError)]
        w.put(item("after"))
        fake.wait_for(2)
        assert fake.batches[-1] == ["after"] and w.alive
    finally:
        w.stop()


def test_stop_fails_waiting_items_and_lets_the_running_batch_finish() -> None:
    fake = Fake()
    w = worker(fake)
    blocked(fake, w)
    w.put(item("waiting"))
    stopper = threading.Thread(target=w.stop)
    stopper.start()
    fake.wait_for(0, 1)
    assert fake.failed == [("waiting", ModelNotReady)]
    fake.gate.set()
    stopper.join(WAIT_S)
    assert not stopper.is_alive() and not w.alive
    assert fake.batches == [["first"]]
    w.put(item("after-stop"))
    assert fake.failed[-1] == ("after-stop", ModelNotReady)


def test_stop_with_drain_runs_what_waits() -> None:
    fake = Fake()
    w = worker(fake, max_items=1)
    blocked(fake, w)
    w.put(item("q1"))
    w.put(item("q2"))
    stopper = threading.Thread(target=w.stop, kwargs={"drain": True})
    stopper.start()
    fake.gate.set()
    stopper.join(WAIT_S)
    assert not stopper.is_alive()
    assert fake.batches == [["first"], ["q1"], ["q2"]] and fake.failed == []


def test_put_from_many_threads() -> None:
    fake = Fake(hold_first=False)
    w = worker(fake, max_items=16)
    try:
        threads = [threading.Thread(target=lambda n=n: [w.put(item(f"{n}-{i}"))
                                                        for i in range(50)])
                   for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        with fake.cond:
            assert fake.cond.wait_for(lambda: sum(map(len, fake.batches)) == 200, WAIT_S)
        names = [n for b in fake.batches for n in b]
        assert sorted(names) == sorted(f"{n}-{i}" for n in range(4) for i in range(50))
        assert all(len(b) <= 16 for b in fake.batches)
    finally:
        w.stop()


def test_invalid_max_items() -> None:
    with pytest.raises(ValueError):
        StageWorker("t", lambda b: None, lambda i, e: None, max_items=0)


def test_put_many_reaches_an_idle_worker_as_one_batch() -> None:
    fake = Fake(hold_first=False)
    w = worker(fake, max_items=8)
    try:
        w.put_many([item(f"c{i}") for i in range(5)])
        fake.wait_for(1)
        assert fake.batches == [["c0", "c1", "c2", "c3", "c4"]]
    finally:
        w.stop()

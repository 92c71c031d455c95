"""``workers = N`` (``sokuji/pycode/pool.py``): a Python model's batches in worker processes,
with the real classes of ``tests/data/pymodels/pool_*.py``: the same results as in a thread,
large arrays through shared memory, workers that crash, hang, raise, grow or fail to set
up, and nothing left behind (no process, no ``/dev/shm`` segment) after a close or after
the server is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sokuji.errors import BadModelOutput, ConfigError, ModelCodeFailed, WorkerLost
from sokuji.pycode import entry, shm
from sokuji.pycode.inthread import ThreadRunner
from sokuji.pycode.pool import ProcessRunner

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "data" / "pymodels"
FAULTY = str(MODELS / "pool_faulty.py") + ":Faulty"
BOUND_S = 30.0
"""What no call here may take (a hang fails the test instead of the suite)."""


def load(target: str) -> entry.UserCode:
    return entry.load(target, "models[0].options.entry")


def pool(target: str = FAULTY, options: dict[str, Any] | None = None, workers: int = 1,
         timeout_ms: float = 0, max_rss_mb: int | None = None, **kw: Any) -> ProcessRunner:
    runner = ProcessRunner(load(target), options or {}, "pymodel", workers, timeout_ms,
                           max_rss_mb, **kw)
    runner.start()
    return runner


def bounded(fn: Callable[[], Any], timeout_s: float = BOUND_S) -> Any:
    """``fn()`` in a thread: its value or its exception; a failure if it never returns."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"the call did not return within {timeout_s} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def until(check: Callable[[], bool], what: str, timeout_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def children(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix))


def echo(x: np.ndarray) -> list[dict[str, Any]]:
    return [{"x": x}]


def act(action: str, **values: Any) -> list[dict[str, Any]]:
    return [{"action": np.array(action), **{k: np.asarray(v) for k, v in values.items()}}]


@pytest.fixture(scope="module")
def two() -> Iterator[ProcessRunner]:
    """Two workers, no timeout: what runs here shares them."""
    runner = pool(options={"scale": 2.0}, workers=2)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def one() -> Iterator[ProcessRunner]:
    """One worker, no timeout: crashed and replaced here."""
    runner = pool(options={"scale": 2.0})
    yield runner
    runner.close()


def test_results_equal_those_of_a_thread(two: ProcessRunner) -> None:
    code = load(FAULTY)
    inthread = ThreadRunner(code, {"scale": 2.0}, "pymodel")
    inthread.start()
    batch = [{"x": np.arange(n, dtype=np.float32)} for n in (1, 5, 300_000)]
    want = inthread.run(batch)
    got = bounded(lambda: two.run(batch))
    assert len(got.results) == len(want.results) == 3
    for g, w in zip(got.results, want.results, strict=True):
        assert g.keys() == w.keys()
        np.testing.assert_array_equal(g["y"], w["y"])
        assert g["y"].dtype == w["y"].dtype and g["label"] == w["label"]
        assert int(g["pid"]) in two.pids and int(w["pid"]) == os.getpid()
    assert [name for name, _ in got.stages] == [name for name, _ in want.stages] == \
        ["scale"] * 3
    inthread.close()


def test_a_large_array_round_trips_exactly_through_shared_memory(two: ProcessRunner) -> None:
    x = np.random.default_rng(7).standard_normal(2 << 20, dtype=np.float32)  # 8 MB
    ran = bounded(lambda: two.run(echo(x)))
    y = ran.results[0]["y"]
    assert y.dtype == np.float32 and y.flags.writeable
    np.testing.assert_array_equal(y, x * np.float32(2.0))
    # it went through the segments, not the pipe: one each way, of 8 MB or more
    sizes = {n: os.path.getsize(os.path.join(shm.SHM_DIR, n)) for n in segments(two.prefix)}
    for way in ("i", "o"):
        assert any(n.split("-")[-1].startswith(way) and size >= x.nbytes
                   for n, size in sizes.items())


def test_two_threads_run_on_two_workers_at_once(two: ProcessRunner, tmp_path: Path) -> None:
    # each batch waits in its worker until both workers have written their mark: one
    # worker after the other would time out in the model (ModelCodeFailed)
    batch = act("meet", dir=str(tmp_path), count=2)
    answers: list[Any] = []
    threads = [threading.Thread(target=lambda: answers.append(two.run(batch)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    assert len(answers) == 2
    assert {int(a.results[0]["pid"]) for a in answers} == set(two.pids)


def test_an_exception_in_predict_fails_that_batch_only(two: ProcessRunner) -> None:
    pids = set(two.pids)
    with pytest.raises(ModelCodeFailed, match="predict raised ValueError") as caught:
        bounded(lambda: two.run(act("raise")))
    assert caught.value.status == 502 and "does not take" not in str(caught.value)
    with pytest.raises(BadModelOutput, match="1 results for a batch of 2"):
        bounded(lambda: two.run(act("count") * 2))
    assert set(two.pids) == pids and two.live_workers == 2  # nobody restarted
    assert bounded(lambda: two.run(echo(np.ones(3)))).results[0]["y"].tolist() == [2.0] * 3


def test_a_batch_that_does_not_pickle_fails_and_the_worker_serves_on(
        two: ProcessRunner) -> None:
    with pytest.raises(ModelCodeFailed, match="cannot be sent to a worker"):
        two.run([{"x": lambda: None}])
    assert two.live_workers == 2
    assert bounded(lambda: two.run(echo(np.ones(2)))).results[0]["y"].tolist() == [2.0] * 2


def test_a_crash_fails_its_batch_while_the_other_worker_serves(two: ProcessRunner) -> None:
    before = set(two.pids)
    with pytest.raises(WorkerLost, match="killed by SIGSEGV") as caught:
        bounded(lambda: two.run(act("segv")))
    assert caught.value.status == 503 and caught.value.headers["retry-after"].isdigit()
    assert two.alive  # the other one is serving while the lost one is replaced
    ran = bounded(lambda: two.run(echo(np.ones(2))))
    assert ran.results[0]["y"].tolist() == [2.0, 2.0]
    until(lambda: two.live_workers == 2, "a replacement is serving")
    assert len(set(two.pids) - before) == 1
    lost = (before - set(two.pids)).pop()
    until(lambda: gone(lost), "the crashed worker is reaped")


@pytest.mark.parametrize(("action", "words"), [("segv", "killed by SIGSEGV"),
                                              ("exit", "exited with status 1")])
def test_the_only_worker_crashes_and_is_replaced(one: ProcessRunner, action: str,
                                                  words: str) -> None:
    until(lambda: one.live_workers == 1, "a worker is serving")
    (first,) = one.pids
    with pytest.raises(WorkerLost, match=words):
        bounded(lambda: one.run(act(action)))
    # no worker live: refused at once (503), never a wait without end
    if not one.alive:
        with pytest.raises(WorkerLost, match="no worker process is live"):
            bounded(lambda: one.run(echo(np.ones(1))), timeout_s=5)
    until(lambda: one.live_workers == 1, "the replacement is serving")
    ran = bounded(lambda: one.run(echo(np.ones(1))))
    assert int(ran.results[0]["pid"]) != first and ran.results[0]["y"].tolist() == [2.0]
    until(lambda: gone(first), "the lost worker is reaped")


def test_a_worker_past_timeout_ms_is_killed_and_replaced() -> None:
    runner = pool(timeout_ms=300)
    try:
        (first,) = runner.pids
        with pytest.raises(WorkerLost, match="ran past timeout_ms = 300"):
            bounded(lambda: runner.run(act("hang")))
        until(lambda: gone(first), "the hung worker is killed")
        until(lambda: runner.live_workers == 1, "the replacement is serving")
        ran = bounded(lambda: runner.run(echo(np.ones(1))))
        assert int(ran.results[0]["pid"]) != first
    finally:
        runner.close()


def test_a_worker_that_exits_in_setup_stops_the_start(tmp_path: Path) -> None:
    runner = ProcessRunner(load(FAULTY), {"exit_in_first_setup": str(tmp_path / "lock")},
                           "pymodel", 2, 0, None)
    with pytest.raises(ConfigError, match=r"model 'pymodel' .*pool_faulty.py:Faulty.*"
                       r"exited with status 3 during setup"):
        bounded(runner.start)
    assert (tmp_path / "lock").exists()  # the other worker set up; it was stopped too
    assert not runner._procs and not runner.alive and runner.live_workers == 0
    assert not segments(runner.prefix)
    runner.close()


def test_an_exception_in_setup_is_the_config_error_of_in_thread_setup() -> None:
    runner = ProcessRunner(load(FAULTY), {"raise_in_setup": True}, "pymodel", 2, 0, None)
    with pytest.raises(ConfigError) as caught:
        bounded(runner.start)
    assert str(caught.value) == ("model 'pymodel' (" + FAULTY + "): setup failed: "
                                 "RuntimeError: no weights at /nowhere")
    assert not runner._procs


def test_a_worker_past_max_rss_mb_is_restarted_between_batches() -> None:
    runner = pool(max_rss_mb=150)
    try:
        (first,) = runner.pids
        ran = bounded(lambda: runner.run(act("alloc", mb=200)))  # its answer still comes
        assert int(ran.results[0]["pid"]) == first
        # the only worker serves on until its replacement is ready: no batch is refused
        pids = set()
        deadline = time.monotonic() + BOUND_S
        while first in pids or not pids or not gone(first):
            assert time.monotonic() < deadline, "the worker past max_rss_mb was not restarted"
            pids = {int(bounded(lambda: runner.run(echo(np.ones(1)))).results[0]["pid"])}
            time.sleep(0.01)
        assert runner.rss_restarts == 1 and runner.lost == 0 and runner.live_workers == 1
    finally:
        runner.close()


def test_streamed_steps_come_as_they_are_yielded_in_the_calling_thread() -> None:
    target = str(MODELS / "pool_stream.py") + ":Steps"
    runner = pool(target)
    inthread = ThreadRunner(load(target), {}, "pymodel")
    inthread.start()
    try:
        x = np.arange(1 << 19, dtype=np.float32)  # 2 MB in the last step, pickled in band
        batch = [{"n": np.array(3), "x": x}, {"n": np.array(1)}]
        seen: list[tuple[int, list[Any]]] = []
        ran = bounded(lambda: runner.stream(batch, lambda s: seen.append(
            (threading.get_ident(), s))))
        want: list[list[Any]] = []
        inthread.stream(batch, want.append)
        assert len(seen) == len(want) == 3
        assert {ident for ident, _ in seen} != {threading.get_ident()}  # bounded's thread
        assert len({ident for ident, _ in seen}) == 1
        for (_, got), exp in zip(seen, want, strict=True):
            assert [g is None for g in got] == [e is None for e in exp]
            assert [int(g["i"]) for g in got if g] == [int(e["i"]) for e in exp if e]
        np.testing.assert_array_equal(seen[-1][1][0]["x"], x)
        assert int(ran.results[1]["i"]) == 0 and int(ran.results[0]["i"]) == 2

        # the caller's emit fails: the stream is stopped, the worker serves the next one
        def refuse(step: list[Any]) -> None:
            raise ConnectionResetError("the client left")

        with pytest.raises(ConnectionResetError):
            bounded(lambda: runner.stream([{"n": np.array(50)}], refuse))
        again: list[list[Any]] = []
        bounded(lambda: runner.stream([{"n": np.array(2)}], again.append))
        assert [int(s[0]["i"]) for s in again] == [0, 1] and runner.lost == 0
    finally:
        runner.close()
        inthread.close()


def test_typed_records_of_the_users_file_cross_both_ways() -> None:
    target = str(MODELS / "pool_typed.py") + ":Typed"
    code = load(target)
    runner = pool(target)
    try:
        point = code.input_type
        ran = bounded(lambda: runner.run([point(x=3.0, y=4.0)]))
        assert isinstance(ran.results[0], code.output_type)
        assert ran.results[0].length == 5.0 and ran.results[0].label == "3.0,4.0"
    finally:
        runner.close()


def test_close_leaves_no_process_and_no_segment() -> None:
    runner = pool(workers=2)
    x = np.ones(1 << 20, np.float32)
    bounded(lambda: runner.run(echo(x)))
    pids = runner.pids
    assert len(pids) == 2 and segments(runner.prefix)
    bounded(runner.close)
    assert all(gone(pid) for pid in pids)
    assert not segments(runner.prefix)
    assert not runner.alive and runner.live_workers == 0
    with pytest.raises(WorkerLost, match="stopping"):
        runner.run(echo(x))
    # what this process still has as children: multiprocessing's fork server and resource
    # tracker, and the module's other pools' workers under the fork server, never these
    for child in children(os.getpid()):
        assert child not in pids


KILLED_SERVER = """
import sys, threading, time
import numpy as np
from sokuji.pycode import entry
from sokuji.pycode.pool import ProcessRunner
code = entry.load(sys.argv[1], "k")
runner = ProcessRunner(code, {}, "m", 2, 0, None)
runner.start()
threading.Thread(target=runner.run, args=([{"action": np.array("hang")}],),
                 daemon=True).start()
time.sleep(0.2)
runner.run([{"x": np.ones(1 << 20, np.float32)}])
print(runner.prefix, *runner.pids, flush=True)
time.sleep(120)
"""


def test_a_server_killed_by_sigterm_leaves_no_worker_behind(tmp_path: Path) -> None:
    # its stderr: the resource tracker's word on the segments it unlinked after the kill
    server = subprocess.Popen([sys.executable, "-c", KILLED_SERVER, FAULTY],
                              stdout=subprocess.PIPE, stderr=(tmp_path / "err").open("w"),
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert server.stdout is not None
        prefix, *raw = server.stdout.readline().split()
        pids = [int(p) for p in raw]
        assert len(pids) == 2 and not any(gone(p) for p in pids)
        helpers = children(server.pid)  # the fork server, the resource tracker
        server.send_signal(signal.SIGTERM)
        assert server.wait(BOUND_S) == -signal.SIGTERM
        # one worker idle (its pipe closed), one in an endless loop (killed with its parent)
        until(lambda: all(gone(p) for p in pids + helpers), "every process of it ended")
        until(lambda: not segments(prefix), "its segments are unlinked")
    finally:
        server.kill()
        server.wait()


def test_the_hand_off_keeps_values_and_grows_its_segment() -> None:
    ours, theirs = Pipe()
    outbox, inbox = shm.Outbox(f"sokuji-{os.getpid()}-test-"), shm.Inbox()

    def through(op: str, value: Any, **kw: Any) -> tuple[str, Any, Any]:
        """Sent from another thread (what is pickled in band fills the pipe), received."""
        sender = threading.Thread(target=shm.send, args=(ours, op, value, outbox), kwargs=kw)
        sender.start()
        got = shm.recv(theirs, inbox)
        sender.join(BOUND_S)
        return got

    try:
        values = {"small": np.arange(4, dtype=np.int16),
                  "big": np.arange(300_000, dtype=np.float64),
                  "fortran": np.asfortranarray(np.arange(200_000.0).reshape(400, 500)),
                  "strided": np.arange(400_000, dtype=np.int32)[::2],
                  "texts": np.array(["a", "bc"], dtype=object), "n": 3, "s": "text"}
        op, got, _ = through("x", values)
        assert op == "x" and got.keys() == values.keys()
        for k, v in values.items():
            if isinstance(v, np.ndarray):
                np.testing.assert_array_equal(got[k], v)
                assert got[k].dtype == v.dtype and got[k].flags.writeable
            else:
                assert got[k] == v
        first = outbox.name
        assert first is not None and os.path.exists(os.path.join(shm.SHM_DIR, first))
        huge = np.ones(3 << 20, np.float32)  # past the first segment: a new one, the old gone
        _, (back,), _ = through("y", [huge])
        np.testing.assert_array_equal(back, huge)
        assert outbox.name != first and not os.path.exists(os.path.join(shm.SHM_DIR, first))
        name = outbox.name
        _, (plain,), _ = through("z", [huge], min_bytes=shm.NEVER)  # plain pickling
        np.testing.assert_array_equal(plain, huge)
        assert outbox.name == name  # the segment was not touched
    finally:
        inbox.close()
        outbox.close()
    assert not segments(f"sokuji-{os.getpid()}-test-")


def test_describe_is_answered_by_a_worker_and_a_failing_one_stops_start_up(
        tmp_path: Path) -> None:
    """``describe()`` with workers: asked of the first set-up instance in the worker (the
    server never builds the class itself); a describe that raises stops start-up there."""
    from sokuji import config as cfg
    from sokuji.repository.models import ModelRepository

    described = "tests.data.pymodels.core_forms:Described"
    config = cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="d", runtime="python",
                                options={"entry": described, "workers": 1}),),
        builtin_pipelines=False, cache_dir=str(tmp_path)))
    repo = ModelRepository.load(config)
    try:
        meta = repo.models["d"].served.metadata
        assert [t.name for t in meta.inputs] == ["x"] and [t.name for t in meta.outputs] == ["y"]
        assert not meta.open
    finally:
        repo.models["d"].served.close()
    bad = tmp_path / "bad_describe.py"
    bad.write_text("class D:\n    def describe(self):\n        raise ValueError('no')\n"
                   "    def predict(self, inputs):\n        return [{} for _ in inputs]\n")
    config = cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="bad", runtime="python",
                                options={"entry": f"{bad}:D", "workers": 1}),),
        builtin_pipelines=False, cache_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"model 'bad'.*describe\(\) failed: ValueError: no"):
        ModelRepository.load(config)

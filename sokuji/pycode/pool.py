"""``workers = N``: a Python model's batches run in N worker processes of its own, so code
that holds the GIL (pure-Python feature code, a rules engine) uses N cores. ``ProcessRunner``
is the same ``Runner`` as ``inthread.py``'s: the model's batcher calls ``run`` (or
``stream``) from its N threads at once, and each call takes a free worker, hands it the
batch, and waits for its answer.

- **Start.** The N workers start at once, through multiprocessing's fork server (never a
  fork of the server itself, which has threads and an event loop), which has imported this
  package and numpy once, so a worker starts in ~5 ms instead of ~150 ms spawned. Each
  worker loads the model's entry itself and sets up one instance (``worker.py``); ``start``
  returns when all are ready, or raises the ``ConfigError`` of the first that failed (its
  setup's traceback's last line, or how it exited) and stops the others.
- **Hand-off.** The batch and the results are pickled; numpy buffers of 128 KB or more go
  through a shared memory segment per worker and direction instead of the pipe
  (``shm.py``, measured in ``benchmarks/python_handoff.py``).
- **A lost worker.** A worker that dies while it runs a batch (a segfault, ``os._exit``, a
  signal) is seen at once (its pipe's end of file or its process sentinel); one that runs
  past ``timeout_ms`` (0: no bound) is sent SIGTERM, then SIGKILL after ``TERM_GRACE_S``.
  Either way that batch raises ``WorkerLost`` (503, Retry-After: about a worker's setup
  time), and a new worker is started in the background (its own setup; after a failed
  setup, again with backoff), while the others go on serving. For a stream the bound is
  per step: a generator may run long, but never ``timeout_ms`` without yielding.
- **No worker live.** ``run`` raises ``WorkerLost`` at once when no worker is live (all are
  being replaced) instead of waiting for one: a replacement's setup may take as long as
  the model's load, and the 503 says when to retry. With a worker live but busy it waits
  for a free one (the batcher runs one thread per worker, so that is a short wait, bounded
  by ``timeout_ms``). ``alive`` (some worker live) and ``live_workers`` are what the
  model's readiness and capacity read.
- **Memory.** With ``max_rss_mb``, a worker whose resident memory (less the hand-off's
  shared memory) is past it after a batch is restarted: that batch's answer is delivered,
  then the worker is stopped and replaced; when it is the only live worker, it goes on
  serving until its replacement is ready, so the model never stops answering for it.
- **Stop.** ``close`` asks every worker to stop (it runs its instance's ``teardown``), kills
  what is left after ``STOP_GRACE_S``, joins them all and unlinks every segment the pool
  and its workers made. A worker also ends when the server does without closing it (it
  exits when its pipe closes, and the kernel kills it when the fork server, its parent,
  exits with the server: ``worker.py``, ``fork_server.py``); ``atexit`` closes every pool
  still open.
- **Scripts.** As with any process not forked from the server, multiprocessing imports a
  script's main module again in each worker: a script that starts a pool keeps its work
  under ``if __name__ == "__main__":`` (``sokuji serve`` and ``python -m sokuji`` do).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import math
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from sokuji.core.backoff import Backoff
from sokuji.errors import ConfigError, ModelCodeFailed, WorkerLost
from sokuji.pycode import shm, worker
from sokuji.pycode.entry import UserCode, last_line
from sokuji.pycode.runner import Emit, Ran

log = logging.getLogger(__name__)

TERM_GRACE_S = 0.5
"""How long a worker sent SIGTERM has before SIGKILL."""
STOP_GRACE_S = 5.0
"""How long ``close`` waits for the workers to stop (a batch to end, ``teardown``)."""
REPLACE_BACKOFF = Backoff(base_s=0.5, cap_s=30.0, jitter=0.2)
"""The wait before trying again to start a worker whose setup failed."""
PRELOAD = ["sokuji.pycode.fork_server", "sokuji.pycode.worker"]
"""What the fork server imports once: its tie to the server's life, and what a worker
needs (numpy with it), so that no worker imports it again."""

_pools: weakref.WeakSet[ProcessRunner] = weakref.WeakSet()
_ids = itertools.count(1)


class _Keeper:
    """The thread that starts multiprocessing's fork server (again, if it was killed) and
    lives as long as the process: the fork server dies with the thread that started it
    (``fork_server.py``), so no shorter-lived thread (a replacement's) may start it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asks: queue.SimpleQueue[tuple[threading.Event, list[BaseException]]] = \
            queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def ensure(self, ctx: Any) -> None:
        """The fork server running, started by the keeper thread."""
        with self._lock:
            if self._thread is None:
                ctx.set_forkserver_preload(PRELOAD)
                self._thread = threading.Thread(target=self._keep, name="sokuji-fork-server",
                                                daemon=True)
                self._thread.start()
        done, errors = threading.Event(), list[BaseException]()
        self._asks.put((done, errors))
        done.wait()
        if errors:
            raise errors[0]

    def _keep(self) -> None:
        from multiprocessing import forkserver

        while True:
            done, errors = self._asks.get()
            try:
                forkserver.ensure_running()
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that asked
                errors.append(exc)
            done.set()


_keeper = _Keeper()


class _Lost(Exception):
    """The worker running a batch is gone (``why``: how, in words)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class _Closed(Exception):
    pass


class _Worker:
    """One worker process and the server's end of it."""

    def __init__(self, wid: int, process: Any, conn: Connection, prefix: str) -> None:
        self.wid = wid
        self.process = process
        self.pid: int = process.pid
        self.conn = conn
        self.prefix = prefix
        self.outbox = shm.Outbox(prefix + "i")  # the batches it is sent
        self.inbox = shm.Inbox()  # its results
        self.lost = False
        self.busy = False
        self.killed = False
        self.retire = False
        """Stop it when it is next free: its replacement is serving."""
        self.replacing = False
        """A replacement is starting for it (it went past ``max_rss_mb``)."""
        self.cleanup = threading.Lock()


class ProcessRunner:
    """A Python model's code in ``workers`` processes (see the module's docstring)."""

    def __init__(self, code: UserCode, options: dict[str, Any], model: str, workers: int,
                 timeout_ms: float, max_rss_mb: int | None, *, key: str = "options.entry",
                 min_bytes: int = shm.MIN_BYTES) -> None:
        if workers < 1:
            raise ValueError("a process pool has at least one worker")
        self.code = code
        self.options = options
        self.model = model
        self.workers = workers
        self.timeout_s = max(0.0, timeout_ms) / 1000.0
        self.max_rss_mb = max_rss_mb
        self.key = key
        self.min_bytes = min_bytes
        self.prefix = f"sokuji-{os.getpid()}-{next(_ids)}-"
        """Every shared memory segment of this pool's is named with it."""
        self.lost = 0
        """Workers lost (crashed, killed past ``timeout_ms``)."""
        self.rss_restarts = 0
        self._ctx = multiprocessing.get_context("forkserver")
        self._entry = _absolute_entry(code)
        self._cv = threading.Condition()
        self._live: list[_Worker] = []
        self._free: deque[_Worker] = deque()
        self._procs: set[_Worker] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._closing = threading.Event()
        self._setup_s = 1.0
        self._wids = itertools.count()
        self._described: Any = None
        """What the last worker set up answered ``describe()`` (None: no describe)."""
        _pools.add(self)

    # -- the Runner contract

    def start(self) -> None:
        """Start the workers at once and wait until each is set up; the first failure's
        ``ConfigError`` (the others stopped) when one is not."""
        t0 = time.monotonic()
        started: list[_Worker] = []
        try:
            for _ in range(self.workers):
                started.append(self._spawn())
            pending = {o: w for w in started for o in (w.conn, w.process.sentinel)}
            ready: set[_Worker] = set()
            while len(ready) < len(started):
                for o in wait(list(pending)):
                    w = pending[o]
                    if w not in ready:
                        self._readiness(w)
                        ready.add(w)
                        del pending[w.conn], pending[w.process.sentinel]
        except BaseException:
            for w in started:
                self._kill(w)
            raise
        self._setup_s = time.monotonic() - t0
        with self._cv:
            self._live.extend(started)
            self._free.extend(started)
            self._cv.notify_all()

    def describe(self) -> Any:
        """The class's ``describe()``, as a worker's set-up instance answered it."""
        return self._described

    @property
    def alive(self) -> bool:
        return bool(self._live) and not self._closed

    @property
    def live_workers(self) -> int:
        """Workers set up and serving (a worker past ``max_rss_mb`` still serving until its
        replacement is ready counts once with it)."""
        return min(len(self._live), self.workers)

    @property
    def pids(self) -> list[int]:
        """The live workers' process ids."""
        return [w.pid for w in list(self._live)]

    def run(self, batch: list[Any]) -> Ran:
        return self._call("run", batch, None)

    def stream(self, batch: list[Any], emit: Emit) -> Ran:
        return self._call("stream", batch, emit)

    def close(self) -> None:
        """Stop every worker (gracefully, then killed), join them, unlink every segment.
        A worker busy with a batch is signalled only: the thread waiting for it sees it
        end (``WorkerLost``) and frees its pipe, which no other thread may close under it."""
        with self._cv:
            self._closed = True
            self._closing.set()
            idle = list(self._free)
            self._free.clear()
            self._live.clear()
            self._cv.notify_all()
        for w in idle:
            with contextlib.suppress(OSError, EOFError, ValueError):
                shm.send(w.conn, "stop", None, None)
        deadline = time.monotonic() + STOP_GRACE_S
        for w in self._snapshot():
            w.process.join(max(0.0, deadline - time.monotonic()))
        for w in self._snapshot():
            if w.busy:
                _signal(w)
            else:
                self._kill(w)
        with self._cv:  # the busy ones' threads free them
            self._cv.wait_for(lambda: not self._procs, timeout=STOP_GRACE_S)
        for t in list(self._threads):
            t.join(STOP_GRACE_S)
        for w in self._snapshot():  # started by a replacement as the pool closed
            self._kill(w)
        shm.unlink_prefix(self.prefix)

    def _snapshot(self) -> list[_Worker]:
        with self._cv:
            return [w for w in self._procs if not w.killed]

    # -- one batch

    def _call(self, op: str, batch: list[Any], emit: Emit | None) -> Ran:
        w = self._take()
        try:
            ran = self._exchange(w, op, batch, emit)
        except _Lost as lost:
            self._lose(w, lost.why)
            raise WorkerLost(f"model '{self.model}': its worker process {lost.why}; a new "
                             "one is starting", retry_after_s=self._retry_after()) from None
        except BaseException:
            self._give_back(w)
            raise
        self._give_back(w)
        return ran

    def _take(self) -> _Worker:
        with self._cv:
            while True:
                if self._closed:
                    raise WorkerLost(f"model '{self.model}' is stopping",
                                     retry_after_s=self._retry_after())
                if self._free:
                    w = self._free.popleft()
                    w.busy = True
                    return w
                if not self._live:
                    raise WorkerLost(f"model '{self.model}': no worker process is live (a "
                                     "new one is starting)", retry_after_s=self._retry_after())
                self._cv.wait()

    def _exchange(self, w: _Worker, op: str, batch: list[Any], emit: Emit | None) -> Ran:
        try:
            shm.send(w.conn, op, batch, w.outbox, self.min_bytes)
        except (EOFError, OSError):
            raise _Lost(self._death(w)) from None
        except Exception as exc:  # noqa: BLE001 - a value in the batch that does not pickle
            raise ModelCodeFailed(f"model '{self.model}': the batch cannot be sent to a worker "
                                  f"process: {last_line(exc)}") from None
        deadline = time.monotonic() + self.timeout_s if self.timeout_s else None
        failed: BaseException | None = None  # what stopped a stream on this side
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not wait([w.conn, w.process.sentinel], timeout):
                with contextlib.suppress(OSError):
                    w.process.terminate()
                raise _Lost(f"ran past timeout_ms = {self.timeout_s * 1000:g} and was "
                            "killed")
            problem: BaseException | None = None
            try:
                if not w.conn.poll():
                    raise EOFError
                reply, value, extra = shm.recv(w.conn, w.inbox)
            except shm.Unreadable as bad:  # read whole: the worker is still in step
                reply, value, extra = bad.op, None, None
                problem = _unreadable(self.model, bad.error)
            except (EOFError, OSError):
                raise _Lost(self._death(w)) from None
            if reply == "step":
                if failed is None:
                    if problem is None and emit is not None:
                        try:
                            emit(value)
                        except BaseException as exc:  # noqa: BLE001 - raised after the stream
                            problem = exc
                    if problem is not None:  # stop the stream; read on to its end
                        failed = problem
                        with contextlib.suppress(OSError, EOFError, ValueError):
                            shm.send(w.conn, "cancel", None, None)
                if deadline is not None:
                    deadline = time.monotonic() + self.timeout_s
                continue
            if failed is not None or problem is not None:
                raise failed or problem  # type: ignore[misc]
            if reply == "error":
                raise value
            return Ran(value if reply == "done" else [None] * len(batch), extra or [])

    def _death(self, w: _Worker) -> str:
        w.process.join(TERM_GRACE_S)  # it has exited (or is about to): its status
        return _exit_words(w.process.exitcode)

    # -- workers coming and going

    def _spawn(self) -> _Worker:
        """A new worker process, started (not yet set up)."""
        wid = next(self._wids)
        prefix = f"{self.prefix}{wid}-"
        spec = worker.Spec(entry=self._entry, key=self.key, options=self.options,
                           model=self.model, sys_path=_sys_path(), cwd=os.getcwd(),
                           prefix=prefix + "o", min_bytes=self.min_bytes)
        _keeper.ensure(self._ctx)
        ours, theirs = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=worker.main, args=(theirs, spec),
                                    name=f"sokuji-{self.model}-{wid}")
        process.start()
        theirs.close()
        w = _Worker(wid, process, ours, prefix)
        with self._cv:
            closed = self._closed
            if not closed:
                self._procs.add(w)
        if closed:
            self._kill(w)
            raise _Closed
        return w

    def _readiness(self, w: _Worker) -> None:
        """Once its pipe or its sentinel is ready: return when it is set up, else raise the
        ``ConfigError`` of its setup."""
        if w.conn.poll():
            try:
                op, value, _ = shm.recv(w.conn, w.inbox)
            except (EOFError, OSError):
                op, value = "", None
            if op == "ready":
                self._described = value[1]
                return
            if op == "setup_failed":
                self._kill(w)
                raise value
        why = self._death(w)
        self._kill(w)
        raise ConfigError(f"model '{self.model}' ({self.code.entry}): a worker process "
                          f"{why} during setup")

    def _lose(self, w: _Worker, why: str) -> None:
        with self._cv:
            w.lost = True
            w.busy = False
            if w in self._live:
                self._live.remove(w)
            replace = not self._closed and not w.replacing
            self.lost += 1
            self._cv.notify_all()
        log.warning("model %s: worker process %d (pid %d) %s%s", self.model, w.wid, w.pid, why,
                    "; starting a new one" if replace else "")
        self._background(self._kill, w)
        if replace:
            self._background(self._replace, None)

    def _give_back(self, w: _Worker) -> None:
        over = self.max_rss_mb is not None and (_rss_mb(w.pid) or 0.0) > self.max_rss_mb
        stop = replace = False
        old: _Worker | None = None
        with self._cv:
            w.busy = False
            if self._closed or w.retire:
                stop = True
            elif over and not w.replacing:
                self.rss_restarts += 1
                replace = True
                if len(self._live) > 1:
                    stop = True
                else:  # the only one: serve on until the replacement is ready
                    w.replacing = True
                    old = w
                    self._free.append(w)
            else:
                self._free.append(w)
            if stop and w in self._live:
                self._live.remove(w)
            self._cv.notify_all()
        if over:
            log.warning("model %s: worker process %d (pid %d) is past max_rss_mb = %d; "
                        "restarting it", self.model, w.wid, w.pid, self.max_rss_mb)
        if stop:
            self._background(self._stop, w)
        if replace:
            self._background(self._replace, old)

    def _replace(self, old: _Worker | None) -> None:
        """Start a worker (again after a failed setup, with backoff) and put it to work;
        then retire ``old``, which served until now."""
        failures = 0
        while not self._closing.is_set():
            t0 = time.monotonic()
            try:
                w = self._spawn()
            except _Closed:
                return
            except Exception:
                log.exception("model %s: a worker process cannot be started", self.model)
            else:
                try:
                    wait([w.conn, w.process.sentinel])
                    self._readiness(w)
                except ConfigError as exc:
                    log.error("model %s: a new worker process failed: %s", self.model, exc)
                else:
                    self._setup_s = time.monotonic() - t0
                    self._enlist(w, old)
                    return
            failures += 1
            self._closing.wait(REPLACE_BACKOFF.delay_s(failures))

    def _enlist(self, w: _Worker, old: _Worker | None) -> None:
        retire = None
        with self._cv:
            if self._closed:
                retire = w
            else:
                self._live.append(w)
                self._free.append(w)
                if old is not None and not old.lost:
                    if old in self._free:
                        self._free.remove(old)
                        self._live.remove(old)
                        retire = old
                    else:
                        old.retire = True
                self._cv.notify_all()
        log.info("model %s: worker process %d (pid %d) is serving", self.model, w.wid, w.pid)
        if retire is not None:
            self._stop(retire)

    def _stop(self, w: _Worker) -> None:
        """A free worker asked to stop, given ``STOP_GRACE_S``, then killed."""
        with contextlib.suppress(OSError, EOFError, ValueError):
            shm.send(w.conn, "stop", None, None)
        w.process.join(STOP_GRACE_S)
        self._kill(w)

    def _kill(self, w: _Worker) -> None:
        """End the process (SIGTERM, then SIGKILL), join it, free its pipe and segments."""
        with w.cleanup:
            if w.killed:
                return
            w.killed = True
            process = w.process
            if process.is_alive():
                with contextlib.suppress(OSError):
                    process.terminate()
                process.join(TERM_GRACE_S)
                if process.is_alive():
                    with contextlib.suppress(OSError):
                        process.kill()
            process.join()
            with contextlib.suppress(OSError):
                w.conn.close()
            w.outbox.close()
            w.inbox.close()
            shm.unlink_prefix(w.prefix)
            with contextlib.suppress(ValueError):
                process.close()
        with self._cv:
            self._procs.discard(w)
            self._cv.notify_all()

    def _background(self, fn: Any, *args: Any) -> None:
        def body() -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("model %s: a worker's upkeep failed", self.model)
            finally:
                with self._cv:
                    self._threads.discard(thread)

        thread = threading.Thread(target=body, name=f"sokuji-pool-{self.model}", daemon=True)
        with self._cv:
            self._threads.add(thread)
        thread.start()

    def _retry_after(self) -> int:
        return max(1, math.ceil(self._setup_s))


def _unreadable(model: str, exc: BaseException) -> Exception:
    from sokuji.errors import BadModelOutput

    return BadModelOutput(f"model '{model}': a result from the worker process cannot be read "
                          f"in the server: {last_line(exc)}")


def _signal(w: _Worker) -> None:
    """SIGTERM, then SIGKILL after ``TERM_GRACE_S``; no join, nothing closed."""
    process = w.process
    with contextlib.suppress(OSError, ValueError):
        process.terminate()
        process.join(TERM_GRACE_S)
        if process.is_alive():
            process.kill()


def _exit_words(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _absolute_entry(code: UserCode) -> str:
    """The entry as a worker loads it: a file entry by the absolute path of the module the
    server loaded (a relative path was relative to the config's directory)."""
    where, _, name = code.entry.rpartition(":")
    if not where.endswith(".py"):
        return code.entry
    module = sys.modules.get(getattr(code.target, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    return f"{os.path.abspath(path)}:{name}" if path else code.entry


def _sys_path() -> list[str]:
    """The server's ``sys.path`` for a worker: relative folders made absolute, entries that
    are no folder (an editable install's path hook) kept as they are."""
    return [os.getcwd() if not p else os.path.abspath(p)
            if not os.path.isabs(p) and os.path.isdir(p) else p for p in sys.path]


def _rss_mb(pid: int) -> float | None:
    """A process's resident memory less its shared memory (the hand-off's segments), MB."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines()
                          if b":" in line)
        rss = int(fields[b"VmRSS"].split()[0]) - int(fields.get(b"RssShmem", b"0").split()[0])
        return rss / 1024.0
    except (OSError, KeyError, ValueError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    try:
        info = psutil.Process(pid).memory_info()
        return float(info.rss - getattr(info, "shared", 0)) / (1 << 20)
    except psutil.Error:
        return None


@atexit.register
def _close_all() -> None:
    """Every pool still open at exit closed (before multiprocessing's own exit function,
    registered earlier, joins the children)."""
    for pool in list(_pools):
        with contextlib.suppress(Exception):
            pool.close()

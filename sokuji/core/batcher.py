"""Dynamic batching for one model: one queue, work-conserving, length-aware.

Contracts:
- **Work-conserving.** When a model instance is free and nothing else runs, the queued requests
  start at once (those read in the same turn of the event loop together): low load pays no
  batching delay. Requests that arrive while a batch runs form the next batch.
  ``max_queue_delay_ms`` only applies while another instance of the same model is busy
  (``instances > 1``): then a partial batch waits at most that long for company.
- **Batches** hold at most ``max_batch_size`` items and ``max_batch_tokens`` padded positions,
  formed around the request that goes first, length-aware or first-come (``core/forming.py``).
- **Scheduling policy** (``core/policy.py``, shared with the generation engine): admission
  (``max_queue_depth``, ``max_concurrency``: ``Overloaded`` at once, Retry-After from the
  measured drain rate), priorities with aging, and deadlines that bound the start (a request
  that cannot start in time is refused, one still queued at its deadline is failed then and
  never takes a batch slot). Work here is counted in items.
- **Where a batch runs.** In a worker thread (``core/workers.py``), so the event loop stays
  free, except a lone request at an idle model whose size was measured to run within
  ``inline_max_ms`` (``core/inline.py``): it runs on the event loop thread itself, with no
  thread hand-off. Requests that arrive meanwhile wait in the socket buffers; they are read
  together afterwards and form the next batch, in a worker.
- **A model whose ``run_batch`` is a coroutine function** (``async def``: code that awaits
  I/O) runs its batches as tasks on the event loop instead (``core/loop_runs.py``), up to
  ``instances`` at once; one whose every request went away is cancelled.
- Results come back in the order of each request's items. A failing batch fails only its own
  requests.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from sokuji.core import forming, policy
from sokuji.core.batcher_config import BatcherConfig
from sokuji.core.forming import BatchInfo
from sokuji.core.inline import LoopGate
from sokuji.core.loop_runs import LoopRuns
from sokuji.core.model import NOTHING, Report
from sokuji.core.request import InferenceRequest, Prepared, Stage
from sokuji.core.slo_admission import TimeAdmission
from sokuji.core.workers import Workers
from sokuji.errors import DeadlineExceeded, ModelNotReady, RuntimeFailed, SokujiError

log = logging.getLogger(__name__)

RunBatch = Callable[[Sequence[Prepared]], list[Any] | Awaitable[list[Any]]]


class _Entry:
    """A queued request, and its caller's handle (``core.model.Submission``)."""

    __slots__ = ("batcher", "dispatched_ns", "future", "released", "request", "timer", "waits")

    def __init__(self, batcher: DynamicBatcher, request: InferenceRequest,
                 future: asyncio.Future[Any]) -> None:
        self.batcher = batcher
        self.request = request
        self.future = future
        self.timer: asyncio.TimerHandle | None = None
        self.dispatched_ns = 0
        self.released = False
        self.waits = False
        """It found the model idle: its start is deferred by one turn of the loop."""

    async def result(self) -> Any:
        """The runtime's output for the request's items, in their order."""
        try:
            if self.waits:
                # Yield once: the deferred start (scheduled before) runs first, so a lone
                # request run on the loop is already done when this resumes (no second turn).
                await asyncio.sleep(0)
            return await self.future
        except asyncio.CancelledError:
            self.cancel()
            raise
        finally:
            self._release()

    async def events(self) -> AsyncIterator[Any]:
        yield await self.result()

    @property
    def report(self) -> Report:
        """Its input tokens (built when asked: most requests never ask)."""
        tokens = self.request.num_tokens
        return Report(input_tokens=tokens) if tokens else NOTHING

    def cancel(self) -> None:
        """Leave the queue if still in it, so ``result()`` raises ``CancelledError`` (a batch
        already running finishes); either way the request stops counting as admitted."""
        queue_ = self.batcher._queue
        if self in queue_:
            queue_.remove(self)
            if not self.future.done():
                self.future.cancel()
        self._release()
        runs = self.batcher._workers
        if isinstance(runs, LoopRuns) and self.dispatched_ns:
            runs.drop_unwanted()  # its batch, on the loop, may now be wanted by nobody

    def _release(self) -> None:
        """Once per request: it no longer counts toward ``max_concurrency``."""
        if not self.released:
            self.released = True
            self.batcher._admitted -= 1
            if self.timer is not None:
                self.timer.cancel()


class DynamicBatcher:
    """Batches are formed synchronously, the moment something can run: one turn of the loop
    after a request arrives at an idle model, and when a running batch completes. No
    scheduler task sits between a request and its worker thread."""

    def __init__(self, name: str, run_batch: RunBatch, config: BatcherConfig,
                 on_batch: Callable[[BatchInfo], None] | None = None) -> None:
        self.name = name
        self.config = config
        self._run_batch = run_batch
        self._on_batch = on_batch
        self._queue: list[_Entry] = []
        self._busy = 0
        self._slot_free_since_ns = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_loop = inspect.iscoroutinefunction(run_batch)
        """Its batches are tasks on the event loop (``core/loop_runs.py``), not threads'."""
        self._workers: Workers[list[_Entry]] | LoopRuns[list[_Entry]] = \
            LoopRuns(name, self._await_entries, self._complete) if self.on_loop else \
            Workers(name, config.instances, config.worker_nice, self._run_entries,
                    self._complete, self._fail_stranded)
        self._timer: asyncio.TimerHandle | None = None
        self._start_pending = False
        """A deferred start of an idle model is scheduled (``_start_idle``)."""
        self.gate = LoopGate(config.inline_max_ms / 1e3
                             if config.instances == 1 and not self.on_loop else 0.0)
        """When a lone request runs on the event loop (``core/inline.py``)."""
        self._idle = asyncio.Event()
        self._admitted = 0
        self._admission = policy.Admission(name, config.max_queue_depth,
                                           config.max_concurrency)
        self._drain = policy.DrainRate(config.instances)  # items/s
        self._aging_ns = policy.aging_ns(config.priority_aging_ms)
        self.by_time = TimeAdmission(name, config.slo, config.instances) if config.slo \
            else None

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_running_batches(self) -> int:
        return self._busy

    @property
    def num_admitted(self) -> int:
        """Requests submitted and not yet answered (queued or running)."""
        return self._admitted

    @property
    def alive(self) -> bool:
        """Started, and every worker thread is alive."""
        return self._loop is not None and self._workers.alive

    @property
    def drain_items_per_s(self) -> float:
        """Measured rate at which the queue drains (all instances); 0 before any batch ran."""
        return self._drain.per_s

    def queued_items(self) -> int:
        return sum(e.request.num_items for e in self._queue)

    def check_capacity(self) -> None:
        """Raise ``Overloaded`` if a request arriving now would be refused: callable before
        the request is even read, so a refusal costs next to nothing."""
        adm, waiting = self._admission, len(self._queue)
        if adm.refuses(waiting, self._admitted):  # else nothing more to compute
            adm.check(waiting, self._admitted, self.queued_items, self._drain.per_s)
        if self.by_time is not None and self._queue:
            self.by_time.check_early((e.request for e in self._queue), time.perf_counter_ns())

    def _admit(self, request: InferenceRequest, now_ns: int) -> None:
        self.check_capacity()
        if request.deadline_ns is not None:
            rate = self._drain.per_s
            ahead = sum(e.request.num_items for e in self._queue
                        if e.request.priority <= request.priority) if rate > 0 else 0
            policy.check_deadline(request.deadline_ns, now_ns, ahead, rate,
                                  saturated=self._busy >= self.config.instances)
        if self.by_time is not None:
            self.by_time.admit(request, (e.request for e in self._queue), now_ns)

    def start(self) -> None:
        """Start the worker threads; call from the event loop that will submit requests."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._slot_free_since_ns = time.perf_counter_ns()
        self._idle.set()
        self._workers.start(self._loop)

    async def stop(self) -> None:
        """Stop taking requests; let running batches finish; fail what is still queued."""
        if self._loop is None:
            return
        self._loop = None
        if self._timer is not None:
            self._timer.cancel()
        for entry in self._queue:
            if not entry.future.done():
                entry.future.set_exception(RuntimeFailed(f"model '{self.name}' stopped"))
        self._queue.clear()
        await self._idle.wait()
        self._workers.stop()

    def enqueue(self, request: InferenceRequest) -> _Entry:
        """Admit and queue ``request`` (``Overloaded``, ``DeadlineExceeded`` at once);
        its handle's ``result()`` must then be awaited (already done if the request ran on
        the loop, ``core/inline.py``)."""
        loop = self._loop
        if loop is None:
            raise RuntimeFailed(f"model '{self.name}' is not running")
        now_ns = time.perf_counter_ns()
        self._admit(request, now_ns)
        entry = _Entry(self, request, loop.create_future())
        request.enqueued_ns = request.timeline.last_ns
        if request.deadline_ns is not None:
            entry.timer = loop.call_later((request.deadline_ns - now_ns) / 1e9,
                                          self._expire, entry)
        self._queue.append(entry)
        self._admitted += 1
        if self._busy or not self.gate.limit_s:
            self._dispatch()
        elif self.gate.fresh and len(self._queue) == 1 and self._fits(request):
            self._run_inline()  # the handle's result is ready when this returns
        else:  # idle, but the loop was just held (or others queued in this turn): a burst is
            entry.waits = True  # read in one turn and forms one batch (``LoopGate.held``)
            if not self._start_pending:
                self._start_pending = True
                loop.call_soon(self._start_idle)
        return entry

    def _fits(self, request: InferenceRequest) -> bool:
        return request.inline and self.gate.allows(request.num_items * request.length)

    async def submit(self, request: InferenceRequest) -> Any:
        """Queue ``request``; return the runtime's output for its items, in their order."""
        return await self.enqueue(request).result()

    def _expire(self, entry: _Entry) -> None:
        """A queued request's deadline passed: fail it now rather than compute it late."""
        if entry in self._queue and not entry.future.done():
            self._queue.remove(entry)
            waited_ms = (time.perf_counter_ns() - entry.request.enqueued_ns) / 1e6
            entry.future.set_exception(DeadlineExceeded(
                f"waited {waited_ms:.0f} ms in the queue; the deadline passed before it "
                "could start"))

    def _dispatch(self) -> None:
        """Hand batches to free instances while there is work; never waits."""
        while self._queue and self._busy < self.config.instances:
            if self._busy and self.queued_items() < self.config.max_batch_size:
                # Another instance is busy: a partial batch waits a bounded time for company.
                deadline_ns = self._queue[0].request.enqueued_ns \
                    + int(self.config.max_queue_delay_ms * 1e6)
                wait_s = (deadline_ns - time.perf_counter_ns()) / 1e9
                if wait_s > 0:
                    if self._timer is None and self._loop is not None:
                        self._timer = self._loop.call_later(wait_s, self._on_timer)
                    return
            batch = self._form_batch()
            if not batch:
                return
            self._busy += 1
            self._idle.clear()
            self._workers.submit(batch)

    def _start_idle(self) -> None:
        """The deferred start of an idle model: on the loop, or in a worker as usual."""
        self._start_pending = False
        if self._loop is None or self._busy:
            return
        if len(self._queue) == 1 and self._fits(self._queue[0].request):
            self._run_inline()
        else:
            self._dispatch()

    def _run_inline(self) -> None:
        """Run the one queued request on this, the event loop's, thread."""
        batch = self._form_batch()
        if not batch:
            return
        self._busy += 1
        self._idle.clear()
        outputs: list[Any] | None = None
        error: BaseException | None = None
        start_ns = time.perf_counter_ns()
        try:
            outputs = self._run_entries(batch)
        except Exception as exc:  # noqa: BLE001 - delivered to the request, as from a worker
            error = exc
        except BaseException as exc:  # interrupted: answer the request, then propagate
            self._complete(batch, None, exc, time.perf_counter_ns(), 0)
            raise
        finally:
            self.gate.held(self._loop)
        done_ns = time.perf_counter_ns()
        self._complete(batch, outputs, error, done_ns, done_ns - start_ns)

    def _run_entries(self, batch: list[_Entry]) -> list[Any]:
        return self._run_batch([e.request.payload for e in batch])  # type: ignore[return-value]

    async def _await_entries(self, batch: list[_Entry]) -> list[Any]:
        return await self._run_batch([e.request.payload  # type: ignore[misc]
                                      for e in batch])

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def _form_batch(self) -> list[_Entry]:
        """Take the next batch out of the queue (``core/forming.py``) and stamp its start."""
        live = [e for e in self._queue if not e.future.done()]
        if not live:
            self._queue.clear()
            return []
        cfg, budget = self.config, self.config.max_batch_tokens
        cap = self.by_time.batch_cap() if self.by_time is not None else None
        choice = forming.choose([e.request for e in live], cfg.policy, cfg.max_batch_size,
                                budget if cap is None else min(budget, cap), self._aging_ns,
                                time.perf_counter_ns(), cfg.preferred_batch_sizes)
        chosen = [live[i] for i in choice.indices]
        if len(chosen) == len(live):
            self._queue = []
        else:
            taken = set(choice.indices)
            self._queue = [e for i, e in enumerate(live) if i not in taken]
        items, longest = choice.items, choice.longest

        dispatch_ns = time.perf_counter_ns()
        for entry in chosen:
            entry.dispatched_ns = dispatch_ns
            if entry.timer is not None:
                entry.timer.cancel()
                entry.timer = None
            tl = entry.request.timeline
            tl.mark(Stage.QUEUE, max(entry.request.enqueued_ns, self._slot_free_since_ns))
            tl.mark(Stage.BATCH, dispatch_ns)
        if self.by_time is not None:
            self.by_time.dispatched(id(chosen), [e.request for e in chosen], dispatch_ns)
        if self._on_batch is not None and self._loop is not None:
            # Published a turn later: metrics never delay a batch (nor, on the loop, a reply).
            self._loop.call_soon(self._on_batch, BatchInfo(
                num_requests=len(chosen), num_items=items, padded_tokens=items * longest,
                real_tokens=sum(e.request.payload.num_tokens for e in chosen
                                if isinstance(e.request.payload, Prepared))))
        return chosen

    def _fail_stranded(self, batch: list[_Entry] | None) -> None:
        """A worker died: its batch in flight and the queue fail with 503 instead of
        waiting for nobody."""
        error = ModelNotReady(f"model '{self.name}': a worker thread died")
        for entry in (*(batch or ()), *self._queue):
            if not entry.future.done():
                entry.future.set_exception(error)
        self._queue.clear()
        if batch:
            self._busy -= 1
            if self._busy == 0:
                self._idle.set()

    def _complete(self, batch: list[_Entry], outputs: list[Any] | None,
                  error: BaseException | None, done_ns: int, ran_ns: int) -> None:
        if error is None and outputs is not None and len(outputs) != len(batch):
            error = RuntimeFailed(f"model '{self.name}' returned {len(outputs)} outputs "
                                  f"for a batch of {len(batch)} requests")
        if self.by_time is not None:
            self.by_time.completed(id(batch), [e.request for e in batch], done_ns,
                                   error is None)
        if isinstance(error, asyncio.CancelledError):  # dropped on the loop: wanted by nobody
            for entry in batch:
                if not entry.future.done():
                    entry.future.cancel()
        elif error is not None:
            if not isinstance(error, SokujiError):
                log.error("model %s: run_batch raised %r", self.name, error, exc_info=error)
                error = RuntimeFailed(f"model '{self.name}' failed: {error!r}")
            for entry in batch:
                if not entry.future.done():
                    entry.future.set_exception(error)
        else:
            assert outputs is not None
            seconds = (done_ns - batch[0].dispatched_ns) / 1e9
            items = sum(e.request.num_items for e in batch)
            self._drain.observe(items, seconds)
            if len(batch) == 1:
                self.gate.costs.observe(items * batch[0].request.length, ran_ns / 1e9)
            for entry, output in zip(batch, outputs, strict=True):
                if not entry.future.done():
                    entry.request.timeline.mark(Stage.INFER, done_ns)
                    entry.future.set_result(output)
        self._busy -= 1
        self._slot_free_since_ns = time.perf_counter_ns()
        if self._busy == 0:
            self._idle.set()
        if self._loop is not None:
            self._dispatch()

"""Dynamic batching for one model: one queue, work-conserving, length-aware.

Contracts:
- **Work-conserving.** When a model instance is free and nothing else runs, the queued requests
  start at once: low load pays no batching delay. Requests that arrive while a batch runs form
  the next batch. ``max_queue_delay_ms`` only applies while another instance of the same model
  is busy (``instances > 1``): then a partial batch waits at most that long for company.
- **Bounded batches.** A batch holds at most ``max_batch_size`` items and at most
  ``max_batch_tokens`` padded positions (items x longest length). A single request larger than
  the token budget still runs, alone.
- **Length-aware forming** (policy ``length``): the oldest queued request always goes into the
  next batch (so no request waits behind more than the queue ahead of it: no starvation), and
  the rest of the batch is filled with the queued requests closest to it in length, which keeps
  padding low. Policy ``fifo`` takes requests strictly in arrival order.
- **Scheduling policy** (``core/policy.py``, shared with the generation engine): admission
  (``max_queue_depth``, ``max_concurrency``: ``Overloaded`` at once, Retry-After from the
  measured drain rate), priorities with aging, and deadlines that bound the start (a request
  that cannot start in time is refused, one still queued at its deadline is failed then and
  never takes a batch slot). Work here is counted in items.
- Results come back in the order of each request's items. A failing batch fails only its own
  requests. ``run_batch`` runs in a worker thread, so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from sokuji.config import BatchPolicy, ModelConfig
from sokuji.core import policy
from sokuji.core.request import InferenceRequest, Prepared, Stage
from sokuji.errors import DeadlineExceeded, ModelNotReady, RuntimeFailed, SokujiError

log = logging.getLogger(__name__)

RunBatch = Callable[[Sequence[Prepared]], list[Any]]


_MODEL = ModelConfig(name="-")  # the defaults, declared once in sokuji.config's schema


@dataclass(frozen=True)
class BatcherConfig:
    """The batcher's share of a ``ModelConfig`` (``from_model``); defaults are the schema's."""

    max_batch_size: int = _MODEL.max_batch_size
    max_batch_tokens: int = _MODEL.max_batch_tokens
    max_queue_delay_ms: float = _MODEL.max_queue_delay_ms
    policy: BatchPolicy = _MODEL.batching
    instances: int = _MODEL.instances
    max_queue_depth: int = _MODEL.max_queue_depth
    max_concurrency: int = _MODEL.max_concurrency
    """Requests admitted (queued or running) at once; 0: bounded by the queue depth only."""
    priority_aging_ms: float = _MODEL.priority_aging_ms
    worker_nice: int = 5
    """Niceness added to the worker threads (Linux), so the event loop wins the CPU."""

    @classmethod
    def from_model(cls, mc: ModelConfig) -> BatcherConfig:
        """Every field but ``policy`` (``batching`` there) and ``worker_nice`` is named as in
        ``ModelConfig``."""
        same = {f.name for f in fields(cls)} - {"policy", "worker_nice"}
        return cls(policy=mc.batching, **{name: getattr(mc, name) for name in same})


@dataclass(frozen=True)
class BatchInfo:
    """What one dispatched batch looked like; published as metrics."""

    num_requests: int
    num_items: int
    padded_tokens: int
    real_tokens: int


class _Entry:
    """A queued request, and its caller's handle (``core.model.Submission``)."""

    __slots__ = ("batcher", "dispatched_ns", "future", "released", "request", "timer")

    def __init__(self, batcher: DynamicBatcher, request: InferenceRequest,
                 future: asyncio.Future[Any]) -> None:
        self.batcher = batcher
        self.request = request
        self.future = future
        self.timer: asyncio.TimerHandle | None = None
        self.dispatched_ns = 0
        self.released = False

    async def result(self) -> Any:
        """The runtime's output for the request's items, in their order."""
        try:
            return await self.future
        except asyncio.CancelledError:
            self.cancel()
            raise
        finally:
            self._release()

    async def events(self) -> AsyncIterator[Any]:
        yield await self.result()

    def cancel(self) -> None:
        """Leave the queue if still in it, so ``result()`` raises ``CancelledError`` (a batch
        already running finishes); either way the request stops counting as admitted."""
        queue_ = self.batcher._queue
        if self in queue_:
            queue_.remove(self)
            if not self.future.done():
                self.future.cancel()
        self._release()

    def _release(self) -> None:
        """Once per request: it no longer counts toward ``max_concurrency``."""
        if not self.released:
            self.released = True
            self.batcher._admitted -= 1
            if self.timer is not None:
                self.timer.cancel()


class DynamicBatcher:
    """Batches are formed synchronously, the moment something can run: when a request arrives
    at an idle model, and when a running batch completes. No scheduler task sits between a
    request and its worker thread; results come back through ``call_soon_threadsafe``.
    """

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
        self._jobs: queue.SimpleQueue[list[_Entry] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._exited: list[str] = []
        """Worker threads that have ended (appended by each as it ends: atomic)."""
        self._timer: asyncio.TimerHandle | None = None
        self._idle = asyncio.Event()
        self._admitted = 0
        self._admission = policy.Admission(name, config.max_queue_depth,
                                           config.max_concurrency)
        self._drain = policy.DrainRate(config.instances)  # items/s
        self._aging_ns = policy.aging_ns(config.priority_aging_ms)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_running_batches(self) -> int:
        return self._busy

    @property
    def running(self) -> bool:
        return self._loop is not None

    @property
    def num_admitted(self) -> int:
        """Requests submitted and not yet answered (queued or running)."""
        return self._admitted

    @property
    def alive(self) -> bool:
        """Started, and every worker thread is alive."""
        return self._loop is not None and not self._exited

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

    def _admit(self, request: InferenceRequest, now_ns: int) -> None:
        self.check_capacity()
        if request.deadline_ns is not None:
            rate = self._drain.per_s
            ahead = sum(e.request.num_items for e in self._queue
                        if e.request.priority <= request.priority) if rate > 0 else 0
            policy.check_deadline(request.deadline_ns, now_ns, ahead, rate,
                                  saturated=self._busy >= self.config.instances)

    def start(self) -> None:
        """Start the worker threads; call from the event loop that will submit requests."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._slot_free_since_ns = time.perf_counter_ns()
        self._idle.set()
        self._exited = []
        for i in range(self.config.instances):
            thread = threading.Thread(target=self._work, name=f"sokuji-{self.name}-{i}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

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
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def enqueue(self, request: InferenceRequest) -> _Entry:
        """Admit and queue ``request`` (``Overloaded``, ``DeadlineExceeded`` at once);
        its handle's ``result()`` must then be awaited."""
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
        self._dispatch()
        return entry

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
            if self._busy and not self._full_batch_queued():
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
            self._jobs.put(batch)

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def _full_batch_queued(self) -> bool:
        items = sum(e.request.num_items for e in self._queue)
        return items >= self.config.max_batch_size

    def _form_batch(self) -> list[_Entry]:
        now_ns = time.perf_counter_ns()
        live = [e for e in self._queue if not e.future.done()]
        if not live:
            self._queue.clear()
            return []
        aging_ns = self._aging_ns
        prank = policy.rank

        def rank(e: _Entry) -> int:
            return prank(e.request.priority, now_ns - e.request.enqueued_ns, aging_ns)

        head = min(live, key=lambda e: (rank(e), e.request.enqueued_ns))
        rest = [e for e in live if e is not head]
        if self.config.policy is BatchPolicy.LENGTH:
            anchor = head.request.length
            rest.sort(key=lambda e: (rank(e), abs(e.request.length - anchor)))
        else:
            rest.sort(key=lambda e: (rank(e), e.request.enqueued_ns))
        chosen = [head]
        items = head.request.num_items
        longest = head.request.length
        strict = self.config.policy is BatchPolicy.FIFO
        for entry in rest:
            if items >= self.config.max_batch_size:
                break
            req = entry.request
            new_items = items + req.num_items
            new_longest = max(longest, req.length)
            if new_items > self.config.max_batch_size or \
                    new_items * new_longest > self.config.max_batch_tokens:
                if strict:
                    break
                continue
            chosen.append(entry)
            items, longest = new_items, new_longest
        taken = set(map(id, chosen))
        self._queue = [e for e in live if id(e) not in taken]

        dispatch_ns = time.perf_counter_ns()
        for entry in chosen:
            entry.dispatched_ns = dispatch_ns
            if entry.timer is not None:
                entry.timer.cancel()
                entry.timer = None
            tl = entry.request.timeline
            tl.mark(Stage.QUEUE, max(entry.request.enqueued_ns, self._slot_free_since_ns))
            tl.mark(Stage.BATCH, dispatch_ns)
        if self._on_batch is not None:
            self._on_batch(BatchInfo(
                num_requests=len(chosen), num_items=items, padded_tokens=items * longest,
                real_tokens=sum(e.request.payload.num_tokens for e in chosen
                                if isinstance(e.request.payload, Prepared))))
        return chosen

    def _work(self) -> None:
        """Worker thread: run batches, post results back to the event loop. However it ends,
        it says so (``alive`` turns false: the model is no longer ready)."""
        held: list[list[_Entry]] = []
        try:
            self._work_until_stopped(held)
        finally:
            self._exited.append(threading.current_thread().name)
            loop = self._loop
            if loop is not None:  # not a stop: the thread died, and nobody else would
                with contextlib.suppress(RuntimeError):  # answer what it held or what waits
                    loop.call_soon_threadsafe(self._fail_stranded, held[0] if held else [])

    def _fail_stranded(self, batch: list[_Entry]) -> None:
        """A worker died: its batch in flight and the queue fail with 503 instead of
        waiting for nobody."""
        error = ModelNotReady(f"model '{self.name}': a worker thread died")
        for entry in (*batch, *self._queue):
            if not entry.future.done():
                entry.future.set_exception(error)
        self._queue.clear()
        if batch:
            self._busy -= 1
            if self._busy == 0:
                self._idle.set()

    def _work_until_stopped(self, held: list[list[_Entry]]) -> None:
        if self.config.worker_nice and hasattr(os, "setpriority"):
            # The event loop needs little CPU but gates every reply and every refusal: when
            # both want the core, it goes first. The worker still gets every idle moment.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               os.getpriority(os.PRIO_PROCESS, 0) + self.config.worker_nice)
        while (batch := self._jobs.get()) is not None:
            held[:] = [batch]
            loop = batch[0].future.get_loop()
            try:
                outputs: list[Any] | None = self._run_batch([e.request.payload for e in batch])
                error: BaseException | None = None
            except Exception as exc:  # noqa: BLE001 - delivered to the batch's own requests
                outputs, error = None, exc
            done_ns = time.perf_counter_ns()
            try:
                loop.call_soon_threadsafe(self._complete, batch, outputs, error, done_ns)
            except RuntimeError:  # the loop closed under us: nobody is waiting any more
                return
            held.clear()

    def _complete(self, batch: list[_Entry], outputs: list[Any] | None,
                  error: BaseException | None, done_ns: int) -> None:
        if error is None and outputs is not None and len(outputs) != len(batch):
            error = RuntimeFailed(f"model '{self.name}' returned {len(outputs)} outputs "
                                  f"for a batch of {len(batch)} requests")
        if error is not None:
            if not isinstance(error, SokujiError):
                log.error("model %s: run_batch raised %r", self.name, error, exc_info=error)
                error = RuntimeFailed(f"model '{self.name}' failed: {error!r}")
            for entry in batch:
                if not entry.future.done():
                    entry.future.set_exception(error)
        else:
            assert outputs is not None
            self._drain.observe(sum(e.request.num_items for e in batch),
                                (done_ns - batch[0].dispatched_ns) / 1e9)
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

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
- Results come back in the order of each request's items. A failing batch fails only its own
  requests. ``run_batch`` runs in a worker thread, so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from sokuji.config import BatchPolicy
from sokuji.core.request import InferenceRequest, Stage
from sokuji.errors import RuntimeFailed, SokujiError
from sokuji.runtimes.base import Prepared

log = logging.getLogger(__name__)

RunBatch = Callable[[Sequence[Prepared]], list[Any]]


@dataclass(frozen=True)
class BatcherConfig:
    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    max_queue_delay_ms: float = 2.0
    policy: BatchPolicy = BatchPolicy.LENGTH
    instances: int = 1


@dataclass(frozen=True)
class BatchInfo:
    """What one dispatched batch looked like; published as metrics."""

    num_requests: int
    num_items: int
    padded_tokens: int
    real_tokens: int


class _Entry:
    __slots__ = ("future", "request")

    def __init__(self, request: InferenceRequest, future: asyncio.Future[Any]) -> None:
        self.request = request
        self.future = future


class DynamicBatcher:
    def __init__(self, name: str, run_batch: RunBatch, config: BatcherConfig,
                 on_batch: Callable[[BatchInfo], None] | None = None) -> None:
        self.name = name
        self.config = config
        self._run_batch = run_batch
        self._on_batch = on_batch
        self._queue: list[_Entry] = []
        self._busy = 0
        self._slot_free_since_ns = 0
        self._wakeup = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=config.instances,
                                            thread_name_prefix=f"sokuji-{name}")

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_running_batches(self) -> int:
        return self._busy

    def start(self) -> None:
        if self._loop_task is None:
            self._slot_free_since_ns = time.perf_counter_ns()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop forming batches; let running batches finish; fail what is still queued."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for entry in self._queue:
            if not entry.future.done():
                entry.future.set_exception(RuntimeFailed(f"model '{self.name}' stopped"))
        self._queue.clear()
        self._executor.shutdown(wait=True)

    async def submit(self, request: InferenceRequest) -> Any:
        """Queue ``request``; return the runtime's output for its items, in their order."""
        if self._loop_task is None:
            raise RuntimeFailed(f"model '{self.name}' is not running")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        entry = _Entry(request, future)
        request.enqueued_ns = request.timeline.last_ns
        self._queue.append(entry)
        self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:
            if entry in self._queue:
                self._queue.remove(entry)
            raise

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue or self._busy >= self.config.instances:
                self._wakeup.clear()
                await self._wakeup.wait()
            if self._busy and not self._full_batch_queued():
                # Another instance is busy: wait a bounded time for company.
                oldest_ns = self._queue[0].request.enqueued_ns
                wait_s = (oldest_ns - time.perf_counter_ns()) / 1e9 \
                    + self.config.max_queue_delay_ms / 1e3
                if wait_s > 0:
                    self._wakeup.clear()
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), wait_s)
                        continue  # re-evaluate with the newcomer
                    except TimeoutError:
                        pass
            batch = self._form_batch()
            if not batch:
                continue
            self._busy += 1
            task = loop.create_task(self._execute(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _full_batch_queued(self) -> bool:
        items = sum(e.request.num_items for e in self._queue)
        return items >= self.config.max_batch_size

    def _form_batch(self) -> list[_Entry]:
        queue = [e for e in self._queue if not e.future.done()]
        if not queue:
            self._queue.clear()
            return []
        head, rest = queue[0], queue[1:]
        if self.config.policy is BatchPolicy.LENGTH:
            anchor = head.request.length
            rest.sort(key=lambda e: abs(e.request.length - anchor))
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
        self._queue = [e for e in queue if id(e) not in taken]

        dispatch_ns = time.perf_counter_ns()
        for entry in chosen:
            tl = entry.request.timeline
            tl.mark(Stage.QUEUE, max(entry.request.enqueued_ns, self._slot_free_since_ns))
            tl.mark(Stage.BATCH, dispatch_ns)
        if self._on_batch is not None:
            self._on_batch(BatchInfo(
                num_requests=len(chosen), num_items=items, padded_tokens=items * longest,
                real_tokens=sum(e.request.payload.num_tokens for e in chosen
                                if isinstance(e.request.payload, Prepared))))
        return chosen

    def _call(self, payloads: list[Any]) -> tuple[list[Any], int]:
        outputs = self._run_batch(payloads)
        return outputs, time.perf_counter_ns()

    async def _execute(self, batch: list[_Entry]) -> None:
        loop = asyncio.get_running_loop()
        try:
            outputs, done_ns = await loop.run_in_executor(
                self._executor, self._call, [e.request.payload for e in batch])
            if len(outputs) != len(batch):
                raise RuntimeFailed(f"model '{self.name}' returned {len(outputs)} outputs "
                                    f"for a batch of {len(batch)} requests")
        except SokujiError as exc:
            self._fail(batch, exc)
        except Exception as exc:
            log.exception("model %s: run_batch raised", self.name)
            self._fail(batch, RuntimeFailed(f"model '{self.name}' failed: {exc!r}"))
        else:
            for entry, output in zip(batch, outputs, strict=True):
                if not entry.future.done():
                    entry.request.timeline.mark(Stage.INFER, done_ns)
                    entry.future.set_result(output)
        finally:
            self._busy -= 1
            self._slot_free_since_ns = time.perf_counter_ns()
            self._wakeup.set()

    @staticmethod
    def _fail(batch: list[_Entry], exc: SokujiError) -> None:
        for entry in batch:
            if not entry.future.done():
                entry.future.set_exception(exc)

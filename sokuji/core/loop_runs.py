"""Batches that run on the event loop itself, as tasks: for a model whose work is a
coroutine (``async def`` code that awaits I/O, a pipeline's async step), the stand-in for
the worker threads of ``core/workers.py``, with the same face (``start``, ``submit``,
``stop``, ``alive``), so the batcher's queue, admission, priorities, deadlines and metrics
are the same.

- ``submit(batch)`` starts a task that awaits ``run(batch)`` and then calls ``done(batch,
  outputs, error, done_ns, ran_ns)`` on the loop, as a worker posts it. ``instances`` bounds
  how many run at once (the batcher hands no more).
- A batch whose every request went away (``drop_unwanted``: each one's caller released it,
  a step's timeout or a client's disconnect) is cancelled: a coroutine waiting on I/O for
  nobody stops, and its slot is free. (A worker thread's batch cannot be stopped and
  finishes.) ``done`` then gets a ``CancelledError``, and the batcher cancels what is left.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

B = TypeVar("B", bound=Sequence[Any])  # a batch of entries with a ``released`` flag


class LoopRuns(Generic[B]):
    def __init__(self, name: str, run: Callable[[B], Awaitable[list[Any]]],
                 done: Callable[[B, list[Any] | None, BaseException | None, int, int], None]
                 ) -> None:
        self.name = name
        self._run = run
        self._done = done
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: dict[asyncio.Task[Any], B] = {}

    @property
    def alive(self) -> bool:
        return self._loop is not None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def submit(self, batch: B) -> None:
        assert self._loop is not None, "start() first"
        task = self._loop.create_task(self._one(batch), name=f"sokuji-{self.name}-batch")
        self._running[task] = batch

    async def _one(self, batch: B) -> None:
        start_ns = time.perf_counter_ns()
        outputs: list[Any] | None = None
        error: BaseException | None = None
        try:
            outputs = await self._run(batch)
        except asyncio.CancelledError as exc:  # dropped: nobody wants it any more
            error = exc
        except Exception as exc:  # noqa: BLE001 - delivered to the batch's own requests
            error = exc
        finally:
            self._running.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
        done_ns = time.perf_counter_ns()
        self._done(batch, outputs, error, done_ns, done_ns - start_ns)

    def drop_unwanted(self) -> None:
        """Cancel each running batch whose every request has been released."""
        for task, batch in list(self._running.items()):
            if all(entry.released for entry in batch) and not task.done():
                task.cancel()

    def stop(self) -> None:
        """Nothing runs when the batcher stops them (it waited until idle)."""
        self._loop = None

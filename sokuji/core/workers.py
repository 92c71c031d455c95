"""The worker threads of one model: they run batches off the event loop and hand each result
back to it.

- ``submit(batch)`` (on the loop) wakes one idle worker; the worker calls ``run(batch)``
  (the runtime releases the GIL while it computes) and posts ``done(batch, outputs, error,
  done_ns, ran_ns)`` to the event loop (``ran_ns``: how long ``run`` took); ``done`` runs
  there.
- ``nice`` (added niceness, Linux) would let the event loop win the core from a worker; it is
  0 by default because a niced worker also loses the core to every other process: with one
  busy neighbour on its core it got a quarter of it where the raw runtime got half.
- However a worker ends, it says so: ``alive`` turns false at once (the model is no longer
  ready), and unless the pool was stopped, ``died(batch)`` is posted to the loop with the
  batch it held (if any), so its requests and the queue are answered instead of waiting for
  nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

B = TypeVar("B")  # a batch, as the owner represents it


class Workers(Generic[B]):
    def __init__(self, name: str, count: int, nice: int,
                 run: Callable[[B], list[Any]],
                 done: Callable[[B, list[Any] | None, BaseException | None, int, int], None],
                 died: Callable[[B | None], None]) -> None:
        self.name = name
        self.count = count
        self.nice = nice
        self._run = run
        self._done = done
        self._died = died
        self._jobs: queue.SimpleQueue[B | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._exited: list[str] = []
        """Workers that have ended (appended by each as it ends: atomic)."""
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def alive(self) -> bool:
        """Started, and every worker alive."""
        return self._loop is not None and not self._exited

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._exited = []
        for i in range(self.count):
            thread = threading.Thread(target=self._work, name=f"sokuji-{self.name}-{i}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def submit(self, batch: B) -> None:
        self._jobs.put(batch)

    def stop(self) -> None:
        """Let the workers finish what they run, then end them (blocking: they are idle when
        the owner calls this)."""
        self._loop = None
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def _work(self) -> None:
        held: list[B] = []
        try:
            loop = self._loop
            assert loop is not None, "start() first"
            self._work_until_stopped(loop, held)
        finally:
            self._exited.append(threading.current_thread().name)
            loop = self._loop
            if loop is not None:  # not a stop: the thread died, and nobody else would
                with contextlib.suppress(RuntimeError):  # answer what it held or what waits
                    loop.call_soon_threadsafe(self._died, held[0] if held else None)

    def _work_until_stopped(self, loop: asyncio.AbstractEventLoop, held: list[B]) -> None:
        if self.nice and hasattr(os, "setpriority"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               os.getpriority(os.PRIO_PROCESS, 0) + self.nice)
        while (batch := self._jobs.get()) is not None:
            held[:] = [batch]
            start_ns = time.perf_counter_ns()
            try:
                outputs: list[Any] | None = self._run(batch)
                error: BaseException | None = None
            except Exception as exc:  # noqa: BLE001 - delivered to the batch's own requests
                outputs, error = None, exc
            done_ns = time.perf_counter_ns()
            try:
                loop.call_soon_threadsafe(self._done, batch, outputs, error, done_ns,
                                          done_ns - start_ns)
            except RuntimeError:  # the loop closed under us: nobody is waiting any more
                return
            held.clear()

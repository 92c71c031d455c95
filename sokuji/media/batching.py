"""``StageWorker``: one thread that runs one stage of a media pipeline over a keyed queue.

Contracts:
- **Keys.** Every item carries a key; a batch only ever holds items of one key (OCR: the
  padded width ``W_ref`` for rec, a constant for cls, the input shape for det). Items of
  different keys never mix: the key is what makes a batch exact.
- **Order.** The next batch is formed around the item that goes first under the one policy
  (``core/policy.rank``: priority class with aging, then arrival, then insertion), and is
  filled with the following items of the same key, in the same order, up to ``max_items``
  and ``max_pixels`` (the sum of the items' ``width``: items x width for equal widths). The
  first item always runs, even alone over the budget.
- **Work-conserving.** An idle worker starts the moment an item is queued; it never waits
  for company (items that arrive while a batch runs form the next one), like
  ``core/batcher.py``.
- **Deadlines.** An item whose ``deadline_ns`` has passed is never run: it is handed to
  ``fail`` with ``DeadlineExceeded`` at its deadline, by a small reaper thread that sleeps
  until the nearest one (the worker itself may be busy with a long batch), or by the worker
  if it picks first.
- **Failures.** ``run(batch)`` owns its items; if it raises, ``fail(batch, error)`` is called
  with the exception, and the worker goes on. ``stop()`` fails the waiting items with
  ``ModelNotReady`` and joins the thread after the running batch (bounded);
  ``stop(drain=True)`` first runs what is queued (items the worker queues for itself meanwhile
  included), then ends; what is left at ``timeout_s`` fails.
- ``put`` is thread-safe from any thread; ``run`` is called on the worker's thread, ``fail``
  on the worker's, the reaper's, or the caller's of ``stop`` / ``put`` (after stop).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sokuji.core.policy import rank
from sokuji.core.request import Priority
from sokuji.errors import DeadlineExceeded, ModelNotReady

log = logging.getLogger(__name__)

_SEQ = itertools.count()


@dataclass(slots=True, eq=False)
class Item:
    key: Hashable
    """Only items of equal keys share a batch."""
    width: int
    """Budget units (pixels of padded width); the batch's sum stays within ``max_pixels``."""
    payload: Any
    priority: Priority = Priority.INTERACTIVE
    arrival_ns: int = 0
    """The request's arrival (``perf_counter_ns``): the order among equals."""
    deadline_ns: int | None = None
    queued_ns: int = 0
    """Set by ``put``: when the item entered this queue (for ``<stage>-wait`` spans)."""
    seq: int = field(default_factory=lambda: next(_SEQ))


Run = Callable[[list[Item]], None]
Fail = Callable[[Sequence[Item], BaseException], None]


class StageWorker:
    def __init__(self, name: str, run: Run, fail: Fail, *, max_items: int,
                 max_pixels: int | None = None, aging_ns: int = 0,
                 limits: Callable[[Hashable], tuple[int, int | None]] | None = None) -> None:
        """``limits(key) -> (max_items, max_pixels)`` overrides the two for a key (None: no
        pixel budget)."""
        if max_items < 1:
            raise ValueError("max_items must be >= 1")
        self.name = name
        self._run = run
        self._fail = fail
        self.max_items = max_items
        self.max_pixels = max_pixels
        self.aging_ns = aging_ns
        self._limits = limits
        self._items: list[Item] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._reaper: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._running = 0
        self.batches = 0
        """Batches run so far (tests, metrics)."""

    # -- any thread ---------------------------------------------------------------------
    def put(self, item: Item) -> None:
        self.put_many([item])

    def put_many(self, items: Sequence[Item]) -> None:
        """Queue ``items`` at once: an idle worker sees them all (one request's crops form
        one batch instead of the first starting alone)."""
        now_ns = time.perf_counter_ns()
        with self._cond:
            refused = self._stopping
            if not refused:
                for item in items:
                    item.queued_ns = now_ns
                self._items.extend(items)
                self._cond.notify_all()  # the worker and the reaper
        if refused and items:
            self._fail(list(items), ModelNotReady(f"'{self.name}' is stopping"))

    @property
    def num_waiting(self) -> int:
        return len(self._items)

    @property
    def num_running(self) -> int:
        """Items in the batch running now."""
        return self._running

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        with self._cond:
            self._stopping = self._draining = False
        self._thread = threading.Thread(target=self._loop, name=f"sokuji-{self.name}",
                                        daemon=True)
        self._reaper = threading.Thread(target=self._reap, name=f"sokuji-{self.name}-deadlines",
                                        daemon=True)
        self._thread.start()
        self._reaper.start()

    def stop(self, timeout_s: float = 30.0, drain: bool = False) -> None:
        """Fail what waits (``ModelNotReady``), let the running batch finish, join. With
        ``drain``, run what waits first (up to ``timeout_s``)."""
        if drain and self._thread is not None:
            with self._cond:
                self._draining = True
                self._cond.notify_all()
            self._thread.join(timeout_s)
        with self._cond:
            self._stopping = True
            waiting, self._items = self._items, []
            self._cond.notify_all()
        if waiting:
            self._fail(waiting, ModelNotReady(f"'{self.name}' stopped"))
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("stage worker %s did not end within %.0f s", self.name, timeout_s)
            self._thread = None
        if self._reaper is not None:
            self._reaper.join(timeout_s)
            self._reaper = None

    # -- the worker's thread ------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            expired: list[Item] = []
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    expired = self._take_expired(time.perf_counter_ns())
                    if expired or self._items:
                        break
                    if self._draining:
                        return
                    self._cond.wait()
                batch = self._form(time.perf_counter_ns()) if not expired else []
                self._running = len(batch)
            if expired:
                self._fail(expired, DeadlineExceeded(
                    "the request's deadline passed while it waited to start"))
                continue
            try:
                self._run(batch)
            except BaseException as exc:
                log.exception("stage %s failed on a batch of %d", self.name, len(batch))
                self._fail(batch, exc)
            finally:
                self.batches += 1
                self._running = 0

    def _reap(self) -> None:
        """Fail waiting items at their deadlines, whatever the worker is doing."""
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    expired = self._take_expired(time.perf_counter_ns())
                    if expired:
                        break
                    self._cond.wait(self._idle_timeout_s())
            self._fail(expired, DeadlineExceeded(
                "the request's deadline passed while it waited to start"))

    def _idle_timeout_s(self) -> float | None:
        deadlines = [i.deadline_ns for i in self._items if i.deadline_ns is not None]
        if not deadlines:
            return None
        return max(0.0, (min(deadlines) - time.perf_counter_ns()) / 1e9)

    def _take_expired(self, now_ns: int) -> list[Item]:
        expired = [i for i in self._items if i.deadline_ns is not None and i.deadline_ns <= now_ns]
        if expired:
            gone = {id(i) for i in expired}
            self._items = [i for i in self._items if id(i) not in gone]
        return expired

    def _form(self, now_ns: int) -> list[Item]:
        """The first item under the policy, then the same key's next ones within budget."""

        def order(i: Item) -> tuple[int, int, int]:
            return (rank(i.priority, now_ns - i.arrival_ns, self.aging_ns), i.arrival_ns, i.seq)

        ordered = sorted(self._items, key=order)
        head = ordered[0]
        max_items, max_pixels = (self._limits(head.key) if self._limits is not None
                                 else (self.max_items, self.max_pixels))
        batch = [head]
        pixels = head.width
        for item in ordered[1:]:
            if len(batch) >= max_items:
                break
            if item.key != head.key:
                continue
            if max_pixels is not None and pixels + item.width > max_pixels:
                break
            batch.append(item)
            pixels += item.width
        taken = {id(i) for i in batch}
        self._items = [i for i in self._items if id(i) not in taken]
        return batch

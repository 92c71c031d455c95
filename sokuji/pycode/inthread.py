"""``workers = 0``: the user's code runs in the server's own threads (the batcher's worker
threads, one per instance), for code that releases the GIL while it computes (numpy, ONNX
Runtime, torch) or waits (I/O). Each instance is an object of the class of its own, set up
once at start; a thread takes a free one for each batch, so two batches never share an
object at once (code need not be thread-safe). ``async def`` code may instead be awaited on
the server's own event loop (``run_on_loop``: ``event_loop = "server"``), concurrently with
everything else there, so it must never block."""

from __future__ import annotations

import logging
import queue
from typing import Any

from sokuji.errors import ConfigError
from sokuji.pycode.entry import UserCode, last_line
from sokuji.pycode.runner import Emit, Ran, invoke, invoke_async, invoke_stream

log = logging.getLogger(__name__)


def set_up(code: UserCode, options: dict[str, Any], model: str) -> Any:
    """A new instance with ``setup(options)`` done; ``ConfigError`` naming the model and the
    traceback's last line when it fails (the traceback itself goes to the log)."""
    instance = code.new()
    setup = None if code.function else getattr(instance, "setup", None)
    if setup is not None:
        try:
            setup(options) if code.takes_options else setup()
        except (Exception, SystemExit) as exc:
            log.error("model %s: setup failed", model, exc_info=exc)
            raise ConfigError(f"model '{model}' ({code.entry}): setup failed: "
                              f"{last_line(exc)}") from None
    return instance


class ThreadRunner:
    def __init__(self, code: UserCode, options: dict[str, Any], model: str,
                 instances: int = 1) -> None:
        self.code = code
        self.options = options
        self.model = model
        self.instances = instances
        self._free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._started = False

    def start(self) -> None:
        for _ in range(self.instances):
            self._free.put(set_up(self.code, self.options, self.model))
        self._started = True

    @property
    def alive(self) -> bool:
        return self._started

    def describe(self) -> Any:
        """The class's ``describe()``, asked of a set-up instance."""
        instance = self._free.get()
        try:
            return instance.describe()
        finally:
            self._free.put(instance)

    def run(self, batch: list[Any]) -> Ran:
        instance = self._free.get()
        try:
            return invoke(self.code, instance, batch, self.model, self.options)
        finally:
            self._free.put(instance)

    async def run_on_loop(self, batch: list[Any]) -> Ran:
        """``async def`` code on the caller's (the server's) loop; the batcher runs at most
        ``instances`` batches at once, so a free instance is always there."""
        instance = self._free.get_nowait()
        try:
            return await invoke_async(self.code, instance, batch, self.model, self.options)
        finally:
            self._free.put(instance)

    def stream(self, batch: list[Any], emit: Emit) -> Ran:
        instance = self._free.get()
        try:
            return invoke_stream(self.code, instance, batch, self.model, emit)
        finally:
            self._free.put(instance)

    def close(self) -> None:
        self._started = False
        while not self._free.empty():
            instance = self._free.get()
            teardown = getattr(instance, "teardown", None)
            if callable(teardown) and not self.code.function:
                try:
                    teardown()
                except Exception:
                    log.exception("model %s: teardown failed", self.model)

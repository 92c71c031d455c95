"""How a batch reaches the user's code, whichever runs it (a thread of the server:
``inthread.py``; a worker process: ``pool.py``, whose workers call ``invoke`` too).

``Runner`` is what a Python model's batcher calls from its worker threads (one per
instance): ``run(batch)`` for the whole results, ``stream(batch, emit)`` for a generator's,
each step's partial results handed to ``emit`` as they come. Both return ``Ran``: the
results, checked (``results.py``), and the stages the code reported (``stage.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from sokuji.errors import ModelCodeFailed, SokujiError
from sokuji.pycode import results
from sokuji.pycode.entry import UserCode
from sokuji.pycode.stage import Stages, collecting

log = logging.getLogger(__name__)

Emit = Callable[[list[Any]], None]
"""Takes one step of a stream: a partial result per request of the batch (None: that request
has nothing this step)."""


class Ran(NamedTuple):
    results: list[Any]
    """One result per request (a stream's: its last step's, or None)."""
    stages: Stages
    """The stages the code reported while it ran the batch."""


class Runner(Protocol):
    def start(self) -> None:
        """Load and set up (blocking); ``ConfigError`` naming the model when ``setup``
        fails, with its traceback's last line."""

    def run(self, batch: list[Any]) -> Ran: ...

    def stream(self, batch: list[Any], emit: Emit) -> Ran: ...

    @property
    def alive(self) -> bool:
        """Able to take a batch (a process pool: at least one live worker)."""

    def close(self) -> None:
        """Stop (a pool: every worker process ended, none left behind)."""


_loops = threading.local()


def _loop() -> asyncio.AbstractEventLoop:
    """This thread's own event loop for ``async def`` code (never the server's: code that
    blocks in it would stall every request)."""
    loop = getattr(_loops, "loop", None)
    if loop is None:
        loop = _loops.loop = asyncio.new_event_loop()
    return loop


def invoke(code: UserCode, instance: Any, batch: list[Any], model: str,
           options: dict[str, Any] | None = None) -> Ran:
    """Call the code on one batch: its results checked, its stages collected; what it raises
    becomes ``ModelCodeFailed`` (a ``SokujiError`` it raised on purpose stays itself)."""
    with collecting() as stages:
        try:
            if code.function:  # a call per request: each outcome its own
                out: Any = [_call_function(code, instance, item, options, model)
                            for item in batch]
            elif code.mode == "async":
                out = _loop().run_until_complete(instance.predict(batch))
            elif code.streams:
                last: list[Any] = [None] * len(batch)
                for step in _steps(code, instance, batch):
                    last = _merge(last, results_step(step, len(batch), model, code))
                out = last
            else:
                out = instance.predict(batch)
        except SokujiError:
            raise
        except Exception as exc:  # noqa: BLE001 (the user's code: whatever it raises is its own failure)
            raise failed(model, exc) from None
    if code.streams:
        return Ran(out, stages)
    return Ran(_own_errors(results.check(out, len(batch), model, code.output_type,
                                         code.function), model), stages)


def _own_errors(out: list[Any], model: str) -> list[Any]:
    """A result that is an exception fails its request alone: a ``SokujiError`` as itself
    (a class may refuse one request with a 4xx), anything else as ``ModelCodeFailed``."""
    for i, result in enumerate(out):
        if isinstance(result, BaseException) and not isinstance(result, SokujiError):
            out[i] = failed(model, result)
    return out


async def invoke_async(code: UserCode, instance: Any, batch: list[Any], model: str,
                       options: dict[str, Any] | None = None) -> Ran:
    """``async def`` code awaited on the caller's loop (the server's: ``event_loop =
    "server"``): a function entry's calls of the batch concurrently, each outcome its own;
    a class's ``predict`` once for the batch."""
    with collecting() as stages:
        try:
            if code.function:
                out: Any = await asyncio.gather(*(
                    _await_function(code, instance, item, options, model) for item in batch))
            else:
                out = await instance.predict(batch)
        except SokujiError:
            raise
        except Exception as exc:  # noqa: BLE001 (the user's code: whatever it raises is its own failure)
            raise failed(model, exc) from None
    return Ran(_own_errors(results.check(out, len(batch), model, code.output_type,
                                         code.function), model), stages)


def invoke_stream(code: UserCode, instance: Any, batch: list[Any], model: str,
                  emit: Emit) -> Ran:
    """A generator's steps, each checked and handed to ``emit`` as it comes."""
    with collecting() as stages:
        last: list[Any] = [None] * len(batch)
        try:
            for step in _steps(code, instance, batch):
                checked = results_step(step, len(batch), model, code)
                emit(checked)
                last = _merge(last, checked)
        except SokujiError:
            raise
        except Exception as exc:  # noqa: BLE001 (the user's code: whatever it raises is its own failure)
            raise failed(model, exc) from None
    return Ran(last, stages)


def results_step(step: Any, size: int, model: str, code: UserCode) -> list[Any]:
    """One step of a stream: a list of one partial result (or None) per request."""
    if not isinstance(step, (list, tuple)) or len(step) != size:
        got = f"{len(step)} results" if isinstance(step, (list, tuple)) else \
            f"a {type(step).__name__}"
        raise results.BadModelOutput(
            f"model '{model}': predict yielded {got}; each step must be a list with one "
            f"partial result (or None) per request ({size})")
    for i, partial in enumerate(step):
        if partial is not None:
            results.check_one(partial, i, model, code.output_type, code.function)
    return list(step)


def _merge(last: list[Any], step: list[Any]) -> list[Any]:
    return [s if s is not None else old for old, s in zip(last, step, strict=True)]


def _steps(code: UserCode, instance: Any, batch: list[Any]) -> Any:
    if code.mode == "async_generator":
        agen = instance.predict(batch)
        loop = _loop()
        while True:
            try:
                yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    else:
        yield from instance.predict(batch)


def _call_function(code: UserCode, fn: Any, item: Any, options: dict[str, Any] | None,
                   model: str) -> Any:
    """One request's call of a function entry; what it raises is that request's result (an
    exception), never the batch's."""
    kwargs = dict(item) if isinstance(item, dict) else {"inputs": item}
    if code.takes_options:
        kwargs["options"] = options or {}
    try:
        if code.mode == "async":
            return _loop().run_until_complete(fn(**kwargs))
        return fn(**kwargs)
    except SokujiError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 (the user's code: its failure, this request's)
        return failed(model, exc)


async def _await_function(code: UserCode, fn: Any, item: Any,
                          options: dict[str, Any] | None, model: str) -> Any:
    kwargs = dict(item) if isinstance(item, dict) else {"inputs": item}
    if code.takes_options:
        kwargs["options"] = options or {}
    try:
        return await fn(**kwargs)
    except SokujiError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 (the user's code: its failure, this request's)
        return failed(model, exc)


def failed(model: str, exc: BaseException) -> ModelCodeFailed:
    """The client's view of an exception in the model's code: its type, not its text (which
    may carry another request's data); the traceback goes to the log."""
    log.error("model %s: predict raised", model, exc_info=exc)
    return ModelCodeFailed(f"model '{model}': predict raised {type(exc).__name__} (the "
                           "model's own code failed; its traceback is in the server's log)")

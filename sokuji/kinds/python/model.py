"""A Python model served under the model contract: the user's class (``pycode/``) behind the
same dynamic batcher as every batched model (``BatchedModel``: admission, priorities,
deadlines, SLO admission, 429 with Retry-After, metrics and statistics).

- A request is one dict of named values (its V2 tensors as arrays and its own parameters,
  or a plain JSON body's fields), or the class's typed input, converted in ``prepare``: a
  value that does not fit is a 400 naming the field before anything is queued.
- A batch is a list of them, one per request (``num_items`` 1: ``max_batch_size`` counts
  requests, as Triton's Python backend hands them); ``run_batch`` runs in the batcher's
  worker threads (``instances``; with worker processes, one thread per process) and hands
  the list to the ``Runner``, whose results are checked before anyone reads them.
- A generator's steps go to each request's ``_Channel`` as they come (a bounded buffer:
  a client that reads too slowly loses its stream, never the others' time); its handle's
  ``events()`` yields them, ``result()`` the last.
- The handle's report carries the stages the code reported (``sokuji.stage``) as
  ``Server-Timing`` entries (``model.<name>``).
- The response cache keeps answers only when the class says it is ``deterministic``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from sokuji.core.limits import Limit
from sokuji.core.model import Api, ModelMetadata, Report, RequestContext, TensorSpec
from sokuji.core.request import Prepared
from sokuji.core.tensor import InferRequest, Tensor
from sokuji.errors import BadModelOutput, RequestTimeout, SokujiError
from sokuji.kinds.encoder.model import BatchedModel
from sokuji.kinds.python import values as values_
from sokuji.kinds.python.tasks import TaskPrepared
from sokuji.pycode.entry import UserCode
from sokuji.pycode.runner import Ran, Runner

STREAM_BUFFER = 1024
"""Steps a stream may hold for a client that has not read them; past that it is ended with
an error (a generator never waits for one slow reader: its batch serves others too)."""


class Out:
    """One request's result and the stages its batch reported."""

    __slots__ = ("stages", "value")

    def __init__(self, value: Any, stages: Sequence[tuple[str, float]]) -> None:
        self.value = value
        self.stages = stages


class StreamOverflow(RequestTimeout):
    """The client read a stream too slowly (``STREAM_BUFFER`` steps behind): the stream's
    last event (408, ``stream_overflow``)."""

    code = "stream_overflow"


class StreamAbandoned(SokujiError):
    """Every request of a streaming batch went away (its clients cancelled): raised from the
    batch's ``emit`` to end the generator early (it is closed: its ``finally`` runs). A
    ``SokujiError``, so the runner passes it on as itself, never as the model's failure."""

    status = 499
    code = "cancelled"


class _Channel:
    """A streaming request's steps, from the batch's thread to the request's handle."""

    __slots__ = ("cancelled", "ended", "loop", "overflowed", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.overflowed = False
        self.ended = False
        self.cancelled = False
        """Its request went away (``_Handle.cancel``): read by the batch's thread."""

    def put(self, step: Any) -> None:  # on the loop
        if self.overflowed:
            return
        if self.queue.qsize() >= STREAM_BUFFER:
            self.overflowed = True
        self.queue.put_nowait(step)

    def put_threadsafe(self, step: Any) -> None:
        self.loop.call_soon_threadsafe(self.put, step)


class _Handle:
    """The batcher's handle, with the stages of the request's batch in its report and, for
    a stream, its steps as events."""

    __slots__ = ("_channel", "_entry", "_out")

    def __init__(self, entry: Any, channel: _Channel | None) -> None:
        self._entry = entry
        self._channel = channel
        self._out: Out | None = None

    async def result(self) -> Out:
        out = await self._entry.result()
        self._out = out
        if isinstance(out.value, BaseException):  # this request's own failure
            raise out.value
        return out

    async def events(self) -> AsyncIterator[Any]:
        channel = self._channel
        if channel is None:
            yield (await self.result()).value
            return
        done = asyncio.ensure_future(self.result())
        try:
            while True:
                if channel.queue.empty() and done.done():
                    done.result()  # the batch's error, if it failed
                    return
                getter = asyncio.ensure_future(channel.queue.get())
                await asyncio.wait((getter, done), return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                if channel.overflowed and channel.queue.empty():
                    raise StreamOverflow(f"the client read the stream too slowly: it was "
                                         f"{STREAM_BUFFER} steps behind the model")
                yield getter.result()
        finally:
            if not done.done():
                done.cancel()

    @property
    def report(self) -> Report:
        out = self._out
        if out is None or not out.stages:
            return self._entry.report
        return Report(timing=[(f"model.{name}", ms, None) for name, ms in out.stages])

    @property
    def streams(self) -> bool:
        """Its steps come one by one (the class is a generator)."""
        return self._channel is not None

    @property
    def dispatched_ns(self) -> int:
        """When its batch started (0: not yet)."""
        return int(self._entry.dispatched_ns)

    def cancel(self) -> None:
        if self._channel is not None:
            self._channel.cancelled = True
        self._entry.cancel()


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # (a builtin without one: called as it comes)
        return None


class PythonModel(BatchedModel):
    """The user's class under a batcher; ``runner`` runs its batches (``pycode``)."""

    def __init__(self, config: Any, code: UserCode, runner: Runner, metadata: ModelMetadata,
                 limits: tuple[Limit, ...], apis: frozenset[Api], task: Any = None) -> None:
        self.config = config
        self.task = task
        """The OpenAI task the class declares (``tasks.py``: its requests' adapter)."""
        self.code = code
        self.runtime = runner
        self.metadata = metadata
        self.limits = limits
        self.apis = apis
        self.streams = code.streams
        self._elements = next(x for x in limits if x.key == "options.max_elements")
        self._order = tuple(t.name for t in metadata.outputs) if not metadata.open else ()
        self._seen = not metadata.open
        self._signature = _signature(code.target) if code.function else None
        """A function entry's: a request's values are its keyword arguments, checked
        before queueing (a request's wrong name fails it alone, with a 400)."""

    # -- adapters --------------------------------------------------------------------------
    def from_tensors(self, request: InferRequest) -> dict[str, Any]:
        elements = sum(math.prod(t.shape) for t in request.inputs.values())
        self._elements.check(elements, "the request's input elements")
        return values_.from_request(request)

    def to_tensors(self, result: Out, report: Report) -> list[Tensor]:
        return values_.to_tensors(result.value, self.name, self._order)

    def to_json(self, result: Any) -> Any:
        """A result (``Out``) or a stream's partial (what ``events()`` yields) as plain JSON
        (the predict route)."""
        return values_.plain(result.value if isinstance(result, Out) else result)

    def identity(self, inputs: Any) -> list[str] | None:
        if not (self.code.deterministic and self.config.cache):
            return None
        if self.task is not None and self.task.accepts(inputs):
            return self.task.identity(inputs)
        return values_.digest(inputs)

    # -- the contract ----------------------------------------------------------------------
    async def prepare(self, inputs: Any, ctx: RequestContext) -> Prepared:
        task = self.task if self.task is not None and self.task.accepts(inputs) else None
        if task is not None:  # an OpenAI route's request, as the class's values
            inputs, form = task.values(inputs)
        if self.code.input_type is not None:
            inputs = values_.typed(inputs, self.code.input_type)
        elif self._signature is not None and isinstance(inputs, dict):
            values_.check_arguments(self._signature, inputs, self.code.takes_options)
        if self.streams:
            inputs = (inputs, _Channel(asyncio.get_running_loop()))
        if task is not None:
            return TaskPrepared(data=inputs, num_items=1, length=1, num_tokens=0, task=task,
                                form=form)
        return Prepared(data=inputs, num_items=1, length=1, num_tokens=0)

    def submit(self, prepared: Prepared, ctx: RequestContext) -> Any:
        entry = super().submit(prepared, ctx)
        handle = _Handle(entry, prepared.data[1] if self.streams else None)
        if isinstance(prepared, TaskPrepared):
            return prepared.task.handle(handle, ctx, prepared.form)
        return handle

    async def run_batch_on_loop(self, batch: Sequence[Prepared]) -> list[Out]:
        """One batch of ``async def`` code, awaited on the server's loop (``event_loop =
        "server"``)."""
        ran = await self.runtime.run_on_loop([p.data for p in batch])
        if not self._seen:
            self._observe(batch[0].data, ran)
        return [Out(r, ran.stages) for r in ran.results]

    def run_batch(self, batch: Sequence[Prepared]) -> list[Out]:
        """One batch, in a worker thread of the batcher (blocking)."""
        if not self.streams:
            ran = self.runtime.run([p.data for p in batch])
        else:
            channels = [p.data[1] for p in batch]

            def emit(step: list[Any]) -> None:
                if all(c.cancelled for c in channels):
                    raise StreamAbandoned(f"model '{self.name}': every request of the "
                                          "streaming batch went away")
                for channel, partial in zip(channels, step, strict=True):
                    if partial is not None:
                        channel.put_threadsafe(partial)
            ran = self.runtime.stream([p.data[0] for p in batch], emit)
        if not self._seen:
            self._observe(batch[0].data if not self.streams else batch[0].data[0], ran)
        return [Out(r, ran.stages) for r in ran.results]

    def _observe(self, first: Any, ran: Ran) -> None:
        """An undeclared model's metadata, from its first batch (what was sent and what came
        back); it stays open: later requests may send other tensors."""
        self._seen = True
        result = ran.results[0] if ran.results else None
        if isinstance(result, BaseException):  # failed alone: the next batch shows it
            self._seen = False
            return
        try:
            outs = values_.to_tensors(result, self.name) if result is not None else []
        except BadModelOutput:
            outs = []
        ins = [values_.tensor(n, v, self.name) for n, v in first.items()
               if isinstance(v, np.ndarray)] if isinstance(first, dict) else []
        self.metadata = ModelMetadata(
            platform=self.metadata.platform, open=True,
            inputs=tuple(TensorSpec(t.name, t.datatype, (-1,) * len(t.shape)) for t in ins),
            outputs=self.metadata.outputs  # declared (options.outputs): kept as declared
            or tuple(TensorSpec(t.name, t.datatype, (-1,) * len(t.shape)) for t in outs))

    @property
    def alive(self) -> bool:
        return self.batcher.alive and self.runtime.alive

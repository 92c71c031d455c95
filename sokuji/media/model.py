"""A media model (OCR, VAD) served under the model contract (``core/model.py``).

- ``prepare(files, ctx)``: each file's limits from its header, then its decoding (and
  resizing / resampling) in the media lane (``core/offload.py``: ``media_lane``), never on
  the event loop nor in the light preparation pool that tokenising shares: its own threads,
  a bound on jobs waiting and one per tenant (``ctx.tenant``), past either a fast 429. A bad
  file is a 4xx naming it; a file past the engine's limits (``limits``) a 413 naming it.
- ``submit(prepared, ctx)``: admission (429: ``max_queue_depth`` files waiting for their
  first stage, or ``max_concurrency`` files in flight) and the deadline check (504), both
  from ``core/policy.py``; then one ``MediaJob`` per file to the engine, whose own threads
  run the stages (batching across requests where that is exact). The engine calls ``done``
  from its thread; one ``call_soon_threadsafe`` hands the result to the loop.
- V2 (``from_tensors``): the files are the one BYTES input's elements, raw (the binary
  extension, a plain upload) or base64 (JSON: ``parameters.content_type`` may say
  ``"base64"``, nothing else); the outputs are the engine's tensors; a plain upload is
  answered with the engine's plain JSON. A file's SHA-256 and the parameters identify an
  answer in the response cache.
- The request's Timeline: ``preprocess`` is the media lane's work (the engine's
  ``image-decode`` + ``resize`` or ``audio-decode`` + ``resample`` and the hand-off),
  ``queue`` lasts until the engine's first stage starts on any of the request's files,
  ``infer`` until the last file is done, ``postprocess`` the hand-back. ``stage_entries``
  details the engine's stages for ``Server-Timing``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from sokuji.config import ModelConfig
from sokuji.core import offload, timing
from sokuji.core.limits import Limit
from sokuji.core.model import (
    Api,
    Capacity,
    ModelBase,
    ModelMetadata,
    RecordStream,
    Report,
    RequestContext,
)
from sokuji.core.policy import Admission, DrainRate, check_deadline
from sokuji.core.request import Stage, Timeline
from sokuji.core.tensor import InferRequest, Tensor
from sokuji.errors import InvalidInput, ModelNotReady, RuntimeFailed, SokujiError, TooManyItems
from sokuji.media.engine import MediaEngine, MediaJob, RequestBudget, StageClock

PREP_STAGES = frozenset({"image-decode", "resize", "audio-decode", "resample"})
"""Stages an engine records in ``decode`` (the media lane), before its queue."""


@dataclass
class MediaPrepared:
    files: list[tuple[Any, StageClock]]
    """Each file decoded, with its stage clock."""
    params: Mapping[str, Any]


class MediaSubmission:
    """The handle of one request's files: ``result()`` is their results, in order."""

    def __init__(self, model: MediaModel, jobs: list[MediaJob],
                 futures: list[asyncio.Future[Any]], timeline: Timeline | None) -> None:
        self.model = model
        self.jobs = jobs
        self.futures = futures
        self.timeline = timeline

    async def result(self) -> list[Any]:
        try:
            results = list(await asyncio.gather(*self.futures))
        except BaseException:
            self.cancel()
            raise
        finally:
            observe = self.model.on_stages
            if observe is not None:  # off the response's own latency
                asyncio.get_running_loop().call_soon(observe, self.model.name, self.jobs)
        tl = self.timeline
        if tl is not None:
            starts = [s for s in (_first_run(j) for j in self.jobs) if s is not None]
            if starts:
                tl.mark(Stage.QUEUE, max(tl.last_ns, min(starts)))
            done_ns = max((j.extra.get("done_ns", 0) for j in self.jobs), default=0)
            tl.mark(Stage.INFER, max(tl.last_ns, done_ns))
            tl.mark(Stage.POSTPROCESS)
        return results

    def events(self) -> Any:
        raise NotImplementedError("a media model answers whole results")

    @property
    def report(self) -> Report:
        """The engine's stages (``stage_entries``) after the request's own."""
        return Report(timing=tuple(self.stage_entries()))

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancelled = True
        for fut in self.futures:
            if not fut.done():
                fut.cancel()

    def stage_entries(self) -> list[timing.Entry]:
        """The engine's stages, summed over the request's files, in the order they first
        ran. A stage's description: the request's own crops when it ran in batches (``8
        crops``), else its one note; never anything of the other requests of a batch."""
        totals: dict[str, int] = {}
        notes: dict[str, list[str]] = {}
        for job in self.jobs:
            for span in list(job.clock.spans):
                totals[span.name] = totals.get(span.name, 0) + span.end_ns - span.start_ns
                if span.note:
                    notes.setdefault(span.name, []).append(span.note)
        return [(name, ns / 1e6, _describe(notes.get(name, []))) for name, ns in totals.items()]

    def stage_totals_s(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for job in self.jobs:
            for name, ns in job.clock.totals_ns().items():
                out[name] = out.get(name, 0.0) + ns / 1e9
        return out


_CROPS = re.compile(r"(\d+) crops?")


def _describe(notes: list[str]) -> str | None:
    if len(notes) <= 1:
        return notes[0] if notes else None
    counts = [m.group(1) for m in map(_CROPS.fullmatch, notes) if m is not None]
    if len(counts) < len(notes):
        return notes[0]
    n = sum(map(int, counts))
    return f"{n} crop{'s' if n != 1 else ''}"


def _base64(name: str, i: int, element: str | bytes) -> bytes:
    try:
        return base64.b64decode(element, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"input '{name}' element {i} is not valid base64 (send the file's "
                           "bytes base64-encoded, or use the binary tensor extension)",
                           param=f"inputs.{name}.data") from None


class _Admitted:
    """An engine's record stream, counted in flight until closed."""

    def __init__(self, records: RecordStream, model: MediaModel) -> None:
        self.records = records
        self.model = model
        self._open = True

    @property
    def ready(self) -> bool:
        return self.records.ready

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        return self.records.feed(chunk)

    def finish(self) -> list[dict[str, Any]]:
        return self.records.finish()

    def end(self, records: int, total_ms: float, work_ms: float) -> dict[str, Any]:
        return self.records.end(records, total_ms, work_ms)

    def close(self) -> None:
        if self._open:
            self._open = False
            self.model.num_admitted -= 1
            self.records.close()


def _never(result: Any, error: BaseException | None) -> None:
    raise AssertionError("a job's done is bound before it is enqueued")


def _first_run(job: MediaJob) -> int | None:
    """When the engine's first stage (not a wait) began for this file."""
    starts = [s.start_ns for s in list(job.clock.spans)
              if s.name not in PREP_STAGES and not s.name.endswith("-wait")]
    return min(starts) if starts else None


class MediaModel(ModelBase):
    def __init__(self, config: ModelConfig, engine: MediaEngine) -> None:
        self.config = config
        self.engine = engine
        self.apis = frozenset({Api.INFER, Api.STREAM}) if engine.streams \
            else frozenset({Api.INFER})
        self.metadata: ModelMetadata = engine.metadata
        self.on_stages: Callable[[str, list[MediaJob]], None] | None = None
        """Observes a request's files' stages once it is done (``attach``)."""
        self.admission = Admission(config.name, config.max_queue_depth,
                                   config.max_concurrency, what="files")
        self.drain = DrainRate(servers=1)
        self.num_admitted = 0
        """Files submitted and not done (waiting or running)."""
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.limits: tuple[Limit, ...] = (
            Limit("max_batch_size", config.max_batch_size, "files", "files in one request"),
            *engine.limits)

    @classmethod
    def over(cls, config: ModelConfig, engine: MediaEngine) -> MediaModel:
        """``engine`` loaded (and warmed up, unless the config says not to) under a model."""
        engine.load()
        if config.warmup:
            engine.warmup()
        return cls(config, engine)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def input_name(self) -> str:
        return self.engine.input_name

    @property
    def alive(self) -> bool:
        return self._started and self.engine.alive

    @property
    def num_waiting(self) -> int:
        return self.engine.num_queued

    def capacity(self) -> Capacity:
        waiting = self.engine.num_queued
        return Capacity(ready=self.alive, num_waiting=waiting,
                        num_running=max(0, self.num_admitted - waiting),
                        max_queue_depth=self.config.max_queue_depth,
                        drain_per_s=self.drain.per_s)

    def check_admission(self, files: int = 1) -> None:
        waiting = self.engine.num_queued
        if self.admission.refuses(waiting + files - 1, self.num_admitted + files - 1):
            self.admission.check(waiting + files - 1, self.num_admitted + files - 1,
                                 lambda: float(waiting), self.drain.per_s)

    def attach(self, observers: Any) -> None:
        self.on_stages = observers.media_stages()

    def parameters(self, raw: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.engine.parameters(raw)

    # -- V2 -------------------------------------------------------------------------------
    def from_tensors(self, request: InferRequest) -> tuple[list[bytes], Mapping[str, Any]]:
        """The files (raw, or base64 in JSON) and the request's parameters."""
        name = self.input_name
        tensor = request.inputs[name]
        if tensor.binary:
            files = list(tensor.data)
        else:
            content = tensor.parameters.get("content_type", "base64")
            if content != "base64":
                raise InvalidInput(f"input '{name}' content_type {content!r:.60} is not "
                                   "supported; JSON data must be base64 (or send the files "
                                   "with the binary tensor extension)",
                                   param=f"inputs.{name}.parameters.content_type")
            files = [_base64(name, i, e) for i, e in enumerate(tensor.data)]
        if not files:
            raise InvalidInput(f"input '{name}' is empty: nothing to infer",
                               param=f"inputs.{name}")
        limit = self.config.max_batch_size
        if len(files) > limit:
            raise TooManyItems(f"input '{name}' has {len(files)} files; this model takes at "
                               f"most {limit} per request", param=f"inputs.{name}")
        return files, request.parameters

    def identity(self, inputs: tuple[list[bytes], Mapping[str, Any]]) -> Sequence[str]:
        files, raw = inputs
        params = orjson.dumps(self.engine.parameters(raw), option=orjson.OPT_SORT_KEYS)
        return [*(hashlib.sha256(f).hexdigest() for f in files), params.decode()]

    def to_tensors(self, result: list[Any], report: Report) -> list[Tensor]:
        return [Tensor(name, datatype, tuple(shape), data)
                for name, datatype, shape, data in self.engine.outputs(result)]

    def to_plain(self, result: list[Any]) -> dict[str, Any]:
        return self.engine.plain(result[0])

    # -- Api.STREAM -------------------------------------------------------------------------
    def open_stream(self, content_type: str, params: Mapping[str, str],
                    ctx: RequestContext) -> RecordStream:
        """One streamed file (the engine's ``open_stream``), counted as one file in flight
        toward ``max_concurrency`` until it is closed."""
        self.check_admission()
        records = self.engine.open_stream(content_type, params)
        self.num_admitted += 1
        return _Admitted(records, self)

    async def prepare(self, inputs: tuple[list[bytes], Mapping[str, Any]],
                      ctx: RequestContext) -> MediaPrepared:
        """``inputs``: the files and the request's raw parameters."""
        files, raw = inputs
        params = self.engine.parameters(raw)
        decoded = await offload.media_lane().run(ctx.tenant, self._decode_all, files)
        if ctx.timeline is not None:
            ctx.timeline.mark(Stage.PREPROCESS)
        return MediaPrepared(decoded, params)

    def _decode_all(self, files: list[bytes]) -> list[tuple[Any, StageClock]]:
        out = []
        for data in files:
            clock = StageClock()
            out.append((self.engine.decode(data, clock), clock))
        return out

    def submit(self, prepared: MediaPrepared, ctx: RequestContext) -> MediaSubmission:
        if not self._started or self._loop is None:
            raise ModelNotReady(f"model '{self.name}' is not ready")
        n = len(prepared.files)
        self.check_admission(n)
        now = time.perf_counter_ns()
        check_deadline(ctx.deadline_ns, now, float(self.engine.num_queued), self.drain.per_s,
                       saturated=self.engine.num_running > 0)
        jobs, futures = [], []
        budget = RequestBudget()
        for decoded, clock in prepared.files:
            job = MediaJob(decoded, prepared.params, clock, ctx.deadline_ns, ctx.priority,
                           _never, enqueued_ns=now, budget=budget)
            futures.append(self._bind(job))
            jobs.append(job)
        self.num_admitted += n
        for job in jobs:
            try:
                self.engine.enqueue(job)
            except SokujiError as exc:
                job.done(None, exc)
        return MediaSubmission(self, jobs, futures, ctx.timeline)

    def _bind(self, job: MediaJob) -> asyncio.Future[Any]:
        """Give ``job`` its ``done``: once, from any thread, to the future on the loop."""
        loop = self._loop
        assert loop is not None
        fut: asyncio.Future[Any] = loop.create_future()
        called = threading.Lock()

        def finish(result: Any, error: BaseException | None) -> None:
            self.num_admitted -= 1
            started = _first_run(job)
            if error is None and started is not None:
                self.drain.observe(1, (job.extra["done_ns"] - started) / 1e9)
            if fut.done():  # cancelled: the client went away
                return
            if error is None:
                fut.set_result(result)
            elif isinstance(error, SokujiError):
                fut.set_exception(error)
            else:  # a bug in the engine: a 500 that says so, never a hang
                fut.set_exception(RuntimeFailed(f"model '{self.name}' failed: {error!r}"))

        def done(result: Any, error: BaseException | None) -> None:
            if not called.acquire(blocking=False):
                return  # the contract says once; a second call must not count twice
            job.extra["done_ns"] = time.perf_counter_ns()
            loop.call_soon_threadsafe(finish, result, error)

        job.done = done
        return fut

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.start()
        self._started = True

    async def stop(self) -> None:
        self._started = False
        await asyncio.to_thread(self.engine.stop)

    def close(self) -> None:
        self.engine.close()

"""The contract between a media model's serving layer and its engine.

The serving layer (``sokuji/media/model.py``) owns what every model shares: admission and
deadlines (``core/policy.py``), the media lane (``core/offload.py``), the request's Timeline,
the protocols.
An engine owns what is specific: decoding and checking a file, and running its ONNX sessions
on threads of its own, batching work of many requests where that is exact.

The way of one file::

    decoded = engine.decode(data, clock)      # in the media lane: limits first, then
                                              # decode (+ resize / resample); 4xx naming it
    params = engine.parameters(raw)           # the request's V2 parameters, checked (400)
    engine.enqueue(MediaJob(decoded, params, clock, deadline_ns, priority, done))
    ...                                       # engine threads; at the end, from one of them:
    job.done(result, None) | job.done(None, error)

``done`` is called exactly once per job, from any thread (the serving layer hands it to the
event loop). An error is a ``SokujiError`` (``DeadlineExceeded`` when the job was still
waiting for its first stage at ``deadline_ns``; ``ModelNotReady`` when the engine stops);
anything else is a bug (500).

Stages are recorded in the job's ``StageClock`` as spans of ``perf_counter_ns``: the engine
records its own (``image-decode``, ``resize``, ``det``, ``cls``, ``rec``; ``audio-decode``,
``resample``, ``infer``), and a wait before a batched stage as ``<stage>-wait``. A batched
stage's span is the batch's run, recorded in every job of the batch, with a note that
speaks of the job's own work only (``4 crops``): never of the other requests in the batch.

A request's files share one ``RequestBudget``: work an engine learns only on its threads
(an image's crops, known after det) is counted there against the request's limits
(``core/limits.py``), before the work it bounds; past one, that file's ``done`` gets the
``LimitExceeded`` and the request is refused (413).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from sokuji.core.limits import Limit
from sokuji.core.model import ModelMetadata, RecordStream
from sokuji.core.request import Priority


@dataclass(slots=True)
class Span:
    name: str
    start_ns: int
    end_ns: int
    note: str = ""
    """Shown to the client (``Server-Timing``): the job's own work only."""
    requests: int = 0
    """A batched stage: the requests whose work shared the batch (the operator's metrics,
    ``sokuji_media_batch_requests``; never shown to a client)."""


class StageClock:
    """A request's (one file's) stage spans, appended from any thread."""

    __slots__ = ("_lock", "spans")

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def add(self, name: str, start_ns: int, end_ns: int, note: str = "",
            requests: int = 0) -> None:
        with self._lock:
            self.spans.append(Span(name, start_ns, end_ns, note, requests))

    def totals_ns(self) -> dict[str, int]:
        """Summed duration per stage name, in the order the stages first ran."""
        out: dict[str, int] = {}
        with self._lock:
            for s in self.spans:
                out[s.name] = out.get(s.name, 0) + (s.end_ns - s.start_ns)
        return out

    def first_start_ns(self, names: tuple[str, ...] | None = None) -> int | None:
        """When the first span (of ``names``, if given) began."""
        with self._lock:
            starts = [s.start_ns for s in self.spans if names is None or s.name in names]
        return min(starts) if starts else None


class RequestBudget:
    """Work counted across one request's files, from any thread."""

    __slots__ = ("_lock", "used")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.used: dict[str, int | float] = {}

    def take(self, limit: Limit, amount: int | float, subject: str = "the request") -> None:
        """Count ``amount`` more of ``limit``'s quantity; ``LimitExceeded`` (nothing counted)
        when the request's total would pass it."""
        with self._lock:
            need = self.used.get(limit.key, 0) + amount
            limit.check(need, subject)
            self.used[limit.key] = need


@dataclass(slots=True, eq=False)
class MediaJob:
    """One file's work, as the serving layer hands it to the engine."""

    decoded: Any
    """What ``engine.decode`` returned."""
    params: Mapping[str, Any]
    """What ``engine.parameters`` returned."""
    clock: StageClock
    deadline_ns: int | None
    """Absolute ``perf_counter_ns`` by which the job must have started its first engine
    stage (det / infer), else it fails with ``DeadlineExceeded`` without running."""
    priority: Priority
    done: Callable[[Any, BaseException | None], None]
    """Called exactly once, from any thread: (result, None) or (None, error)."""
    enqueued_ns: int = 0
    cancelled: bool = False
    """Set by the serving layer when the client went away: skip the work, call ``done``."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The engine's own per-job state."""
    budget: RequestBudget = field(default_factory=RequestBudget)
    """Shared by the request's files (``MediaModel.submit``)."""


class MediaEngine(Protocol):
    # Read-only members (properties here, so that an engine may declare them as plain
    # class attributes of narrower types).
    @property
    def input_name(self) -> str:
        """The V2 input: ``image`` or ``audio``."""

    @property
    def metadata(self) -> ModelMetadata:
        """V2 inputs (one BYTES input, shape [-1]) and outputs."""

    @property
    def stage_names(self) -> tuple[str, ...]:
        """Every stage the engine records, in pipeline order (Server-Timing and metrics)."""

    @property
    def limits(self) -> tuple[Limit, ...]:
        """Its cost bound (``core/limits.py``): every limit ``decode`` and the engine's
        threads check, each before the work it bounds."""

    @property
    def streams(self) -> bool:
        """It takes a file streamed in (``open_stream``: the model serves ``Api.STREAM``)."""

    def open_stream(self, content_type: str, params: Mapping[str, str]) -> RecordStream:
        """A file streamed in, its records out as they are final (``streams`` only); 4xx
        for a content type or parameters it cannot take."""

    def load(self) -> None:
        """Create the ONNX sessions (blocking)."""

    def warmup(self) -> None:
        """Run every session once on a small generated input (blocking)."""

    def decode(self, data: bytes, clock: StageClock) -> Any:
        """Check the file's limits from its header, then decode it into what ``enqueue``
        takes (records ``image-decode`` + ``resize`` or ``audio-decode`` + ``resample``).
        Raises ``InvalidInput`` (400), ``PayloadTooLarge`` (413) or ``UnsupportedMediaType``
        (415) with a message naming the problem; ``LimitExceeded`` (413) past ``limits``. Runs
        in the media lane (``core/offload.media_lane``)."""

    def parameters(self, raw: Mapping[str, Any]) -> Mapping[str, Any]:
        """The request's parameters for this engine (known keys only; others ignored),
        checked: ``InvalidInput`` naming the key."""

    def enqueue(self, job: MediaJob) -> None:
        """Queue ``job`` on the engine's threads (non-blocking)."""

    def outputs(self, results: list[Any]) -> list[tuple[str, str, list[int], Any]]:
        """V2 output tensors for the results of one request's files, in order:
        (name, datatype, shape, data). data: a numpy array (numeric datatypes) or a list of
        str (BYTES)."""

    def plain(self, result: Any) -> dict[str, Any]:
        """One file's result as plain JSON (a plain upload's answer)."""

    @property
    def num_queued(self) -> int:
        """Jobs waiting for their first stage."""

    @property
    def num_running(self) -> int:
        """Jobs past their first stage, not done."""

    @property
    def alive(self) -> bool:
        """Every engine thread alive (after ``start``)."""

    def start(self) -> None:
        """Start the engine's threads."""

    def stop(self) -> None:
        """Stop taking jobs; jobs still waiting fail with ``ModelNotReady`` (``done``);
        running ones finish. Blocking, bounded."""

    def close(self) -> None:
        """Free the sessions (after ``stop``)."""

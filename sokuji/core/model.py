"""The model contract: the few verbs every kind of served model offers, and the plain data
they exchange. Pure: no HTTP, no runtime imports.

A served model is called the same way whatever it is (an encoder over a batcher, a
generator over the continuous-batching engine; later a pipeline, a router or an upstream
server)::

    model.check_admission()                  # 429 before the body is even read
    prepared = await model.prepare(inputs, ctx)   # model-specific: tokenise, template, limits
    handle = model.submit(prepared, ctx)     # admission + deadline check, then queued
    output = await handle.result()           # the whole output ...
    async for event in handle.events(): ...  # ... or a stream of events
    handle.cancel()                          # the caller went away

``prepare`` raises ``InvalidInput`` (400, naming the field) for what the model cannot take;
``submit`` raises ``Overloaded`` (429) or ``DeadlineExceeded`` (504) under the scheduling
policy (``core/policy.py``); failures later come typed (a ``SokujiError``), never as text to
be matched. Codecs only translate protocols to and from these calls.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sokuji.core.request import Priority
from sokuji.core.trace import TRACEPARENT, Hop, header, new_span_id

if TYPE_CHECKING:
    from sokuji.core.request import Timeline


class ModelKind(enum.StrEnum):
    ENCODER = "encoder"
    """Items in -> one output row per item (embeddings); inputs: a list of texts."""
    GENERATOR = "generator"
    """A prompt in -> a stream of text deltas, then a finish; inputs: ``GenerationInput``."""
    PIPELINE = "pipeline"
    """Steps over other models (``sokuji/pipelines``); inputs: a mapping of named inputs."""
    MEDIA = "media"
    """Encoded files in (images, audio) -> structured outputs (``sokuji/media``): OCR lines,
    speech segments."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    """KServe V2 datatype: BYTES, FP32, INT64, ..."""
    shape: tuple[int, ...]
    """-1 marks a variable dimension."""


@dataclass(frozen=True)
class ModelMetadata:
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(slots=True)
class RequestContext:
    """Who is asking and how: built once per request (after authentication, from the
    tenant, the request's hints and the model's default timeout) and read by every layer.
    Read-only by contract (not ``frozen``: a frozen dataclass costs ~0.7 us more to build,
    on a path whose whole overhead is counted in microseconds)."""

    tenant: str
    priority: Priority
    """Effective: the tenant's default or the request's hint, under the tenant's ceiling."""
    deadline_ns: int | None
    """Absolute ``perf_counter_ns`` by which the request must have *started*; None: none."""
    arrival_ns: int
    request_id: str = ""
    traceparent: str | None = None
    """W3C trace context as received."""
    timeline: Timeline | None = None
    """The request's stage stamps (encoders: stamped through to the batch's end)."""
    headers: Mapping[str, str] | None = None
    """The request's headers (lower-case names), for routers' rules; None where a request
    has none (a pipeline's steps)."""
    trace: Trace | None = None
    """Set when the request is traced (``observability/tracing.py``): its ids, its upstream
    hops. None for almost every request: nothing else is done for tracing."""


class Trace:
    """A traced request (``observability/tracing.py`` samples it): its ids, its context once
    built, and its upstream hops."""

    __slots__ = ("ctx", "hops", "parent_id", "span_id", "trace_id")

    def __init__(self, trace_id: int, parent_id: int = 0) -> None:
        self.trace_id = trace_id
        self.parent_id = parent_id
        """The client's span (remote), 0 for a root."""
        self.span_id = new_span_id()
        """Our server span's id, known from the start so hops can name it."""
        self.ctx: RequestContext | None = None
        """Set by ``scheduling.context``: tenant, priority, deadline for the attributes."""
        self.hops: list[Hop] = []

    def hop(self, model: str, url: str, headers: dict[str, str]) -> Hop:
        """Start a hop to the upstream's ``model`` now; ``headers`` (the upstream call's)
        get its ``traceparent``."""
        hop = Hop(f"upstream {model}", url)
        self.hops.append(hop)
        headers[TRACEPARENT] = header(self.trace_id, hop.span_id)
        return hop


@dataclass(frozen=True, slots=True)
class Capacity:
    ready: bool
    """Started, and its worker or engine threads alive."""
    num_waiting: int
    num_running: int
    """Requests (encoder) or generations admitted and not finished."""
    max_queue_depth: int
    drain_per_s: float
    """Measured: items/s (encoder) or generations/s (generator); 0 until measured."""


@dataclass
class GenerationInput:
    """What a generator is asked: the prompt (exactly one of ``messages`` for a chat, text
    or token ids in ``prompt``) and how to sample. Limits are the model's to check."""

    chat: bool
    messages: list[dict[str, str]] | None
    prompt: str | list[int] | None
    max_tokens: int | None
    max_tokens_field: str
    """The field ``max_tokens`` came from (errors name it): max_tokens or
    max_completion_tokens."""
    min_tokens: int
    ignore_eos: bool
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None


class Submission(Protocol):
    """A submitted request's handle."""

    async def result(self) -> Any:
        """The whole output (encoder: the rows; generator: a ``Generated``); raises the
        ``SokujiError`` the request failed with."""

    def events(self) -> AsyncIterator[Any]:
        """Outputs as they come (generator: ``Delta`` then one ``Finish``)."""

    def cancel(self) -> None:
        """Stop working for it (a no-op once it finished)."""


class ServedModel(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> ModelKind: ...

    @property
    def metadata(self) -> ModelMetadata: ...

    @property
    def alive(self) -> bool:
        """Started, and every worker / engine thread it needs is alive."""

    @property
    def num_waiting(self) -> int: ...

    def capacity(self) -> Capacity: ...

    def check_admission(self) -> None:
        """Raise ``Overloaded`` if a request arriving now would be refused: callable before
        the body is read."""

    async def prepare(self, inputs: Any, ctx: RequestContext) -> Any:
        """Model-specific preparation (tokenise, template, limits: ``InvalidInput``), off
        the event loop for large inputs."""

    def submit(self, prepared: Any, ctx: RequestContext) -> Submission:
        """Admission and the deadline check (``core/policy.py``), then queue. It may also
        compute the request before returning (an encoder's lone request at an idle model:
        ``core/inline.py``); the handle's ``result()`` is then ready at once."""

    def attach(self, observers: Any) -> None:
        """Connect what the model reports beyond the Timeline to the server's observers
        (``observability/observers.py``: an engine's gauges, a pipeline's step times, a
        router's breakers); called once, before ``start``."""

    def neighbours(self, busy: Callable[[], bool]) -> None:
        """Told how to ask whether the other models of the server have work in flight (an
        encoder runs a lone request on the event loop only while they have none)."""

    def start(self) -> None:
        """Start its threads; call from the event loop that will submit."""

    async def stop(self) -> None:
        """Stop taking requests; what runs finishes, what waits fails."""

    def close(self) -> None:
        """Free the weights (after ``stop``)."""


class ModelBase:
    """Defaults for the contract's optional verbs: a kind's served model may inherit them."""

    def attach(self, observers: Any) -> None:
        """Nothing to report beyond the Timeline."""

    def neighbours(self, busy: Callable[[], bool]) -> None:
        """Nothing runs on the event loop."""

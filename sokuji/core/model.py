"""The model contract: the few verbs every kind of served model offers, and the plain data
they exchange. Pure: no HTTP, no runtime imports.

A served model is called the same way whatever it is (an encoder over a batcher, a
generator over the continuous-batching engine, a pipeline, a router, an upstream server)::

    model.check_admission()                  # 429 before the body is even read (the edge:
                                             # once per request)
    prepared = await model.prepare(inputs, ctx)   # model-specific: tokenise, template, limits
    handle = model.submit(prepared, ctx)     # admission + deadline check, then queued
    output = await handle.result()           # the whole output ...
    async for event in handle.events(): ...  # ... or a stream of events
    handle.report                            # how it was served (``Report``)
    handle.cancel()                          # the caller went away

What it answers is its ``apis`` (``Api``), never what it is: the HTTP layer routes by them,
and each protocol's adapters are the model's (V2 tensors: ``from_tensors`` / ``to_tensors``,
``core/tensor.py``; a stream: ``open_stream``).

``prepare`` raises ``InvalidInput`` (400, naming the field) for what the model cannot take;
``submit`` raises ``Overloaded`` (429) or ``DeadlineExceeded`` (504) under the scheduling
policy (``core/policy.py``); failures later come typed (a ``SokujiError``), never as text to
be matched. Codecs only translate protocols to and from these calls.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from sokuji.core import timing as timing_
from sokuji.core.limits import Limit
from sokuji.core.request import Priority
from sokuji.core.trace import TRACEPARENT, Hop, header, new_span_id

if TYPE_CHECKING:
    from sokuji.core.request import Timeline
    from sokuji.core.tensor import InferRequest, Tensor


_EMPTY: Mapping[str, Any] = MappingProxyType({})


class Api(enum.StrEnum):
    """What a served model answers: the HTTP layer routes by these, never by what a model
    is. A route a model does not serve is a 400 naming the routes it does."""

    INFER = "infer"
    """KServe V2 infer: named tensors in, named tensors out (``from_tensors`` /
    ``to_tensors`` adapt them to ``prepare`` and from ``result()``)."""
    EMBED = "embed"
    """OpenAI embeddings: texts in (``prepare`` takes a list of str), one vector per text
    out (``result()``: a float matrix, a row per text)."""
    GENERATE = "generate"
    """OpenAI chat / completions: ``prepare`` takes a ``GenerationInput``; the handle is a
    stream of ``Delta`` then one ``Finish`` (``core/events.py``) with a ``timing``."""
    PREDICT = "predict"
    """Plain JSON in, plain JSON out (a Python model's ``POST /v2/models/{m}/predict``):
    ``prepare`` takes the body's object (or the class's typed input); ``to_json`` gives the
    answer's JSON value."""
    STREAM = "stream"
    """A body streamed in, records streamed out as they are known (``open_stream``)."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    """KServe V2 datatype: BYTES, FP32, INT64, ..."""
    shape: tuple[int, ...]
    """-1 marks a variable dimension."""
    media_types: tuple[str, ...] = ()
    """A BYTES input of encoded files: the media types (``image/png``, ...) it takes as a
    plain upload, the file itself as the request body (or one multipart file)."""
    optional: bool = False
    """A request may leave this input out."""


class Report:
    """What a handle says about how its request was served, beyond its output; the HTTP
    layer reads it as it is (every field optional). Read-only by contract (a plain class:
    built on the hot path, and a frozen dataclass costs several times more to build).
    Handles that have nothing to say share ``NOTHING``."""

    __slots__ = ("cached", "headers", "input_tokens", "outputs", "served_by", "timing")

    def __init__(self, served_by: str = "", timing: Sequence[timing_.Entry] = (),
                 headers: Mapping[str, str] = _EMPTY, cached: bool = False,
                 outputs: Mapping[str, Any] = _EMPTY, input_tokens: int = 0) -> None:
        self.served_by = served_by
        """Who answered (a router's target, an LLM replica, ``cache``):
        ``X-Sokuji-Served-By``."""
        self.timing = timing
        """``Server-Timing`` entries after the request's own stages (a route, a pipeline's
        steps, a media engine's stages)."""
        self.headers = headers
        """More response headers (lower-case names), e.g. ``x-sokuji-pipeline-steps``."""
        self.cached = cached
        """Nothing was computed for it (a response- or semantic-cache hit)."""
        self.outputs = outputs
        """Extra outputs beside the result, by name (a pipeline's extra steps: its
        sources)."""
        self.input_tokens = input_tokens
        """Input tokens the model read (an encoder's unpadded count: OpenAI usage)."""

    def __repr__(self) -> str:
        fields = {k: getattr(self, k) for k in self.__slots__}
        return f"Report({', '.join(f'{k}={v!r}' for k, v in fields.items() if v)})"


NOTHING = Report()
"""The report of a handle with nothing to say."""


@dataclass(frozen=True)
class ModelMetadata:
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    open: bool = False
    """The model takes whatever named tensors a request sends, and may answer any outputs (a
    Python model that declares none): the V2 codec checks each tensor against itself only
    (its datatype, shape and data), and a request may send none, its values in
    ``parameters``. ``inputs`` / ``outputs`` then say what was seen, for the metadata."""


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
    company: bool = False
    """Other requests of its front end were on their way when it arrived (gRPC's, which
    reach their handlers over several loop turns: ``server/grpc_arrivals.py``): it must not
    run on the event loop, where they would wait behind it, but batch with them."""


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
    top_k: int = field(default=0, kw_only=True)
    min_p: float = field(default=0.0, kw_only=True)
    presence_penalty: float = field(default=0.0, kw_only=True)
    frequency_penalty: float = field(default=0.0, kw_only=True)
    repetition_penalty: float = field(default=1.0, kw_only=True)
    logit_bias: tuple[tuple[int, float], ...] = field(default=(), kw_only=True)
    """(token id, bias) pairs, ids checked against the model's vocabulary by the model."""
    logprobs: int | None = field(default=None, kw_only=True)
    """None: no log-probabilities; n: the chosen token's and n alternatives'."""
    grammar: Any = field(default=None, kw_only=True)
    """The constraint its output must follow (``llm/grammar.GrammarSpec``: a JSON schema from
    ``response_format``, a GBNF ``grammar``), checked but not compiled; None: free text."""
    tools: Any = field(default=None, kw_only=True)
    """The tools it may call (``llm/tools.ToolSpec``), with ``tool_choice``; None: none."""
    n: int = field(default=1, kw_only=True)
    """Choices to generate from the one prompt."""

    def extended_sampling(self) -> str | None:
        """The first of the sampling fields beyond temperature / top_p / seed that this
        request sets (a generator that cannot honour them refuses it by name), or None."""
        for key, default in (("logprobs", None), ("logit_bias", ()), ("top_k", 0),
                             ("min_p", 0.0), ("presence_penalty", 0.0),
                             ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                             ("grammar", None), ("tools", None), ("n", 1)):
            if getattr(self, key) != default:
                return key
        return None


class Submission(Protocol):
    """A submitted request's handle."""

    async def result(self) -> Any:
        """The whole output (encoder: the rows; generator: a ``Generated``); raises the
        ``SokujiError`` the request failed with."""

    def events(self) -> AsyncIterator[Any]:
        """Outputs as they come (generator: ``Delta`` then one ``Finish``)."""

    def cancel(self) -> None:
        """Stop working for it (a no-op once it finished)."""

    @property
    def report(self) -> Report:
        """How it was served (``Report``), read once ``result()`` returned (a generation:
        once its first events came); ``NOTHING`` when there is nothing to say."""


class RecordStream(Protocol):
    """One request of ``Api.STREAM``: a body fed chunk by chunk (in the preparation pool,
    one chunk at a time), records out as soon as they are known."""

    @property
    def ready(self) -> bool:
        """The body's head has arrived and passed its checks: the status can be sent."""

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        """The records this chunk completes (``SokujiError`` if the body is wrong)."""

    def finish(self) -> list[dict[str, Any]]:
        """The body ended: the last records (``SokujiError`` if it ended too soon)."""

    def end(self, records: int, total_ms: float, work_ms: float) -> dict[str, Any]:
        """The stream's last record (``records`` written, its time, the time fed chunks
        took)."""

    def close(self) -> None:
        """No longer in flight (called once, whatever happened)."""


class ServedModel(Protocol):
    """What every served model is. ``apis`` says which protocols it answers; the adapters
    of a protocol (``from_tensors`` / ``to_tensors`` for ``Api.INFER``, ``open_stream`` for
    ``Api.STREAM``) are its to implement, the rest of its way (admission, prepare, submit)
    is the same verbs for every protocol."""

    @property
    def name(self) -> str: ...

    @property
    def apis(self) -> frozenset[Api]:
        """The protocols it answers (``Api``)."""

    @property
    def batches(self) -> bool:
        """Its requests are batched along their first dimension (Triton's
        ``max_batch_size`` > 0 and a ``dynamic_batching`` section)."""

    @property
    def metadata(self) -> ModelMetadata: ...

    @property
    def alive(self) -> bool:
        """Started, and every worker / engine thread it needs is alive."""

    @property
    def limits(self) -> tuple[Limit, ...]:
        """Its cost bound (``core/limits.py``): the most work one request may cause, each
        quantity checked before the work it bounds (``LimitExceeded``, 413). The request
        body's bytes are the server's (``max_request_bytes``); these are what the model
        itself would make of them (pixels after resizing, crops, samples, tokens, steps)."""

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


    # -- Api.INFER: tensors in, tensors out ------------------------------------------------
    def from_tensors(self, request: InferRequest) -> Any:
        """A V2 request (decoded and checked against ``metadata`` by the codec) as what
        ``prepare`` takes; ``InvalidInput`` for what only the model can judge (an element
        that is not UTF-8 text, too many items). Pure: it may run in a worker thread."""

    def to_tensors(self, result: Any, report: Report) -> list[Tensor]:
        """The handle's ``result()`` (and its report's extra outputs) as output tensors,
        named as ``metadata.outputs``."""

    def identity(self, inputs: Any) -> Sequence[str] | None:
        """What identifies ``inputs`` (what ``prepare`` takes) for the response cache; None:
        never cached. Two inputs with the same identity must get the same answer."""

    def to_plain(self, result: Any) -> dict[str, Any]:
        """The answer to a plain upload (its one input's file as the body) as plain JSON."""

    # -- Api.PREDICT ------------------------------------------------------------------------
    def to_json(self, result: Any) -> Any:
        """The handle's ``result()`` (or, for a model that ``streams``, one of the partials
        its ``events()`` yields) as a plain JSON value."""

    # -- Api.STREAM -------------------------------------------------------------------------
    def open_stream(self, content_type: str, params: Mapping[str, str],
                    ctx: RequestContext) -> RecordStream:
        """Admit one streamed request (``Overloaded``), its content type and parameters
        checked (4xx)."""


class ModelBase:
    """Defaults for the contract's optional verbs: a kind's served model may inherit them."""

    batches = False
    limits: tuple[Limit, ...] = ()

    def attach(self, observers: Any) -> None:
        """Nothing to report beyond the Timeline."""

    def neighbours(self, busy: Callable[[], bool]) -> None:
        """Nothing runs on the event loop."""

    def identity(self, inputs: Any) -> Sequence[str] | None:
        """Not cached."""
        return None

    def from_tensors(self, request: InferRequest) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not serve V2 infer")

    def to_tensors(self, result: Any, report: Report) -> list[Tensor]:
        raise NotImplementedError(f"{type(self).__name__} does not serve V2 infer")

    def to_plain(self, result: Any) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} takes no plain uploads")

    def to_json(self, result: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not serve predict")

    def open_stream(self, content_type: str, params: Mapping[str, str],
                    ctx: RequestContext) -> RecordStream:
        raise NotImplementedError(f"{type(self).__name__} does not stream")

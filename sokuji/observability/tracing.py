"""OpenTelemetry traces: the sampling decision, the W3C ``traceparent`` a request brings.

Only what a request touches while it runs lives here, and none of it imports OpenTelemetry
(``import sokuji`` stays light; the SDK is imported when ``[tracing] enabled``, by
``tracing_spans.py``):

- **The decision**, once, when the request enters (``Tracer.sample``): a valid W3C
  ``traceparent`` whose sampled flag is set is always traced (parent-based), one whose flag
  is clear never is; without one (or with one that is not valid: ignored, a new root; never
  a 4xx) a ``random()`` below ``sample_ratio`` decides. An unsampled request costs that
  comparison and nothing else: no OpenTelemetry object, no id, nothing per stage.
- **A traced request** carries a ``Trace`` (``core/model.py``, in its
  ``RequestContext.trace``; its hops and ids: ``core/trace.py``): the trace id,
  its parent (the client's span, if any) and the id of the server span it will have. Nothing
  is recorded while it runs except upstream hops (``Trace.hop``: a child span id, so the
  upstream's spans hang under ours, and the hop's start and end). When the request has been
  answered, ``Tracer.end_request`` / ``end_generation`` build every span after the fact from
  the stamps Sokuji keeps anyway (the ``Timeline``, a generation's ``Timing``, a pipeline's
  step times): ``tracing_spans.py``.
- **The context** reaches the request's ``RequestContext`` through ``current`` (a context
  variable set by the app in the request's own task, read by ``scheduling.context``), so no
  endpoint's signature changes for it.
"""

from __future__ import annotations

import contextvars
import random
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeGuard

from sokuji.core.model import Trace
from sokuji.core.trace import TRACEPARENT as TRACEPARENT  # the header ``sample`` reads

if TYPE_CHECKING:
    from sokuji.config_ops import TracingConfig
    from sokuji.core.request import Timeline
    from sokuji.llm.request import Finish, Timing
    from sokuji.observability.tracing_spans import SpanSink
    from sokuji.pipelines.run import Run

MAX_TRACEPARENT = 256
"""Longer headers are ignored without being parsed (a future version may append fields,
but not kilobytes of them)."""
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})"
                          r"(-[\x21-\x7e]*)?")
_getrandbits = random.getrandbits

current: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("sokuji_trace",
                                                                       default=None)
"""The traced request's ``Trace``, set in the request's task when it is sampled."""


def parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """(trace id, parent span id, flags) of a valid W3C ``traceparent``, else None.

    Valid (W3C Trace Context level 1): lower-case hex fields ``version-trace_id-parent_id-
    flags``; version ``ff`` is invalid; version ``00`` has exactly 55 characters; a later
    version may append ``-...`` fields, which are ignored; an all-zero trace id or parent id
    is invalid."""
    if len(value) > MAX_TRACEPARENT:
        return None
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, int(flags_hex, 16)


def valid_traceparent(value: str | None) -> TypeGuard[str]:
    return value is not None and parse_traceparent(value) is not None


class Tracer:
    """The server's tracer: samples requests, and hands traced ones to the span sink."""

    def __init__(self, config: TracingConfig, sink: SpanSink | None = None) -> None:
        self.config = config
        self.ratio = config.sample_ratio
        self._random = random.random
        if sink is None:
            from sokuji.observability.tracing_spans import SpanSink

            sink = SpanSink(config)
        self.sink = sink

    def sample(self, traceparent: str | None) -> Trace | None:
        """The decision for a request that just arrived with ``traceparent`` (or none)."""
        if traceparent is None:
            if self._random() >= self.ratio:
                return None
            return Trace(_getrandbits(128) or 1)
        parsed = parse_traceparent(traceparent)
        if parsed is None:  # not valid: ignored, a new root under the ratio
            return self.sample(None)
        trace_id, parent_id, flags = parsed
        return Trace(trace_id, parent_id) if flags & 1 else None

    # -- after the answer (on the loop, off the request's own latency) ----------------------
    def end_request(self, trace: Trace, operation: str, model: str, response_model: str,
                    timeline: Timeline, status: int, path: str,
                    error: BaseException | None = None) -> None:
        """An inference request (encoder, pipeline, media) answered with ``status``."""
        self.sink.request(trace, operation, model, response_model, timeline, status, path,
                          error)

    def end_generation(self, trace: Trace, operation: str, model: str, request: Any,
                       timing: Timing | None, finish: Finish | None, status: int, path: str,
                       error: BaseException | None = None) -> None:
        """A generation (chat, text completion) ended: answered, failed or cancelled."""
        self.sink.generation(trace, operation, model, request, timing, finish, status, path,
                             error)

    def pipeline_observer(self, observe: Callable[[Run], None]) -> Callable[[Run], None]:
        """A pipeline's ``on_done``: ``observe`` (the metrics), then a traced request's
        steps as spans."""
        def on_done(run: Run) -> None:
            observe(run)
            trace = run.ctx.trace
            if trace is not None:
                self.sink.steps(trace, run)
        return on_done

    def shutdown(self) -> None:
        """Export what is queued, then stop the exporter (the server is stopping)."""
        self.sink.shutdown()


def build(config: TracingConfig) -> Tracer | None:
    """The server's tracer, or None when tracing is off (every hook then costs one test)."""
    return Tracer(config) if config.enabled else None

"""The spans of a traced request, built after it was answered, and their export over OTLP.

Imported only when tracing is enabled (it imports the OpenTelemetry SDK). Every span is
built from stamps Sokuji keeps anyway (``perf_counter_ns``, turned into epoch nanoseconds
by one offset), with explicit start and end times, as a ``ReadableSpan`` handed straight to
the SDK's ``BatchSpanProcessor`` (what a span's ``end()`` does). That skips the live-span
machinery a span made after the fact does not need (locks, the sampler, context
management): 9 spans cost ~37 us this way against ~200 us through ``start_span`` /
``end``. The processor's thread batches them to the SDK's ``OTLPSpanExporter``
(HTTP/protobuf) with a faster encoding (``tracing_otlp.py``); a full queue drops spans,
never delays a request.

The tree (span names; all in the client's trace when it sent a sampled ``traceparent``):

- ``{operation} {model}`` (SERVER; ``infer minilm``, ``embeddings minilm``, ``chat
  smollm2``, ``text_completion smollm2``): the request, arrival to answer, parent = the
  client's span. GenAI attributes (``gen_ai.operation.name``, ``gen_ai.request.model``,
  ``gen_ai.response.model``, ``gen_ai.usage.*``, ``gen_ai.request.max_tokens`` ...), HTTP
  ones, ``sokuji.*`` (priority, timeout, tenant as configured: by default a hash keyed by
  ``tenant_secret``, else by a key drawn at start).
- its stages, laid end to end (they tile it): an encoder's ``Timeline`` (``decode`` ...
  ``encode``; a stage stamped twice shows once, its summed time) or a generation's
  ``preprocess``, ``queue``, ``prefill``, ``decode`` (``Timing``);
- ``step {name}`` per pipeline step that ran (they overlap where the steps did);
- ``upstream {model}`` (CLIENT) per upstream call: the parent of the upstream's own spans.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from sokuji.core.model import Trace
from sokuji.core.request import STAGES
from sokuji.core.trace import Hop, new_span_id
from sokuji.observability.tracing_otlp import FastOTLPSpanExporter

if TYPE_CHECKING:
    from sokuji.config_ops import TracingConfig
    from sokuji.core.request import Timeline
    from sokuji.llm.request import Finish, Timing
    from sokuji.pipelines.run import Run

SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.UNSET)
_ERROR = Status(StatusCode.ERROR)
_GENERATION_STAGES = ("preprocess", "queue", "prefill", "decode")
_CLOCK_REFRESH_NS = 60 * 1_000_000_000
SHUTDOWN_S = 3.0
Attributes = dict[str, Any]


class _OncePerMinute(logging.Filter):
    """The processor warns once per span it drops (a collector down or too slow: thousands
    a second): let one through a minute, saying how many were held back."""

    def __init__(self) -> None:
        super().__init__()
        self.last = -1e9
        self.held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "dropping" not in record.getMessage():
            return True
        now = time.monotonic()
        if now - self.last < 60:
            self.held += 1
            return False
        if self.held:
            record.msg = f"{record.getMessage()} ({self.held} more not logged)"
            record.args = ()
        self.last, self.held = now, 0
        return True


_DROPS = _OncePerMinute()


class SpanSink:
    """Builds spans and queues them for export."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        self.config = config
        self.resource = Resource.create({"service.name": config.service_name})
        self.scope = InstrumentationScope("sokuji")
        if exporter is None:
            exporter = FastOTLPSpanExporter(endpoint=config.endpoint,
                                            headers=dict(config.headers),
                                            timeout=config.export_timeout_ms / 1e3)
        self.exporter = exporter
        self.processor = BatchSpanProcessor(
            exporter, max_queue_size=config.queue_size,
            schedule_delay_millis=config.export_delay_ms,
            max_export_batch_size=min(config.export_batch_size, config.queue_size),
            export_timeout_millis=config.export_timeout_ms)
        self.provider = TracerProvider(resource=self.resource)
        """Owns the processor: its ``shutdown`` exports what is queued."""
        self.provider.add_span_processor(self.processor)
        logging.getLogger("opentelemetry.sdk._shared_internal").addFilter(_DROPS)
        self._tenants: dict[str, str] = {}
        self._tenant_key = config.tenant_secret.encode()[:64] or secrets.token_bytes(32)
        """The tenant hash's key: the configured secret, else one drawn at start (hashes
        then match within this process only)."""
        self._offset_at = 0
        self._offset = 0
        self._epoch(time.perf_counter_ns())

    def _epoch(self, now_ns: int) -> int:
        """perf_counter_ns -> epoch ns offset (re-read every minute: the wall clock may be
        slewed)."""
        if now_ns - self._offset_at > _CLOCK_REFRESH_NS:
            self._offset = time.time_ns() - time.perf_counter_ns()
            self._offset_at = now_ns
        return self._offset

    def _span(self, trace: Trace, name: str, span_id: int, parent: SpanContext | None,
              start_ns: int, end_ns: int, attributes: Attributes,
              kind: SpanKind = SpanKind.INTERNAL, error: bool = False) -> None:
        off = self._offset
        self.processor.on_end(ReadableSpan(
            name, SpanContext(trace.trace_id, span_id, False, SAMPLED), parent,
            self.resource, attributes, kind=kind, status=_ERROR if error else _OK,
            start_time=start_ns + off, end_time=max(end_ns, start_ns) + off,
            instrumentation_scope=self.scope))

    def _child(self, trace: Trace, ours: SpanContext, name: str, start_ns: int, end_ns: int,
               attributes: Attributes | None = None, error: bool = False) -> None:
        """A span under ``ours`` (the server span's context)."""
        self._span(trace, name, new_span_id(), ours, start_ns, end_ns, attributes or {},
                   error=error)

    @staticmethod
    def _ours(trace: Trace) -> SpanContext:
        """The server span's context: the parent of the request's other spans."""
        return SpanContext(trace.trace_id, trace.span_id, False, SAMPLED)

    # -- the request's span ----------------------------------------------------------------
    def _server(self, trace: Trace, operation: str, model: str, response_model: str,
                start_ns: int, end_ns: int, status: int, path: str,
                error: BaseException | None, extra: Attributes) -> SpanContext:
        """The request's span (and its hops'); returns its context."""
        attrs: Attributes = {"gen_ai.operation.name": operation,
                             "http.request.method": "POST", "url.path": path,
                             "http.response.status_code": status}
        if model:
            attrs["gen_ai.request.model"] = model
        if status == 200 and response_model:
            attrs["gen_ai.response.model"] = response_model
        if status >= 400:
            attrs["error.type"] = getattr(error, "code", None) or str(status)
        ctx = trace.ctx
        if ctx is not None:
            attrs["sokuji.priority"] = ctx.priority.name.lower()
            if ctx.deadline_ns is not None:
                attrs["sokuji.timeout_ms"] = (ctx.deadline_ns - ctx.arrival_ns) / 1e6
            if ctx.request_id:
                attrs["sokuji.request_id"] = ctx.request_id
            tenant = self._tenant(ctx.tenant)
            if tenant:
                attrs["sokuji.tenant"] = tenant
        attrs.update(extra)
        name = f"{operation} {model}" if model else operation
        client = SpanContext(trace.trace_id, trace.parent_id, True, SAMPLED) \
            if trace.parent_id else None
        self._span(trace, name, trace.span_id, client, start_ns, end_ns, attrs,
                   SpanKind.SERVER, error=status >= 500)
        ours = self._ours(trace)
        for hop in trace.hops:
            self._hop(trace, ours, hop, end_ns)
        return ours

    def _tenant(self, name: str) -> str:
        how = self.config.tenant_attribute
        if how == "off" or not name:
            return ""
        if how == "name":
            return name
        shown = self._tenants.get(name)
        if shown is None:
            shown = hashlib.blake2b(name.encode(), key=self._tenant_key,
                                    digest_size=8).hexdigest()
            if len(self._tenants) < 10_000:
                self._tenants[name] = shown
        return shown

    def _hop(self, trace: Trace, ours: SpanContext, hop: Hop, end_ns: int) -> None:
        url = urlsplit(hop.url)
        attrs: Attributes = {"http.request.method": "POST", "url.path": url.path,
                             "server.address": url.hostname or ""}
        if url.port is not None:
            attrs["server.port"] = url.port
        failed = False
        if isinstance(hop.outcome, int):
            attrs["http.response.status_code"] = hop.outcome
            failed = hop.outcome >= 400
            if failed:
                attrs["error.type"] = str(hop.outcome)
        elif hop.outcome:
            attrs["error.type"] = hop.outcome
            failed = True
        self._span(trace, hop.name, hop.span_id, ours, hop.start_ns, hop.end_ns or end_ns,
                   attrs, SpanKind.CLIENT, error=failed)

    # -- encoders, pipelines, media: the Timeline ------------------------------------------
    def request(self, trace: Trace, operation: str, model: str, response_model: str,
                tl: Timeline, status: int, path: str, error: BaseException | None) -> None:
        now = time.perf_counter_ns()
        self._epoch(now)
        end = tl.last_ns if status == 200 else max(now, tl.last_ns)
        ours = self._server(trace, operation, model, response_model, tl.start_ns, end, status,
                            path, error, {})
        at = tl.start_ns
        durations = tl.durations_ns
        for stage in STAGES:
            took = durations.get(stage)
            if took is None:
                continue
            note = tl.notes.get(stage)
            self._child(trace, ours, stage.value, at, at + took,
                        {"sokuji.note": note} if note else None)
            at += took

    # -- generations: the Timing -------------------------------------------------------------
    def generation(self, trace: Trace, operation: str, model: str, request: Any,
                   timing: Timing | None, finish: Finish | None, status: int, path: str,
                   error: BaseException | None) -> None:
        now = time.perf_counter_ns()
        self._epoch(now)
        ctx = trace.ctx
        start = timing.arrival_ns if timing is not None else \
            ctx.arrival_ns if ctx is not None else now
        end = (timing.end_ns if timing is not None else 0) or now
        attrs: Attributes = {}
        if request is not None:
            for key, attr in (("max_tokens", "gen_ai.request.max_tokens"),
                              ("temperature", "gen_ai.request.temperature"),
                              ("top_p", "gen_ai.request.top_p"),
                              ("seed", "gen_ai.request.seed")):
                value = getattr(request, key, None)
                if value is not None:
                    attrs[attr] = value
            for key, attr, default in (  # (OpenTelemetry's names; set only when asked)
                    ("top_k", "gen_ai.request.top_k", 0),
                    ("presence_penalty", "gen_ai.request.presence_penalty", 0.0),
                    ("frequency_penalty", "gen_ai.request.frequency_penalty", 0.0)):
                value = getattr(request, key, default)
                if value != default:
                    attrs[attr] = value
            attrs["sokuji.stream"] = bool(getattr(request, "stream", False))
        if finish is not None:
            attrs["gen_ai.usage.output_tokens"] = finish.completion_tokens
            attrs["gen_ai.response.finish_reasons"] = (finish.reason,)
        if timing is not None:
            if timing.prompt_tokens:
                attrs["gen_ai.usage.input_tokens"] = timing.prompt_tokens
            if timing.prefix_lookup != "off":
                attrs["sokuji.prefix_cache"] = timing.prefix_lookup
                attrs["sokuji.prefix_cache.reused_tokens"] = timing.reused_tokens
            if timing.speculative != "off":
                attrs["sokuji.speculative"] = timing.speculation()
        ours = self._server(trace, operation, model, model, start, end, status, path, error,
                            attrs)
        if timing is None:
            return
        stamps = (timing.arrival_ns, timing.submitted_ns, timing.admitted_ns,
                  timing.first_token_ns, timing.end_ns)
        for i, name in enumerate(_GENERATION_STAGES):
            begin, until = stamps[i], stamps[i + 1]
            if not begin:
                break
            extra: Attributes | None = None
            if name == "prefill":
                extra = {"sokuji.prompt_tokens_computed":
                         timing.prompt_tokens - timing.reused_tokens}
            elif name == "decode":
                extra = {"sokuji.tokens": len(timing.token_ns)}
            self._child(trace, ours, name, begin, until or end, extra,
                        error=not until and status >= 500)
            if not until:  # it was in this stage when it ended
                break

    # -- pipelines: the steps ------------------------------------------------------------------
    def steps(self, trace: Trace, run: Run) -> None:
        now = time.perf_counter_ns()
        self._epoch(now)
        critical = set(run.critical_path())
        ours = self._ours(trace)
        for node, t in zip(run.graph.nodes, run.times, strict=True):
            if not t.start_ns:
                continue
            attrs: Attributes = {"sokuji.pipeline": run.graph.name,
                                 "sokuji.step": node.name,
                                 "sokuji.step.kind": node.config.kind,
                                 "sokuji.step.outcome": t.outcome or "unfinished",
                                 "sokuji.critical_path": node.index in critical}
            self._child(trace, ours, f"step {node.name}", t.start_ns, t.end_ns or now, attrs,
                        error=t.outcome in ("failed", "timeout"))

    def shutdown(self) -> None:
        """Export what is queued, waiting at most ``SHUTDOWN_S``: a collector that is down
        must not hold the server's stop for the exporter's retries (they are cut short, and
        what is left is dropped)."""
        done = threading.Event()

        def stop() -> None:
            self.provider.shutdown()
            done.set()
        threading.Thread(target=stop, name="sokuji-trace-stop", daemon=True).start()
        if not done.wait(SHUTDOWN_S):
            self.exporter.shutdown()
            done.wait(1.0)

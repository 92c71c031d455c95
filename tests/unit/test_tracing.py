"""Tracing (issue 16): the W3C ``traceparent`` read strictly, the sampling decision, the spans
made after the fact from a ``Timeline``, a generation's ``Timing`` and a pipeline's steps,
the upstream hop's header, the GenAI metrics' names and buckets, the config's checks.

Spans go to the SDK's own in-memory exporter (the OTLP exporter and a real receiver process
are in ``tests/integration/test_tracing.py``)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.config_ops import TracingConfig
from sokuji.core.model import RequestContext, Trace
from sokuji.core.request import STAGES, Priority, Stage, Timeline
from sokuji.errors import ConfigError, DeadlineExceeded
from sokuji.llm.request import Finish, Timing
from sokuji.observability import tracing
from sokuji.observability.metrics import Metrics
from sokuji.observability.tracing_spans import SpanSink
from sokuji.pipelines.config import PipelineConfig, StepConfig
from sokuji.server import llm_codec
from tests.conftest import client_for

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
SAMPLED = f"00-{TRACE}-{PARENT}-01"


# -- the header -----------------------------------------------------------------------------
@pytest.mark.parametrize("value", [
    SAMPLED,
    f"00-{TRACE}-{PARENT}-00",                      # valid, not sampled
    f"00-{TRACE}-{PARENT}-09",                      # other flags beside sampled
    f"01-{TRACE}-{PARENT}-01",                      # a later version ...
    f"cc-{TRACE}-{PARENT}-01-what-the-future-adds",  # ... may append fields
])
def test_valid_traceparents_parse(value: str) -> None:
    parsed = tracing.parse_traceparent(value)
    assert parsed is not None
    assert parsed[:2] == (int(TRACE, 16), int(PARENT, 16))


@pytest.mark.parametrize("value", [
    "", "garbage", "00", f"00-{TRACE}-{PARENT}",
    f"ff-{TRACE}-{PARENT}-01",                      # version ff is invalid
    f"00-{'0' * 32}-{PARENT}-01",                   # all-zero trace id
    f"00-{TRACE}-{'0' * 16}-01",                    # all-zero parent id
    f"00-{TRACE.upper()}-{PARENT}-01",              # upper-case hex
    f"00-{TRACE}-{PARENT}-01-extra",                # version 00 has exactly 55 characters
    f"00-{TRACE}-{PARENT}-01 ", f" 00-{TRACE}-{PARENT}-01",
    f"00-{TRACE}-{PARENT}-1",                       # short flags
    f"00-{TRACE[:-1]}-{PARENT}0-01",                # the separators in the wrong places
    f"01-{TRACE}-{PARENT}-01x",                     # a later version's fields start with '-'
    f"01-{TRACE}-{PARENT}-01-" + "x" * 300,         # too long to parse
    f"0g-{TRACE}-{PARENT}-01", f"00_{TRACE}_{PARENT}_01", f"00-{TRACE}-{PARENT}-01\n",
])
def test_invalid_traceparents_are_none(value: str) -> None:
    assert tracing.parse_traceparent(value) is None
    assert not tracing.valid_traceparent(value)


# -- the decision ---------------------------------------------------------------------------
class Sink(SpanSink):
    """The real sink, exporting to the SDK's in-memory exporter."""

    def __init__(self, config: TracingConfig) -> None:
        self.memory = InMemorySpanExporter()
        super().__init__(config, self.memory)

    def finished(self) -> list[ReadableSpan]:
        self.processor.force_flush()
        return list(self.memory.get_finished_spans())


def make_tracer(ratio: float = 1.0, **options: Any) -> tuple[tracing.Tracer, Sink]:
    config = TracingConfig(enabled=True, sample_ratio=ratio, export_delay_ms=10, **options)
    sink = Sink(config)
    return tracing.Tracer(config, sink), sink


@pytest.fixture
def traced() -> Iterator[tuple[tracing.Tracer, Sink]]:
    tracer, sink = make_tracer()
    yield tracer, sink
    tracer.shutdown()


def test_sampling_follows_the_parent_else_the_ratio() -> None:
    never, _ = make_tracer(0.0)
    always, _ = make_tracer(1.0)
    try:
        assert never.sample(None) is None
        kept = never.sample(SAMPLED)  # a sampled parent is always traced
        assert kept is not None and (kept.trace_id, kept.parent_id) == \
            (int(TRACE, 16), int(PARENT, 16))
        assert kept.span_id not in (0, kept.parent_id)
        assert always.sample(f"00-{TRACE}-{PARENT}-00") is None  # unsampled parent: never
        root = always.sample(None)
        assert root is not None and root.parent_id == 0 and root.trace_id
        for bad in (f"ff-{TRACE}-{PARENT}-01", f"00-{'0' * 32}-{PARENT}-01", "junk"):
            assert never.sample(bad) is None  # ignored: a new root under the ratio
            new = always.sample(bad)
            assert new is not None and new.parent_id == 0 and new.trace_id != int(TRACE, 16)
    finally:
        never.shutdown()
        always.shutdown()


def test_the_ratio_is_a_share() -> None:
    tracer, _ = make_tracer(0.25)
    try:
        tracer._random = iter([0.1, 0.3, 0.2499, 0.25, 0.9]).__next__
        assert [tracer.sample(None) is not None for _ in range(5)] == \
            [True, False, True, False, False]
    finally:
        tracer.shutdown()


# -- spans from stamps ----------------------------------------------------------------------
def context(trace: Trace, tenant: str = "acme") -> RequestContext:
    ctx = RequestContext(tenant=tenant, priority=Priority.BATCH, deadline_ns=5_000_000_000,
                         arrival_ns=1_000_000_000, request_id="rid-1", trace=trace)
    trace.ctx = ctx
    return ctx


def by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans}


def test_an_encoder_request_is_a_server_span_tiled_by_its_stages(
        traced: tuple[tracing.Tracer, Sink]) -> None:
    tracer, sink = traced
    trace = tracer.sample(SAMPLED)
    assert trace is not None
    context(trace)
    tl = Timeline(1_000_000_000)
    at = tl.start_ns
    for i, stage in enumerate(STAGES):
        if stage is Stage.CACHE:
            continue  # a stage that did not happen has no span
        at += (i + 1) * 1000
        tl.mark(stage, at)
    tl.notes[Stage.INFER] = "int8"
    tracer.end_request(trace, "infer", "minilm", "minilm@int8", tl, 200, "/v2/models/minilm/infer")
    spans = by_name(sink.finished())
    server = spans.pop("infer minilm")
    assert server.kind is SpanKind.SERVER
    assert server.context is not None and server.parent is not None
    assert server.context.trace_id == int(TRACE, 16) and server.parent.span_id == int(PARENT, 16)
    assert server.parent.is_remote and server.context.span_id == trace.span_id
    assert server.attributes is not None
    attrs = dict(server.attributes)
    assert attrs["gen_ai.operation.name"] == "infer"
    assert attrs["gen_ai.request.model"] == "minilm"
    assert attrs["gen_ai.response.model"] == "minilm@int8"
    assert attrs["http.response.status_code"] == 200 and attrs["sokuji.priority"] == "batch"
    assert attrs["sokuji.timeout_ms"] == 4000.0 and attrs["sokuji.request_id"] == "rid-1"
    assert attrs["sokuji.tenant"] != "acme" and len(str(attrs["sokuji.tenant"])) == 16
    assert server.end_time is not None and server.start_time is not None
    assert server.end_time - server.start_time == tl.total_ns
    assert list(spans) == [s.value for s in STAGES if s is not Stage.CACHE]
    edge = server.start_time
    for name, span in spans.items():  # laid end to end: they tile the request
        assert span.parent is not None and span.parent.span_id == trace.span_id
        assert span.start_time == edge and span.end_time is not None
        assert span.end_time - span.start_time == tl.durations_ns[Stage(name)]
        edge = span.end_time
    assert edge == server.end_time
    assert dict(spans["infer"].attributes or {}) == {"sokuji.note": "int8"}


def test_a_failed_request_is_an_error_span(traced: tuple[tracing.Tracer, Sink]) -> None:
    tracer, sink = traced
    trace = tracer.sample(None)
    assert trace is not None
    tl = Timeline()
    tl.mark(Stage.DECODE)
    tracer.end_request(trace, "embeddings", "", "", tl, 503, "/v1/embeddings",
                       DeadlineExceeded("late"))
    server = by_name(sink.finished())["embeddings"]  # no model known: the operation alone
    assert server.parent is None  # a root
    assert server.status.status_code is StatusCode.ERROR
    assert dict(server.attributes or {})["error.type"] == "deadline_exceeded"


@pytest.mark.parametrize(("how", "shown"), [("name", "acme"), ("off", None)])
def test_the_tenant_attribute_as_configured(how: str, shown: str | None) -> None:
    tracer, sink = make_tracer(tenant_attribute=how)
    try:
        trace = tracer.sample(None)
        assert trace is not None
        context(trace)
        tracer.end_request(trace, "infer", "m", "m", Timeline(), 200, "/v2/models/m/infer")
        assert dict(sink.finished()[0].attributes or {}).get("sokuji.tenant") == shown
    finally:
        tracer.shutdown()


def test_the_tenant_hash_is_keyed() -> None:
    hashes = []
    for secret in ("", "a-secret-key"):
        tracer, sink = make_tracer(tenant_secret=secret)
        trace = tracer.sample(None)
        assert trace is not None
        context(trace)
        tracer.end_request(trace, "infer", "m", "m", Timeline(), 200, "/p")
        hashes.append(dict(sink.finished()[0].attributes or {})["sokuji.tenant"])
        tracer.shutdown()
    assert hashes[0] != hashes[1]


def generation_timing(admitted: bool = True) -> Timing:
    t = Timing(arrival_ns=10_000_000, submitted_ns=11_000_000, prompt_tokens=40,
               reused_tokens=8, prefix_lookup="hit")
    if admitted:
        t.admitted_ns = 15_000_000
        t.first_token_ns = 40_000_000
        t.token_ns = [40_000_000, 50_000_000, 60_000_000]
        t.end_ns = 61_000_000
    return t


def test_a_generation_has_genai_attributes_and_its_phases(
        traced: tuple[tracing.Tracer, Sink]) -> None:
    tracer, sink = traced
    trace = tracer.sample(SAMPLED)
    assert trace is not None
    req = llm_codec.decode(b'{"model": "smollm2", "max_tokens": 3, "temperature": 0, '
                           b'"seed": 7, "messages": [{"role": "user", "content": "hi"}]}', True)
    timing = generation_timing()
    tracer.end_generation(trace, "chat", "smollm2", req, timing, Finish("length", 3), 200,
                          "/v1/chat/completions")
    spans = by_name(sink.finished())
    server = spans.pop("chat smollm2")
    attrs = dict(server.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == "smollm2"
    assert attrs["gen_ai.usage.input_tokens"] == 40 and attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["gen_ai.request.max_tokens"] == 3 and attrs["gen_ai.request.seed"] == 7
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)  # type: ignore[arg-type]
    assert attrs["sokuji.prefix_cache"] == "hit" and attrs["sokuji.stream"] is False
    stamps = [timing.arrival_ns, timing.submitted_ns, timing.admitted_ns,
              timing.first_token_ns, timing.end_ns]
    assert list(spans) == ["preprocess", "queue", "prefill", "decode"]
    assert server.start_time is not None
    offset = server.start_time - timing.arrival_ns
    for i, span in enumerate(spans.values()):
        assert (span.start_time, span.end_time) == (stamps[i] + offset, stamps[i + 1] + offset)
    assert dict(spans["prefill"].attributes or {})["sokuji.prompt_tokens_computed"] == 32
    assert dict(spans["decode"].attributes or {})["sokuji.tokens"] == 3


def test_a_generation_that_failed_in_the_queue(traced: tuple[tracing.Tracer, Sink]) -> None:
    tracer, sink = traced
    trace = tracer.sample(None)
    assert trace is not None
    timing = generation_timing(admitted=False)
    tracer.end_generation(trace, "text_completion", "smollm2", None, timing, None, 504,
                          "/v1/completions", DeadlineExceeded("late"))
    spans = by_name(sink.finished())
    assert list(spans) == ["text_completion smollm2", "preprocess", "queue"]
    assert spans["queue"].status.status_code is StatusCode.ERROR  # it ended there
    assert spans["text_completion smollm2"].status.status_code is StatusCode.ERROR


def test_an_upstream_hop_names_our_span_as_the_upstreams_parent(
        traced: tuple[tracing.Tracer, Sink]) -> None:
    tracer, sink = traced
    trace = tracer.sample(SAMPLED)
    assert trace is not None
    headers: dict[str, str] = {}
    hop = trace.hop("enc", "http://10.0.0.7:8001/v2/models/enc/infer", headers)
    parsed = tracing.parse_traceparent(headers["traceparent"])
    assert parsed == (int(TRACE, 16), hop.span_id, 1)
    hop.end(503)
    tracer.end_request(trace, "infer", "far", "far", Timeline(), 200, "/v2/models/far/infer")
    client = by_name(sink.finished())["upstream enc"]
    assert client.kind is SpanKind.CLIENT
    assert client.context is not None and client.context.span_id == hop.span_id
    assert client.parent is not None and client.parent.span_id == trace.span_id
    attrs = dict(client.attributes or {})
    assert attrs["server.address"] == "10.0.0.7" and attrs["server.port"] == 8001
    assert attrs["http.response.status_code"] == 503 and attrs["error.type"] == "503"
    assert client.status.status_code is StatusCode.ERROR


def test_an_untraced_upstream_call_forwards_only_a_valid_traceparent() -> None:
    from sokuji.routing.config import UpstreamOptions
    from sokuji.routing.upstream_http import UpstreamClient

    client = UpstreamClient("far", UpstreamOptions(protocol="v2", url="http://127.0.0.1:9",
                                                   upstream_model="m"))
    for given, sent in ((SAMPLED, SAMPLED), (f"ff-{TRACE}-{PARENT}-01", None),
                        (f"00-{TRACE}-{PARENT}-00", f"00-{TRACE}-{PARENT}-00"), (None, None)):
        ctx = RequestContext(tenant="t", priority=Priority.INTERACTIVE, deadline_ns=None,
                             arrival_ns=0, traceparent=given)
        assert client.headers(ctx, 1.0).get("traceparent") == sent


# -- metrics and config ---------------------------------------------------------------------
def test_genai_metrics_have_the_conventions_names_labels_and_buckets() -> None:
    metrics = Metrics()
    metrics.genai.request("infer", "minilm", 15_000_000)
    metrics.genai.generation("chat", "smollm2", generation_timing())
    text = metrics.render().decode()
    labels = 'gen_ai_operation_name="infer",gen_ai_request_model="minilm"'
    assert f'gen_ai_server_request_duration_seconds_bucket{{{labels},le="0.01"}} 0.0' in text
    assert f'gen_ai_server_request_duration_seconds_bucket{{{labels},le="0.02"}} 1.0' in text
    assert f'gen_ai_server_request_duration_seconds_bucket{{{labels},le="81.92"}} 1.0' in text
    chat = 'gen_ai_operation_name="chat",gen_ai_request_model="smollm2"'
    # TTFT 30 ms; time per output token: 21 ms over the 2 tokens after the first
    assert f'gen_ai_server_time_to_first_token_seconds_bucket{{{chat},le="0.02"}} 0.0' in text
    assert f'gen_ai_server_time_to_first_token_seconds_bucket{{{chat},le="0.04"}} 1.0' in text
    assert f'gen_ai_server_time_per_output_token_seconds_bucket{{{chat},le="0.01"}} 0.0' in text
    assert f'gen_ai_server_time_per_output_token_seconds_bucket{{{chat},le="0.025"}} 1.0' \
        in text
    assert f"gen_ai_server_time_per_output_token_seconds_sum{{{chat}}} 0.0105" in text


def test_the_config_checks_the_endpoint_and_hides_the_headers() -> None:
    with pytest.raises(ConfigError, match=r"tracing\.endpoint.*http:// or https://"):
        cfg.validate(cfg.ServerConfig(tracing=TracingConfig(endpoint="collector:4318")))
    config = cfg.validate(cfg.ServerConfig(tracing=TracingConfig(
        enabled=True, headers={"authorization": "Bearer s3cr3t-t0ken"})))
    assert "s3cr3t" not in repr(config)
    assert tracing.build(cfg.ServerConfig().tracing) is None  # off by default


# -- over HTTP, in process ------------------------------------------------------------------
def upper(question: str) -> str:
    return question.upper()


def twice(text: str) -> str:
    return text + text


@pytest.fixture(scope="module")
def app() -> Iterator[tuple[TestClient, Sink]]:
    here = "tests.unit.test_tracing"
    steps = (StepConfig(name="up", kind="python", function=f"{here}:upper",
                            inputs={"question": "input.question"}),
             StepConfig(name="twice", kind="python", function=f"{here}:twice",
                            inputs={"text": "up"}))
    config = cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="synth", runtime="synthetic", options={"base_ms": 0.0}),),
        pipelines=(PipelineConfig(name="shout", steps=steps),), builtin_pipelines=False,
        tracing=TracingConfig(enabled=True, sample_ratio=1.0),
        cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))
    with client_for(config) as client:
        tracer = client.app.tracer  # type: ignore[attr-defined]
        tracer.sink.shutdown()  # (nothing was queued: nothing is sent)
        sink = tracer.sink = Sink(config.tracing)
        yield client, sink
        sink.shutdown()


def v2(question: str) -> dict[str, Any]:
    return {"inputs": [{"name": "question", "datatype": "BYTES", "shape": [1],
                        "data": [question]}]}


def test_a_pipelines_steps_are_spans_under_the_request(app: tuple[TestClient, Sink]) -> None:
    client, sink = app
    r = client.post("/v2/models/shout/infer", json=v2("hi"), headers={"traceparent": SAMPLED})
    assert r.status_code == 200 and "HIHI" in r.text
    spans = [s for s in sink.finished() if s.context and s.context.trace_id == int(TRACE, 16)]
    server = by_name(spans)["infer shout"]
    assert server.context is not None
    steps = {s.name: s for s in spans if s.name.startswith("step ")}
    assert set(steps) == {"step up", "step twice"}
    for span in steps.values():
        assert span.parent is not None and span.parent.span_id == server.context.span_id
        assert dict(span.attributes or {})["sokuji.step.outcome"] == "ok"
        assert dict(span.attributes or {})["sokuji.critical_path"] is True
    assert steps["step up"].end_time <= steps["step twice"].start_time  # type: ignore[operator]


@pytest.mark.parametrize("header", [
    f"ff-{TRACE}-{PARENT}-01", f"00-{'0' * 32}-{PARENT}-01", "\x7f" * 600, "00-zz", ""])
def test_a_bad_traceparent_is_a_new_root_never_an_error(app: tuple[TestClient, Sink],
                                                         header: str) -> None:
    client, sink = app
    sink.memory.clear()
    r = client.post("/v2/models/synth/infer", headers={"traceparent": header}, json={
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["x"]}]})
    assert r.status_code == 200
    server = by_name(sink.finished())["infer synth"]
    assert server.parent is None and server.context is not None
    assert server.context.trace_id != int(TRACE, 16)


def test_the_fast_encoding_is_the_sdks() -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from sokuji.observability.tracing_otlp import Encoder

    tracer, sink = make_tracer()
    try:
        trace = tracer.sample(SAMPLED)
        assert trace is not None
        context(trace)
        trace.hop("enc", "http://127.0.0.1:9/x", {}).end("timeout")
        tl = Timeline()
        for stage in STAGES:
            tl.mark(stage)
        tl.notes[Stage.CACHE] = "miss"
        tracer.end_request(trace, "infer", "m", "m", tl, 200, "/v2/models/m/infer")
        req = llm_codec.decode(b'{"model": "g", "max_tokens": 3, "temperature": 0.5, '
                               b'"stop": ["a", "b"], "prompt": "x"}', False)
        tracer.end_generation(trace, "text_completion", "g", req, generation_timing(),
                              Finish("stop", 2), 200, "/v1/completions")
        tracer.end_generation(trace, "text_completion", "g", req, generation_timing(False),
                              None, 504, "/v1/completions", DeadlineExceeded("late"))
        spans = sink.finished()
    finally:
        tracer.shutdown()
    assert len(spans) > 15
    encoder = Encoder()
    for _ in range(2):  # the second time from the encoder's caches
        ours = ExportTraceServiceRequest.FromString(encoder.encode(spans))
        assert ours == ExportTraceServiceRequest.FromString(
            encode_spans(spans).SerializeToString())


def _tenant_hash(secret: str = "") -> str:
    tracer, sink = make_tracer(tenant_secret=secret)
    try:
        trace = tracer.sample(None)
        assert trace is not None
        context(trace)
        tracer.end_request(trace, "infer", "m", "m", Timeline(), 200, "/p")
        return str(dict(sink.finished()[0].attributes or {})["sokuji.tenant"])
    finally:
        tracer.shutdown()


def test_the_tenant_hash_is_keyed_with_no_secret_configured() -> None:
    """The replay of finding 6: with ``tenant_secret`` empty (the default) the attribute was
    BLAKE2b of the name with no key, which anyone who guesses a tenant's name can compute. Now
    a key drawn at start keys it: opaque, stable within the process, not across starts."""
    import hashlib

    unkeyed = hashlib.blake2b(b"acme", digest_size=8).hexdigest()
    first, second = _tenant_hash(), _tenant_hash()
    assert unkeyed not in (first, second)
    assert first != second  # a fresh key per start
    assert _tenant_hash("shared-secret") == _tenant_hash("shared-secret")

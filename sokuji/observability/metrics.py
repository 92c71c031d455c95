"""Prometheus metrics, derived from the same Timeline that writes ``Server-Timing``.

A request's stage timings go to its model's row buffer (``timings.py``), folded in bulk when
``/metrics`` is scraped; the same fold feeds Triton's statistics extension (``model_stats``;
the mapping of stages is in ``stats.py``) and the dashboard (``timeseries.py``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from sokuji.core.batcher import BatchInfo
from sokuji.core.request import STAGES, Timeline
from sokuji.observability.stats import ModelCounters, StatsSnapshot, snapshot
from sokuji.observability.timings import LATENCY_BUCKETS_S, TimingHistograms

if TYPE_CHECKING:
    from sokuji.config_ops import SloConfig
    from sokuji.llm.engine import GenerationEngine
    from sokuji.llm.request import Timing
    from sokuji.observability.slo import SloBook

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Queue(Protocol):
    @property
    def num_waiting(self) -> int: ...


class _TimingCollector(Collector):
    def __init__(self, models: dict[str, TimingHistograms]) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        request = HistogramMetricFamily("sokuji_request_duration_seconds",
                                        "End-to-end server time of a request.",
                                        labels=["model"])
        stage = HistogramMetricFamily("sokuji_stage_duration_seconds",
                                      "Time a request spent in each stage.",
                                      labels=["model", "stage"])
        edges = [str(b) for b in LATENCY_BUCKETS_S] + ["+Inf"]
        for model, hist in self.models.items():
            hist.flush()
            cumulative = np.cumsum(hist.counts, axis=1)
            for col in range(hist.columns):
                buckets = list(zip(edges, cumulative[col].tolist(), strict=True))
                if col == hist.columns - 1:
                    request.add_metric([model], buckets, float(hist.sums[col]))
                else:
                    stage.add_metric([model, STAGES[col].value], buckets, float(hist.sums[col]))
        yield request
        yield stage


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._timings: dict[str, TimingHistograms] = {}
        self._counters: dict[str, ModelCounters] = {}
        r.register(_TimingCollector(self._timings))
        self.batch_size = Histogram(
            "sokuji_batch_size", "Items per dispatched batch.", ["model"],
            buckets=BATCH_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            "sokuji_batch_padded_tokens", "Padded positions (items x longest) per batch.",
            ["model"], buckets=TOKEN_BUCKETS, registry=r)
        self.padding_tokens = Counter(
            "sokuji_padding_tokens", "Positions computed only as padding.", ["model"],
            registry=r)
        self.input_tokens = Counter(
            "sokuji_input_tokens", "Real (unpadded) input tokens processed.", ["model"],
            registry=r)
        self.queue_depth = Gauge(
            "sokuji_queue_depth", "Requests waiting in the model's queue.", ["model"],
            registry=r)
        self.requests = Counter(
            "sokuji_requests", "Requests answered, by model and HTTP status.",
            ["model", "status"], registry=r)
        self.auth_failures = Counter(
            "sokuji_auth_failures", "Requests refused for their key (401: none or unknown; "
            "403: not allowed the model), counted apart from any model: who may be anyone.",
            ["status"], registry=r)
        self.cache_requests = Counter(
            "sokuji_cache_requests", "Response-cache lookups by result (hit, miss, coalesced, "
            "bypass).", ["model", "result"], registry=r)
        self.cache_errors = Counter(
            "sokuji_cache_errors", "Response-cache backend calls that failed or timed out "
            "(op: get, served as a miss; set, not stored).", ["op"], registry=r)
        self._ok: dict[str, Callable[[], None]] = {}
        self.variant = Gauge(
            "sokuji_model_variant", "1 for the variant each model serves by default (others are "
            "served as versions, under model=\"name@variant\").", ["model", "variant"],
            registry=r)
        self.llm = GenerationMetrics(r)
        from sokuji.observability.genai import GenAIMetrics
        from sokuji.observability.media import MediaMetrics
        from sokuji.observability.pipelines import PipelineMetrics

        self.pipelines = PipelineMetrics(r)
        self.media = MediaMetrics(r)
        self.genai = GenAIMetrics(r, first_token=self.llm.first_token)
        """The GenAI semantic conventions' server metrics (``genai.py``); a generation's
        time to first token is observed there once, for both exporters."""
        self._routing: Any = None
        self.slo: SloBook | None = None
        """SLO status by (model, tenant) (``slo.py``); None: no SLO configured."""
        self.on_generation: Callable[[str, Timing, int, int], None] | None = None
        """Called with each finished generation (model, timing, tokens, status): the
        dashboard's per-interval TTFT / ITL (``timeseries.py``). None: nobody listens."""

    def add_slos(self, model_slos: dict[str, SloConfig], tenant_slos: Iterable[SloConfig]
                 ) -> None:
        """Track these objectives (once, at start; nothing is registered without any)."""
        from sokuji.observability import slo

        self.slo = slo.build(model_slos, tenant_slos, self.registry)

    def observe_slo(self, model: str, tenant: str, latency_ms: float | None,
                    status: int) -> None:
        """One answer toward the SLOs that cover it (call only when ``slo`` is set)."""
        assert self.slo is not None
        self.slo.observe(model, tenant, latency_ms, status)

    @property
    def routing(self) -> Any:
        """``observability/routing.RoutingMetrics``, registered when first asked for (only a
        server with routers, upstreams or semantic caches has these series)."""
        if self._routing is None:
            from sokuji.observability.routing import RoutingMetrics

            self._routing = RoutingMetrics(self.registry)
        return self._routing

    def add_model(self, name: str, queue: _Queue) -> None:
        self._timings[name] = TimingHistograms()
        self._counters.setdefault(name, ModelCounters())
        self._ok[name] = self.requests.labels(name, "200").inc
        self.queue_depth.labels(name).set_function(lambda: float(queue.num_waiting))

    def cache_result(self, model: str, result: str) -> None:
        self.cache_requests.labels(model, result).inc()

    def cache_error(self, op: str) -> None:
        self.cache_errors.labels(op).inc()

    def batch_observer(self, name: str) -> Callable[[BatchInfo], None]:
        size, tokens = self.batch_size.labels(name), self.batch_tokens.labels(name)
        padding, real = self.padding_tokens.labels(name), self.input_tokens.labels(name)

        counters = self._counters.setdefault(name, ModelCounters())

        def observe(info: BatchInfo) -> None:
            counters.batch(info.num_items)
            size.observe(info.num_items)
            tokens.observe(info.padded_tokens)
            padding.inc(max(0, info.padded_tokens - info.real_tokens))
            real.inc(info.real_tokens)
        return observe

    def observe_request(self, model: str, timeline: Timeline, status: int) -> None:
        hist = self._timings.get(model)
        if status == 200 and hist is not None:
            self._ok[model]()
            hist.record(timeline)
        else:
            self.requests.labels(model, str(status)).inc()

    def observe_media(self, model: str, jobs: list[Any]) -> None:
        """A media model's request (its files' jobs): stage histograms, and one execution
        of ``len(jobs)`` inferences in Triton's statistics."""
        self.media.observe(model, jobs)
        counters = self._counters.get(model)
        if counters is not None:
            counters.batch(len(jobs))

    def observe_generation(self, model: str, timing: Timing, completion_tokens: int,
                           status: int, count: bool = True) -> None:
        if count:
            self.requests.labels(model, str(status)).inc()
        self.llm.observe(model, timing, completion_tokens, status == 200)
        if self.on_generation is not None:
            self.on_generation(model, timing, completion_tokens, status)
        counters = self._counters.get(model)
        if counters is None:
            return
        if status == 200:
            counters.generation(timing.arrival_ns, timing.submitted_ns, timing.admitted_ns,
                                timing.end_ns)
        else:
            counters.failure((timing.end_ns or time.perf_counter_ns()) - timing.arrival_ns)

    # --- Triton's statistics extension (``stats.py`` says how stages map) ---------------

    def observe_failure(self, model: str, duration_ns: int) -> None:
        """An error reply for ``model`` (a metric name: ``name`` or ``name@variant``)."""
        counters = self._counters.get(model)
        if counters is not None:
            counters.failure(duration_ns)

    def timings(self, model: str) -> TimingHistograms | None:
        """``model``'s stage histograms (a metric name), or None if it has none."""
        return self._timings.get(model)

    def model_stats(self, model: str) -> StatsSnapshot:
        """Cumulative statistics of ``model`` (a metric name), pending rows folded first."""
        hist = self._timings.get(model) or TimingHistograms(capacity=1)
        counters = self._counters.get(model) or ModelCounters()
        return snapshot(hist, counters)

    def render(self) -> bytes:
        return generate_latest(self.registry)


ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.5, 1.0, 2.5)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)


# name, help, how to read it off an engine
_ENGINE_COUNTERS: tuple[tuple[str, str, Callable[[GenerationEngine], int]], ...] = (
    ("sokuji_llm_decode_steps", "llama_decode calls (one batch each).", lambda e: e.steps),
    ("sokuji_llm_decode_sequences", "Sequences sampled, summed over decode steps (divide by "
     "steps: the mean batch).", lambda e: e.rows),
    ("sokuji_llm_prefix_cache_evictions", "Prefix-cache entries evicted for room.",
     lambda e: e.prefix_cache.evictions),
    ("sokuji_llm_sequence_moves", "Sequences moved to a lower slot (KV state copied) to keep "
     "busy slots consecutive.", lambda e: e.moves),
    ("sokuji_llm_split_steps", "Decode steps run row by row, because that measured cheaper "
     "than one small batch.", lambda e: e.split_steps),
)


class _EngineCollector(Collector):
    """Counters the engine thread keeps as plain integers, read at scrape time."""

    def __init__(self, engines: dict[str, GenerationEngine]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        for name, text, read in _ENGINE_COUNTERS:
            family = CounterMetricFamily(name, text, labels=["model"])
            for model, engine in self.engines.items():
                family.add_metric([model], read(engine))
            yield family


class GenerationMetrics:
    """Generation metrics in the spirit of vLLM's (``vllm:time_to_first_token_seconds`` ...),
    observed once per finished request on the event loop (not on the engine thread). The
    time to first token is the GenAI exporter's observation (``genai.py``), handed over
    through ``first_token``: one figure behind both names."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.ttft = Histogram("sokuji_llm_time_to_first_token_seconds",
                              "Arrival to first generated token.", ["model"],
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("sokuji_llm_inter_token_latency_seconds",
                             "Time between consecutive generated tokens.", ["model"],
                             buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("sokuji_llm_e2e_request_latency_seconds",
                             "Arrival to last token.", ["model"], buckets=E2E_BUCKETS_S,
                             registry=r)
        self.queue = Histogram("sokuji_llm_queue_time_seconds",
                               "Waiting for a sequence slot.", ["model"],
                               buckets=LATENCY_BUCKETS_S, registry=r)
        self.prefill = Histogram("sokuji_llm_prefill_time_seconds",
                                 "Slot given to first token (prompt processing).", ["model"],
                                 buckets=TTFT_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("sokuji_llm_prompt_tokens", "Prompt tokens received.",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("sokuji_llm_generation_tokens",
                                         "Tokens generated.", ["model"], registry=r)
        self.prefix_hits = Counter("sokuji_llm_prefix_cache_hits",
                                   "Requests whose prompt prefix came from the prefix cache.",
                                   ["model"], registry=r)
        self.prefix_misses = Counter("sokuji_llm_prefix_cache_misses",
                                     "Requests that looked up the prefix cache and missed.",
                                     ["model"], registry=r)
        self.prefix_reused = Counter("sokuji_llm_prefix_cache_reused_tokens",
                                     "Prompt tokens not prefilled thanks to the prefix cache.",
                                     ["model"], registry=r)
        # -- speculative decoding (llm/speculative.py): accepted / drafted = acceptance rate
        self.spec_drafted = Counter("sokuji_llm_spec_draft_tokens", "Draft tokens verified "
                                    "(speculative decoding).", ["model"], registry=r)
        self.spec_accepted = Counter("sokuji_llm_spec_accepted_tokens", "Draft tokens "
                                     "accepted: the model's own greedy tokens, emitted without "
                                     "a step of their own.", ["model"], registry=r)
        self.running = Gauge("sokuji_llm_running_sequences", "Sequences being generated.",
                             ["model"], registry=r)
        self.cache_bytes = Gauge("sokuji_llm_prefix_cache_bytes",
                                 "Host memory held by the prefix cache.", ["model"], registry=r)

        self.engines: dict[str, GenerationEngine] = {}
        r.register(_EngineCollector(self.engines))

    def add_engine(self, name: str, engine: GenerationEngine) -> None:
        self.engines[name] = engine
        self.running.labels(name).set_function(lambda: float(engine.num_running))
        self.cache_bytes.labels(name).set_function(lambda: float(engine.prefix_cache.bytes))

    def first_token(self, model: str, seconds: float) -> None:
        """An answered generation's time to first token (``GenAIMetrics.generation``)."""
        self.ttft.labels(model).observe(seconds)

    def observe(self, model: str, t: Timing, completion_tokens: int, ok: bool) -> None:
        self.prompt_tokens.labels(model).inc(t.prompt_tokens)
        self.generation_tokens.labels(model).inc(completion_tokens)
        if t.drafted_tokens:  # speculative decoding
            self.spec_drafted.labels(model).inc(t.drafted_tokens)
            self.spec_accepted.labels(model).inc(t.accepted_tokens)
        if t.prefix_lookup == "hit":
            self.prefix_hits.labels(model).inc()
            self.prefix_reused.labels(model).inc(t.reused_tokens)
        elif t.prefix_lookup == "miss":
            self.prefix_misses.labels(model).inc()
        if t.admitted_ns:
            self.queue.labels(model).observe((t.admitted_ns - t.submitted_ns) / 1e9)
        if not ok or not t.first_token_ns:
            return
        self.prefill.labels(model).observe((t.first_token_ns - t.admitted_ns) / 1e9)
        self.e2e.labels(model).observe((t.end_ns - t.arrival_ns) / 1e9)
        itl = self.itl.labels(model)
        stamps = t.token_ns
        for a, b in itertools.pairwise(stamps):
            itl.observe((b - a) / 1e9)

"""Prometheus metrics, derived from the same Timeline that writes ``Server-Timing``.

Per-request stage timings are the hot part: ten ``Histogram.observe`` calls (each a locked
Python loop over the buckets) cost tens of microseconds a request. Instead, each request
appends one row to a per-model numpy buffer, and the buffer is folded into bucket counts in
bulk (``searchsorted`` + ``bincount``) when it fills or when ``/metrics`` is scraped. Recording
and scraping both run on the event loop thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from sokuji.core.batcher import BatchInfo
from sokuji.core.request import STAGES, Timeline

LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Queue(Protocol):
    @property
    def num_waiting(self) -> int: ...


class TimingHistograms:
    """Histograms of one model's request stages (columns: each stage, then total)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.columns = len(STAGES) + 1
        self._bounds = np.asarray(LATENCY_BUCKETS_S)
        self._buffer = np.empty((capacity, self.columns), dtype=np.float64)
        self._pending = 0
        self.counts = np.zeros((self.columns, len(LATENCY_BUCKETS_S) + 1), dtype=np.int64)
        self.sums = np.zeros(self.columns, dtype=np.float64)

    def record(self, timeline: Timeline) -> None:
        durations = timeline.durations_ns
        row = self._buffer[self._pending]
        for i, stage in enumerate(STAGES):
            row[i] = durations.get(stage, 0) / 1e9
        row[-1] = timeline.total_ns / 1e9
        self._pending += 1
        if self._pending == len(self._buffer):
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        rows = self._buffer[:self._pending]
        bins = len(self._bounds) + 1
        for col in range(self.columns):
            index = np.searchsorted(self._bounds, rows[:, col], side="left")  # value <= bound
            self.counts[col] += np.bincount(index, minlength=bins)
        self.sums += rows.sum(axis=0)
        self._pending = 0


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
        self.cache_requests = Counter(
            "sokuji_cache_requests", "Response-cache lookups by result (hit, miss, coalesced, "
            "bypass).", ["model", "result"], registry=r)
        self._ok: dict[str, Callable[[], None]] = {}

    def add_model(self, name: str, queue: _Queue) -> None:
        self._timings[name] = TimingHistograms()
        self._ok[name] = self.requests.labels(name, "200").inc
        self.queue_depth.labels(name).set_function(lambda: float(queue.num_waiting))

    def cache_result(self, model: str, result: str) -> None:
        self.cache_requests.labels(model, result).inc()

    def batch_observer(self, name: str) -> Callable[[BatchInfo], None]:
        size, tokens = self.batch_size.labels(name), self.batch_tokens.labels(name)
        padding, real = self.padding_tokens.labels(name), self.input_tokens.labels(name)

        def observe(info: BatchInfo) -> None:
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

    def render(self) -> bytes:
        return generate_latest(self.registry)

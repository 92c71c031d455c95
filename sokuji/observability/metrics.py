"""Prometheus metrics, derived from the same Timeline that writes ``Server-Timing``.

Labelled children are bound once per model, so recording a request costs a few dictionary-free
observations on the hot path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sokuji.core.batcher import BatchInfo
from sokuji.core.request import STAGES, Stage, Timeline

LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Queue(Protocol):
    @property
    def num_waiting(self) -> int: ...


@dataclass
class _ModelSeries:
    request: Histogram
    stages: list[tuple[Stage, Histogram]]
    batch_size: Histogram
    batch_tokens: Histogram
    padding: Counter
    tokens: Counter


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.request_duration = Histogram(
            "sokuji_request_duration_seconds", "End-to-end server time of a request.",
            ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.stage_duration = Histogram(
            "sokuji_stage_duration_seconds", "Time a request spent in each stage.",
            ["model", "stage"], buckets=LATENCY_BUCKETS_S, registry=r)
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
        self._series: dict[str, _ModelSeries] = {}

    def add_model(self, name: str, queue: _Queue) -> None:
        self._series[name] = _ModelSeries(
            request=self.request_duration.labels(name),
            stages=[(s, self.stage_duration.labels(name, s.value)) for s in STAGES],
            batch_size=self.batch_size.labels(name),
            batch_tokens=self.batch_tokens.labels(name),
            padding=self.padding_tokens.labels(name),
            tokens=self.input_tokens.labels(name),
        )
        self.queue_depth.labels(name).set_function(lambda: float(queue.num_waiting))

    def batch_observer(self, name: str) -> Callable[[BatchInfo], None]:
        def observe(info: BatchInfo) -> None:
            series = self._series.get(name)
            if series is None:
                return
            series.batch_size.observe(info.num_items)
            series.batch_tokens.observe(info.padded_tokens)
            series.padding.inc(max(0, info.padded_tokens - info.real_tokens))
            series.tokens.inc(info.real_tokens)
        return observe

    def observe_request(self, model: str, timeline: Timeline, status: int) -> None:
        self.requests.labels(model, str(status)).inc()
        series = self._series.get(model)
        if series is None:
            return
        durations = timeline.durations_ns
        for stage, hist in series.stages:
            ns = durations.get(stage)
            if ns is not None:
                hist.observe(ns / 1e9)
        series.request.observe(timeline.total_ns / 1e9)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The OpenTelemetry GenAI server metrics, in Prometheus: what dashboards built for the GenAI
semantic conventions read.

- ``gen_ai_server_request_duration_seconds`` (``gen_ai.server.request.duration``): arrival to
  the answer's last byte (a generation: its last token), for answered requests;
- ``gen_ai_server_time_to_first_token_seconds`` (``gen_ai.server.time_to_first_token``):
  observed here once per answered generation, and the same observation is handed to
  Sokuji's own ``sokuji_llm_time_to_first_token_seconds`` (``first_token``), so the two
  exporters' TTFT are one figure;
- ``gen_ai_server_time_per_output_token_seconds`` (``gen_ai.server.time_per_output_token``):
  a generation's decode time over its tokens after the first (requests of 2 tokens or more).

Labels ``gen_ai_operation_name`` (``chat``, ``text_completion``, ``embeddings``; ``infer``
for V2 inference, which the conventions do not name) and ``gen_ai_request_model``; the
buckets are the conventions' advisory boundaries. Observing is a ``bisect`` and two
additions on the event loop (no ``Histogram`` lock, no label lookup in
``prometheus_client``); the families are built when ``/metrics`` is scraped, on the loop too.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from sokuji.llm.request import Timing

REQUEST_DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12,
                              10.24, 20.48, 40.96, 81.92)
TIME_TO_FIRST_TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                   0.75, 1.0, 2.5)
LABELS = ["gen_ai_operation_name", "gen_ai_request_model"]


class _Histogram:
    """One histogram's series by (operation, model): bucket counts (not cumulative) and sum."""

    __slots__ = ("bounds", "help", "name", "series")

    def __init__(self, name: str, text: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self.help = text
        self.bounds = bounds
        self.series: dict[tuple[str, str], tuple[list[int], list[float]]] = {}

    def observe(self, operation: str, model: str, seconds: float) -> None:
        series = self.series.get((operation, model))
        if series is None:
            series = self.series[(operation, model)] = ([0] * (len(self.bounds) + 1), [0.0])
        series[0][bisect_left(self.bounds, seconds)] += 1  # value <= bound: Prometheus's le
        series[1][0] += seconds

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.help, labels=LABELS, unit="seconds")
        edges = [str(b) for b in self.bounds] + ["+Inf"]
        for labels, (counts, total) in self.series.items():
            cumulative, running = [], 0
            for edge, count in zip(edges, counts, strict=True):
                running += count
                cumulative.append((edge, running))
            family.add_metric(list(labels), cumulative, total[0])
        return family


class GenAIMetrics(Collector):
    """Registered once per ``Metrics`` (``metrics.py``)."""

    def __init__(self, r: CollectorRegistry,
                 first_token: Callable[[str, float], None] | None = None) -> None:
        self.first_token = first_token
        """Given ``(model, seconds)`` of each time to first token observed here: another
        exporter's histogram fed by the same observation (``metrics.GenerationMetrics``).
        None: only the GenAI histogram."""
        self.duration = _Histogram(
            "gen_ai_server_request_duration", "GenAI server request duration: arrival to the "
            "last byte or last output token (gen_ai.server.request.duration).",
            REQUEST_DURATION_BUCKETS_S)
        self.ttft = _Histogram(
            "gen_ai_server_time_to_first_token", "Time to generate the first token "
            "(gen_ai.server.time_to_first_token).", TIME_TO_FIRST_TOKEN_BUCKETS_S)
        self.tpot = _Histogram(
            "gen_ai_server_time_per_output_token", "Time per output token after the first "
            "(gen_ai.server.time_per_output_token).", TIME_PER_OUTPUT_TOKEN_BUCKETS_S)
        r.register(self)

    def request(self, operation: str, model: str, duration_ns: int) -> None:
        """An answered inference request (encoder, pipeline, media)."""
        self.duration.observe(operation, model, duration_ns / 1e9)

    def generation(self, operation: str, model: str, timing: Timing) -> None:
        """A generation answered in full (not failed, not cancelled): the one place its time
        to first token is observed (see ``first_token``)."""
        if not timing.end_ns:
            return
        self.duration.observe(operation, model, (timing.end_ns - timing.arrival_ns) / 1e9)
        if not timing.first_token_ns:
            return
        ttft_s = (timing.first_token_ns - timing.arrival_ns) / 1e9
        self.ttft.observe(operation, model, ttft_s)
        if self.first_token is not None:
            self.first_token(model, ttft_s)
        after_first = len(timing.token_ns) - 1
        if after_first > 0:
            self.tpot.observe(operation, model,
                              (timing.end_ns - timing.first_token_ns) / 1e9 / after_first)

    def collect(self) -> Iterator[Metric]:
        yield self.duration.family()
        yield self.ttft.family()
        yield self.tpot.family()

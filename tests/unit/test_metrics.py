from __future__ import annotations

import numpy as np

from sokuji.core.request import STAGES, Stage, Timeline
from sokuji.llm.request import Timing
from sokuji.observability.metrics import Metrics
from sokuji.observability.timings import LATENCY_BUCKETS_S, TimingHistograms


def timeline_with(decode_s: float) -> Timeline:
    tl = Timeline(start_ns=0)
    tl.mark(Stage.DECODE, int(decode_s * 1e9))
    for i, stage in enumerate(STAGES[1:], start=1):
        tl.mark(stage, int(decode_s * 1e9) + i)
    return tl


def test_bulk_folding_matches_prometheus_bucket_semantics() -> None:
    values = [0.00005, 0.0001, 0.00011, 0.003, 0.003, 7.0, 12.0]  # 0.0001 sits on a bound
    hist = TimingHistograms(capacity=3)  # forces folds mid-way and at the end
    for v in values:
        hist.record(timeline_with(v))
    hist.flush()
    expected = [sum(v <= b for v in values) for b in LATENCY_BUCKETS_S] + [len(values)]
    assert np.cumsum(hist.counts[0]).tolist() == expected
    assert hist.sums[0] == sum(round(v * 1e9) / 1e9 for v in values)
    assert hist.counts[-1].sum() == len(values)  # the total column counts every request


def test_one_ttft_observation_feeds_both_exporters() -> None:
    """An answered generation's time to first token: the same value under Sokuji's name and
    the GenAI convention's, each observed once (``observe_generation`` adds no second)."""
    metrics = Metrics()
    timing = Timing(arrival_ns=10_000_000, submitted_ns=11_000_000, admitted_ns=15_000_000,
                    first_token_ns=40_000_000, end_ns=61_000_000,
                    token_ns=[40_000_000, 50_000_000, 60_000_000])
    registry = metrics.registry
    sokuji = {"model": "llm"}
    genai = {"gen_ai_operation_name": "chat", "gen_ai_request_model": "llm"}
    metrics.genai.generation("chat", "llm", timing)
    for observed in ("genai", "then the generation's own metrics"):
        for name, labels in (("sokuji_llm_time_to_first_token_seconds", sokuji),
                             ("gen_ai_server_time_to_first_token_seconds", genai)):
            assert registry.get_sample_value(f"{name}_count", labels) == 1.0, observed
            assert registry.get_sample_value(f"{name}_sum", labels) == 0.03, observed
        metrics.observe_generation("llm", timing, 3, 200)

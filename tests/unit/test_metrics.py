from __future__ import annotations

import numpy as np

from sokuji.core.request import STAGES, Stage, Timeline
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

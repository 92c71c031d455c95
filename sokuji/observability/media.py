"""Prometheus metrics of media models (OCR, VAD): each engine stage's time per file, and the
size of the batches that cross-request batching formed.

Observed once a request is answered, by a ``call_soon`` callback (off the response's own
latency): one ``Histogram.observe`` per stage of each file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram

if TYPE_CHECKING:
    from sokuji.media.engine import MediaJob

STAGE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class MediaMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.stage = Histogram(
            "sokuji_media_stage_duration_seconds",
            "Time one file spent in a media model's stage (image-decode, resize, det, cls, "
            "rec; audio-decode, resample, infer; *-wait: waiting for a batched stage), "
            "summed over the stage's batches.", ["model", "stage"],
            buckets=STAGE_BUCKETS_S, registry=r)
        self.batch_requests = Histogram(
            "sokuji_media_batch_requests",
            "Requests whose work shared one batch of a stage (cross-request batching), "
            "counted once per file and stage.", ["model", "stage"], buckets=BATCH_BUCKETS,
            registry=r)

    def observe(self, model: str, jobs: list[MediaJob]) -> None:
        for job in jobs:
            for name, ns in job.clock.totals_ns().items():
                self.stage.labels(model, name).observe(ns / 1e9)
            seen: dict[str, int] = {}
            for span in list(job.clock.spans):
                if span.requests:
                    seen[span.name] = max(seen.get(span.name, 0), span.requests)
            for name, count in seen.items():
                self.batch_requests.labels(model, name).observe(count)

"""Prometheus metrics of pipelines: each step's duration and outcome.

Observed once a request's steps are done, by a ``call_soon`` callback (off the response's
own latency): a few ``Histogram.observe`` calls per request, one per step that ran.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram

if TYPE_CHECKING:
    from sokuji.pipelines.run import Run

STEP_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                  0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class PipelineMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.step = Histogram("sokuji_pipeline_step_duration_seconds",
                              "Time a pipeline step took (a generated answer: to its last "
                              "token).", ["pipeline", "step"], buckets=STEP_BUCKETS_S,
                              registry=r)
        self.outcomes = Counter("sokuji_pipeline_step_outcomes",
                                "Steps by outcome: ok, fallback (failed or timed out, its "
                                "fallback value used), failed, timeout, cancelled.",
                                ["pipeline", "step", "outcome"], registry=r)
        self.critical = Histogram("sokuji_pipeline_critical_path_seconds",
                                  "The chain of steps that set a request's answer time.",
                                  ["pipeline"], buckets=STEP_BUCKETS_S, registry=r)

    def observe(self, run: Run) -> None:
        graph = run.graph
        for node, t in zip(graph.nodes, run.times, strict=True):
            if not t.start_ns or not t.outcome:
                continue
            self.outcomes.labels(graph.name, node.name, t.outcome).inc()
            if t.end_ns:
                self.step.labels(graph.name, node.name).observe((t.end_ns - t.start_ns) / 1e9)
        path = [i for i in run.critical_path() if run.times[i].start_ns and run.times[i].end_ns]
        if path:
            self.critical.labels(graph.name).observe(
                (run.times[path[-1]].end_ns - run.times[path[0]].start_ns) / 1e9)

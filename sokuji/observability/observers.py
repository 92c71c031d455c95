"""What a served model may report beyond the Timeline, in one object the app hands to every
model's ``attach`` (``core/model.py``): the model says what it has (an engine, refusals by
time, step times, upstream attempts, routing events), the observers know where it goes
(Prometheus, SLO status, traces). No kind is named here; each verb is a kind of report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sokuji.observability.metrics import Metrics
    from sokuji.observability.tracing import Tracer


@dataclass
class Observers:
    metrics: Metrics
    tracer: Tracer | None = None

    def generation_engine(self, model: str, engine: Any) -> None:
        """A continuous-batching engine's gauges (slots, steps, tokens, KV)."""
        self.metrics.llm.add_engine(model, engine)

    def time_refusals(self, model: str, count: Callable[[], int]) -> None:
        """How many requests admission by time refused, read when SLOs are reported."""
        if self.metrics.slo is not None:
            self.metrics.slo.refusals[model] = count

    def pipeline_done(self) -> Callable[[Any], None]:
        """What observes a finished run of steps: step metrics, and spans when traced."""
        observe = self.metrics.pipelines.observe
        return observe if self.tracer is None else self.tracer.pipeline_observer(observe)

    def media_stages(self) -> Callable[[str, list[Any]], None]:
        """What observes a media request's files once they are done (model, their jobs):
        stage durations, batches shared, one execution in Triton's statistics."""
        return self.metrics.observe_media

    def upstream_attempt(self, upstream: str, code: int | str, seconds: float) -> None:
        """One call to another server: its outcome and duration."""
        self.metrics.routing.upstream_attempt(upstream, code, seconds)

    def routing(self, hooks: Any) -> None:
        """A router's events (routes, breaker transitions, canary steps, shadow results)."""
        self.metrics.routing.connect(hooks)

"""The batcher's share of a model's config (``BatcherConfig.from_model``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from sokuji.config import BatchPolicy, ModelConfig, SloConfig
from sokuji.core.slo_admission import SloBudgets, budgets_for

_MODEL = ModelConfig(name="-")  # the defaults, declared once in sokuji.config's schema


@dataclass(frozen=True)
class BatcherConfig:
    """The batcher's share of a ``ModelConfig`` (``from_model``); defaults are the schema's."""

    max_batch_size: int = _MODEL.max_batch_size
    max_batch_tokens: int = _MODEL.max_batch_tokens
    max_queue_delay_ms: float = _MODEL.max_queue_delay_ms
    policy: BatchPolicy = _MODEL.batching
    instances: int = _MODEL.instances
    max_queue_depth: int = _MODEL.max_queue_depth
    max_concurrency: int = _MODEL.max_concurrency
    """Requests admitted (queued or running) at once; 0: bounded by the queue depth only."""
    priority_aging_ms: float = _MODEL.priority_aging_ms
    inline_max_ms: float = _MODEL.inline_max_ms
    """A lone request measured to run within this long runs on the event loop (0: never)."""
    slo: SloBudgets = field(default_factory=SloBudgets)
    """p99 targets for admission by time (``core/slo_admission.py``); empty: by count only."""
    worker_nice: int = 0
    """Niceness added to the worker threads (Linux). 0: a niced worker lost half its core to
    any busy neighbour process (throughput 0.51 of the raw runtime's, c=1 latency +8 ms)."""

    @classmethod
    def from_model(cls, mc: ModelConfig, tenant_slos: Iterable[SloConfig] = ()
                   ) -> BatcherConfig:
        """Every field but ``policy`` (``batching`` there) and ``worker_nice`` is named as in
        ``ModelConfig``."""
        same = {f.name for f in fields(cls)} - {"policy", "worker_nice", "slo"}
        return cls(policy=mc.batching, slo=budgets_for(mc.name, mc.slo, tenant_slos),
                   **{name: getattr(mc, name) for name in same})

"""The batcher's settings: plain data (the config layer makes them from a model's config:
``kinds/encoder/model.batcher_config``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sokuji.core.forming import BatchPolicy
from sokuji.core.slo_budgets import SloBudgets


@dataclass(frozen=True)
class BatcherConfig:
    """One encoder queue's settings; the defaults are ``ModelConfig``'s (a test holds them
    equal), and so are the names, but for ``policy`` (``batching`` there)."""

    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    max_queue_delay_ms: float = 2.0
    policy: BatchPolicy = BatchPolicy.LENGTH
    instances: int = 1
    max_queue_depth: int = 1024
    max_concurrency: int = 0
    """Requests admitted (queued or running) at once; 0: bounded by the queue depth only."""
    priority_aging_ms: float = 1000.0
    inline_max_ms: float = 50.0
    """A lone request measured to run within this long runs on the event loop (0: never)."""
    preferred_batch_sizes: tuple[int, ...] = ()
    """Batch sizes (items, ascending) a batch is cut back to (``core/forming.py``); empty:
    any size. Triton's ``preferred_batch_size``; tensor models only."""
    slo: SloBudgets = field(default_factory=SloBudgets)
    """p99 targets for admission by time (``core/slo_admission.py``); empty: by count only."""
    worker_nice: int = 0
    """Niceness added to the worker threads (Linux). 0: a niced worker lost half its core to
    any busy neighbour process (throughput 0.51 of the raw runtime's, c=1 latency +8 ms)."""

"""The p99 targets admission by time (``slo_admission.py``) uses for one model: plain data,
made from the config's SLOs by ``config_ops.budgets_for``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SloBudgets:
    """The p99 targets (ms) admission uses for one model: its own, and its tenants'."""

    model_ms: float | None = None
    tenants_ms: Mapping[str, float] = field(default_factory=dict)
    batch_share: float = 0.0
    """The most of the loosest target one batch may take (0: no cap)."""

    def budget_ms(self, tenant: str) -> float | None:
        own, theirs = self.model_ms, self.tenants_ms.get(tenant)
        if own is None:
            return theirs
        return own if theirs is None else min(own, theirs)

    @property
    def loosest_ms(self) -> float | None:
        """The largest target any request of this model can have (None: none has one)."""
        return max([*self.tenants_ms.values(),
                    *([self.model_ms] if self.model_ms is not None else [])], default=None)

    def __bool__(self) -> bool:
        return self.model_ms is not None or bool(self.tenants_ms)

"""SLO status: how each configured objective is doing over its rolling window.

One ``SloWindow`` per (model, tenant) objective: answers, errors (5xx and 504) and shed
requests (429) in time slots (a window is ``SLOTS`` slots; old slots are dropped as time
moves), and a log-bucketed latency histogram per slot (2% wide buckets: a p99 read from it is
within 2% of the exact one). From it, on demand (a ``/metrics`` scrape, the dashboard):
- ``p99_ms`` over the window, and the share of answers slower than the target
  (``slow_fraction``; the p99 objective allows 1%);
- the error rate and the **error budget**: ``1 - errors / (target * answers)`` (1: untouched,
  0: spent, below 0: overspent);
- **burn rates** (Google SRE's multiwindow alerting): the error rate over the whole window
  and over its last twelfth, each divided by the target. A burn rate of 1 spends the budget
  exactly in one window; 14.4 over an hour spends 2% of a 30-day budget.

Recording costs a dict lookup, a log and a few increments (only for models or tenants that
have an SLO; ``Metrics.slo`` is None when none is configured). Everything runs on the event
loop thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sokuji.config_ops import SloConfig

SLOTS = 60
SHORT_SLOTS = 5
"""The short burn window: the last twelfth of the window."""
_LOW_MS, _GROWTH = 0.01, 1.02
_BUCKETS = int(math.log(1e7 / _LOW_MS) / math.log(_GROWTH)) + 2  # 10 us .. ~3 h
_LOG_GROWTH = math.log(_GROWTH)


def bucket_of(ms: float) -> int:
    if ms <= _LOW_MS:
        return 0
    return min(_BUCKETS - 1, 1 + int(math.log(ms / _LOW_MS) / _LOG_GROWTH))


def bucket_upper_ms(index: int) -> float:
    return _LOW_MS * _GROWTH ** index


class SloWindow:
    """One objective's rolling counts (see the module docstring)."""

    def __init__(self, model: str, tenant: str, slo: SloConfig,
                 clock: Any = time.monotonic) -> None:
        self.model, self.tenant, self.slo = model, tenant, slo
        self.clock = clock
        self.slot_s = slo.window_s / SLOTS
        self.counts = np.zeros((SLOTS, 3), dtype=np.int64)  # answers, errors, shed
        self.hist = np.zeros((SLOTS, _BUCKETS), dtype=np.int64)
        self.slow = np.zeros(SLOTS, dtype=np.int64)
        self._epoch = int(clock() / self.slot_s)  # slot number of the newest slot

    def _slot(self) -> int:
        """The index of the current slot, clearing any slots time has moved past."""
        now = int(self.clock() / self.slot_s)
        gap = now - self._epoch
        if gap > 0:
            for k in range(1, min(gap, SLOTS) + 1):
                i = (self._epoch + k) % SLOTS
                self.counts[i] = 0
                self.hist[i] = 0
                self.slow[i] = 0
            self._epoch = now
        return now % SLOTS

    def observe(self, latency_ms: float | None, status: int) -> None:
        """One answer: ``latency_ms`` of a success (None for a failure), its status."""
        i = self._slot()
        if status == 429:
            self.counts[i, 2] += 1
            return
        self.counts[i, 0] += 1
        if status >= 500:
            self.counts[i, 1] += 1
        if latency_ms is not None:
            self.hist[i, bucket_of(latency_ms)] += 1
            if latency_ms > self.slo.p99_ms:
                self.slow[i] += 1

    def _recent(self, slots: int) -> list[int]:
        newest = self._slot()
        return [(newest - k) % SLOTS for k in range(slots)]

    def snapshot(self) -> dict[str, Any]:
        self._slot()
        answers, errors, shed = (int(v) for v in self.counts.sum(axis=0))
        hist = self.hist.sum(axis=0)
        n_lat = int(hist.sum())
        p99 = None
        if n_lat:
            rank = math.ceil(0.99 * n_lat)
            p99 = bucket_upper_ms(int(np.searchsorted(np.cumsum(hist), rank)))
        target = self.slo.error_rate
        error_rate = errors / answers if answers else 0.0
        short = self.counts[self._recent(SHORT_SLOTS)].sum(axis=0)
        short_rate = float(short[1]) / float(short[0]) if short[0] else 0.0
        slow_fraction = float(self.slow.sum()) / n_lat if n_lat else 0.0
        budget = 1.0 - errors / (target * answers) if answers and target > 0 else 1.0
        return {
            "model": self.model, "tenant": self.tenant,
            "target_p99_ms": self.slo.p99_ms, "target_error_rate": target,
            "window_s": self.slo.window_s, "requests": answers, "errors": errors,
            "shed": shed, "p99_ms": p99, "slow_fraction": slow_fraction,
            "error_rate": error_rate,
            "latency_ok": p99 is None or p99 <= self.slo.p99_ms,
            "errors_ok": error_rate <= target,
            "budget_remaining": budget,
            "burn_rate": error_rate / target if target > 0 else 0.0,
            "burn_rate_short": short_rate / target if target > 0 else 0.0,
            "latency_burn_rate": slow_fraction / 0.01,
        }


class SloBook:
    """Every objective in the config, and what each answer counts toward: the model's own
    SLO (tenant ``""``: every tenant's answers) and the tenant's (for that model, or for
    every model it uses)."""

    def __init__(self, model_slos: dict[str, SloConfig], tenant_slos: Iterable[SloConfig],
                 registry: CollectorRegistry | None = None, clock: Any = time.monotonic
                 ) -> None:
        self.clock = clock
        self.windows: dict[tuple[str, str], SloWindow] = {
            (m, ""): SloWindow(m, "", s, clock) for m, s in model_slos.items()}
        self.tenant_slos: dict[str, list[SloConfig]] = {}
        for s in tenant_slos:
            self.tenant_slos.setdefault(s.tenant, []).append(s)
        self._targets: dict[tuple[str, str], list[SloWindow]] = {}
        self.refusals: dict[str, Callable[[], int]] = {}
        """Model -> how many requests its admission by time has refused."""
        if registry is not None:
            registry.register(_SloCollector(self))

    def targets(self, model: str, tenant: str) -> list[SloWindow]:
        """The windows an answer of ``model`` for ``tenant`` counts toward (cached)."""
        key = (model, tenant)
        found = self._targets.get(key)
        if found is None:
            found = []
            own = self.windows.get((model, ""))
            if own is not None:
                found.append(own)
            for s in self.tenant_slos.get(tenant, ()):
                if s.model in ("", model):
                    w = self.windows.get(key)
                    if w is None:
                        w = self.windows[key] = SloWindow(model, tenant, s, self.clock)
                    found.append(w)
                    break  # a tenant's model-specific SLO is listed before its general one
            self._targets[key] = found
        return found

    def observe(self, model: str, tenant: str, latency_ms: float | None, status: int) -> None:
        for w in self.targets(model, tenant):
            w.observe(latency_ms, status)

    def snapshot(self) -> list[dict[str, Any]]:
        return [w.snapshot() for w in self.windows.values()]


class _SloCollector(Collector):
    """The SLO gauges, computed at scrape time."""

    def __init__(self, book: SloBook) -> None:
        self.book = book

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "tenant"]
        families = {
            "target_p99": GaugeMetricFamily("sokuji_slo_target_p99_seconds",
                                            "The SLO's p99 latency target", labels=labels),
            "p99": GaugeMetricFamily("sokuji_slo_p99_seconds",
                                     "p99 latency over the SLO's window", labels=labels),
            "target_err": GaugeMetricFamily("sokuji_slo_target_error_rate",
                                            "The SLO's error-rate target", labels=labels),
            "err": GaugeMetricFamily("sokuji_slo_error_rate",
                                     "Error rate (5xx, 504) over the SLO's window",
                                     labels=labels),
            "budget": GaugeMetricFamily("sokuji_slo_error_budget_remaining",
                                        "Share of the window's error budget left (1 "
                                        "untouched, 0 spent, < 0 overspent)", labels=labels),
            "burn": GaugeMetricFamily("sokuji_slo_burn_rate",
                                      "Error rate / target, over the whole window (long) or "
                                      "its last twelfth (short)", labels=[*labels, "window"]),
        }
        refused = CounterMetricFamily(
            "sokuji_slo_refused", "Requests refused (429) because their predicted wait plus "
            "service would miss their SLO", labels=["model"])
        for model, count in self.book.refusals.items():
            refused.add_metric([model], count())
        yield refused
        for snap in self.book.snapshot():
            key = [snap["model"], snap["tenant"]]
            families["target_p99"].add_metric(key, snap["target_p99_ms"] / 1e3)
            if snap["p99_ms"] is not None:
                families["p99"].add_metric(key, snap["p99_ms"] / 1e3)
            families["target_err"].add_metric(key, snap["target_error_rate"])
            families["err"].add_metric(key, snap["error_rate"])
            families["budget"].add_metric(key, snap["budget_remaining"])
            families["burn"].add_metric([*key, "long"], snap["burn_rate"])
            families["burn"].add_metric([*key, "short"], snap["burn_rate_short"])
        yield from families.values()


def build(model_slos: dict[str, SloConfig], tenant_slos: Iterable[SloConfig],
          registry: CollectorRegistry) -> SloBook | None:
    """The book for a config, or None when it has no SLO at all."""
    tenant_slos = sorted(tenant_slos, key=lambda s: s.model == "")  # specific ones first
    if not model_slos and not tenant_slos:
        return None
    return SloBook(model_slos, tenant_slos, registry)

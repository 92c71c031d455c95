"""For ``goodput.py``: the ideal server, simulated, to say what limits a measured goodput.

An ideal server has no cost of its own: one core, a work-conserving batcher (when the core
frees, every request that has arrived, up to ``max_batch``, goes as one batch; an idle core
starts a lone arrival at once), and each batch of b takes the raw runtime's measured time for
b items (a call time drawn from the samples of the nearest measured size, scaled by the
interpolated mean). Fed the same Poisson schedules as the real run, it gives the highest rate
whose p99 meets the SLO with nothing but the runtime and the queueing that Poisson arrivals
cause. Adding a per-request cost (CPU the server spends on each request on the same core:
HTTP, JSON, hand-offs) shows how much of that rate a server's own work costs, and which cost
per request still reaches a given share of the limit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from sokuji.bench.schedule import Arrivals, intended_times


class CallTimes:
    """The raw runtime's call time for any batch size, from the measured samples."""

    def __init__(self, samples: dict[int, list[float]], seed: int) -> None:
        self.sizes = np.array(sorted(samples))
        self.means = np.array([np.mean(samples[int(b)]) for b in self.sizes])
        self.relative = {int(b): (np.asarray(samples[int(b)]) / m).tolist()
                         for b, m in zip(self.sizes, self.means, strict=True)}
        self.uniform = np.random.default_rng(seed).random(1 << 16).tolist()
        self.cursor = 0
        self.table: dict[int, tuple[float, list[float]]] = {}

    def mean_ms(self, b: int) -> float:
        # Linear in b between measured sizes; beyond the largest, the last per-item slope.
        if b > self.sizes[-1] and len(self.sizes) > 1:
            slope = (self.means[-1] - self.means[-2]) / (self.sizes[-1] - self.sizes[-2])
            return float(self.means[-1] + slope * (b - self.sizes[-1]))
        return float(np.interp(b, self.sizes, self.means))

    def draw_ms(self, b: int) -> float:
        if b not in self.table:  # the mean for b, and the spread of the nearest measured size
            nearest = int(self.sizes[np.abs(self.sizes - b).argmin()])
            self.table[b] = (self.mean_ms(b), self.relative[nearest])
        mean, spread = self.table[b]
        self.cursor = (self.cursor + 1) % len(self.uniform)
        return mean * spread[int(self.uniform[self.cursor] * len(spread))]


def latencies_s(arrivals_s: np.ndarray, calls: CallTimes, max_batch: int,
                overhead_ms: float) -> np.ndarray:
    """Each request's latency through the ideal server plus ``overhead_ms`` a request."""
    n = len(arrivals_s)
    out = np.empty(n)
    free_s, i = 0.0, 0
    while i < n:
        start = max(free_s, arrivals_s[i])
        j = min(int(np.searchsorted(arrivals_s, start, side="right")), i + max_batch)
        j = max(j, i + 1)
        free_s = start + (calls.draw_ms(j - i) + overhead_ms * (j - i)) / 1e3
        out[i:j] = free_s - arrivals_s[i:j]
        i = j
    return out


def p99_ms(rate: float, calls: CallTimes, max_batch: int, overhead_ms: float,
           seconds: float, warmup_s: float, seeds: int) -> float:
    """The ideal server's p99 at ``rate``, pooled over ``seeds`` schedules."""
    lat = []
    for seed in range(seeds):
        times = intended_times(rate, Arrivals.POISSON, seed, duration_s=warmup_s + seconds)
        lat.append(latencies_s(times, calls, max_batch, overhead_ms)[times >= warmup_s])
    return float(np.percentile(np.concatenate(lat), 99) * 1e3)


def meets(rate: float, calls: CallTimes, max_batch: int, overhead_ms: float, slo_ms: float,
          **run: Any) -> bool:
    return p99_ms(rate, calls, max_batch, overhead_ms, **run) <= slo_ms


def max_rate(calls: CallTimes, max_batch: int, overhead_ms: float, slo_ms: float,
             hi: float, **run: Any) -> float:
    """The highest Poisson rate whose p99 meets the SLO, bisected to 0.5%; at most 4 x
    ``hi`` (a cost per request below zero, from a disturbed measurement, has no bound)."""
    lo = 1.0
    if not meets(lo, calls, max_batch, overhead_ms, slo_ms, **run):
        return 0.0
    for _ in range(4):
        if not meets(hi, calls, max_batch, overhead_ms, slo_ms, **run):
            break
        lo, hi = hi, hi * 1.5
    else:
        return lo
    while hi / lo > 1.005:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if meets(mid, calls, max_batch, overhead_ms, slo_ms, **run) \
            else (lo, mid)
    return lo


def analyse(samples: dict[int, list[float]], limit_rps: float, max_batch: int, slo_ms: float,
            overheads_ms: dict[str, float], target_share: float,
            seconds: float = 30.0, warmup_s: float = 2.0, seeds: int = 3) -> dict[str, Any]:
    """Ideal goodput with no cost per request and with each given cost, as shares of the
    limit, and the largest cost per request that still reaches ``target_share``."""
    calls = CallTimes(samples, seed=0)
    run: dict[str, Any] = {"seconds": seconds, "warmup_s": warmup_s, "seeds": seeds}
    hi = 1.5 * limit_rps
    out: dict[str, Any] = {"max_batch": max_batch, "seconds": seconds, "seeds": seeds}
    ideal = max_rate(calls, max_batch, 0.0, slo_ms, hi, **run)
    out["ideal_rps"], out["ideal_over_limit"] = ideal, ideal / limit_rps
    out["with_overhead"] = {}
    for name, ms in overheads_ms.items():
        rate = max_rate(calls, max_batch, ms, slo_ms, hi, **run)
        out["with_overhead"][name] = {"overhead_ms_per_request": ms, "rps": rate,
                                      "over_limit": rate / limit_rps}
    rates = np.linspace(0.3, 1.05, 16) * limit_rps
    out["curves"] = {"rates": rates.tolist(), "p99_ms": {
        name: [p99_ms(r, calls, max_batch, ms, **run) for r in rates]
        for name, ms in {"ideal": 0.0, **overheads_ms}.items()}}
    goal = target_share * limit_rps
    if ideal < goal:
        out["overhead_budget_ms"] = None  # even a server with no cost cannot
    else:
        lo, hi_ms = 0.0, 2.0
        while hi_ms - lo > 0.005:
            mid = (lo + hi_ms) / 2
            ok = meets(goal, calls, max_batch, mid, slo_ms, **run)
            lo, hi_ms = (mid, hi_ms) if ok else (lo, mid)
        out["overhead_budget_ms"] = lo
    return out


def raw_ms_per_item(limit: dict[str, Any], batch: float) -> float:
    """The raw runtime's mean time per item at a (mean) batch size, interpolated linearly in
    the call time between the measured sizes."""
    rows = sorted((int(bs), row["mean_ms"]) for bs, row in limit["by_batch_size"].items())
    lo = max(((bs, ms) for bs, ms in rows if bs <= batch), default=rows[0])
    hi = min(((bs, ms) for bs, ms in rows if bs >= batch), default=rows[-1])
    ms = lo[1] if hi[0] == lo[0] else lo[1] + (hi[1] - lo[1]) * (batch - lo[0]) / (hi[0] - lo[0])
    return ms / batch


def explain_best(best: dict[str, Any], limit: dict[str, Any]) -> dict[str, float]:
    """Where a contender's core went at its best rate: CPU per request, less the raw
    runtime's time per item at the batch size it ran (1 for the FastAPI peers)."""
    batch = best.get("batch_mean", 1.0)
    raw = raw_ms_per_item(limit, batch)
    return {"server_busy": best["server_busy"], "batch_mean": batch,
            "cpu_ms_per_request": best["server_cpu_ms_per_request"], "raw_ms_per_item": raw,
            "serving_ms_per_request": best["server_cpu_ms_per_request"] - raw}

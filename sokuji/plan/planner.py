"""From a fitted replica to a plan: replicas, cores, cost, the p99 curve, and variants.

Traffic is split evenly, so each of n replicas sees the rate / n (a Poisson stream split at
random stays Poisson), and a plan's latency is one replica's at rate / n. The planner finds
the highest rate one replica takes while every latency SLO holds and nothing is refused
(bisection over simulated loads); the fewest replicas for the target rate follow, and are
checked by one more simulation at rate / n. Cores = replicas x cores per replica. Cost at a
price per replica-hour: replicas x price / requests (or output tokens) per hour.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from sokuji.bench.stats import Slo
from sokuji.errors import ConfigError
from sokuji.plan import simulate
from sokuji.plan.fit import EncoderFit, Sim

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Goal:
    rate: float | None
    """Requests a second for the whole service; None: only --predict."""
    slos: tuple[Slo, ...]
    price_per_hour: float | None
    """Of one replica (the server benched), per hour."""
    cores_per_replica: int = 1
    max_replicas: int = 10_000


def meets(slos: tuple[Slo, ...], fig: simulate.Figures) -> bool:
    for slo in slos:
        if slo.metric == "error_rate":
            if fig.refused_share > slo.limit:
                return False
        elif slo.metric == "latency_ms":
            value = fig.latency_ms.get(slo.stat)
            if value is None or value > slo.limit:
                return False
    # Without an error-rate SLO, a replica that refuses requests does not take the rate.
    return any(s.metric == "error_rate" for s in slos) or fig.refused_share == 0


def predict(fit: EncoderFit, rate: float, sim: Sim, *, first_seed: int = 0) -> simulate.Figures:
    """One replica at ``rate`` requests a second (Poisson)."""
    return simulate.poisson_load(rate, fit.service(), max_batch=fit.max_batch,
                                 queue_depth=fit.queue_depth, outside_ms=fit.open_outside,
                                 seconds=sim.seconds_for(rate), warmup_s=sim.warmup_s,
                                 seeds=sim.seeds, first_seed=first_seed)


def max_rate(fit: EncoderFit, slos: tuple[Slo, ...], sim: Sim,
             progress: Progress = lambda _: None) -> tuple[float, simulate.Figures | None]:
    """The highest rate one replica takes within ``slos`` (to 0.5% of its capacity), and its
    figures there; 0 and None when even a trickle of requests misses them."""
    capacity = fit.capacity_rps()
    lo, hi = 0.0, capacity
    best: simulate.Figures | None = None
    trickle = predict(fit, 0.01 * capacity, sim)
    if not meets(slos, trickle):
        return 0.0, None
    lo, best = 0.01 * capacity, trickle
    step = 0
    while hi - lo > 0.005 * capacity:
        step += 1
        progress(f"replica's highest rate within the SLO (step {step})")
        mid = (lo + hi) / 2
        fig = predict(fit, mid, sim)
        if meets(slos, fig):
            lo, best = mid, fig
        else:
            hi = mid
    return lo, best


def cost(replicas: int, rate: float, price: float | None,
         tokens_per_request: float = 0.0) -> dict[str, float] | None:
    if price is None or rate <= 0:
        return None
    per_hour = replicas * price
    out = {"price_per_replica_hour": price, "per_hour": per_hour,
           "per_1m_requests": per_hour / (rate * 3600) * 1e6}
    if tokens_per_request > 0:
        out["per_1m_output_tokens"] = per_hour / (rate * tokens_per_request * 3600) * 1e6
    return out


def replicas_for(rate: float, per_replica: float, goal: Goal) -> int | None:
    """The fewest replicas that each take at most ``per_replica``; None: none can (a lone
    request already misses the SLO) or more than ``goal.max_replicas``."""
    if per_replica <= 0:
        return None
    n = max(1, math.ceil(rate / per_replica - 1e-9))
    return n if n <= goal.max_replicas else None


UNREACHABLE = ("no number of replicas meets the SLO: even a trickle of requests misses it "
               "(the SLO is below one request's own latency)")


def encoder_plan(fit: EncoderFit, goal: Goal, sim: Sim,
                 progress: Progress = lambda _: None) -> dict[str, Any]:
    """Replicas, cores, cost and curves for ``goal`` (needs ``goal.rate`` and an SLO)."""
    assert goal.rate is not None
    per_replica, at_max = max_rate(fit, goal.slos, sim, progress)
    n = replicas_for(goal.rate, per_replica, goal)
    if n is None:
        return {"replicas": None, "per_replica_max_rate": per_replica,
                "per_replica_capacity_rps": fit.capacity_rps(),
                "reason": UNREACHABLE if per_replica <= 0 else
                f"more than --max-replicas {goal.max_replicas} replicas needed"}
    progress(f"checking {n} replica(s)")
    fig = predict(fit, goal.rate / n, sim, first_seed=100)
    while not meets(goal.slos, fig) and n < goal.max_replicas:  # noise at the edge
        n += 1
        fig = predict(fit, goal.rate / n, sim, first_seed=100)
    return {"replicas": n, "cores": n * goal.cores_per_replica,
            "per_replica_rate": goal.rate / n,
            "per_replica_max_rate": per_replica,
            "per_replica_capacity_rps": fit.capacity_rps(),
            "utilisation": fig.busy_share, "predicted": fig.as_dict(),
            "at_max_rate": at_max.as_dict() if at_max else None,
            "cost": cost(n, goal.rate, goal.price_per_hour)}


def curves(fit: EncoderFit, goal: Goal, plan: dict[str, Any], sim: Sim,
           progress: Progress = lambda _: None, points: int = 16) -> dict[str, Any]:
    """One replica's p99 against its rate (n replicas: the same curve at n x the rate), and
    the cost per 1M requests against the total rate."""
    capacity = fit.capacity_rps()
    rates = np.linspace(0.05, 0.98, points) * capacity
    quick = replace(sim, seeds=max(1, sim.seeds // 2), requests=sim.requests // 2)
    p99 = []
    for i, r in enumerate(rates):
        progress(f"p99 curve ({i + 1}/{points})")
        p99.append(predict(fit, float(r), quick).latency_ms.get("p99"))
    out: dict[str, Any] = {"per_replica_rate": rates.tolist(), "p99_ms": p99}
    per_replica = plan["per_replica_max_rate"]
    if goal.rate and goal.price_per_hour and per_replica > 0:
        totals = np.linspace(0.05, 2.0, 80) * goal.rate
        unbounded = replace(goal, max_replicas=10**12)
        reps = [replicas_for(float(t), per_replica, unbounded) or 0 for t in totals]
        out["cost"] = {"rate": totals.tolist(), "replicas": reps,
                       "per_1m_requests": [r * goal.price_per_hour / (t * 3600) * 1e6
                                           for r, t in zip(reps, totals, strict=True)],
                       "floor_per_1m_requests": goal.price_per_hour / (per_replica * 3600)
                       * 1e6}
    return out


# --- variants (sokuji optimize's index) -----------------------------------------------------

def read_index(path: str) -> dict[str, Any]:
    p = Path(path)
    p = p / "index.json" if p.is_dir() else p
    try:
        import json

        doc = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--variants {p}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ConfigError(f"--variants {p}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("schema") != "sokuji.optimize/1" \
            or not isinstance(doc.get("variants"), dict):
        raise ConfigError(f"--variants {p}: not a sokuji optimize index (schema "
                          "sokuji.optimize/1)")
    return doc


def _speeds(entry: dict[str, Any], name: str) -> dict[int, float]:
    try:
        return {int(b): float(v) for b, v in
                entry["figures"]["throughput_items_per_s"].items() if float(v) > 0}
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"--variants: variant '{name}' has no figures."
                          "throughput_items_per_s") from None


def variant_plans(fit: EncoderFit, goal: Goal, sim: Sim, index: dict[str, Any], served: str,
                  rss_bytes: int | None, progress: Progress = lambda _: None
                  ) -> tuple[list[dict[str, Any]], str | None]:
    """Each variant's plan, its runtime scaled from the one benched (``served``) by their
    measured items/s at each batch size; and the recommended one: the fewest replicas among
    those the server may serve, then the least memory, then the best quality."""
    entries = index["variants"]
    if served not in entries:
        raise ConfigError(f"--served-variant {served!r}: not in the index "
                          f"({', '.join(entries)})")
    base = _speeds(entries[served], served)
    base_rss = entries[served].get("figures", {}).get("peak_rss_mb")
    rows: list[dict[str, Any]] = []
    for name, e in entries.items():
        row: dict[str, Any] = {"variant": name, "bytes": e.get("bytes"),
                               "quality": e.get("quality"),
                               "servable": bool((e.get("passed") or e.get("forced"))
                                                and e.get("kept", True))}
        if not row["servable"]:
            row["reason"] = e.get("reason") or "failed the quality gate"
            rows.append(row)
            continue
        speeds = _speeds(e, name)
        scale = {b: base[b] / speeds[b] for b in base if b in speeds}
        vfit = replace(fit, scale=scale)
        progress(f"variant {name}")
        row["scale_by_batch"] = scale
        row["capacity_rps"] = vfit.capacity_rps()
        peak = e.get("figures", {}).get("peak_rss_mb")
        if rss_bytes and peak and base_rss:
            row["rss_bytes_estimate"] = int(rss_bytes + (peak - base_rss) * (1 << 20))
        row["runtime_peak_rss_mb"] = peak
        if goal.rate is not None and goal.slos:
            per_replica, _ = max_rate(fit if name == served else vfit, goal.slos, sim)
            row["per_replica_max_rate"] = per_replica
            n = replicas_for(goal.rate, per_replica, goal)
            if n is not None:
                row["replicas"] = n
                row["cores"] = n * goal.cores_per_replica
                row["cost"] = cost(n, goal.rate, goal.price_per_hour)
        rows.append(row)
    ranked = [r for r in rows if r.get("replicas")]
    ranked.sort(key=lambda r: (r["replicas"], r.get("rss_bytes_estimate") or r["bytes"] or 0,
                               -((r.get("quality") or {}).get("mean_cosine") or 0)))
    return rows, (ranked[0]["variant"] if ranked else None)

"""Generators (LLMs): how much one replica takes within TTFT / ITL SLOs, from bench runs.

A continuous-batching engine's latency depends on how many sequences share its steps, so
the plan reads it off measurements rather than simulating llama.cpp: each streaming run (a
closed loop at some concurrency, or an open loop at some rate) gives a point: requests and
output tokens a second against TTFT, ITL, TPOT and latency percentiles. Sorted by
throughput, the highest throughput whose every SLO holds is found between the last run
that meets them and the first that does not, by linear interpolation of each metric (never
beyond the measured range: if the busiest run still meets the SLOs, that is the answer, and
a note says more may fit).
"""

from __future__ import annotations

import math
from typing import Any

from sokuji.bench.stats import Slo
from sokuji.errors import ConfigError
from sokuji.plan.inputs import Run
from sokuji.plan.planner import Goal, cost, replicas_for

NO_RUN = ("no run meets the SLO, not even the lightest: a replica cannot take any rate "
          "within it (bench at a lower concurrency or rate to find out)")


def _summary(run: Run) -> dict[str, Any]:
    sent = max(run.sent, 1)
    return {"latency_ms": run.latency_ms, "ttft_ms": run.ttft_ms, "itl_ms": run.itl_ms,
            "tpot_ms": run.tpot_ms, "requests": {"error_rate": (run.sent - run.ok) / sent}}


def _row(run: Run, slos: tuple[Slo, ...]) -> dict[str, Any]:
    s = _summary(run)
    values = {slo.text: slo.measure(s) for slo in slos}
    return {"run": run.label, "concurrency": run.concurrency, "rate": run.rate,
            "throughput_rps": run.throughput_rps,
            "output_tokens_per_s": run.output_tokens_per_s,
            "tokens_per_request": run.tokens_per_request,
            "ttft_ms": {k: (run.ttft_ms or {}).get(k) for k in ("p50", "p99")},
            "itl_ms": {k: (run.itl_ms or {}).get(k) for k in ("p50", "p99")},
            "slo": values,
            "meets": all(v is not None and v <= slo.limit
                         for slo, v in zip(slos, values.values(), strict=True))}


def max_rate(runs: list[Run], slos: tuple[Slo, ...]) -> tuple[float, float, list[dict[str, Any]],
                                                              list[str]]:
    """(requests/s, output tokens/s) one replica takes within ``slos``, the runs as rows,
    notes."""
    rows = sorted((_row(r, slos) for r in runs), key=lambda r: r["throughput_rps"])
    notes: list[str] = []
    passing = [i for i, r in enumerate(rows) if r["meets"]]
    if not passing:
        return 0.0, 0.0, rows, []
    i = max(passing)
    a = rows[i]
    if i == len(rows) - 1:
        notes.append(f"the busiest run ({a['run']}) still meets the SLO: a replica may take "
                     "more; bench at a higher concurrency to find its limit")
        return a["throughput_rps"], a["output_tokens_per_s"], rows, notes
    b = rows[i + 1]
    frac = 1.0
    for slo in slos:
        va, vb = a["slo"][slo.text], b["slo"][slo.text]
        if va is None or vb is None or vb <= slo.limit or vb <= va:
            continue
        frac = min(frac, (slo.limit - va) / (vb - va))
    if any(j > i + 1 for j in passing):
        notes.append("a busier run met the SLO again after one that missed it: the runs "
                     "are noisy; the planner stops at the first miss")
    x = a["throughput_rps"] + frac * (b["throughput_rps"] - a["throughput_rps"])
    tps = a["output_tokens_per_s"] + frac * (b["output_tokens_per_s"] - a["output_tokens_per_s"])
    return x, tps, rows, notes


def generator_plan(runs: list[Run], goal: Goal) -> dict[str, Any]:
    if not goal.slos:
        raise ConfigError("--slo is needed for a generator's plan (e.g. ttft_p99=500ms, "
                          "itl_p99=50ms)")
    for slo in goal.slos:
        if slo.metric not in ("latency_ms", "ttft_ms", "itl_ms", "tpot_ms", "error_rate"):
            raise ConfigError(f"SLO {slo.text!r}: not a metric of a streaming run")
    per_replica, tps, rows, notes = max_rate(runs, goal.slos)
    tokens = sum(r.output_tokens for r in runs) / max(1, sum(r.ok for r in runs))
    out: dict[str, Any] = {"runs": rows, "per_replica_max_rate": per_replica,
                           "per_replica_output_tokens_per_s": tps,
                           "tokens_per_request": tokens, "notes": notes}
    n = replicas_for(goal.rate, per_replica, goal) if goal.rate is not None else None
    if goal.rate is not None and n is not None:
        out.update(replicas=n, cores=n * goal.cores_per_replica,
                   per_replica_rate=goal.rate / n,
                   output_tokens_per_s=goal.rate * tokens,
                   cost=cost(n, goal.rate, goal.price_per_hour, tokens))
    elif goal.rate is not None:
        out["replicas"] = None
        out["reason"] = NO_RUN if per_replica <= 0 else \
            f"more than --max-replicas {goal.max_replicas} replicas needed"
    if goal.price_per_hour and tps > 0:
        out["floor_per_1m_output_tokens"] = goal.price_per_hour / (tps * 3600) * 1e6
    if per_replica > 0 and math.isfinite(per_replica):
        out["floor_per_1m_requests"] = (goal.price_per_hour / (per_replica * 3600) * 1e6
                                        if goal.price_per_hour else None)
    return out

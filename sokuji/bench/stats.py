"""From records to figures: HDR-histogram percentiles, tail attribution, SLO verdicts, cost.

Warm-up requests are excluded from every figure. Latencies are recorded in microseconds into
an HDR histogram (3 significant digits). Tail attribution: the mean time per
``Server-Timing`` stage over all requests, and over the slowest 1% (latency >= p99).
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from hdrh.histogram import HdrHistogram

from sokuji.bench.engine import Record, RunResult

PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)
TOTAL_STAGE = "total"


def histogram(values_s: list[float]) -> HdrHistogram:
    hist = HdrHistogram(1, 3_600_000_000, 3)  # 1 us .. 1 h
    for v in values_s:
        hist.record_value(max(1, round(v * 1e6)))
    return hist


def latency_summary(values_s: list[float]) -> dict[str, float] | None:
    """Mean, percentiles and max, in milliseconds; None when there is nothing to summarise."""
    if not values_s:
        return None
    hist = histogram(values_s)
    out = {"count": float(len(values_s)), "mean": hist.get_mean_value() / 1e3}
    for p in PERCENTILES:
        out[_pkey(p)] = hist.get_value_at_percentile(p) / 1e3
    out["max"] = hist.get_max_value() / 1e3
    out["min"] = hist.get_min_value() / 1e3
    return out


def _pkey(p: float) -> str:
    return "p" + (f"{p:g}".replace(".", "_"))


def stage_attribution(records: list[Record], p99_ms: float) -> dict[str, Any] | None:
    timed = [r for r in records if r.stages_ms]
    if not timed:
        return None
    tail = [r for r in timed if r.latency_s * 1e3 >= p99_ms] or \
        [max(timed, key=lambda r: r.latency_s)]
    names = [k for k in timed[0].stages_ms or {} if k != TOTAL_STAGE]

    def means(rs: list[Record]) -> dict[str, float]:
        return {k: statistics.fmean((r.stages_ms or {}).get(k, 0.0) for r in rs) for k in names}

    def shares(m: dict[str, float], rs: list[Record]) -> dict[str, float]:
        client_ms = statistics.fmean(r.latency_s * 1e3 for r in rs)
        return {k: v / client_ms for k, v in m.items()} if client_ms > 0 else {}

    mean_all, mean_tail = means(timed), means(tail)
    return {"requests_with_timing": len(timed), "tail_requests": len(tail),
            "mean_ms": mean_all, "tail_mean_ms": mean_tail,
            "mean_share": shares(mean_all, timed), "tail_share": shares(mean_tail, tail)}


def summarize(run: RunResult, *, streaming: bool = False) -> dict[str, Any]:
    measured = [r for r in run.records if not r.warmup]
    ok = [r for r in measured if r.error is None]
    errors = Counter(r.error for r in measured if r.error is not None)
    out: dict[str, Any] = {
        "mode": run.mode,
        "requests": {"sent": len(measured), "ok": len(ok), "errors": dict(errors),
                     "error_rate": (len(measured) - len(ok)) / len(measured) if measured else 0,
                     "warmup_excluded": len(run.records) - len(measured)},
    }
    if measured:
        start = min(r.intended_s for r in measured)
        end = max(r.done_s for r in measured)
        window = max(end - start, 1e-9)
        out["window_s"] = window
        out["throughput_rps"] = len(ok) / window
        out["offered_rps"] = len(measured) / max(
            max(r.intended_s for r in measured) - start, 1e-9) if len(measured) > 1 else 0.0
    latency = latency_summary([r.latency_s for r in ok])
    out["latency_ms"] = latency
    # How fast errors come back matters too: a 429 should take a millisecond, not a timeout.
    out["error_latency_ms"] = {kind: latency_summary([r.latency_s for r in measured
                                                      if r.error == kind])
                               for kind in errors}
    if streaming:
        out["ttft_ms"] = latency_summary([r.ttft_s for r in ok if r.ttft_s is not None])
        out["itl_ms"] = latency_summary([x for r in ok for x in r.itl_s])
        tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
                if r.ttft_s is not None and r.output_tokens > 1]
        out["tpot_ms"] = latency_summary(tpot)
        tokens = sum(r.output_tokens for r in ok)
        out["output_tokens"] = tokens
        out["output_tokens_per_s"] = tokens / out["window_s"] if measured else 0.0
    if latency is not None:
        out["stages"] = stage_attribution(ok, latency["p99"])
    lags = [r.lag_s for r in measured]
    out["client"] = {
        "cpu_s": run.client_cpu_s, "wall_s": run.wall_s,
        "cpu_fraction": run.client_cpu_s / run.wall_s if run.wall_s else 0.0}
    if run.mode == "open" and lags:
        lag = latency_summary([max(x, 0.0) for x in lags]) or {}
        ratio = send_rate_ratio(measured)
        out["client"].update({
            "lag_ms": lag, "behind_schedule": lag.get("p99", 0.0) > LAG_WARNING_MS,
            "send_rate_ratio": ratio, "cannot_keep_up": ratio < MIN_SEND_RATE_RATIO})
    return out


# Lag is jitter when the client catches up (a busy machine delays a send now and then; the
# latency, measured from the intended time, includes it): worth a warning. It is a failure to
# offer the load only when sending falls behind for good, which shows as a lower send rate.
LAG_WARNING_MS = 5.0
MIN_SEND_RATE_RATIO = 0.9


def send_rate_ratio(records: list[Record]) -> float:
    """The rate the client actually sent at over the scheduled rate (1.0: on schedule), from
    the first to the last of ``records``."""
    if len(records) < 2:
        return 1.0
    intended = max(r.intended_s for r in records) - min(r.intended_s for r in records)
    sent = max(r.sent_s for r in records) - min(r.sent_s for r in records)
    return min(1.0, intended / sent) if sent > 0 else 1.0


# --- SLOs -----------------------------------------------------------------------------------

_SLO = re.compile(r"^(?:(?P<metric>ttft|itl|tpot|latency)_)?(?P<p>p[0-9]+(?:[._][0-9]+)?|mean"
                  r"|max)=(?P<value>[0-9.]+)(?P<unit>ms|s|us)$")
_UNITS = {"ms": 1.0, "s": 1e3, "us": 1e-3}


@dataclass(frozen=True)
class Slo:
    text: str
    metric: str   # latency_ms | ttft_ms | itl_ms | tpot_ms | error_rate
    stat: str     # p99, p50, mean, max ... or 'rate'
    limit: float  # ms, or a fraction for error_rate

    def measure(self, summary: dict[str, Any]) -> float | None:
        if self.metric == "error_rate":
            return float(summary["requests"]["error_rate"])
        block = summary.get(self.metric)
        return None if not block else block.get(self.stat)


def parse_slo(text: str) -> Slo:
    """``p99=100ms``, ``ttft_p95=500ms``, ``itl_p99=50ms``, ``mean=20ms``, ``error_rate=1%``."""
    raw = text.strip().lower()
    if raw.startswith("error_rate="):
        value = raw.split("=", 1)[1]
        limit = float(value[:-1]) / 100 if value.endswith("%") else float(value)
        return Slo(text, "error_rate", "rate", limit)
    m = _SLO.match(raw)
    if not m:
        raise ValueError(f"SLO {text!r} not understood; examples: p99=100ms, ttft_p95=500ms, "
                         "itl_p99=50ms, mean=20ms, error_rate=1%")
    metric = f"{m['metric'] or 'latency'}_ms"
    stat = m["p"].replace(".", "_")
    return Slo(text, metric, stat, float(m["value"]) * _UNITS[m["unit"]])


def verdicts(slos: list[Slo], summary: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for slo in slos:
        measured = slo.measure(summary)
        out.append({"slo": slo.text, "metric": slo.metric, "stat": slo.stat,
                    "limit": slo.limit, "measured": measured,
                    "ok": measured is not None and measured <= slo.limit})
    return out


def cost(summary: dict[str, Any], price_per_hour: float) -> dict[str, float]:
    out: dict[str, float] = {"price_per_hour": price_per_hour}
    rps = summary.get("throughput_rps") or 0.0
    if rps > 0:
        out["per_1k_requests"] = price_per_hour / (rps * 3600) * 1000
    tps = summary.get("output_tokens_per_s") or 0.0
    if tps > 0:
        out["per_1m_output_tokens"] = price_per_hour / (tps * 3600) * 1e6
    return out

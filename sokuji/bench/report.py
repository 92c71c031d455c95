"""Outputs: a terminal table (rich), the JSON result, and an HTML report with plots.

Credentials never reach an output: every writer passes the result through ``scrub.result``
(``--header`` values such as ``Authorization: Bearer ***``, passwords in URLs).

JSON schema ``sokuji.bench/1`` (stable; additions only within a version)::

    {"schema": "sokuji.bench/1", "started_at": ISO-8601, "command": [...],
     "config": {target, url, model, dataset, seed, mode, concurrency | rate, arrivals,
                burstiness, duration_s, count, warmup, timeout_s},
     "summary": {mode, window_s, throughput_rps, offered_rps,
                 requests: {sent, ok, errors: {kind: n}, error_rate, warmup_excluded},
                 latency_ms: {count, mean, min, p50, p90, p95, p99, p99_9, max} | null,
                 error_latency_ms: {kind: (same as latency_ms)},
                 ttft_ms, itl_ms, tpot_ms (streaming targets), output_tokens_per_s,
                 stages: {mean_ms, tail_mean_ms, mean_share, tail_share, ...} | null,
                 client: {cpu_s, wall_s, cpu_fraction, lag_ms?, behind_schedule? (lag p99
                          over 5 ms), send_rate_ratio? (sent / scheduled rate),
                          cannot_keep_up? (ratio under 0.9: a sweep stops)}},
     "slo": [{slo, metric, stat, limit, measured, ok}],
     "cost": {price_per_hour, per_1k_requests, per_1m_output_tokens} | null,
     "sweep": {steps: [{rate, summary, slo}], goodput_rps, max_rate_meeting_slo, knee_rate}
              | null,
     "samples": {"t_s": [...], "latency_ms": [...]}}   (successful requests, at most 20,000;
                                                      in a sweep, those of the last step)
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sokuji.bench import scrub
from sokuji.bench.engine import RunResult

SCHEMA = "sokuji.bench/1"
MAX_SAMPLES = 20_000


def samples(run: RunResult) -> dict[str, list[float]]:
    ok = [r for r in run.records if not r.warmup and r.error is None]
    step = max(1, len(ok) // MAX_SAMPLES)
    ok = sorted(ok, key=lambda r: r.intended_s)[::step]
    return {"t_s": [round(r.intended_s, 6) for r in ok],
            "latency_ms": [round(r.latency_s * 1e3, 4) for r in ok]}


def print_summary(console: Console, result: dict[str, Any]) -> None:
    result = scrub.result(result)
    s = result["summary"]
    table = Table(title=f"sokuji bench: {result['config']['url']}", show_lines=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    req = s["requests"]
    table.add_row("requests ok / sent", f"{req['ok']} / {req['sent']}")
    table.add_row("errors", ", ".join(f"{k}: {v}" for k, v in req["errors"].items()) or "0")
    table.add_row("throughput", f"{s.get('throughput_rps', 0):.1f} req/s")
    for name in ("latency_ms", "ttft_ms", "itl_ms", "tpot_ms"):
        block = s.get(name)
        if block:
            table.add_row(name.replace("_ms", ""),
                          "  ".join(f"{k} {block[k]:.2f}" for k in
                                    ("mean", "p50", "p90", "p95", "p99", "p99_9", "max")) + " ms")
    if s.get("output_tokens_per_s"):
        table.add_row("output tokens/s", f"{s['output_tokens_per_s']:.1f}")
    stages = s.get("stages")
    if stages:
        def fmt(shares: dict[str, float]) -> str:
            top = sorted(shares.items(), key=lambda kv: -kv[1])[:4]
            return ", ".join(f"{k} {v:.0%}" for k, v in top)
        table.add_row("where the time went (mean)", fmt(stages["mean_share"]))
        table.add_row("where the time went (p99+)", fmt(stages["tail_share"]))
    client = s["client"]
    table.add_row("client CPU", f"{client['cpu_fraction']:.0%} of a core")
    if "lag_ms" in client:
        lag = client["lag_ms"]
        table.add_row("client lag p99 / max", f"{lag.get('p99', 0):.2f} / {lag.get('max', 0):.2f}"
                      " ms" + ("  BEHIND SCHEDULE" if client.get("cannot_keep_up")
                               else "  LATE SENDS" if client["behind_schedule"] else ""))
    for v in result.get("slo") or ():
        measured = "n/a" if v["measured"] is None else f"{v['measured']:.4g}"
        table.add_row(f"SLO {v['slo']}", ("PASS " if v["ok"] else "FAIL ") + measured)
    cost = result.get("cost")
    if cost:
        for key in ("per_1k_requests", "per_1m_output_tokens"):
            if key in cost:
                table.add_row(f"cost {key.replace('_', ' ')}", f"{cost[key]:.5f}")
    console.print(table)
    sweep = result.get("sweep")
    if sweep:
        st = Table(title="sweep")
        for col in ("offered req/s", "achieved req/s", "p50 ms", "p99 ms", "errors", "SLO"):
            st.add_column(col, justify="right")
        for step in sweep["steps"]:
            ss = step["summary"]
            lat = ss.get("latency_ms") or {}
            st.add_row(f"{step['rate']:.1f}", f"{ss.get('throughput_rps', 0):.1f}",
                       f"{lat.get('p50', float('nan')):.2f}", f"{lat.get('p99', float('nan')):.2f}",
                       str(sum(ss["requests"]["errors"].values())),
                       "pass" if step["slo_ok"] else "FAIL")
        console.print(st)
        console.print(f"goodput (max throughput meeting the SLO): "
                      f"{sweep['goodput_rps']:.1f} req/s; knee at {sweep['knee_rate']} req/s")


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(scrub.result(result), indent=1, default=float))


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def plots(result: dict[str, Any]) -> dict[str, str]:
    """Base64 PNGs: latency CDF, latency over time, stage breakdown, latency vs throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import ScalarFormatter

    out: dict[str, str] = {}
    lat = np.asarray(result["samples"]["latency_ms"])
    t = np.asarray(result["samples"]["t_s"])
    if len(lat):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        xs = np.sort(lat)
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("Latency CDF")
        ax.grid(True, which="both", alpha=0.3)
        out["Latency CDF"] = _png(fig)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(6, 3.6))
        ax.scatter(t, lat, s=3, alpha=0.5)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("intended send time (s)")
        ax.set_ylabel("latency (ms)")
        ax.set_title("Latency over time")
        ax.grid(True, alpha=0.3)
        out["Latency over time"] = _png(fig)
        plt.close(fig)

    stages = result["summary"].get("stages")
    if stages:
        names = list(stages["mean_ms"])
        colours = plt.get_cmap("tab10")
        fig, ax = plt.subplots(figsize=(6, 2.8))
        for row, key in ((0, "mean_ms"), (1, "tail_mean_ms")):
            left = 0.0
            for i, name in enumerate(names):  # one fixed colour per stage, in both rows
                value = stages[key][name]
                ax.barh(row, value, left=left, color=colours(i % 10),
                        label=name if row == 0 else None)
                left += value
        ax.set_yticks([0, 1], ["mean", "slowest 1%"])
        ax.set_xlabel("server time per stage (ms)")
        ax.set_title("Where the time went (Server-Timing)")
        ax.legend(fontsize=7, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.3))
        out["Stage breakdown"] = _png(fig)
        plt.close(fig)

    sweep = result.get("sweep")
    if sweep and sweep["steps"]:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        rates = [s["summary"].get("throughput_rps", 0) for s in sweep["steps"]]
        for key in ("p50", "p99"):
            ys = [(s["summary"].get("latency_ms") or {}).get(key, float("nan"))
                  for s in sweep["steps"]]
            ax.plot(rates, ys, marker="o", label=key)
        ax.set_xlabel("achieved throughput (req/s)")
        ax.set_ylabel("latency (ms)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.set_title("Latency against throughput")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        out["Latency against throughput"] = _png(fig)
        plt.close(fig)
    return out


def write_html(path: str | Path, result: dict[str, Any]) -> None:
    result = scrub.result(result)
    images = "\n".join(
        f'<figure><figcaption>{html.escape(title)}</figcaption>'
        f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}"></figure>'
        for title, data in plots(result).items())
    summary = html.escape(json.dumps({k: v for k, v in result.items() if k != "samples"},
                                     indent=1, default=float))
    Path(path).write_text(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>sokuji bench report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1300px}}
figure{{display:inline-block;margin:1em}}
pre{{background:#f6f6f6;padding:1em;overflow:auto}}</style>
</head><body><h1>sokuji bench: {html.escape(result['config']['url'])}</h1>
<p>{html.escape(result['started_at'])} &middot; {html.escape(' '.join(result['command']))}</p>
{images}
<h2>Result</h2><pre>{summary}</pre></body></html>
""", encoding="utf-8")

"""``sokuji plan``'s outputs: a progress bar, a terminal table (rich), JSON, and an HTML report
(predicted p99 against the rate for a few replica counts, the cost curve, the variants).

JSON schema ``sokuji.plan/1``::

    {"schema", "created", "command", "inputs": [run labels], "model", "kind": encoder |
     generator, "goal": {rate, slos, price_per_replica_hour, cores_per_replica},
     "fit": {base_ms, per_item_ms, overhead_ms, outside_ms, lone_request_ms, max_batch_size,
             queue_depth, capacity_rps, spread, anchor, capacity_runs, notes}    (encoders)
     "fit_check": [{run, measured: {throughput_rps, p50_ms, p99_ms}, simulated: {...}}],
     "predictions": [{rate, throughput_rps, latency_ms: {mean, p50 ... max}, refused_share,
                      mean_batch, busy_share}],                       (--predict, encoders)
     "plan": {replicas, cores, per_replica_rate, per_replica_max_rate, utilisation,
              predicted, cost: {per_hour, per_1m_requests, per_1m_output_tokens?} | null,
              runs (generators)} | null,
     "curves": {per_replica_rate, p99_ms, cost: {rate, replicas, per_1m_requests}},
     "variants": [{variant, servable, replicas, cores, cost, capacity_rps, quality, ...}],
     "recommended_variant", "memory": {weights_bytes, kv_cache_bytes, buffers_bytes,
     measured_rss_bytes, total_bytes, all_replicas_bytes}, "kv_shape", "notes": [...]}
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


@contextlib.contextmanager
def progress_bar(console: Console, quiet: bool) -> Iterator[Callable[[str], None]]:
    """A spinner with the current step (the simulations take seconds to a minute)."""
    if quiet:
        yield lambda _: None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("reading the bench results")
        yield lambda text: bar.update(task, description=text)


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _bytes(value: Any) -> str:
    return "-" if not value else f"{value / (1 << 20):,.0f} MiB"


def print_plan(console: Console, doc: dict[str, Any]) -> None:
    t = Table(title=f"sokuji plan: {doc['model']} ({doc['kind']})")
    t.add_column("")
    t.add_column("value", justify="right")
    goal = doc["goal"]
    if goal["rate"] is not None:
        t.add_row("target", f"{goal['rate']:g} req/s, {', '.join(goal['slos'])}")
    fit = doc.get("fit")
    if fit:
        t.add_row("fitted batch time", f"{fit['base_ms']:.2f} + {fit['per_item_ms']:.2f} x b ms"
                  f" (of which server work {fit['overhead_ms']:.2f} ms/request)")
        t.add_row("outside the server", _ms(fit["outside_ms"]))
        t.add_row("capacity of one replica", f"{fit['capacity_rps']:.1f} req/s "
                  f"(batches of {fit['max_batch_size']})")
    for c in doc.get("fit_check") or ():
        m, s = c["measured"], c["simulated"]
        t.add_row(f"check {c['run']}", f"measured {m['throughput_rps']:.1f} req/s p99 "
                  f"{m['p99_ms']:.1f}; model {s['throughput_rps']:.1f} req/s p99 "
                  f"{(s['p99_ms'] or 0):.1f}")
    for p in doc.get("predictions") or ():
        lat = p["latency_ms"]
        t.add_row(f"one replica at {p['rate']:g} req/s",
                  f"{p['throughput_rps']:.1f} req/s, p50 {_ms(lat.get('p50'))}, "
                  f"p99 {_ms(lat.get('p99'))}, refused {p['refused_share']:.1%}")
    plan = doc.get("plan")
    if plan:
        if plan.get("replicas") is None:
            t.add_row("[red]replicas", f"[red]{plan.get('reason', 'none meets the SLO')}")
        else:
            t.add_row("[bold]replicas", f"[bold]{plan['replicas']}")
            t.add_row("[bold]cores", f"[bold]{plan['cores']}")
            t.add_row("per replica", f"{plan['per_replica_rate']:.1f} req/s of at most "
                      f"{plan['per_replica_max_rate']:.1f} within the SLO")
            pred = plan.get("predicted")
            if pred:
                lat = pred["latency_ms"]
                t.add_row("predicted latency", f"p50 {_ms(lat.get('p50'))}, p99 "
                          f"{_ms(lat.get('p99'))} (busy {pred['busy_share']:.0%})")
            cost = plan.get("cost")
            if cost:
                t.add_row("cost per hour", f"{cost['per_hour']:.4g}")
                t.add_row("cost per 1M requests", f"{cost['per_1m_requests']:.4g}")
                if "per_1m_output_tokens" in cost:
                    t.add_row("cost per 1M output tokens", f"{cost['per_1m_output_tokens']:.4g}")
    mem = doc.get("memory") or {}
    t.add_row("memory per replica", f"weights {_bytes(mem.get('weights_bytes'))}, KV cache "
              f"{_bytes(mem.get('kv_cache_bytes'))}, buffers {_bytes(mem.get('buffers_bytes'))}"
              f", total {_bytes(mem.get('total_bytes'))}")
    if mem.get("all_replicas_bytes"):
        t.add_row("memory, all replicas", _bytes(mem["all_replicas_bytes"]))
    if doc.get("recommended_variant"):
        t.add_row("[bold]variant to serve", f"[bold]{doc['recommended_variant']}")
    console.print(t)
    if plan and plan.get("runs"):
        rt = Table(title="streaming runs (by throughput)")
        for col in ("run", "req/s", "tokens/s", "ttft p99", "itl p99", "SLO"):
            rt.add_column(col, justify="right")
        for r in plan["runs"]:
            rt.add_row(r["run"], f"{r['throughput_rps']:.2f}", f"{r['output_tokens_per_s']:.1f}",
                       _ms(r["ttft_ms"].get("p99")), _ms(r["itl_ms"].get("p99")),
                       "meets" if r["meets"] else "[red]misses")
        console.print(rt)
    if doc.get("variants"):
        vt = Table(title="variants")
        for col in ("variant", "servable", "capacity req/s", "replicas", "mean cosine"):
            vt.add_column(col, justify="right")
        for v in doc["variants"]:
            q = (v.get("quality") or {}).get("mean_cosine")
            vt.add_row(v["variant"], "yes" if v["servable"] else "no",
                       f"{v['capacity_rps']:.1f}" if v.get("capacity_rps") else "-",
                       str(v.get("replicas") or "-"), f"{q:.4f}" if q else "-")
        console.print(vt)
    for note in doc.get("notes") or ():
        console.print(f"[yellow]note: {note}")


def write_json(path: str, doc: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(doc, indent=1, default=float), encoding="utf-8")


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def plots(doc: dict[str, Any]) -> dict[str, str]:
    """Base64 PNGs: p99 against the rate per replica count, cost per 1M requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    out: dict[str, str] = {}
    curves, plan, goal = doc.get("curves"), doc.get("plan") or {}, doc["goal"]
    limit = next((float(s.split("=")[1].rstrip("ms")) for s in goal["slos"]
                  if s.startswith("p99=") and s.endswith("ms")), None)
    if curves:
        n = plan.get("replicas") or 1
        fig, ax = plt.subplots(figsize=(7, 4))
        for k in sorted({max(1, n - 1), n, n + 1}):
            ax.plot([k * r for r in curves["per_replica_rate"]], curves["p99_ms"],
                    marker=".", label=f"{k} replica{'s' if k > 1 else ''}",
                    lw=2.2 if k == n else 1.0)
        if limit:
            ax.axhline(limit, color="red", ls="--", lw=1, label=f"SLO p99 {limit:g} ms")
        if goal["rate"]:
            ax.axvline(goal["rate"], color="black", ls=":", lw=1, label="target rate")
        ax.set(xlabel="total rate (req/s, Poisson, split evenly)", ylabel="predicted p99 (ms)",
               yscale="log", title="Predicted p99 against the rate")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        out["Predicted p99 against the rate"] = _png(fig)
        plt.close(fig)
        cost = curves.get("cost")
        if cost:
            fig, ax = plt.subplots(figsize=(7, 4))
            ax.step(cost["rate"], cost["per_1m_requests"], where="post",
                    label="at the replicas needed")
            ax.axhline(cost["floor_per_1m_requests"], color="grey", ls="--", lw=1,
                       label="every replica at its SLO limit")
            if goal["rate"]:
                ax.axvline(goal["rate"], color="black", ls=":", lw=1, label="target rate")
            ax.set(xlabel="total rate (req/s)", ylabel="cost per 1M requests",
                   title="Cost per 1M requests against the rate")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            out["Cost curve"] = _png(fig)
            plt.close(fig)
    runs = plan.get("runs")
    if runs:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [r["throughput_rps"] for r in runs]
        for key in ("ttft_ms", "itl_ms"):
            ax.plot(xs, [r[key].get("p99") for r in runs], marker="o", label=f"{key[:-3]} p99")
        if plan.get("per_replica_max_rate"):
            ax.axvline(plan["per_replica_max_rate"], color="black", ls=":", lw=1,
                       label="highest rate within the SLO")
        ax.set(xlabel="throughput (req/s, one replica)", ylabel="ms", yscale="log",
               title="Generation latency against throughput")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        out["Generation latency"] = _png(fig)
        plt.close(fig)
    return out


def write_html(path: str, doc: dict[str, Any]) -> None:
    images = "\n".join(
        f'<figure><figcaption>{html.escape(title)}</figcaption>'
        f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}"></figure>'
        for title, data in plots(doc).items())
    console = Console(record=True, width=110, file=io.StringIO())
    print_plan(console, doc)
    table = html.escape(console.export_text())
    body = html.escape(json.dumps(doc, indent=1, default=float))
    Path(path).write_text(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>sokuji plan report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1300px}}
figure{{display:inline-block;margin:1em}}
pre{{background:#f6f6f6;padding:1em;overflow:auto}}</style>
</head><body><h1>sokuji plan: {html.escape(doc['model'])}</h1>
<p>{html.escape(doc['created'])} &middot; {html.escape(' '.join(doc['command']))}</p>
<pre>{table}</pre>
{images}
<h2>Result</h2><pre>{body}</pre></body></html>
""", encoding="utf-8")

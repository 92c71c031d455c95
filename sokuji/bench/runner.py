"""``sokuji bench``: argument handling, a live progress bar, sweeps and comparisons."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from sokuji.bench import dataset, report, scrub, stats
from sokuji.bench.engine import Engine, Record, RunResult
from sokuji.bench.schedule import Arrivals, intended_times
from sokuji.bench.targets import Target, TargetKind


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="base URL of the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--target", choices=[k.value for k in TargetKind], default="v2")
    p.add_argument("--model", default="minilm")
    p.add_argument("--input-name", default="text", help="V2 input tensor name")
    p.add_argument("--path", help="request path, overriding the target's default")
    p.add_argument("--body-template", help='http target: JSON with "{text}" as placeholder')
    p.add_argument("--header", action="append", default=[], help="extra header, K:V")
    p.add_argument("--max-tokens", type=int, default=64, help="generation targets")
    p.add_argument("--dataset", default="mixed",
                   help=f"built-in ({', '.join(dataset.BUILTIN)}) or a JSONL file")
    p.add_argument("--seed", type=int, default=0, help="seeds the schedule and the sampling")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, help="closed loop: N workers")
    load.add_argument("--rate", type=float, help="open loop: requests per second")
    p.add_argument("--arrivals", choices=[a.value for a in Arrivals], default="poisson")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma arrivals' shape")
    p.add_argument("--duration", type=float, default=30.0, help="measured seconds")
    p.add_argument("--count", type=int, help="measured requests (instead of --duration)")
    p.add_argument("--warmup", default="2s", help="excluded: seconds ('5s') or requests ('100')")
    p.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument("--sweep", action="store_true",
                   help="open loop from --rate upward until the SLO fails")
    p.add_argument("--sweep-factor", type=float, default=1.5)
    p.add_argument("--sweep-steps", type=int, default=12)
    p.add_argument("--slo", action="append", default=[],
                   help="e.g. p99=100ms, ttft_p95=500ms, itl_p99=50ms, error_rate=1%%")
    p.add_argument("--price-per-hour", type=float, help="cost per 1k requests / 1M tokens")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--html", help="write an HTML report with plots here")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("baseline")
    p.add_argument("candidate")
    p.add_argument("--threshold", default="10%",
                   help="a change worse than this is a regression (exit 1)")


def parse_warmup(text: str) -> tuple[float, int]:
    text = text.strip().lower()
    if text.endswith("s"):
        return float(text[:-1]), 0
    return 0.0, int(text)


class LiveProgress:
    """A rich progress bar showing the current rate and the p99 of the last seconds."""

    def __init__(self, console: Console, total: float, by_count: bool, quiet: bool) -> None:
        self.by_count = by_count
        self.recent: deque[tuple[float, float]] = deque()
        self.start = time.perf_counter()
        self.last_update = 0.0
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[rate]:>8.1f} req/s  p99 {task.fields[p99]:>8.2f} ms  "
                       "errors {task.fields[errors]}"),
            console=console, disable=quiet, transient=False)
        self.task = self.progress.add_task("load", total=total, rate=0.0, p99=0.0, errors=0)
        self.done = 0
        self.errors = 0

    def __enter__(self) -> LiveProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def __call__(self, rec: Record) -> None:
        now = time.perf_counter()
        self.done += 1
        self.errors += rec.error is not None
        self.recent.append((now, rec.latency_s))
        while self.recent and self.recent[0][0] < now - 2.0:
            self.recent.popleft()
        if now - self.last_update < 0.2:
            return
        self.last_update = now
        lats = sorted(x for _, x in self.recent)
        p99 = lats[min(len(lats) - 1, int(0.99 * len(lats)))] * 1e3 if lats else 0.0
        span = min(2.0, now - self.start) or 1.0
        self.progress.update(self.task, completed=self.done if self.by_count else now - self.start,
                             rate=len(lats) / span, p99=p99, errors=self.errors)


def _target(args: argparse.Namespace) -> Target:
    headers = {}
    for i, h in enumerate(args.header, 1):
        key, sep, value = h.partition(":")
        if not sep:  # the text itself is not echoed: it may be a credential
            raise ValueError(f"--header number {i} has no ':'; expected Name: value")
        headers[key.strip()] = value.strip()
    return Target(kind=TargetKind(args.target), base_url=args.url, model=args.model,
                  input_name=args.input_name, path=args.path, body_template=args.body_template,
                  max_tokens=args.max_tokens, headers=headers)


async def _run_once(args: argparse.Namespace, engine: Engine, rate: float | None) -> RunResult:
    warmup_s, warmup_n = parse_warmup(args.warmup)
    if rate is None:
        return await engine.closed(args.concurrency, duration_s=None if args.count else
                                   args.duration, count=args.count, warmup_s=warmup_s,
                                   warmup_count=warmup_n)
    arrivals = Arrivals(args.arrivals)
    if args.count:
        times = intended_times(rate, arrivals, args.seed, count=args.count + warmup_n,
                               burstiness=args.burstiness)
    else:
        times = intended_times(rate, arrivals, args.seed, duration_s=warmup_s + args.duration,
                               burstiness=args.burstiness)
    return await engine.open(times, warmup_s=warmup_s, warmup_count=warmup_n)


def _measure(args: argparse.Namespace, target: Target, items: list[dataset.Item],
             console: Console, rate: float | None, slos: list[stats.Slo]
             ) -> tuple[RunResult, dict[str, Any], list[dict[str, Any]]]:
    warmup_s, warmup_n = parse_warmup(args.warmup)
    by_count = bool(args.count)
    total = (args.count + warmup_n) if by_count else (args.duration + warmup_s)
    with LiveProgress(console, total, by_count, args.quiet) as live:
        engine = Engine(target, dataset.Sampler(items, args.seed), timeout_s=args.timeout,
                        progress=live)
        run = asyncio.run(_run_once(args, engine, rate))
    summary = stats.summarize(run, streaming=target.streaming)
    return run, summary, stats.verdicts(slos, summary)


def _sweep(args: argparse.Namespace, target: Target, items: list[dataset.Item],
           console: Console, slos: list[stats.Slo]) -> tuple[RunResult, dict[str, Any],
                                                            dict[str, Any]]:
    if not any(s.metric != "error_rate" for s in slos):
        raise ValueError("--sweep needs a latency SLO, e.g. --slo p99=100ms")
    if not any(s.metric == "error_rate" for s in slos):
        slos = [*slos, stats.parse_slo("error_rate=1%")]
    steps: list[dict[str, Any]] = []
    rate = args.rate
    last: tuple[RunResult, dict[str, Any]] | None = None
    for _ in range(args.sweep_steps):
        if not args.quiet:
            console.print(f"[bold]sweep step: {rate:.1f} req/s")
        run, summary, verdict = _measure(args, target, items, console, rate, slos)
        ok = all(v["ok"] for v in verdict)
        steps.append({"rate": rate, "summary": summary, "slo": verdict, "slo_ok": ok})
        last = (run, summary)
        # A step the client could not offer says nothing about the next; late sends alone
        # (lag on a busy machine) are already in the latencies the SLO judged.
        if not ok or summary["client"].get("cannot_keep_up"):
            break
        rate *= args.sweep_factor
    assert last is not None
    passing = [s for s in steps if s["slo_ok"]]
    base_p99 = (steps[0]["summary"].get("latency_ms") or {}).get("p99")
    knee = None
    for prev, step in itertools.pairwise(steps):
        p99 = (step["summary"].get("latency_ms") or {}).get("p99")
        if base_p99 and (p99 is None or p99 > 2 * base_p99 or not step["slo_ok"]):
            knee = round(prev["rate"], 3)
            break
    sweep = {"steps": steps, "slos": [s.text for s in slos],
             "goodput_rps": max((s["summary"].get("throughput_rps", 0.0) for s in passing),
                                default=0.0),
             "max_rate_meeting_slo": max((round(s["rate"], 3) for s in passing), default=None),
             "knee_rate": knee}
    return last[0], last[1], sweep


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    console = Console(stderr=True)
    target = _target(args)
    items = dataset.load(args.dataset)
    slos = [stats.parse_slo(s) for s in args.slo]
    if args.sweep and args.rate is None:
        raise ValueError("--sweep needs a starting --rate")
    sweep = None
    if args.sweep:
        run_result, summary, sweep = _sweep(args, target, items, console, slos)
        verdict = sweep["steps"][-1]["slo"]
    else:
        run_result, summary, verdict = _measure(args, target, items, console, args.rate, slos)
    config = {k: v for k, v in vars(args).items() if k not in {"out", "html", "quiet"}}
    config["mode"] = "open" if args.rate is not None else "closed"
    result: dict[str, Any] = {
        "schema": report.SCHEMA,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": ["sokuji", *argv], "config": config, "summary": summary, "slo": verdict,
        "cost": stats.cost(summary, args.price_per_hour) if args.price_per_hour else None,
        "sweep": sweep, "samples": report.samples(run_result)}
    result = scrub.result(result)  # no credential (--header, URL) reaches any output
    if not args.quiet:
        report.print_summary(Console(), result)
        client = summary["client"]
        if client.get("cannot_keep_up"):
            console.print(f"[bold red]the client fell behind its schedule (it sent at "
                          f"{client['send_rate_ratio']:.0%} of the asked rate): the offered "
                          "load was lower than asked; use a faster client machine or a lower "
                          "rate")
        elif client.get("behind_schedule"):
            console.print(f"[yellow]the client sent some requests late (lag p99 "
                          f"{client['lag_ms']['p99']:.1f} ms): the latencies include that lag; "
                          "a quieter client machine measures the server more closely")
    if args.out:
        report.write_json(args.out, result)
    if args.html:
        report.write_html(args.html, result)
    return 0 if all(v["ok"] for v in verdict) else 3


# --- compare --------------------------------------------------------------------------------

# (label, path into the summary, +1 if higher is better, -1 if lower is better)
COMPARED = [
    ("throughput req/s", ("throughput_rps",), +1),
    ("latency p50 ms", ("latency_ms", "p50"), -1),
    ("latency p99 ms", ("latency_ms", "p99"), -1),
    ("latency p99.9 ms", ("latency_ms", "p99_9"), -1),
    ("ttft p99 ms", ("ttft_ms", "p99"), -1),
    ("itl p99 ms", ("itl_ms", "p99"), -1),
    ("output tokens/s", ("output_tokens_per_s",), +1),
    ("error rate", ("requests", "error_rate"), -1),
]


def _dig(doc: dict[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = doc
    for key in path:
        if not isinstance(node, dict) or node.get(key) is None:
            return None
        node = node[key]
    return float(node)


def compare(args: argparse.Namespace) -> int:
    threshold = float(args.threshold.rstrip("%")) / (100 if args.threshold.endswith("%") else 1)
    docs = []
    for path in (args.baseline, args.candidate):
        doc = json.loads(Path(path).read_text())
        if doc.get("schema") != report.SCHEMA:
            raise ValueError(f"{path}: not a {report.SCHEMA} result")
        docs.append(doc["summary"])
    from rich.table import Table

    table = Table(title=f"{args.baseline} -> {args.candidate} (threshold {threshold:.0%})")
    for col in ("metric", "baseline", "candidate", "change", "verdict"):
        table.add_column(col, justify="right")
    regressions = 0
    for label, path, sign in COMPARED:
        a, b = _dig(docs[0], path), _dig(docs[1], path)
        if a is None or b is None:
            continue
        if a == 0:
            change = 0.0 if b == 0 else float("inf") * (1 if b > 0 else -1)
        else:
            change = (b - a) / abs(a)
        worse = -sign * change > threshold if path != ("requests", "error_rate") \
            else b - a > threshold * max(a, 0.001)
        regressions += worse
        table.add_row(label, f"{a:.4g}", f"{b:.4g}", f"{change:+.1%}",
                      "[red]REGRESSION" if worse else "ok")
    Console().print(table)
    return 1 if regressions else 0


def main_bench(argv: Sequence[str]) -> int:
    """Entry from ``sokuji bench ...`` (``argv`` excludes the program name)."""
    if len(argv) > 1 and argv[1] == "compare":
        p = argparse.ArgumentParser(prog="sokuji bench compare")
        add_compare_arguments(p)
        cargs = p.parse_args(argv[2:])
        try:
            return compare(cargs)
        except (OSError, ValueError) as exc:
            print(f"sokuji bench compare: {exc}", file=sys.stderr)
            return 2
    p = argparse.ArgumentParser(prog="sokuji bench",
                                description="load generator; also: sokuji bench compare A B")
    add_run_arguments(p)
    args = p.parse_args(argv[1:])
    try:
        return run(args, argv)
    except ValueError as exc:
        print(f"sokuji bench: {exc}", file=sys.stderr)
        return 2

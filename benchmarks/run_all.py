"""Every headline figure from one command (``make bench-all``), with the machine that gave it.

    .venv/bin/python benchmarks/run_all.py [--quick] [--only overhead,goodput,llm,
        speculative,media,hop,failover,cascade,canary,semantic]   (steps comma-separated)

Runs each benchmark script in turn (never two at once: they pin the same cores), each writing
its own raw JSON, probes the machine before and after (CPU, load, thread and event-loop
wake-up latency: what the encoder figures depend on), then prints one table of the headline
figures against their targets and writes it as JSON and as a Markdown table ready for
BENCHMARKS.md (``benchmarks/results/all/summary.{json,md}``).

The LLM benchmarks need llama.cpp's own ``llama-server``: ``benchmarks/build_llama_server.sh``
builds it from the same llama.cpp sources Sokuji runs (~13 min on 2 cores, once). Without it
the LLM step is skipped and says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _llama_cpp_tools import find_tool
from machine import describe
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Figure:
    label: str
    read: Callable[[dict[str, Any]], float]
    target: str  # e.g. ">= 0.95", "<= 0.3"
    unit: str = ""

    def met(self, value: float) -> bool | None:
        """None: a figure recorded without a target."""
        if not self.target:
            return None
        op, bound = self.target.split()
        b = float(bound)
        return {">=": value >= b, "<=": value <= b, "<": value < b, ">": value > b,
                "==": value == b}[op]


@dataclass(frozen=True)
class Step:
    name: str
    script: str
    minutes: str
    figures: list[Figure]
    quick: list[str] = field(default_factory=list)
    needs: Callable[[], str | None] = lambda: None  # a reason it cannot run, or None


def _needs_llama_server() -> str | None:
    try:
        find_tool("llama-server")
    except (FileNotFoundError, SystemExit):
        return "llama-server not built: run benchmarks/build_llama_server.sh (make llama-server)"
    return None


def _ratios(key: str) -> Callable[[dict[str, Any]], float]:
    return lambda r: float(r["ratios"][key])


def _spec(cell: str, key: str) -> Callable[[dict[str, Any]], float]:
    return lambda r: float(r["results"][cell]["cell"]["ngram"][key])


STEPS = [
    Step("overhead", "serving_overhead.py", "~6", [
        Figure("(a) saturated throughput / raw, short", _ratios("a_throughput_ratio_short"),
               ">= 0.95"),
        Figure("(a) saturated throughput / raw, long", _ratios("a_throughput_ratio_long"),
               ">= 0.95"),
        Figure("(b) c=1 p50 - raw call, short", _ratios("b_c1_p50_overhead_ms_short"),
               "<= 0.3", "ms"),
        Figure("(b) c=1 p50 - raw call, long", _ratios("b_c1_p50_overhead_ms_long"),
               "<= 0.3", "ms"),
        Figure("(c) length-aware / FIFO, mixed", _ratios("c_length_over_fifo_mixed"),
               ">= 1.8"),
    ], quick=["--rounds", "2", "--seconds", "3", "--latency-calls", "300",
              "--mixed-seconds", "8"]),
    Step("goodput", "goodput.py", "~8", [
        Figure("goodput under p99 <= 100 ms / raw runtime's limit",
               _ratios("sokuji_over_limit"), ">= 0.9"),
        Figure("goodput / plain FastAPI", _ratios("sokuji_over_fastapi"), ">= 1.5"),
    ], quick=["--quick"]),
    Step("llm", "llm_serving.py", "~8", [
        Figure("tokens/s / llama-server, 8 streams", _ratios("tokens_per_s_at_max_streams"),
               ">= 1.0"),
        Figure("TTFT p99 / llama-server, 8 streams", _ratios("ttft_p99_at_max_streams"),
               "<= 0.5"),
        Figure("idle TTFT p50 / llama-server", _ratios("idle_ttft_p50"), "<= 1.05"),
    ], quick=["--quick"], needs=_needs_llama_server),
    Step("speculative", "speculative.py", "~6", [
        Figure("n-gram speculation: decode tokens/s / off, copy-heavy, 1 stream",
               _spec("copy/1", "per_request_ratio"), ">= 1.0"),
        Figure("n-gram speculation: acceptance, copy-heavy", _spec("copy/1", "acceptance"),
               ">= 0.5"),
        Figure("n-gram speculation: decode tokens/s / off, free text, 1 stream",
               _spec("free/1", "per_request_ratio"), ">= 0.95"),
    ], quick=["--quick"]),
    Step("media", "media.py", "~14", [
        Figure("OCR images/s / rapidocr behind FastAPI, c=4",
               lambda r: float(r["summary"]["ocr"]["per_concurrency"]["4"]
                               ["sokuji_over_fastapi"]), ">= 1.0"),
        Figure("OCR document page, shared rec batches / own only, c=4",
               lambda r: float(r["summary"]["ocr_doc"]["per_concurrency"]["4"]
                               ["batch_over_nobatch"]), ">= 1.0"),
        Figure("VAD audio-s/s / silero's own sequence path, c=1",
               lambda r: float(r["summary"]["vad"]["1"]["sokuji_over_silero_sequence"]),
               ">= 0.95"),
    ], quick=["--quick"]),
    Step("hop", "upstream_hop.py", "~2", [
        Figure("router -> upstream Sokuji, added p50 at c=1 (V2)",
               lambda r: float(r["figures"]["v2 c=1 router"]["added_p50_ms"]), "", "ms"),
    ], quick=["--rounds", "1", "--no-ttft"]),
    Step("failover", "failover.py", "~1", [
        Figure("5xx while an upstream is killed (breaker)",
               lambda r: float(sum(p["5xx"] for p in r["summaries"]["kill"]["breaker"]
                                   ["phases"].values())), "== 0"),
        Figure("hung upstream: outage mean latency, breaker / none",
               lambda r: float(r["summaries"]["stop"]["breaker"]["phases"]["outage"]
                               ["mean_ms"] / r["summaries"]["stop"]["nobreak"]["phases"]
                               ["outage"]["mean_ms"]), "< 1"),
    ]),
    Step("cascade", "cascade.py", "~8", [
        Figure("cascade θ 0.05: accuracy / large-only",
               lambda r: float(next(s["of_large"] for s in r["systems"]
                                    if s["system"] == "cascade-0.05")), ">= 0.98"),
        Figure("cascade θ 0.05: compute / large-only",
               lambda r: float(next(s["compute_of_large"] for s in r["systems"]
                                    if s["system"] == "cascade-0.05")), "<= 0.5"),
    ], quick=["--quick"]),
    Step("canary", "canary.py", "~6", [], quick=["--quick"]),
    Step("semantic", "semantic_cache.py", "~5", [], quick=["--quick"]),
]


def run_step(step: Step, out_dir: Path, quick: bool) -> dict[str, Any]:
    out = out_dir / f"{step.name}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / step.script), "--out", str(out),
           *(step.quick if quick else [])]
    log = out_dir / f"{step.name}.log"
    with open(log, "w", encoding="utf-8") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{step.script} exited {rc}; its output is in {log}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated steps: "
                    + ",".join(s.name for s in STEPS))
    ap.add_argument("--quick", action="store_true", help="shorter runs (noisier)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results" / "all")
    args = ap.parse_args()
    chosen = [s for s in STEPS if not args.only or s.name in args.only.split(",")]
    if args.only and len(chosen) != len(args.only.split(",")):
        ap.error(f"--only: known steps are {', '.join(s.name for s in STEPS)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    console = Console()
    summary: dict[str, Any] = {"command": " ".join(sys.argv), "quick": args.quick,
                               "machine_before": describe(), "steps": {}}
    rows: list[tuple[str, Figure, float | None, str]] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[now]}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("benchmarks", total=len(chosen), now="")
        for step in chosen:
            bar.update(task, now=f"{step.name} ({step.script}, {step.minutes} min)")
            began = time.monotonic()
            reason = step.needs()
            entry: dict[str, Any] = {"script": step.script}
            if reason is not None:
                entry["skipped"] = reason
                rows += [(step.name, f, None, reason) for f in step.figures]
            else:
                try:
                    result = run_step(step, args.out_dir, args.quick)
                except RuntimeError as e:
                    entry["failed"] = str(e)
                    rows += [(step.name, f, None, str(e)) for f in step.figures]
                else:
                    entry["figures"] = {}
                    for f in step.figures:
                        value = f.read(result)
                        entry["figures"][f.label] = {"value": value, "target": f.target,
                                                     "met": f.met(value), "unit": f.unit}
                        rows.append((step.name, f, value, ""))
            entry["seconds"] = round(time.monotonic() - began, 1)
            summary["steps"][step.name] = entry
            bar.advance(task)
    summary["machine_after"] = describe()
    table = Table(title="Sokuji benchmarks: headline figures")
    for col in ("step", "figure", "value", "target", "met"):
        table.add_column(col)
    md = ["| step | figure | value | target | met |", "|---|---|---|---|---|"]
    for name, f, got, note in rows:
        shown = f"{got:.3f}{(' ' + f.unit) if f.unit else ''}" if got is not None else note
        judged = None if got is None else f.met(got)
        met = "" if judged is None else ("yes" if judged else "**no**")
        table.add_row(name, f.label, shown, f.target, met.replace("*", ""))
        md.append(f"| {name} | {f.label} | {shown} | {f.target} | {met} |")
    console.print(table)
    m = summary["machine_before"]
    md += ["", f"Machine: {m['cpu']}, {m['cores']} cores, kernel {m['kernel']}; thread wake-up "
           f"p50 {m['thread_wakeup_us']['p50']:.1f} µs, event-loop wake-up p50 "
           f"{m['loop_wakeup_us']['p50']:.1f} µs; load average {m['load_average'][0]:.2f} "
           f"at the start. Date {m['date']}. Command: `{summary['command']}`."]
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out_dir / "summary.md").write_text("\n".join(md) + "\n")
    console.print(f"wrote {args.out_dir / 'summary.json'} and summary.md")


if __name__ == "__main__":
    main()

"""Was anything lost? The same benchmarks against two source trees, alternating, in one run.

    .venv/bin/python benchmarks/before_after.py --before ../baseline [--runs 2] [--quick]

``--before`` is another checkout of Sokuji (e.g. ``git worktree add ../baseline <commit>``);
``--after`` defaults to this one. Each run of each benchmark is started from that tree's own
script with ``PYTHONPATH`` set to the tree, so its servers import that tree's ``sokuji``
(this venv's packages serve both). The trees alternate (A B, then B A, ...), so a machine that
drifts during the run penalises neither. Every figure compared is already a ratio to a
baseline measured inside its own run (the raw runtime, llama.cpp's server): that is what makes
two runs minutes apart comparable on a shared machine.

Prints each figure for before and after (median over runs) and after / before; writes the
raw reports and the summary as JSON (``benchmarks/results/before_after.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

Figure = Callable[[dict[str, Any]], float]
# name -> (how to read it from a report, which direction is better)
OVERHEAD: dict[str, tuple[Figure, str]] = {
    "a: throughput / raw, short": (lambda r: r["ratios"]["a_throughput_ratio_short"], "higher"),
    "a: throughput / raw, long": (lambda r: r["ratios"]["a_throughput_ratio_long"], "higher"),
    "b: c=1 p50 - raw, short (ms)": (lambda r: r["ratios"]["b_c1_p50_overhead_ms_short"],
                                      "lower"),
    "b: c=1 p50 - raw, long (ms)": (lambda r: r["ratios"]["b_c1_p50_overhead_ms_long"],
                                     "lower"),
    "c: length-aware / FIFO": (lambda r: r["ratios"]["c_length_over_fifo_mixed"], "higher"),
}


LLM: dict[str, tuple[Figure, str]] = {
    "idle TTFT / direct": (lambda r: r["ratios"]["idle_ttft_p50_vs_direct"], "lower"),
    "tokens/s / llama-server, most streams": (
        lambda r: r["ratios"]["tokens_per_s_at_max_streams"], "higher"),
    "TTFT p99 / llama-server, most streams": (
        lambda r: r["ratios"]["ttft_p99_at_max_streams"], "lower"),
    "prefix-cache TTFT ratio": (lambda r: r["prefix"]["ratio"], "lower"),
}


def run_one(tree: Path, script: str, extra: list[str], out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "benchmarks" / script), "--out", str(out), *extra]
    print(f"== {tree.name}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=tree, env=env)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, type=Path, help="the other source tree")
    ap.add_argument("--after", type=Path, default=ROOT)
    ap.add_argument("--runs", type=int, default=2, help="runs per tree and benchmark")
    ap.add_argument("--bench", choices=["overhead", "llm", "both"], default="both")
    ap.add_argument("--quick", action="store_true",
                    help="shorter runs (fewer rounds and seconds; noisier)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" /
                    "before_after.json")
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, tree in trees.items():
        if not (tree / "sokuji" / "__init__.py").is_file():
            ap.error(f"--{name} {tree} is not a Sokuji source tree")
    args.out = args.out.resolve()  # the benchmarks run with each tree as their cwd
    work = args.out.parent / "before_after"
    work.mkdir(parents=True, exist_ok=True)
    benches: list[tuple[str, str, list[str], dict[str, tuple[Figure, str]]]] = []
    if args.bench in ("overhead", "both"):
        quick = ["--rounds", "2", "--seconds", "3", "--latency-calls", "300",
                 "--mixed-seconds", "8"] if args.quick else []
        benches.append(("overhead", "serving_overhead.py", quick, OVERHEAD))
    if args.bench in ("llm", "both"):
        quick = ["--streams", "1", "8", "--idle-samples", "8", "--prefix-samples", "4"] \
            if args.quick else []
        benches.append(("llm", "llm_serving.py", quick, LLM))

    summary: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "trees": {k: str(v) for k, v in trees.items()},
                               "runs": args.runs, "quick": args.quick, "figures": {}}
    for bench, script, extra, figures in benches:
        reports: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for i in range(args.runs):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            for name in order:
                out = work / f"{bench}-{name}-{i}.json"
                reports[name].append(run_one(trees[name], script, extra, out))
        print(f"\n{bench}: median of {args.runs} runs each")
        print(f"  {'figure':44s} {'before':>9s} {'after':>9s} {'after/before':>13s}  better")
        for label, (read, better) in figures.items():
            b = statistics.median(read(r) for r in reports["before"])
            a = statistics.median(read(r) for r in reports["after"])
            ratio = a / b if b else float("nan")
            worse = (ratio < 1) if better == "higher" else (ratio > 1)
            print(f"  {label:44s} {b:9.3f} {a:9.3f} {ratio:13.3f}  {better}"
                  f"{'  (worse)' if worse else ''}")
            summary["figures"][f"{bench}: {label}"] = {
                "before": [read(r) for r in reports["before"]],
                "after": [read(r) for r in reports["after"]],
                "median_before": b, "median_after": a, "after_over_before": ratio,
                "better": better}
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

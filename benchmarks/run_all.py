"""Every headline figure from one command (``make bench-all``), with the machine that gave it.

    .venv/bin/python benchmarks/run_all.py [--quick] [--only STEP,STEP,...] [--list]

Runs each benchmark script in turn (never two at once: they pin the same cores), each writing
its own raw JSON, probes the machine before and after (CPU, load, thread and event-loop
wake-up latency: what the encoder figures depend on), then prints one table of the headline
figures against their targets and writes it as JSON and as a Markdown table ready for
BENCHMARKS.md (``benchmarks/results/all/summary.{json,md}``). ``--list`` prints the steps in
order (by area: serving, overload/admission, LLM, media, pipelines, routing, observability,
plan, scale-out), their minutes, and what each needs here.

A step that cannot run on this machine is skipped and the table says why:

- the LLM comparisons need llama.cpp's own ``llama-server`` / ``llama-batched-bench``:
  ``benchmarks/build_llama_server.sh`` builds them from the same llama.cpp sources Sokuji runs
  (~13 min on 2 cores, once; ``make llama-server``);
- the grammar-engine comparison needs its side venv
  (``benchmarks/grammar_engines/setup_venv.sh``);
- the ANN comparison needs faiss-cpu, hnswlib and usearch; Ray Serve's steps need ``ray``;
- steps that pin a server core and a client core need 2 cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
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
BENCH = ROOT / "benchmarks"
GRAMMAR_PY = ROOT / ".cache" / "bench-venvs" / "grammar" / "bin" / "python"


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
    script: str  # under benchmarks/
    minutes: str
    figures: list[Figure]
    quick: list[str] = field(default_factory=list)
    needs: Callable[[], str | None] = lambda: None  # a reason it cannot run, or None
    area: str = ""
    args: list[str] = field(default_factory=list)  # passed on every run, before ``quick``
    python: Path | None = None  # the interpreter (default: this one)
    out_flag: str | None = "--out"  # None: the script has no such flag, see ``default_out``
    default_out: Callable[[], list[Path]] | None = None  # where it writes without one


@dataclass(frozen=True)
class Need:
    """What a step needs beyond the venv (``what``, for --list) and the check: a reason it
    cannot run here, or None."""
    what: str
    check: Callable[[], str | None]

    def __call__(self) -> str | None:
        return self.check()


def _needs_tool(name: str) -> Need:
    def check() -> str | None:
        try:
            find_tool(name)
        except (FileNotFoundError, SystemExit):
            return f"{name} not built: run benchmarks/build_llama_server.sh (make llama-server)"
        return None
    return Need(f"llama.cpp's {name}", check)


_needs_llama_server = _needs_tool("llama-server")


def _needs_cores(n: int) -> Need:
    def check() -> str | None:
        have = len(os.sched_getaffinity(0))
        return None if have >= n else f"needs {n} cores (server and client pinned), has {have}"
    return Need(f"{n} cores", check)


def _needs_modules(*names: str) -> Need:
    def check() -> str | None:
        missing = [m for m in names if importlib.util.find_spec(m) is None]
        return (f"not installed in {sys.executable}: {', '.join(missing)}" if missing
                else None)
    return Need("Python modules " + ", ".join(names), check)


def _needs_all(*needs: Need) -> Need:
    def check() -> str | None:
        return next((r for r in (n() for n in needs) if r is not None), None)
    return Need("; ".join(n.what for n in needs), check)


def _grammar_venv() -> str | None:
    if GRAMMAR_PY.is_file():
        return None
    return (f"the grammar engines' side venv is missing ({GRAMMAR_PY}): run "
            "benchmarks/grammar_engines/setup_venv.sh")


_needs_grammar_venv = Need("the side venv of benchmarks/grammar_engines/setup_venv.sh",
                           _grammar_venv)


def _ratios(key: str) -> Callable[[dict[str, Any]], float]:
    return lambda r: float(r["ratios"][key])


def _spec(cell: str, key: str) -> Callable[[dict[str, Any]], float]:
    return lambda r: float(r["results"][cell]["cell"]["ngram"][key])


def _path(*keys: str) -> Callable[[dict[str, Any]], float]:
    """The number at ``r[k1][k2]...``."""
    def read(r: dict[str, Any]) -> float:
        for k in keys:
            r = r[k]
        return float(r)  # type: ignore[arg-type]
    return read


def _handoff(size: str, key: str) -> Callable[[dict[str, Any]], float]:
    return lambda r: float(next(row[key] for row in r["rows"] if row["size"] == size))


def _batched_ratio(rows: str) -> Callable[[dict[str, Any]], float]:
    def read(r: dict[str, Any]) -> float:
        cpp = r["llama_batched_bench"][rows]
        return float(r["engine"][rows]["step_ms_median"] / (1e3 * cpp["t_tg"] / cpp["tg"]))
    return read


def _grammar(engine: str, what: str) -> Callable[[dict[str, Any]], float]:
    def read(r: dict[str, Any]) -> float:
        e = next(x for x in r["bench"] if x["key"] == engine)
        if what == "compile":
            return float(statistics.median(e["compile_ms"]))
        return float(e["scripted_walk"]["mask"]["mean_ms"])
    return read


def _ann(lib: str, key: str) -> Callable[[dict[str, Any]], float]:
    # the data set's key names the index size ("pydoc (652 x 384, MiniLM)")
    return lambda r: float(next(v for k, v in r.items() if k.startswith("pydoc"))[lib][key])


def _plan_worst(key: str, overload: bool | None) -> Callable[[dict[str, Any]], float]:
    return lambda r: float(max(abs(row["error"][key]) for row in r["rows"]
                               if overload is None or row["overload"] == overload))


def _canary_broken(key: str, how: Callable[[list[float]], float]) -> Callable[
        [dict[str, Any]], float]:
    return lambda r: float(how([row["sokuji"][key] for row in r["time_to_rollback"]
                                if row["fault"] == "broken"]))


def _canary_aa(r: dict[str, Any]) -> float:
    rows = r["aa_false_rollbacks"]
    return float(sum(x["sokuji alpha=0.001"]["false_rollbacks"] for x in rows)
                 / sum(x["rollouts"] for x in rows))


def _ray_lost(setting: str) -> Callable[[dict[str, Any]], float]:
    """Requests lost per kill (anything but a 200), the worst round, under ``setting``."""
    return lambda r: float(max(sum(n for code, n in row["statuses"].items() if code != "200")
                               for row in r["settings"][setting]["rounds"]))


def _ray_recovery(r: dict[str, Any]) -> float:
    return float(max(row["kill_to_new_replica_answering_s"]
                     for v in r["settings"].values() for row in v["rounds"]))


TWO_CORES = _needs_cores(2)
RAY = _needs_all(_needs_modules("ray"), TWO_CORES)

STEPS = [
    # -- serving ------------------------------------------------------------------------------
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
              "--mixed-seconds", "8"], area="serving", needs=TWO_CORES),
    Step("goodput", "goodput.py", "~8", [
        Figure("goodput under p99 <= 100 ms / raw runtime's limit",
               _ratios("sokuji_over_limit"), ">= 0.9"),
        Figure("goodput / plain FastAPI", _ratios("sokuji_over_fastapi"), ">= 1.5"),
    ], quick=["--quick"], area="serving", needs=TWO_CORES),
    Step("variants", "variants_serving.py", "~8", [
        Figure("recommended INT8 variant: goodput at p99 <= 300 ms / FP32",
               _path("ratio_recommended"), ">= 1.5"),
    ], quick=["--step-s", "4"], area="serving", needs=TWO_CORES),
    Step("tensor", "tensor_serving.py", "~10", [
        Figure("tabular (GBDT) c=1 added p50, binary tensors",
               _path("c1", "tabular", "sokuji_binary", "added_p50_ms"), "<= 0.3", "ms"),
        Figure("OCR det graph: saturated / raw best batch", _path("saturated", "ocr", "ratio"),
               ">= 0.95"),
        Figure("tabular goodput at p99 <= 10 ms / best peer",
               _path("goodput", "tabular", "ratio"), ">= 1.5"),
        Figure("OCR det goodput at p99 <= 1 s / best peer", _path("goodput", "ocr", "ratio"),
               ">= 1.5"),
    ], quick=["--quick"], area="serving", needs=TWO_CORES),
    Step("grpc", "grpc_vs_rest.py", "~5", [
        Figure("minilm saturated, gRPC / REST", _path("models", "minilm", "saturated",
                                                      "grpc_over_rest"), ">= 1.0"),
        Figure("tabular saturated, gRPC / REST", _path("models", "tabular", "saturated",
                                                       "grpc_over_rest"), ">= 1.0"),
        Figure("minilm c=1 p50 added over the runtime, gRPC",
               _path("models", "minilm", "c1", "grpc", "added_p50_ms"), "<= 0.3", "ms"),
        Figure("tabular c=1 p50 added over the runtime, gRPC",
               _path("models", "tabular", "c1", "grpc", "added_p50_ms"), "<= 0.3", "ms"),
    ], quick=["--quick"], area="serving", needs=TWO_CORES),
    Step("python_processes", "python_processes.py", "~1", [
        Figure("GIL-bound Python model: 2 worker processes / 1", _path("two_over_one"),
               ">= 1.7"),
    ], quick=["--seconds", "2"], area="serving", needs=TWO_CORES),
    Step("python_handoff", "python_handoff.py", "~1", [
        Figure("batch hand-off, 1 MB: pickling / shared memory", _handoff("1MB",
                                                                          "pickle_over_shm"),
               ""),
        Figure("a process hop over a call in a thread, 1 KB batch",
               _handoff("1KB", "hop_ms"), "", "ms"),
    ], quick=["--reps", "50"], area="serving"),
    Step("python", "python_serving.py", "~8", [
        Figure("Python class c=1 added p50 over predict() called directly",
               _path("c1", "contenders", "sokuji", "added_p50_ms"), "<= 0.3", "ms"),
        Figure("Python class: process hop (workers=1 - workers=0), c=1 p50",
               _path("c1", "process_hop_p50_ms"), "", "ms"),
        Figure("Python class goodput at p99 <= 25 ms / best peer", _path("goodput", "ratio"),
               ">= 1.5"),
    ], quick=["--quick"], area="serving", needs=TWO_CORES),
    Step("reload", "model_reload.py", "~1", [
        Figure("requests failed while the model is reloaded under load",
               _path("reloading", "failures"), "== 0"),
        Figure("p99 reloading / steady", _path("p99_ratio"), ""),
    ], quick=["--seconds", "3"], area="serving", needs=TWO_CORES),
    # -- overload and admission ---------------------------------------------------------------
    Step("overload", "overload.py", "~5", [
        Figure("3x capacity, admission by time: 5xx", _path("overload_time", "count_5xx"),
               "== 0"),
        Figure("3x capacity, admission by time: admitted p99",
               _path("overload_time", "admitted_latency_ms", "p99"), "<= 2000", "ms"),
        Figure("3x capacity, admission by time: goodput / capacity",
               lambda r: float(r["overload_time"]["goodput_rps"] / r["capacity_rps"]),
               ">= 0.9"),
        Figure("3x capacity, admission by time: time to a 429, p99",
               _path("overload_time", "rejected_latency_ms", "p99"), "<= 5", "ms"),
        Figure("3x capacity, admission by count (queue 64): admitted p99",
               _path("overload_count", "admitted_latency_ms", "p99"), "", "ms"),
        Figure("cache hit end to end, c=1 p50", _path("cache_hit", "p50_ms"), "<= 1", "ms"),
    ], quick=["--seconds", "20"], area="overload/admission", needs=TWO_CORES),
    # -- LLM ----------------------------------------------------------------------------------
    Step("llm", "llm_serving.py", "~8", [
        Figure("tokens/s / llama-server, 8 streams", _ratios("tokens_per_s_at_max_streams"),
               ">= 1.0"),
        Figure("TTFT p99 / llama-server, 8 streams", _ratios("ttft_p99_at_max_streams"),
               "<= 0.5"),
        Figure("idle TTFT p50 / llama-server", _ratios("idle_ttft_p50"), "<= 1.05"),
    ], quick=["--quick"], needs=_needs_llama_server, area="LLM"),
    Step("llm_batched", "llm_batched_bench.py", "~2", [
        Figure("engine decode step / llama-batched-bench's, 8 rows", _batched_ratio("8"), ""),
    ], quick=["--npl", "1", "8", "--tg", "32"], needs=_needs_tool("llama-batched-bench"),
        area="LLM"),
    Step("speculative", "speculative.py", "~6", [
        Figure("n-gram speculation: decode tokens/s / off, copy-heavy, 1 stream",
               _spec("copy/1", "per_request_ratio"), ">= 1.0"),
        Figure("n-gram speculation: acceptance, copy-heavy", _spec("copy/1", "acceptance"),
               ">= 0.5"),
        Figure("n-gram speculation: decode tokens/s / off, free text, 1 stream",
               _spec("free/1", "per_request_ratio"), ">= 0.95"),
    ], quick=["--quick"], area="LLM"),
    Step("structured", "llm_serving.py", "~10", [
        Figure("JSON-schema answers: tokens/s / llama-server's, 8 streams",
               _path("structured", "load", "8", "ratios", "json_sokuji_over_llama_server"),
               ">= 1.0"),
        Figure("JSON-schema answers: tokens/s / unconstrained, 8 streams",
               _path("structured", "load", "8", "ratios", "sokuji_json_over_plain"), ">= 0.95"),
        Figure("logprobs (top 5): tokens/s / none, 8 streams",
               _path("structured", "logprobs", "8", "tokens_per_s_ratio"), ""),
    ], quick=["--quick"], args=["--parts", "schema", "logprobs"],
        needs=_needs_llama_server, area="LLM"),
    Step("grammar", "grammar_engines/bench.py", "~1", [
        Figure("llguidance: compile the test schema, median of 5", _grammar("llg", "compile"),
               "", "ms"),
        Figure("llguidance: mask a token, scripted walk, mean", _grammar("llg", "mask"), "",
               "ms"),
        Figure("llama.cpp grammar: mask a token, scripted walk, mean",
               _grammar("lcpp", "mask"), "", "ms"),
    ], args=["llg", "xgr", "oc", "lcpp"], python=GRAMMAR_PY, out_flag="--json",
        needs=_needs_grammar_venv, area="LLM"),
    # -- media --------------------------------------------------------------------------------
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
    ], quick=["--quick"], area="media", needs=TWO_CORES),
    Step("ocr_worst", "ocr_worst_case.py", "~2", [
        Figure("worst OCR request the default limits allow (8 files), one core",
               _path("worst_request_s"), "", "s"),
    ], area="media"),
    # -- pipelines, retrieval, features -------------------------------------------------------
    Step("pipelines", "pipelines.py", "~8", [
        Figure("pipeline layer: cost of a step (server)", _path("part_b", "per_step_ms_server"),
               "<= 0.1", "ms"),
        Figure("rag: concurrent p50 <= sequential p50 - shorter branch (1 = met)",
               lambda r: float(r["part_a"]["target_met"]), "== 1"),
        Figure("rag with a 5 ms lookup: paired TTFT saved by concurrency",
               _path("part_c", "paired_ttft_diff_ms_median"), "", "ms"),
    ], quick=["--quick"], area="pipelines", needs=TWO_CORES),
    Step("retrieval", "retrieval_recall.py", "~1", [
        Figure("hybrid retrieval recall@5, 106 questions",
               _path("recall", "hybrid", "all", "recall@5"), ""),
        Figure("hybrid retrieval MRR@10", _path("recall", "hybrid", "all", "mrr@10"), ""),
    ], quick=["--repeat", "3"], area="pipelines"),
    Step("ann", "retrieval_ann.py", "~1", [
        Figure("faiss HNSW recall@10, pydoc", _ann("faiss-cpu", "recall@10"), ""),
        Figure("faiss HNSW recall@10 with a 10% filter, pydoc",
               _ann("faiss-cpu", "filtered10%_recall@10"), ""),
    ], quick=["--n", "5000"], needs=_needs_modules("faiss", "hnswlib", "usearch"),
        area="pipelines"),
    Step("features", "feature_lookup.py", "~1", [
        Figure("feature lookup (SQLite online store) p50 / a direct read",
               _path("stores", "sqlite", "get", "p50_vs_direct"), ""),
        Figure("feature lookup (SQLite online store) p50", _path("stores", "sqlite", "get",
                                                                 "p50_us"), "", "µs"),
    ], quick=["--quick"], needs=_needs_modules("feast"), area="pipelines"),
    # -- routing ------------------------------------------------------------------------------
    Step("hop", "upstream_hop.py", "~2", [
        Figure("router -> upstream Sokuji, added p50 at c=1 (V2)",
               lambda r: float(r["figures"]["v2 c=1 router"]["added_p50_ms"]), "", "ms"),
    ], quick=["--rounds", "1", "--no-ttft"], area="routing", needs=TWO_CORES),
    Step("failover", "failover.py", "~1", [
        Figure("5xx while an upstream is killed (breaker)",
               lambda r: float(sum(p["5xx"] for p in r["summaries"]["kill"]["breaker"]
                                   ["phases"].values())), "== 0"),
        Figure("hung upstream: outage mean latency, breaker / none",
               lambda r: float(r["summaries"]["stop"]["breaker"]["phases"]["outage"]
                               ["mean_ms"] / r["summaries"]["stop"]["nobreak"]["phases"]
                               ["outage"]["mean_ms"]), "< 1"),
    ], area="routing", needs=TWO_CORES),
    Step("cascade", "cascade.py", "~8", [
        Figure("cascade θ 0.05: accuracy / large-only",
               lambda r: float(next(s["of_large"] for s in r["systems"]
                                    if s["system"] == "cascade-0.05")), ">= 0.98"),
        Figure("cascade θ 0.05: compute / large-only",
               lambda r: float(next(s["compute_of_large"] for s in r["systems"]
                                    if s["system"] == "cascade-0.05")), "<= 0.5"),
    ], quick=["--quick"], area="routing"),
    Step("canary", "canary.py", "~6", [
        Figure("broken canary: Sokuji's slowest rollback", _canary_broken("rollback_s", max),
               "", "s"),
        Figure("broken canary: failed answers clients saw (Sokuji)",
               _canary_broken("client_errors", sum), "== 0"),
        Figure("A/A: false rollbacks per rollout (Sokuji, alpha 0.001)", _canary_aa, ""),
    ], quick=["--quick"], area="routing", needs=TWO_CORES),
    Step("semantic", "semantic_cache.py", "~5", [
        Figure("semantic cache: hit p50 speed-up over generating",
               _path("serving", "hit_speedup"), "", "x"),
        Figure("semantic cache: hit rate on paraphrases, served",
               _path("serving", "kinds", "positive", "rate"), ""),
        Figure("semantic cache: false hits on near-opposites, served (5% target)",
               _path("serving", "kinds", "negative", "rate"), "<= 0.05"),
    ], quick=["--quick"], area="routing", needs=TWO_CORES),
    # -- observability ------------------------------------------------------------------------
    Step("tracing", "tracing_overhead.py", "~8", [
        Figure("tracing at 1%: throughput / off (0 ms model)",
               _path("summary", "synth", "1%", "throughput_ratio"), ">= 0.98"),
        Figure("tracing at 1%: c=1 p50 added (0 ms model)",
               _path("summary", "synth", "1%", "p50_added_ms"), "<= 0.05", "ms"),
        Figure("tracing at 100%: throughput / off (0 ms model)",
               _path("summary", "synth", "100%", "throughput_ratio"), ""),
    ], quick=["--rounds", "2", "--calls", "200", "--seconds", "2"], area="observability",
        needs=TWO_CORES),
    Step("dashboard", "dashboard_overhead.py", "~2", [
        Figure("dashboard watched: c=1 p50 added", _path("summary", "watched", "p50_added_ms"),
               "", "ms"),
        Figure("dashboard watched: throughput / off",
               _path("summary", "watched", "throughput_ratio"), ""),
    ], quick=["--rounds", "2", "--calls", "500", "--seconds", "2"], area="observability",
        needs=TWO_CORES),
    # -- plan ---------------------------------------------------------------------------------
    Step("plan", "plan_validation.py", "~13", [
        Figure("sokuji plan: worst |p99 error| below capacity", _plan_worst("p99_ms", False),
               "<= 0.15"),
        Figure("sokuji plan: worst |throughput error|, every held-out load",
               _plan_worst("throughput_rps", None), "<= 0.15"),
    ], quick=["--quick"], area="plan", needs=TWO_CORES),
    # -- scale-out ----------------------------------------------------------------------------
    Step("ray", "ray_scaleout.py", "~9", [
        Figure("Ray, 1 replica: idle p50 added via HAProxy",
               _path("summary", "added_p50_ms", "haproxy"), "<= 2", "ms"),
        Figure("Ray, 2 replicas / (2 x 1 replica), 48 connections",
               lambda r: float(r["summary"]["c48"]["ray2_over_ray1"] / 2), ">= 0.9"),
        Figure("sokuji plan --ray: p99 error, synthetic 2-replica check",
               _path("checks", "synthetic", "error_pct", "p99_ms"), "", "%"),
    ], quick=["--rounds", "1", "--seconds", "3", "--check-seconds", "8", "--fit-seconds", "4"],
        needs=RAY, area="scale-out"),
    Step("ray_affinity", "ray_affinity.py", "~2", [
        Figure("LLM replicas: later-turn TTFT p90, default router / prefix affinity",
               _path("ratios_random_over_affinity", "later_client_ttft_p90"), ""),
        Figure("LLM replicas: later-turn TTFT mean, default router / prefix affinity",
               _path("ratios_random_over_affinity", "later_client_ttft_mean"), ""),
    ], quick=["--rounds", "1"], needs=RAY, area="scale-out"),
    Step("ray_faults", "ray_faults.py", "~3", [
        Figure("replica SIGKILLed, retry_lost = true: requests lost, worst kill",
               _ray_lost("retry_lost=true"), ""),
        Figure("replica SIGKILLed, no retry: requests lost, worst kill",
               _ray_lost("retry_lost=false"), ""),
        Figure("kill -> new replica answering, slowest", _ray_recovery, "", "s"),
        Figure("autoscaling: load -> second replica answering",
               _path("autoscale", "load_to_2nd_replica_answering_s"), "", "s"),
    ], quick=["--quick"], needs=RAY, area="scale-out"),
]


def _out_path(step: Step, out_dir: Path) -> Path:
    return out_dir / f"{step.name}.json"


def command(step: Step, out_dir: Path, quick: bool) -> list[str]:
    """The command line ``run_step`` runs."""
    cmd = [str(step.python or sys.executable), str(BENCH / step.script), *step.args]
    if step.out_flag:
        cmd += [step.out_flag, str(_out_path(step, out_dir))]
    return cmd + (step.quick if quick else [])


def run_step(step: Step, out_dir: Path, quick: bool) -> dict[str, Any]:
    cmd = command(step, out_dir, quick)
    log = out_dir / f"{step.name}.log"
    began = time.time()
    with open(log, "w", encoding="utf-8") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{step.script} exited {rc}; its output is in {log}")
    if step.out_flag:
        out = _out_path(step, out_dir)
    else:  # the script chose the path: the newest of its candidates, written by this run
        assert step.default_out is not None, step.name
        written = [p for p in step.default_out() if p.is_file() and p.stat().st_mtime >= began]
        if not written:
            raise RuntimeError(f"{step.script} wrote none of "
                               f"{', '.join(map(str, step.default_out()))}; see {log}")
        out = max(written, key=lambda p: p.stat().st_mtime)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _reader_error(f: Figure, result: dict[str, Any]) -> tuple[float | None, str]:
    try:
        return f.read(result), ""
    except (KeyError, IndexError, StopIteration, TypeError, ValueError, ZeroDivisionError) as e:
        return None, f"not in the JSON ({type(e).__name__}: {e})"


def list_steps() -> None:
    """One line a step, in run order: area, name, script, minutes, figures, what it needs and
    whether it can run here (plain text: readable in a log or a narrow terminal)."""
    total = 0
    for s in STEPS:
        reason = s.needs()
        total += int(s.minutes.lstrip("~"))
        print(f"{s.area:19s} {s.name:17s} {s.script:26s} {s.minutes:>4s} min  "
              f"{len(s.figures)} figures  needs: {getattr(s.needs, 'what', '') or '-'}  -> "
              + ("ready" if reason is None else f"SKIPPED: {reason}"))
    print(f"{len(STEPS)} steps, ~{total} minutes in all (--quick: shorter)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated steps: "
                    + ",".join(s.name for s in STEPS))
    ap.add_argument("--quick", action="store_true", help="shorter runs (noisier)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results" / "all")
    ap.add_argument("--list", action="store_true",
                    help="print the steps, their minutes and what each needs; run nothing")
    args = ap.parse_args()
    if args.list:
        list_steps()
        return
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
                        value, why = _reader_error(f, result)
                        entry["figures"][f.label] = {
                            "value": value, "target": f.target, "unit": f.unit,
                            "met": None if value is None else f.met(value),
                            **({"error": why} if why else {})}
                        rows.append((step.name, f, value, why))
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

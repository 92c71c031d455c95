"""Pipelines (issue 13): the built-in ``rag`` with its steps run concurrently against the same
steps run one after another, and the pipeline layer's own cost per step. One server, both
variants side by side in one run, open-loop load.

    .venv/bin/python benchmarks/pipelines.py [--quick] [--out benchmarks/results/pipelines.json]

Part A, RAG time to first token. Two pipelines in one server: ``rag`` (the user's features
and the retrieval run concurrently) and ``rag_seq`` (the same steps, retrieval waiting for
the features lookup). Poisson arrivals; arrival 2i and 2i+1 ask the same question, one to
each pipeline (which first alternates), streamed over the OpenAI chat endpoint. Every
(question, user) is asked once before the measurement, so each measured prompt is in the
prefix cache (both pipelines build the same prompt): the prefill left is a few tokens, and
the steps before the answer are not lost in a second of prefill's variation (a cold rag
prompt, ~400 tokens, takes ~1 s to prefill on one core). Figures: TTFT
p50/p99 of each, the paired TTFT difference (median of seq - conc over the pairs), and the
shorter branch's time (the features step's duration from Server-Timing): the target is
concurrent p50 <= sequential p50 - the shorter branch.

Part B, the layer's cost. ``chain1`` (one step that passes its input on) and ``chain9``
(nine such steps in a chain), alternated request by request under open-loop Poisson load
over V2; per step = (p50 of chain9 - p50 of chain1) / 8, from the client's latency and from
the server's own Server-Timing total. Also ``embed`` (a pipeline of one MiniLM step)
against MiniLM called directly: what wrapping a model in a pipeline costs. Target: <= 0.1 ms
a step.

Server on --server-core, client on --client-core. What the figures depend on: the machine's
thread wake-ups (the features lookup runs in a worker thread), the LLM's prefill (Part A's
TTFT is the steps, the prompt's last uncached tokens and the wait for the engine's step in
flight).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from _harness import Server, free_port, parse_timing, percentile
from rich.console import Console
from rich.table import Table

from sokuji.bench import sse
from sokuji.pipelines.builtin import rag_config
from sokuji.retrieval.corpus import pydoc_passages
from sokuji.retrieval.questions import load_questions

ROOT = Path(__file__).resolve().parent.parent
console = Console()


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def pipeline_toml(name: str, steps: list[dict[str, Any]], **top: Any) -> str:
    lines = ["[[pipelines]]", f"name = {_toml(name)}"]
    lines += [f"{k} = {_toml(v)}" for k, v in top.items()]
    for step in steps:
        lines.append("[[pipelines.steps]]")
        lines += [f"{k} = {_toml(v)}" for k, v in step.items() if v not in (None, (), {})
                  or k == "fallback"]
    return "\n".join(lines) + "\n"


def _steps(after_features: bool, remote: bool = False) -> list[dict[str, Any]]:
    out = []
    for s in rag_config().steps:
        d = {"name": s.name, "kind": s.kind, "inputs": dict(s.inputs), "model": s.model or None,
             "function": s.function or None, "options": dict(s.options),
             "timeout_ms": s.timeout_ms or None, "on_error": s.on_error}
        if remote and s.name == "features":  # Part C: the lookup waits on a network
            d.update(kind="python", function="benchmarks._pipeline_steps:remote_profile",
                     options={})
        if s.on_error == "fallback":
            d["fallback"] = s.fallback
        if after_features and s.name == "retrieve":
            d["after"] = ["features"]
        out.append(d)
    return out


def config(port: int, cache_dir: str) -> str:
    rag = rag_config()
    top = {"inputs": list(rag.inputs), "optional_inputs": list(rag.optional_inputs),
           "output": rag.output, "extra_outputs": list(rag.extra_outputs)}
    ident = "sokuji.pipelines.builtin:identity"
    chain = [{"name": f"s{i}", "kind": "python", "function": ident,
              "inputs": {"value": "input.question" if i == 0 else f"s{i - 1}"}}
             for i in range(9)]
    return f"""port = {port}
cache_dir = "{cache_dir}"
log_level = "warning"
builtin_pipelines = false
[cache]
enabled = false
[[models]]
name = "minilm"
intra_op_threads = 1
[[models]]
name = "smollm2"
runtime = "llama"
[models.options]
prefix_cache_mb = 2048
""" + pipeline_toml("rag", _steps(False), **top) \
        + pipeline_toml("rag_seq", _steps(True), **top) \
        + pipeline_toml("rag_remote", _steps(False, True), **top) \
        + pipeline_toml("rag_remote_seq", _steps(True, True), **top) \
        + pipeline_toml("chain1", chain[:1]) + pipeline_toml("chain9", chain) \
        + pipeline_toml("embed", [{"name": "embed", "kind": "model", "model": "minilm",
                                   "inputs": {"texts": "input.question"}}])


async def _chat(session: aiohttp.ClientSession, url: str, model: str, question: str,
                user: str, max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    timing: dict[str, float] = {}
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "user": user, "messages": [{"role": "user", "content": question}]}
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        status = r.status
        async for line in r.content:
            doc = sse.data(line) if ttft is None else None
            if doc is not None and sse.piece(doc):
                ttft = (time.perf_counter() - t0) * 1000
            elif (header := sse.comment(line, "server-timing")) is not None:
                timing = parse_timing(header)
                start = re.search(r'step\.answer;dur=[\d.]+;desc="start=([\d.]+)', header)
                if start:
                    timing["answer_start"] = float(start.group(1))
    return {"model": model, "status": status, "ttft_ms": ttft, "timing": timing,
            "total_ms": (time.perf_counter() - t0) * 1000}


async def part_a(url: str, questions: list[str], rate: float, pairs: int,
                 max_tokens: int, seed: int, conc: str = "rag", seq: str = "rag_seq"
                 ) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    plan = []
    for i in range(pairs):
        q = questions[i % len(questions)]
        user = f"user-{rng.randrange(200):04d}"
        first, second = (conc, seq) if i % 2 == 0 else (seq, conc)
        plan += [(i, first, q, user), (i, second, q, user)]
    results: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for _ in range(2):  # warm-up: both pipelines, the index and the store paged in
            await _chat(session, url, conc, questions[0], "user-0001", 4)
            await _chat(session, url, seq, questions[0], "user-0001", 4)
        # Each (question, user) once, so that every measured prompt is in the prefix cache
        # (both pipelines build the same prompt): the prefill left is a few tokens, and the
        # steps before the answer are not lost in a second of prefill's variation.
        for q, user in sorted({(q, user) for _, _, q, user in plan}):
            await _chat(session, url, conc, q, user, 1)
        start = time.perf_counter()
        at = 0.0
        tasks = []
        for pair, model, q, user in plan:
            at += rng.expovariate(rate)
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)

            async def one(pair: int = pair, model: str = model, q: str = q,
                          user: str = user) -> None:
                r = await _chat(session, url, model, q, user, max_tokens)
                r["pair"] = pair
                results.append(r)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return results


async def _v2(session: aiohttp.ClientSession, url: str, model: str, text: str,
              input_name: str) -> dict[str, Any]:
    body = {"inputs": [{"name": input_name, "datatype": "BYTES", "shape": [1], "data": [text]}]}
    t0 = time.perf_counter()
    async with session.post(f"{url}/v2/models/{model}/infer", json=body) as r:
        await r.read()
        ms = (time.perf_counter() - t0) * 1000
        return {"model": model, "status": r.status, "ms": ms,
                "timing": parse_timing(r.headers.get("server-timing", ""))}


async def part_b(url: str, groups: list[list[tuple[str, str]]], rate: float, count: int,
                 seed: int) -> list[dict[str, Any]]:
    """Open loop: each arrival picks one variant of one group, round robin."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    conn = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=conn) as session:
        for group in groups:
            for model, name in group:  # warm-up
                for _ in range(20):
                    await _v2(session, url, model, "warm up", name)
            start, at, tasks = time.perf_counter(), 0.0, []
            for i in range(count):
                at += rng.expovariate(rate)
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                model, name = group[i % len(group)]
                tasks.append(asyncio.create_task(
                    _v2(session, url, model, f"how do I sort a list {i % 50}", name)))
            out += await asyncio.gather(*tasks)
    return out


def _p(values: list[float], q: float) -> float:
    return percentile(values, q) if values else float("nan")


def summarize_a(results: list[dict[str, Any]], conc: str = "rag",
                seq: str = "rag_seq") -> dict[str, Any]:
    ok = [r for r in results if r["status"] == 200 and r["ttft_ms"] is not None]
    by: dict[str, list[dict[str, Any]]] = {conc: [], seq: []}
    for r in ok:
        by[r["model"]].append(r)
        r["model"] = "rag" if r["model"] == conc else "rag_seq"  # (keys below)
    by = {"rag": by[conc], "rag_seq": by[seq]}
    ttft = {m: [r["ttft_ms"] for r in rs] for m, rs in by.items()}
    pairs: dict[int, dict[str, float]] = {}
    for r in ok:
        pairs.setdefault(r["pair"], {})[r["model"]] = r["ttft_ms"]
    diffs = [p["rag_seq"] - p["rag"] for p in pairs.values() if len(p) == 2]
    features = [r["timing"].get("step.features", 0.0) for r in ok]
    retrieve = [r["timing"].get("step.retrieve", 0.0) for r in ok]
    crit = {m: [r["timing"].get("critical-path", 0.0) for r in rs] for m, rs in by.items()}
    starts: dict[int, dict[str, float]] = {}
    for r in ok:
        starts.setdefault(r["pair"], {})[r["model"]] = r["timing"].get("answer_start", 0.0)
    start_diffs = [p["rag_seq"] - p["rag"] for p in starts.values() if len(p) == 2]
    shorter = statistics.median([min(f, t) for f, t in zip(features, retrieve, strict=True)])
    conc, seq = _p(ttft["rag"], 50), _p(ttft["rag_seq"], 50)
    return {
        "requests": len(results), "ok": len(ok),
        "ttft_p50_ms": {"rag": conc, "rag_seq": seq},
        "ttft_p99_ms": {m: _p(v, 99) for m, v in ttft.items()},
        "paired_ttft_diff_ms_median": statistics.median(diffs) if diffs else float("nan"),
        "pairs": len(diffs),
        "features_ms_p50": statistics.median(features),
        "retrieve_ms_p50": statistics.median(retrieve),
        "shorter_branch_ms_p50": shorter,
        "steps_before_answer_ms_p50": {m: statistics.median(
            [r["timing"].get("step.features", 0) + r["timing"].get("step.retrieve", 0)
             if m == "rag_seq" else max(r["timing"].get("step.features", 0),
                                        r["timing"].get("step.retrieve", 0))
             for r in rs]) for m, rs in by.items()},
        "critical_path_ms_p50": {m: _p(v, 50) for m, v in crit.items()},
        "answer_start_ms_p50": {m: statistics.median(
            [r["timing"].get("answer_start", 0.0) for r in rs]) for m, rs in by.items()},
        "paired_answer_start_diff_ms_median": statistics.median(start_diffs)
        if start_diffs else float("nan"),
        "target_met": conc <= seq - shorter,
    }


def summarize_b(results: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r["status"] == 200:
            by.setdefault(r["model"], []).append(r)
    p50 = {m: _p([r["ms"] for r in rs], 50) for m, rs in by.items()}
    server = {m: _p([r["timing"].get("total", 0.0) for r in rs], 50) for m, rs in by.items()}
    per_step = (p50["chain9"] - p50["chain1"]) / 8
    per_step_server = (server["chain9"] - server["chain1"]) / 8
    return {"client_p50_ms": p50, "server_total_p50_ms": server,
            "errors": len(results) - sum(len(v) for v in by.values()),
            "per_step_ms_client": per_step, "per_step_ms_server": per_step_server,
            "embed_pipeline_minus_direct_ms_client": p50["embed"] - p50["minilm"],
            "embed_pipeline_minus_direct_ms_server": server["embed"] - server["minilm"],
            "target_met": per_step_server <= 0.1 and per_step <= 0.1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-core", default="1",
                    help="CPU list for taskset, e.g. 1 or 0,1 (the client shares core 0 then)")
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    ap.add_argument("--rate", type=float, default=2.0, help="Part A: requests/s")
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--b-rate", type=float, default=150.0, help="Part B: requests/s")
    ap.add_argument("--b-count", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipelines.json"))
    args = ap.parse_args()
    if args.quick:
        args.pairs, args.b_count = 10, 600
    import os

    os.sched_setaffinity(0, {args.client_core})
    port = free_port()
    questions = [q.text for q in load_questions(pydoc_passages())]
    with Server(args, [sys.executable, "-m", "sokuji", "serve"], port,
                config=config(port, args.cache_dir)):
        url = f"http://127.0.0.1:{port}"
        console.print(f"Part A: {args.pairs} question pairs at {args.rate}/s ...")
        a = asyncio.run(part_a(url, questions, args.rate, args.pairs, args.max_tokens,
                               args.seed))
        console.print(f"Part B: {args.b_count} requests per group at {args.b_rate}/s ...")
        console.print(f"Part C: the same with a remote-like features lookup "
                      f"({args.pairs} pairs) ...")
        c = asyncio.run(part_a(url, questions, args.rate, args.pairs, args.max_tokens,
                               args.seed + 1, "rag_remote", "rag_remote_seq"))
        b = asyncio.run(part_b(url, [[("chain1", "question"), ("chain9", "question")],
                                     [("embed", "question"), ("minilm", "text")]],
                               args.b_rate, args.b_count, args.seed))
    sa, sb = summarize_a(a), summarize_b(b)
    sc = summarize_a(c, "rag_remote", "rag_remote_seq")
    table = Table(title="Pipelines: rag concurrent vs sequential; the layer's cost")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target")
    table.add_row("TTFT p50 rag / rag_seq (ms)",
                  f"{sa['ttft_p50_ms']['rag']:.1f} / {sa['ttft_p50_ms']['rag_seq']:.1f}",
                  "conc <= seq - shorter branch")
    table.add_row("TTFT p99 rag / rag_seq (ms)",
                  f"{sa['ttft_p99_ms']['rag']:.1f} / {sa['ttft_p99_ms']['rag_seq']:.1f}", "")
    table.add_row("paired TTFT seq - conc, median (ms)",
                  f"{sa['paired_ttft_diff_ms_median']:.2f} ({sa['pairs']} pairs)", "")
    table.add_row("shorter branch (features) p50 (ms)", f"{sa['shorter_branch_ms_p50']:.2f}",
                  "")
    table.add_row("answer step starts at, p50 rag / rag_seq (ms)",
                  f"{sa['answer_start_ms_p50']['rag']:.2f} / "
                  f"{sa['answer_start_ms_p50']['rag_seq']:.2f}", "")
    table.add_row("paired answer start seq - conc, median (ms)",
                  f"{sa['paired_answer_start_diff_ms_median']:.2f}", "~ shorter branch")
    table.add_row("Part A target", "met" if sa["target_met"] else "MISSED", "")
    table.add_row("C: remote-like lookup (5 ms wait): TTFT p50 conc / seq (ms)",
                  f"{sc['ttft_p50_ms']['rag']:.1f} / {sc['ttft_p50_ms']['rag_seq']:.1f}",
                  "conc <= seq - shorter branch")
    table.add_row("C: paired TTFT / answer start seq - conc (ms)",
                  f"{sc['paired_ttft_diff_ms_median']:.2f} / "
                  f"{sc['paired_answer_start_diff_ms_median']:.2f}",
                  f"shorter branch {sc['shorter_branch_ms_p50']:.2f}")
    table.add_row("Part C target", "met" if sc["target_met"] else "MISSED", "")
    table.add_row("per step, client p50 (ms)", f"{sb['per_step_ms_client']:.4f}", "<= 0.1")
    table.add_row("per step, server total p50 (ms)", f"{sb['per_step_ms_server']:.4f}",
                  "<= 0.1")
    table.add_row("embed pipeline - minilm direct, client / server (ms)",
                  f"{sb['embed_pipeline_minus_direct_ms_client']:.3f} / "
                  f"{sb['embed_pipeline_minus_direct_ms_server']:.3f}", "")
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "part_a": sa, "part_b": sb, "part_c": sc,
                               "raw_a": a, "raw_c": c,
                               "raw_b": [{k: r[k] for k in ("model", "status", "ms")}
                                         | {"total": r["timing"].get("total")} for r in b]}))
    console.print(f"raw figures: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

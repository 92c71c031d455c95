"""Is llama.cpp's batched step the limit? llama.cpp's own figures beside Sokuji's engine.

    .venv/bin/python benchmarks/llm_batched_bench.py [--npl 1 2 4 8] [--pp 128] [--tg 128]
    (~2 minutes; needs llama-batched-bench: benchmarks/build_llama_server.sh)

Everything on one core (``--core``, 1), 1 llama.cpp thread, the same GGUF, 8 sequences of 2,048
cells with one KV stream each, flash attention on:

1. ``llama-batched-bench`` (llama.cpp's C++ tool, built from the same sources as Sokuji's
   llama-cpp-python): ``npl`` sequences prefill ``pp`` tokens, then ``tg`` steps of one token
   each; S_TG = npl x tg / time of the steps (no sampling: it feeds random tokens).
2. The same steps from Python through Sokuji's own ``LlamaModel.decode`` (ctypes) with an
   argmax per row: llama.cpp's step plus the least Python a server needs.
3. Sokuji's ``GenerationEngine`` in-process (no HTTP): ``npl`` greedy requests of ``pp``
   random tokens, ``ignore_eos``, ``tg`` tokens each, submitted together. Every
   ``llama_decode`` is timed (a wrapper on this instance's ``model.decode``, nothing changed
   in sokuji/); the engine's own time a step is the gap between one decode's end and the next
   one's start (batch building, sampling, text, events, the event loop thread sharing the core).

Prints, by rows per step: ms a step and tokens/s for each, and the engine's step split into
llama_decode and the rest. Writes JSON under benchmarks/results/. The figures depend on the
CPU and on what else runs on it; compare them with each other, from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _llama_cpp_tools import find_tool, tool_version  # noqa: E402

from sokuji.llm import native  # noqa: E402

SLOTS, CTX_PER_SLOT = 8, 2048


def batched_bench(args: argparse.Namespace, binary: Path, gguf: Path) -> dict[int, Any]:
    """llama-batched-bench's JSONL rows by npl."""
    cmd = ["taskset", "-c", str(args.core), str(binary), "-m", str(gguf), "-t",
           str(args.threads), "-tb", str(args.threads), "-fa", "on", "-c",
           str(SLOTS * CTX_PER_SLOT), "-npp", str(args.pp), "-ntg", str(args.tg), "-npl",
           ",".join(map(str, args.npl)), "--output-format", "jsonl"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    rows = {}
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            rows[int(row["pl"])] = row
    if set(rows) != set(args.npl):
        raise RuntimeError(f"llama-batched-bench gave rows for {sorted(rows)}:\n{done.stderr}")
    return rows


def python_loop(model: native.LlamaModel, npl: int, pp: int, tg: int, rng: np.random.Generator
                ) -> dict[str, Any]:
    """Prefill ``npl`` x ``pp`` random tokens, then ``tg`` steps of ``npl`` rows with an argmax
    a row: the decode phase's time per step."""
    for s in range(npl):
        prompt = rng.integers(0, model.n_vocab, pp).tolist()
        for i in range(0, pp, model.shape.n_batch):
            chunk = prompt[i:i + model.shape.n_batch]
            model.decode([(t, i + j, s, i + j == pp - 1) for j, t in enumerate(chunk)])
    last = rng.integers(0, model.n_vocab, npl).tolist()
    steps = []
    for i in range(tg):
        t0 = time.perf_counter()
        if model.decode([(last[s], pp + i, s, True) for s in range(npl)]) != 0:
            raise RuntimeError("llama_decode failed")
        last = [int(model.logits(s).argmax()) for s in range(npl)]
        steps.append(time.perf_counter() - t0)
    for s in range(npl):
        model.forget(s)
    return {"step_ms_median": statistics.median(steps) * 1e3,
            "tokens_per_s": npl * tg / sum(steps)}


async def engine_run(runtime: Any, npl: int, pp: int, tg: int, rng: np.random.Generator
                     ) -> dict[str, Any]:
    from sokuji.llm.request import GenerationRequest, SamplingParams, now_ns

    engine, model = runtime.engine, runtime.engine.model
    log: list[tuple[float, float, int, int]] = []
    real = model.decode

    def timed(entries: list[tuple[int, int, int, bool]]) -> int:
        t0 = time.perf_counter()
        rc = real(entries)
        log.append((t0, time.perf_counter(), len(entries), sum(1 for e in entries if e[3])))
        return int(rc)

    model.decode = timed
    try:
        loop = asyncio.get_running_loop()
        params = SamplingParams(max_tokens=tg, temperature=0.0, ignore_eos=True)
        reqs = [GenerationRequest("m", rng.integers(0, model.n_vocab, pp).tolist(), params,
                                  loop, now_ns()) for _ in range(npl)]
        t0 = time.perf_counter()
        for r in reqs:
            engine.submit(r)
        done = await asyncio.gather(*(r.result() for r in reqs))
        wall = time.perf_counter() - t0
    finally:
        del model.decode  # the class's method again
    tokens = sum(g.finish.completion_tokens for g in done)
    # pure-decode steps with every sequence in them (the engine's steady state)
    decode, gap = [], []
    for prev, cur in itertools.pairwise(log):
        if cur[2] == cur[3] == npl:
            decode.append(cur[1] - cur[0])
            gap.append(cur[0] - prev[1])
    d, g = statistics.median(decode), statistics.median(gap)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s_overall": tokens / wall,
            "steps": len(log), "pure_decode_steps": len(decode),
            "decode_ms_median": d * 1e3, "other_ms_median": g * 1e3,
            "decode_ms_mean": statistics.fmean(decode) * 1e3,
            "other_ms_mean": statistics.fmean(gap) * 1e3,
            "step_ms_median": (d + g) * 1e3, "tokens_per_s": npl / (d + g)}


async def sokuji_side(args: argparse.Namespace, gguf: Path) -> dict[str, Any]:
    from sokuji.llm.options import LlamaOptions
    from sokuji.llm.runtime import LlamaRuntime

    runtime = LlamaRuntime("m", str(gguf), LlamaOptions(
        threads=args.threads, slots=SLOTS, context_size=CTX_PER_SLOT,
        prefix_cache_mb=0, split_small_batches=False), str(ROOT / ".cache" / "sokuji"),
        max_queue_depth=64, priority_aging_ms=0.0, at="models[0]")
    runtime.load()
    runtime.warmup()
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"python_loop": {}, "engine": {}}
    for npl in args.npl:
        out["python_loop"][str(npl)] = python_loop(runtime.model, npl, args.pp, args.tg, rng)
    runtime.engine.start()
    try:
        for npl in args.npl:
            out["engine"][str(npl)] = await engine_run(runtime, npl, args.pp, args.tg, rng)
    finally:
        await runtime.engine.stop()
        runtime.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--npl", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--gguf", choices=["shipped", "q8_0"], default="shipped")
    ap.add_argument("--llama-batched-bench", help="the binary (default: built by "
                    "build_llama_server.sh under $SOKUJI_TOOLS_DIR or .cache/tools)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                         "llm_batched_bench.json"))
    args = ap.parse_args()
    binary = find_tool("llama-batched-bench", args.llama_batched_bench)
    gguf = native.smollm2_path()
    if args.gguf == "q8_0":
        gguf = native.requantized(gguf, "q8_0", str(ROOT / ".cache" / "sokuji"))
    print("llama-batched-bench ...", flush=True)
    cpp = batched_bench(args, binary, gguf)
    print("Sokuji: python loop, then the engine ...", flush=True)
    os.sched_setaffinity(0, {args.core})  # engine thread and event loop: one core, as served
    py = asyncio.run(sokuji_side(args, gguf))
    print(f"\nrows a step: ms a step (tokens/s), decode phase; {args.pp}-token prompts, "
          f"{args.tg} tokens each")
    print(f"{'rows':>4} | {'llama-batched-bench':>20} | {'python + ctypes loop':>20} | "
          f"{'Sokuji engine':>20} | engine step = llama_decode + rest (ms)")
    for npl in args.npl:
        c, p, e = cpp[npl], py["python_loop"][str(npl)], py["engine"][str(npl)]
        c_ms = 1e3 * c["t_tg"] / c["tg"]
        print(f"{npl:4d} | {c_ms:9.2f} ({c['speed_tg']:7.1f}) | {p['step_ms_median']:9.2f} "
              f"({p['tokens_per_s']:7.1f}) | {e['step_ms_median']:9.2f} ({e['tokens_per_s']:7.1f})"
              f" | {e['decode_ms_median']:.2f} + {e['other_ms_median']:.2f}")
    print("\n(generated tokens / whole run, prefill included, tokens/s: Sokuji's engine "
          + ", ".join(f"{n}: {py['engine'][str(n)]['tokens_per_s_overall']:.1f}"
                      for n in args.npl) + "; llama-batched-bench's: "
          + ", ".join(f"{n}: {n * args.tg / cpp[n]['t']:.1f}" for n in args.npl) + ")")
    result = {"args": vars(args), "gguf": str(gguf), "llama_batched_bench": cpp,
              **py, "machine": {"cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
                                "loadavg_at_end": os.getloadavg(),
                                "llama_cpp_version": tool_version(binary)}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"raw figures: {out}")


if __name__ == "__main__":
    main()

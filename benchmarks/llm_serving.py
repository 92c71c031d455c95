"""LLM serving, side by side: Sokuji against llama.cpp's own C++ server (``llama-server``,
continuous batching; the main peer) and against llama.cpp called directly in-process (the
floor); optionally also llama-cpp-python's server (``llama_cpp.server``, one sequence at a time).

    benchmarks/build_llama_server.sh                  (once, 4-13 min on 2 cores)
    .venv/bin/python benchmarks/llm_serving.py        (~7 minutes; --quick: ~2, for development)

Same for every contestant: the GGUF (smollm2's Q4_1 as shipped; ``--gguf q8_0`` for its Q8_0
requantization), llama.cpp threads (``--threads``, 1: ``-t 1 -tb 1``), 8 slots of 2,048 cells
with one KV stream each, flash attention on, greedy decoding. Servers and the direct process
run on core 1 (``--server-core``), this load generator on core 0. llama-server is built from
the same llama.cpp sources as Sokuji's llama-cpp-python (build_llama_server.sh), run with
``-np 8 -cb -c 16384 -fa on --no-webui``. Streams over SSE (/v1/completions) with
``ignore_eos`` (every request does the same ``--max-tokens`` of work on both servers) and
``stream_options.include_usage``: tokens are the usage's completion tokens (non-empty chunks
where a server gives no usage), TTFT the first non-empty chunk, ITL the gaps between chunks.

1. Idle TTFT: one request at a time, contestants in a rotating order prompt by prompt; each
   prompt (~70 tokens) starts with a fresh number, so no prefix cache helps anyone.
2. Load (``_llm_load.py``): closed loops of 1, 4, 8 concurrent streams, each stream
   ``--turns`` chat turns (shared system prompt, a different question each). The first turn's
   length ramps with the stream's index so the streams fall out of step; later turns spread
   +-``--spread`` around ``--max-tokens`` (with equal lengths, ignore_eos keeps every stream
   in lockstep: all arrive at once, every turn). Contestants alternate run by run, ``--rounds``
   runs each per level, the same prompts and lengths for each in a round. Pooled over all
   runs: aggregate output tokens/s; TTFT p50 / p99 / max of the later turns (the first turn's
   all-at-once arrivals are the run's start, reported apart); ITL p50 / p99.
3. Prefix cache (Sokuji): TTFT with a shared ~500-token system prompt already cached, against
   the same length of prompt that starts fresh every time, alternated.

Targets (issue 12), Sokuji / llama-server: at 8 streams tokens/s >= 1.0, TTFT p99 <= 0.5;
idle TTFT p50 <= 1.05. (Issue 5: idle TTFT <= 1.1x direct; cached prefix <= 0.2x uncached.)

Structured outputs (issue 28; ``--parts schema compile logprobs``, ``_llm_structured.py``):

4. ``schema``: the same closed loops at ``--schema-streams`` (1, 8) with a bounded JSON schema
   (OpenAI ``response_format`` to Sokuji, llama-server's native ``json_schema`` field, both on
   /v1/completions), no ignore_eos (each answer ends with its document), every answer checked
   with ``jsonschema``; then each server's same prompts unconstrained, ``max_tokens`` equal to
   the tokens its constrained answer took, ignore_eos (the same work, no grammar). Targets at
   8 streams: Sokuji json tokens/s >= 1.0x llama-server json, >= 0.95x Sokuji plain.
5. ``compile``: TTFT one request at a time with a schema never seen (cold compile: one
   property renamed), the warm schema again (cached) and none, fresh prompts.
6. ``logprobs``: Sokuji's chat route with ``logprobs: true, top_logprobs: 5`` against without,
   at ``--logprobs-streams`` (1, 8), ignore_eos, lengths as in 2: tokens/s, ITL, ms a token.

    .venv/bin/python benchmarks/llm_serving.py --parts schema compile logprobs
                     (~12 min; --quick: ~4; writes benchmarks/recorded/llm_structured.json)
Figures depend on the CPU and what else runs on it: compare ratios from one run. Writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import _llm_structured as structured  # noqa: E402
import machine  # noqa: E402
from _harness import Server, free_port, percentile  # noqa: E402
from _llama_cpp_tools import LlamaServer, find_tool, tool_version  # noqa: E402
from _llm_direct import Direct  # noqa: E402
from _llm_load import SYSTEM, TOPICS, Contestant, itls, one_run, session_, summarize  # noqa: E402

from sokuji.llm import native  # noqa: E402

FILLER = ("The bakery opens at seven, sells sourdough, rye and croissants, takes orders by "
          "phone, and closes on Mondays. ")
SK, LS, LC = "sokuji", "llama-server", "llama_cpp.server"


def prompt(nonce: int, topic: str, system: str = SYSTEM) -> str:
    """A fresh prompt: it starts with the number's digits reversed, so consecutive prompts
    differ from their first token and no cache can reuse any of it."""
    return (f"{str(nonce)[::-1]} <|im_start|>system\n{system}<|im_end|>\n"
            f"<|im_start|>user\nWrite a long story about {topic}.<|im_end|>\n"
            "<|im_start|>assistant\n")


async def idle_ttft(args: argparse.Namespace, servers: list[Contestant], direct: Direct
                    ) -> dict[str, Any]:
    names = [c.name for c in servers] + ["direct"]
    ttft: dict[str, list[float]] = {n: [] for n in names}
    itl: dict[str, list[float]] = {n: [] for n in names}
    async with session_() as session:
        for i in range(args.idle_samples):
            text = prompt(10_000 + i, TOPICS[i % len(TOPICS)])
            k = i % len(servers)  # rotate who goes first
            for c in servers[k:] + servers[:k]:
                t, _ = await c.stream(session, text, args.idle_tokens)
                ttft[c.name].append(t[0])
                itl[c.name].extend(itls(t))
            t = await asyncio.to_thread(direct.run, text, args.idle_tokens)
            ttft["direct"].append(t[0])
            itl["direct"].extend(itls(t))
    out: dict[str, Any] = {n: {"ttft_ms": [x * 1e3 for x in ttft[n]],
                               "ttft_p50_ms": statistics.median(ttft[n]) * 1e3,
                               "ttft_mean_ms": statistics.fmean(ttft[n]) * 1e3,
                               "ttft_p99_ms": percentile(ttft[n], 99) * 1e3,
                               "itl_p50_ms": statistics.median(itl[n]) * 1e3} for n in names}
    for other in names[1:]:  # the same prompt back to back: its own length cancels out
        out[f"paired_ratio_{SK}_{other}"] = statistics.median(
            a / b for a, b in zip(ttft[SK], ttft[other], strict=True))
    return out


async def load_level(args: argparse.Namespace, contestants: list[Contestant], n: int
                     ) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in contestants}
    for r in range(args.rounds):
        order = contestants if r % 2 == 0 else contestants[::-1]
        for c in order:  # the same prompts for everyone in a round
            runs[c.name].append(await one_run(args, c, n, base=1_000_000 * n + 1000 * r))
    out: dict[str, Any] = {name: summarize(rs) for name, rs in runs.items()}
    out["paired_tokens_per_s_ratios"] = [a["tokens_per_s"] / b["tokens_per_s"]
                                         for a, b in zip(runs[SK], runs[LS], strict=True)]
    return out


async def prefix(args: argparse.Namespace, sokuji: Contestant) -> dict[str, Any]:
    shared = FILLER * 22  # ~500 tokens
    cached, fresh = [], []
    async with session_() as session:
        await sokuji.stream(session, prompt(0, "a bakery", shared), 1)  # fills the cache
        for i in range(args.prefix_samples):
            topic = TOPICS[i % len(TOPICS)]
            fresh.append((await sokuji.stream(session, prompt(50_000 + i, topic, shared),
                                              1))[0][0])
            text = prompt(0, topic, shared).replace("Write a long", f"Write ({i}) a long")
            cached.append((await sokuji.stream(session, text, 1))[0][0])
    return {"uncached_ttft_ms": [x * 1e3 for x in fresh],
            "cached_ttft_ms": [x * 1e3 for x in cached],
            "uncached_p50_ms": statistics.median(fresh) * 1e3,
            "cached_p50_ms": statistics.median(cached) * 1e3,
            "ratio": statistics.median(cached) / statistics.median(fresh)}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    levels = result["args"]["streams"]
    for name in result["contestants"]:
        a.plot(levels, [result["load"][str(n)][name]["tokens_per_s"] for n in levels],
               marker="o", label=name)
        b.plot(levels, [result["load"][str(n)][name]["ttft_p99_ms"] for n in levels],
               marker="o", label=name)
    a.set(xlabel="concurrent streams", ylabel="output tokens/s", title="Aggregate throughput")
    b.set(xlabel="concurrent streams", ylabel="ms", yscale="log", title="TTFT p99 under load")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def run(args: argparse.Namespace, contestants: list[Contestant], direct: Direct | None
              ) -> dict[str, Any]:
    async with session_() as session:  # warm all (first-request costs)
        for c in contestants:
            await c.stream(session, prompt(1, "warmup"), 8)
    result: dict[str, Any] = {}
    if direct is not None:
        await asyncio.to_thread(direct.run, prompt(1, "warmup"), 8)
        print(f"idle TTFT: {args.idle_samples} prompts each ...", flush=True)
        result["idle"] = await idle_ttft(args, contestants, direct)
    if "load" in args.parts:
        result["load"] = {}
        for n in args.streams:
            print(f"load: {n} streams x {args.turns} turns, {args.rounds} runs each ...",
                  flush=True)
            result["load"][str(n)] = await load_level(args, contestants, n)
    if set(args.parts) & STRUCTURED:
        ports = {c.name: int(c.url.split(":")[2].split("/")[0]) for c in contestants}
        result["structured"] = await structured.run_parts(args, ports)
    if args.prefix_samples and "prefix" in args.parts:
        print("prefix cache ...", flush=True)
        result["prefix"] = await prefix(args, contestants[0])
    return result


STRUCTURED = {"schema", "compile", "logprobs"}
PARTS = ["idle", "load", "prefix", *sorted(STRUCTURED)]


def ratios(result: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    if "idle" not in result or "load" not in result:
        return {}
    top = result["load"][str(max(args.streams))]
    idle = result["idle"]
    return {"tokens_per_s_at_max_streams": top[SK]["tokens_per_s"] / top[LS]["tokens_per_s"],
            "ttft_p99_at_max_streams": top[SK]["ttft_p99_ms"] / top[LS]["ttft_p99_ms"],
            "idle_ttft_p50": idle[SK]["ttft_p50_ms"] / idle[LS]["ttft_p50_ms"],
            "idle_ttft_paired": idle[f"paired_ratio_{SK}_{LS}"],
            "idle_ttft_p50_vs_direct": idle[SK]["ttft_p50_ms"] / idle["direct"]["ttft_p50_ms"]}


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    if "structured" in result:
        structured.report(result["structured"], args)
    if not result["ratios"]:
        return
    idle, names = result["idle"], result["contestants"]
    print(f"\nidle TTFT, {args.idle_samples} prompts of ~70 tokens each (ms):")
    for name in [*names, "direct"]:
        r = idle[name]
        print(f"  {name:17s} p50 {r['ttft_p50_ms']:7.1f}  mean {r['ttft_mean_ms']:7.1f}  "
              f"p99 {r['ttft_p99_ms']:7.1f}  ITL p50 {r['itl_p50_ms']:.1f}")
    print(f"\n{'streams':>7} {'contestant':17s} {'tok/s':>7} {'TTFT p50':>9} {'p99':>7} "
          f"{'max':>7} {'ITL p50':>8} {'p99':>6} {'n':>4} | start of run: TTFT p50 / max")
    for n in args.streams:
        level = result["load"][str(n)]
        for name in names:
            r = level[name]
            print(f"{n:7d} {name:17s} {r['tokens_per_s']:7.1f} {r['ttft_p50_ms']:9.0f} "
                  f"{r['ttft_p99_ms']:7.0f} {r['ttft_max_ms']:7.0f} {r['itl_p50_ms']:8.1f} "
                  f"{r['itl_p99_ms']:6.1f} {len(r['ttft_ms']):4d} | "
                  f"{r['ttft_start_p50_ms']:.0f} / {r['ttft_start_max_ms']:.0f}")
        pr = level["paired_tokens_per_s_ratios"]
        print(f"{'':7s} {'ratio':17s} {level[SK]['tokens_per_s'] / level[LS]['tokens_per_s']:7.2f}"
              f" {level[SK]['ttft_p50_ms'] / level[LS]['ttft_p50_ms']:9.2f} "
              f"{level[SK]['ttft_p99_ms'] / level[LS]['ttft_p99_ms']:7.2f}   "
              f"(tok/s ratio run by run: {min(pr):.2f}-{max(pr):.2f})")
    q = result["ratios"]
    top = max(args.streams)
    print(f"\nSokuji / llama-server: tokens/s at {top} streams "
          f"{q['tokens_per_s_at_max_streams']:.3f} (target >= 1.0); TTFT p99 at {top} streams "
          f"{q['ttft_p99_at_max_streams']:.3f} "
          f"(target <= 0.5)\n  idle TTFT p50 {q['idle_ttft_p50']:.3f} (paired, prompt by "
          f"prompt: {q['idle_ttft_paired']:.3f}; target <= 1.05); idle TTFT p50 / direct "
          f"{q['idle_ttft_p50_vs_direct']:.3f} (target <= 1.1)")
    if "prefix" in result:
        p = result["prefix"]
        print(f"prefix cache: TTFT p50 cached {p['cached_p50_ms']:.1f} ms, uncached "
              f"{p['uncached_p50_ms']:.1f} ms: ratio {p['ratio']:.3f} (target <= 0.2)")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", choices=["shipped", "q8_0"], default="shipped")
    ap.add_argument("--llama-server", help="the binary (default: built by "
                    "build_llama_server.sh under $SOKUJI_TOOLS_DIR or .cache/tools)")
    ap.add_argument("--with-llama-cpp-python", action="store_true",
                    help="also run llama_cpp.server (one sequence at a time: slow under load)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=6, help="runs per contestant per level")
    ap.add_argument("--turns", type=int, default=3, help="requests per stream per run (the "
                    "first, ramped, starts the run: its TTFT is kept apart)")
    ap.add_argument("--spread", type=float, default=0.5, help="later turns' max_tokens: "
                    "--max-tokens x (1 +- spread), uniform, the same for every contestant")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="let requests end at end-of-generation (work then may differ)")
    ap.add_argument("--idle-samples", type=int, default=40)
    ap.add_argument("--idle-tokens", type=int, default=16)
    ap.add_argument("--prefix-samples", type=int, default=10)
    ap.add_argument("--server-core", type=int, default=1)
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=["idle", "load", "prefix"],
                    help="what to run (default: idle load prefix; the structured-output "
                    "parts: schema compile logprobs)")
    ap.add_argument("--schema-streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--schema-max-tokens", type=int, default=256, help="every bounded "
                    "answer ends well under it (one that does not is counted invalid)")
    ap.add_argument("--compile-samples", type=int, default=20)
    ap.add_argument("--compile-tokens", type=int, default=2)
    ap.add_argument("--logprobs-streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--speculative", choices=["ngram", "off"], default="ngram",
                    help="Sokuji's speculative decoding (ngram: its default; llama-server "
                    "runs none)")
    ap.add_argument("--quick", action="store_true", help="a short run for development: "
                    "streams 1 8, 2 rounds of 2 turns, 32 tokens, 6 idle and 3 prefix samples,"
                    " 6 compile samples")
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    ap.add_argument("--out", help="default: benchmarks/results/llm_serving.json, or "
                    "benchmarks/recorded/llm_structured.json with structured parts only")
    ap.add_argument("--plot", help="write a PNG here")
    args = ap.parse_args()
    if args.quick:
        args.streams, args.rounds, args.turns, args.max_tokens = [1, 8], 2, 2, 32
        args.idle_samples, args.prefix_samples, args.compile_samples = 6, 3, 6
    if args.out is None:
        args.out = str(ROOT / "benchmarks" / (
            "recorded/llm_structured.json" if set(args.parts) <= STRUCTURED
            else "results/llm_serving.json"))
    return args


def main() -> None:
    args = parse_args()
    binary = find_tool("llama-server", args.llama_server)
    os.sched_setaffinity(0, {args.client_core})
    gguf = native.smollm2_path()
    if args.gguf == "q8_0":
        gguf = native.requantized(gguf, "q8_0", args.cache_dir)
    sk_port, ls_port, lc_port = free_port(), free_port(), free_port()
    sokuji = Server(args, [sys.executable, "-m", "sokuji", "serve"], sk_port, config=f"""
port = {sk_port}
cache_dir = "{args.cache_dir}"
log_level = "warning"
[[models]]
name = "smollm2"
runtime = "llama"
path = "{gguf}"
cache = false
[models.options]
threads = {args.threads}
slots = 8
context_size = 2048
speculative = "{args.speculative}"
""")
    log = Path(args.out).with_suffix(".llama-server.log")
    peer = LlamaServer(args, binary, gguf, ls_port, slots=8, ctx_per_slot=2048, log_path=log)
    extras: dict[str, Any] = {"stream_options": {"include_usage": True}}
    if args.ignore_eos:
        extras["ignore_eos"] = True
    contestants = [Contestant(SK, sk_port, "smollm2", extras),
                   Contestant(LS, ls_port, "smollm2", extras)]
    servers: list[Server] = [sokuji, peer]
    if args.with_llama_cpp_python:
        servers.append(Server(args, [
            sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port",
            str(lc_port), "--n_threads", str(args.threads), "--n_threads_batch",
            str(args.threads), "--n_ctx", "2048", "--flash_attn", "true", "--verbose", "false",
            # its default lets a new request cut off the one streaming: queue
            "--interrupt_requests", "false"], lc_port, ready_path="/v1/models"))
        contestants.append(Contestant(LC, lc_port, "smollm2", {}))  # (no usage, no ignore_eos)
    started: list[Server] = []
    try:
        for s in servers:  # one at a time: each loads while the core is otherwise idle
            started.append(s)
            s.__enter__()
        direct = Direct(args.server_core, gguf, args.threads) if "idle" in args.parts else None
        try:
            result = asyncio.run(run(args, contestants, direct))
        finally:
            if direct is not None:
                direct.close()
    finally:
        for s in reversed(started):
            if s.proc is not None:  # (also one that never became ready)
                s.__exit__(None, None, None)
    result["contestants"] = [c.name for c in contestants]
    result["ratios"] = ratios(result, args)
    result["args"] = {**vars(args), "gguf_path": str(gguf), "llama_server": str(binary),
                      "llama_server_argv": peer.argv}
    result["machine"] = {"cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
                         "loadavg_at_end": os.getloadavg(),
                         "llama_server_version": tool_version(binary),
                         "probe": machine.describe()}
    report(result, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nraw figures: {out}; llama-server's log: {log}")
    if args.plot:
        plot(result, Path(args.plot))
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()

"""LLM serving, side by side: Sokuji against llama-cpp-python's own OpenAI server
(``llama_cpp.server``) and against llama.cpp called directly in-process (the floor).

    .venv/bin/python benchmarks/llm_serving.py [--gguf q8_0|shipped]     (~5 minutes)

Same GGUF for all three (by default smollm2's Q4_1 as shipped; ``--gguf q8_0`` for its
Q8_0 requantization, which Sokuji offers as an option), same llama.cpp threads (--threads, 1),
flash attention on for all three, greedy decoding. Servers and the direct process on core 1;
this load generator on core 0. Streams over SSE (/v1/completions); a token is a non-empty
chunk, counted the same way for both servers.

1. Idle TTFT: one request at a time, contestants interleaved request by request; each prompt
   (~70 tokens) starts with a fresh number, so no prefix cache can help anyone.
2. Load: closed loops of 1, 2, 4, 8 concurrent streams, each stream --rounds chat turns
   (shared system prompt, a different question each) of --max-tokens tokens; Sokuji and
   llama_cpp.server alternate, twice per level. Aggregate
   output tokens/s, TTFT p50/p99 under load, inter-token latency p50/p99.
3. Prefix cache (Sokuji): TTFT with a shared ~500-token system prompt already cached, against
   the same length of prompt that starts fresh every time, alternated.

Targets (issue 5): tokens/s at 8 streams >= 2x llama_cpp.server; idle TTFT <= 1.1x direct;
cached-prefix TTFT <= 0.2x uncached. Writes JSON (and a PNG plot with --plot).
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

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _harness import Server, free_port, percentile  # noqa: E402

from sokuji.llm import native  # noqa: E402

TOPICS = ["a lighthouse keeper", "a lost robot", "a mountain village", "a clockmaker",
          "a river journey", "a dragon who cannot fly", "a city under the sea",
          "an old library", "a desert caravan", "a winter festival", "a tiny astronaut",
          "a talking cat"]
SYSTEM = ("You are a creative writing assistant. You write vivid, detailed stories with "
          "named characters, dialogue and a clear beginning, middle and end.")
FILLER = ("The bakery opens at seven, sells sourdough, rye and croissants, takes orders by "
          "phone, and closes on Mondays. ")


def prompt(nonce: int, topic: str, system: str = SYSTEM) -> str:
    """A fresh prompt: it starts with the number's digits reversed, so consecutive prompts
    differ from their first token and no cache can reuse any of it (llama_cpp.server and the
    direct ``Llama`` reuse whatever prefix the previous prompt shares; Sokuji's prefix
    cache, 16 tokens or more from any earlier prompt)."""
    return (f"{str(nonce)[::-1]} <|im_start|>system\n{system}<|im_end|>\n"
            f"<|im_start|>user\nWrite a long story about {topic}.<|im_end|>\n"
            "<|im_start|>assistant\n")


def chat_prompt(nonce: int, topic: str) -> str:
    """A chat turn: the system prompt is shared, the question differs (both servers may reuse
    the shared part: Sokuji's prefix cache, llama_cpp.server its previous prompt)."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
            f"Write a long story about {topic} (story {nonce}).<|im_end|>\n"
            "<|im_start|>assistant\n")


class Contestant:
    """An OpenAI-compatible server, streamed over aiohttp."""

    def __init__(self, name: str, port: int, model: str) -> None:
        self.name, self.url, self.model = name, f"http://127.0.0.1:{port}/v1/completions", model

    async def stream(self, session: aiohttp.ClientSession, text: str, max_tokens: int
                     ) -> list[float]:
        body = {"model": self.model, "prompt": text, "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True}
        t0 = time.perf_counter()
        times: list[float] = []
        async with session.post(self.url, json=body) as r:
            assert r.status == 200, f"{self.name}: {r.status} {await r.text()}"
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                choices = orjson.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text"):
                    times.append(time.perf_counter() - t0)
        return times


class Direct:
    """llama.cpp in its own process on the server core (benchmarks/_llm_direct.py)."""

    name = "direct"

    def __init__(self, args: argparse.Namespace, gguf: Path) -> None:
        self.proc = subprocess.Popen(
            ["taskset", "-c", str(args.server_core), sys.executable,
             str(ROOT / "benchmarks" / "_llm_direct.py"), str(gguf), str(args.threads), "2048"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        json.loads(self.proc.stdout.readline())

    def run(self, text: str, max_tokens: int) -> list[float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"prompt": text, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return list(json.loads(self.proc.stdout.readline())["times"])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def itls(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


async def idle_ttft(args: argparse.Namespace, servers: list[Contestant], direct: Direct
                    ) -> dict[str, Any]:
    ttft: dict[str, list[float]] = {c.name: [] for c in [*servers, direct]}
    itl: dict[str, list[float]] = {c.name: [] for c in [*servers, direct]}
    async with aiohttp.ClientSession() as session:
        for i in range(args.idle_samples):
            text = prompt(10_000 + i, TOPICS[i % len(TOPICS)])
            for c in (servers if i % 2 else servers[::-1]):
                t = await c.stream(session, text, args.idle_tokens)
                ttft[c.name].append(t[0])
                itl[c.name].extend(itls(t))
            t = await asyncio.to_thread(direct.run, text, args.idle_tokens)
            ttft["direct"].append(t[0])
            itl["direct"].extend(itls(t))
    return {name: {"ttft_ms": [x * 1e3 for x in ttft[name]],
                   "ttft_p50_ms": statistics.median(ttft[name]) * 1e3,
                   "ttft_p99_ms": percentile(ttft[name], 99) * 1e3,
                   "itl_p50_ms": statistics.median(itl[name]) * 1e3} for name in ttft}


async def load(c: Contestant, streams: int, rounds: int, max_tokens: int, base: int
               ) -> dict[str, Any]:
    results: list[list[float]] = []
    async with aiohttp.ClientSession() as session:
        async def worker(w: int) -> None:
            for r in range(rounds):
                n = base + w * rounds + r
                results.append(await c.stream(session, chat_prompt(n, TOPICS[n % len(TOPICS)]),
                                               max_tokens))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(streams)))
        wall = time.perf_counter() - t0
    tokens = sum(len(t) for t in results)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_ms": [t[0] * 1e3 for t in results if t],
            "itl_ms": [x * 1e3 for t in results for x in itls(t)]}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [x for r in runs for x in r["ttft_ms"]]
    itl = [x for r in runs for x in r["itl_ms"]]
    tokens, wall = sum(r["tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    return {"tokens_per_s": tokens / wall, "runs_tokens_per_s": [r["tokens_per_s"] for r in runs],
            "ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": percentile(ttft, 99),
            "itl_p50_ms": statistics.median(itl), "itl_p99_ms": percentile(itl, 99),
            "tokens": tokens}


async def prefix(args: argparse.Namespace, sokuji: Contestant) -> dict[str, Any]:
    shared = FILLER * 22  # ~500 tokens
    cached, fresh = [], []
    async with aiohttp.ClientSession() as session:
        await sokuji.stream(session, prompt(0, "a bakery", shared), 1)  # fills the cache
        for i in range(args.prefix_samples):
            topic = TOPICS[i % len(TOPICS)]
            fresh.append((await sokuji.stream(session, prompt(50_000 + i, topic, shared),
                                              1))[0])
            text = prompt(0, topic, shared).replace("Write a long", f"Write ({i}) a long")
            cached.append((await sokuji.stream(session, text, 1))[0])
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
    for name in ("sokuji", "llama_cpp.server"):
        a.plot(levels, [result["load"][str(n)][name]["tokens_per_s"] for n in levels],
               marker="o", label=name)
        b.plot(levels, [result["load"][str(n)][name]["ttft_p50_ms"] for n in levels],
               marker="o", label=name)
    a.axhline(1e3 / result["idle"]["direct"]["itl_p50_ms"], ls="--", c="grey",
              label="direct, 1 stream, decode only")
    a.set(xlabel="concurrent streams", ylabel="output tokens/s", title="Aggregate throughput")
    b.set(xlabel="concurrent streams", ylabel="ms", yscale="log", title="TTFT p50 under load")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def run(args: argparse.Namespace, sk: Contestant, lc: Contestant, direct: Direct
              ) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:  # warm both (first-request costs)
        for c in (sk, lc):
            await c.stream(session, prompt(1, "warmup"), 8)
    await asyncio.to_thread(direct.run, prompt(1, "warmup"), 8)
    print("idle TTFT ...", flush=True)
    idle = await idle_ttft(args, [sk, lc], direct)
    result: dict[str, Any] = {"idle": idle, "load": {}}
    for n in args.streams:
        print(f"load: {n} streams ...", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {sk.name: [], lc.name: []}
        for rep in range(2):
            for c in ((sk, lc) if rep == 0 else (lc, sk)):
                runs[c.name].append(await load(c, n, args.rounds, args.max_tokens,
                                               base=100_000 * n + 1000 * rep))
        result["load"][str(n)] = {name: summarize(r) for name, r in runs.items()}
    print("prefix cache ...", flush=True)
    result["prefix"] = await prefix(args, sk)
    return result


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    idle = result["idle"]
    print(f"\nidle TTFT p50 / p99 (ms), {args.idle_samples} prompts of ~70 tokens:")
    for name, r in idle.items():
        print(f"  {name:18s} {r['ttft_p50_ms']:8.1f} / {r['ttft_p99_ms']:8.1f}   "
              f"ITL p50 {r['itl_p50_ms']:.1f} ms")
    ratio = idle["sokuji"]["ttft_p50_ms"] / idle["direct"]["ttft_p50_ms"]
    print(f"  sokuji / direct: {ratio:.3f}  (target <= 1.1)")
    print("\nstreams | tokens/s sokuji  llama_cpp.server  ratio | TTFT p50/p99 ms sokuji    "
          "llama_cpp.server | ITL p50/p99 ms sokuji  llama_cpp.server")
    for n in args.streams:
        s, l_ = result["load"][str(n)]["sokuji"], result["load"][str(n)]["llama_cpp.server"]
        print(f"{n:7d} | {s['tokens_per_s']:15.1f} {l_['tokens_per_s']:17.1f} "
              f"{s['tokens_per_s'] / l_['tokens_per_s']:6.2f} | {s['ttft_p50_ms']:7.0f}/"
              f"{s['ttft_p99_ms']:<7.0f} {l_['ttft_p50_ms']:8.0f}/{l_['ttft_p99_ms']:<8.0f} | "
              f"{s['itl_p50_ms']:6.1f}/{s['itl_p99_ms']:<6.1f} {l_['itl_p50_ms']:8.1f}/"
              f"{l_['itl_p99_ms']:<6.1f}")
    top = str(max(args.streams))
    r8 = result["load"][top]
    print(f"tokens/s at {top} streams, sokuji / llama_cpp.server: "
          f"{r8['sokuji']['tokens_per_s'] / r8['llama_cpp.server']['tokens_per_s']:.2f} "
          "(target >= 2)")
    p = result["prefix"]
    print(f"\nprefix cache: TTFT p50 cached {p['cached_p50_ms']:.1f} ms, uncached "
          f"{p['uncached_p50_ms']:.1f} ms: ratio {p['ratio']:.3f} (target <= 0.2)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", choices=["shipped", "q8_0"], default="shipped")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream per run")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--idle-samples", type=int, default=16)
    ap.add_argument("--idle-tokens", type=int, default=16)
    ap.add_argument("--prefix-samples", type=int, default=10)
    ap.add_argument("--server-core", type=int, default=1)
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "llm_serving.json"))
    ap.add_argument("--plot", help="write a PNG here")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.client_core})
    gguf = native.smollm2_path()
    if args.gguf == "q8_0":
        gguf = native.requantized(gguf, "q8_0", args.cache_dir)
    sk_port, lc_port = free_port(), free_port()
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
""")
    peer = Server(args, [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
                         "--port", str(lc_port), "--n_threads", str(args.threads),
                         "--n_threads_batch", str(args.threads), "--n_ctx", "2048",
                         "--flash_attn", "true", "--verbose", "false",
                         # its default lets a new request cut off the one streaming: queue
                         "--interrupt_requests", "false"],
                  lc_port, ready_path="/v1/models")
    with sokuji, peer:
        direct = Direct(args, gguf)
        try:
            result = asyncio.run(run(args, Contestant("sokuji", sk_port, "smollm2"),
                                     Contestant("llama_cpp.server", lc_port, "smollm2"),
                                     direct))
        finally:
            direct.close()
    result["args"] = {**vars(args), "gguf_path": str(gguf)}
    result["machine"] = {"cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M")}
    report(result, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nraw figures: {out}")
    if args.plot:
        plot(result, Path(args.plot))
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()

"""Speculative decoding, side by side: the same server config with speculation off and on,
alternated in one run.

    .venv/bin/python benchmarks/speculative.py [--quick] [--gguf shipped|q8_0]

One ``sokuji serve`` on --server-core (1 llama.cpp thread a model) serves the same GGUF as
several models that differ only in their speculation options; this load generator runs on
--client-core. Only one model is busy at a time: contestants alternate (their order
reversed every round), each round sends every contestant the same requests, and greedy
decoding makes their answers identical token for token, so each contestant generates the
same tokens (checked: each answer's text is compared with ``off``'s). The prefix cache is off
for all: a hit leaves a prompt's last tokens to another llama.cpp kernel than the first
prefill used, which can change greedy text by itself.

Contestants: ``off``; ``ngram`` (the default: prompt lookup, adaptive); ``ngram-forced``
(drafts whatever the lookup offers); ``draft-forced`` (a draft model: the same model
requantized to Q4_0, since no smaller model with the same vocabulary is installed, 4 drafts
a step: the mechanism, which cannot speed anything up with a draft as large as the target).

Workloads (chat, streamed, temperature 0):
- copy-heavy: the prompt holds a passage (``PASSAGES``: narrative prose written for this
  benchmark) and asks to repeat it word for word;
- free text: a story on a topic.

Per workload and concurrency: per-request decode tokens/s ((tokens - 1) / (last - first
token)), aggregate tokens/s (all tokens / wall time of the run), the ratio of each to
``off``, and the acceptance rate and tokens per step from each response's Server-Timing.
What the figures depend on: how much more a llama.cpp step of k tokens costs than one of 1
on this machine (near-linear on this CPU with SmolLM2's Q4_1: the kernels re-read the
weights per token, so verifying costs about as much as decoding), and how faithfully the
model copies. Writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _harness import Server, free_port  # noqa: E402

from sokuji.bench import dataset, sse  # noqa: E402
from sokuji.llm import native  # noqa: E402

CONTESTANTS = {
    "off": 'speculative = "off"',
    "ngram": 'speculative = "ngram"',
    "ngram-forced": 'speculative = "ngram"\nspeculative_adaptive = false',
    "draft-forced": 'speculative = "draft"\ndraft_requantize = "q4_0"\nspeculative_tokens = 4\n'
                    'speculative_adaptive = false',
}
TOPICS = ["a lighthouse keeper", "a lost robot", "a mountain village", "a clockmaker",
          "a river journey", "a dragon who cannot fly", "a city under the sea",
          "an old library", "a desert caravan", "a winter festival", "a tiny astronaut",
          "a talking cat"]


PASSAGES = [item.text for item in dataset.load("passages")]
"""Narrative prose written for this benchmark (the built-in dataset ``passages``):
SmolLM2-135M repeats such prose when asked (it explains technical text instead)."""


def messages(workload: str, i: int, texts: list[str]) -> list[dict[str, str]]:
    if workload == "copy":
        return [{"role": "system", "content": "You repeat text exactly."},
                {"role": "user", "content": "Repeat this passage word for word:\n\n"
                                            + texts[i % len(texts)]}]
    return [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]} "
                                        f"(story {i})."}]


def speculation(line: str) -> dict[str, float]:
    """From ': server-timing ...': the speculative entry's figures."""
    for part in line.split(","):
        name, _, rest = part.strip().partition(";")
        if name == "speculative" and 'desc="' in rest:
            words = rest.split('desc="', 1)[1].rstrip('"').split()
            if len(words) >= 9:
                return {k: float(v) for k, v in zip(words[1::2], words[2::2], strict=True)}
    return {}


async def one(session: aiohttp.ClientSession, url: str, model: str,
              msgs: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = 0.0
    tokens, spec, text = 0, {}, []
    async with session.post(url, json=body) as r:
        assert r.status == 200, f"{model}: {r.status} {await r.text()}"
        async for line in r.content:
            if sse.comment(line, "server-timing") is not None:
                spec = speculation(line.decode())
            doc = sse.data(line)
            if doc is None:
                continue
            tokens = sse.completion_tokens(doc) or tokens
            if (content := sse.piece(doc)) is not None:
                last = time.perf_counter() - t0
                first = first or last
                text.append(content)
    return {"tokens": tokens, "ttft_s": first, "total_s": last, "spec": spec,
            "text_hash": hashlib.sha256("".join(text).encode()).hexdigest()[:16],
            "decode_tps": (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0}


async def run_cell(url: str, model: str, workload: str, streams: int, per_stream: int,
                   base: int, max_tokens: int, texts: list[str]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        results: list[dict[str, Any]] = []

        async def worker(w: int) -> None:
            for r in range(per_stream):
                i = base + w * per_stream + r
                results.append({"index": i, **await one(
                    session, url, model, messages(workload, i, texts), max_tokens)})
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(streams)))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "requests": results}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    reqs = [r for run in runs for r in run["requests"]]
    tokens = sum(r["tokens"] for r in reqs)
    drafted = sum(r["spec"].get("drafted", 0) for r in reqs)
    accepted = sum(r["spec"].get("accepted", 0) for r in reqs)
    steps = sum(r["tokens"] / r["spec"]["tokens/step"] for r in reqs
                if r["spec"].get("tokens/step"))
    decode_s = sum(r["total_s"] - r["ttft_s"] for r in reqs)
    return {"requests": len(reqs), "tokens": tokens,
            "aggregate_tps": tokens / sum(run["wall_s"] for run in runs),
            "per_request_decode_tps": sum(r["tokens"] - 1 for r in reqs) / decode_s
            if decode_s > 0 else 0.0,
            "per_request_decode_tps_median": statistics.median(r["decode_tps"] for r in reqs),
            "ttft_p50_ms": statistics.median(r["ttft_s"] for r in reqs) * 1e3,
            "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else 0.0,
            "tokens_per_step": tokens / steps if steps else 1.0}


async def bench(args: argparse.Namespace, url: str) -> dict[str, Any]:
    texts = PASSAGES
    # Warm every model with one whole answer of each kind (untimed): an adaptive engine
    # learns its step costs and acceptance on its first requests (probes), once per process.
    async with aiohttp.ClientSession() as session:
        for model in args.contestants:
            for workload in ("copy", "free"):
                await one(session, url, model, messages(workload, 0, texts), args.max_tokens)
    result: dict[str, Any] = {}
    for workload in ("copy", "free"):
        for streams in args.streams:
            print(f"{workload}, {streams} stream(s) ...", flush=True)
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.contestants}
            per_stream = max(1, args.requests // streams)
            for rnd in range(args.rounds):
                order = args.contestants if rnd % 2 == 0 else args.contestants[::-1]
                # the same requests for every contestant in a round, and for every
                # concurrency: round k sends requests k*n .. k*n + n - 1
                base = rnd * streams * per_stream
                for model in order:
                    runs[model].append(await run_cell(url, model, workload, streams,
                                                      per_stream, base, args.max_tokens,
                                                      texts))
            cell = {m: summarize(r) for m, r in runs.items()}
            off = cell["off"]
            for s in cell.values():
                s["aggregate_ratio"] = s["aggregate_tps"] / off["aggregate_tps"]
                s["per_request_ratio"] = s["per_request_decode_tps"] / \
                    off["per_request_decode_tps"]
            answers = {m: {(k, q["index"]): q["text_hash"] for k, run in enumerate(r)
                           for q in run["requests"]} for m, r in runs.items()}
            for m, s in cell.items():
                s["same_text_as_off"] = answers[m] == answers["off"]
            result[f"{workload}/{streams}"] = {"cell": cell, "raw": runs}
    return result


def report(result: dict[str, Any]) -> None:
    print("\nworkload/streams  contestant     tok/s agg (x off)  per-request decode tok/s (x off)"
          "  acceptance  tokens/step  TTFT p50 ms")
    for key, entry in result.items():
        for m, s in entry["cell"].items():
            print(f"{key:16s}  {m:13s} {s['aggregate_tps']:7.1f} ({s['aggregate_ratio']:.2f})"
                  f"     {s['per_request_decode_tps']:7.1f} ({s['per_request_ratio']:.2f})"
                  f"             {s['acceptance']:5.2f}     {s['tokens_per_step']:5.2f}"
                  f"    {s['ttft_p50_ms']:7.0f}"
                  + ("" if s["same_text_as_off"] else "   TEXT DIFFERS FROM off"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="1 stream, 2 requests a cell, 2 rounds (~2 minutes)")
    ap.add_argument("--gguf", choices=["shipped", "q8_0"], default="shipped")
    ap.add_argument("--contestants", nargs="+", default=list(CONTESTANTS),
                    choices=list(CONTESTANTS))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--requests", type=int, default=4, help="requests a cell and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--server-core", type=int, default=1)
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speculative.json"))
    args = ap.parse_args()
    if args.quick:
        args.streams, args.requests, args.rounds = [1], 2, 2
    if "off" not in args.contestants:
        args.contestants.insert(0, "off")
    os.sched_setaffinity(0, {args.client_core})
    gguf = native.smollm2_path()
    if args.gguf == "q8_0":
        gguf = native.requantized(gguf, "q8_0", args.cache_dir)
    port = free_port()
    models = "".join(f"""
[[models]]
name = "{name}"
runtime = "llama"
path = "{gguf}"
cache = false
[models.options]
threads = {args.threads}
slots = {max(args.streams)}
context_size = 1024
prefix_cache_mb = 0
{CONTESTANTS[name]}
""" for name in args.contestants)
    server = Server(args, [sys.executable, "-m", "sokuji", "serve"], port, config=f"""
port = {port}
cache_dir = "{args.cache_dir}"
log_level = "warning"
{models}""")
    t0 = time.perf_counter()
    with server:
        result = asyncio.run(bench(args, f"http://127.0.0.1:{port}/v1/chat/completions"))
    out = {"results": result, "args": {**vars(args), "gguf_path": str(gguf)},
           "machine": {"cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
                       "uname": " ".join(os.uname())},
           "wall_s": time.perf_counter() - t0}
    report(result)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"\nraw figures: {path}  ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()

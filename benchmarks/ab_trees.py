"""Two source trees served side by side, interleaved call by call chunk, in one run.

    .venv/bin/python benchmarks/ab_trees.py --a ../before --b ../after [--quick]

The one A/B runner of benchmarks/ (it replaced ``before_after.py``, which ran whole benchmarks
one tree after the other: on a shared machine the drift between those runs can be larger than
the difference sought: a raw runtime that did not change once measured 20% slower in the later
runs). Here both trees' servers are up at once, pinned to the same core, and the client
alternates between them in small chunks, so drift falls on both alike:

1. Encoder, concurrency 1: ``--chunks`` chunks of ``--chunk`` calls per tree and dataset
   (short, long), A and B alternating chunk by chunk (the order flips every chunk pair).
   Reported: p50 and mean per tree, B - A, and the median of the per-pair differences of
   chunk medians (robust to slow phases of the machine).
2. Encoder, saturated: closed loops of ``--concurrency`` alternating for ``--rounds`` rounds;
   items/s per tree and B / A.
3. LLM (``--llm``): idle TTFT, one streamed completion at a time alternating; and
   ``--streams`` concurrent streams alternating round by round: tokens/s and TTFT p99.

Each server imports its own tree's ``sokuji`` (``PYTHONPATH`` and working directory set to
the tree); this venv's packages serve both. Writes JSON (``benchmarks/results/ab_trees.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from _harness import C1Client, closed_loop, free_port, percentile, pooled_rate, v2_body
from serving_overhead import load_texts

from sokuji.bench import sse

ROOT = Path(__file__).resolve().parent.parent


class TreeServer:
    """``sokuji serve`` from one tree, pinned to the server core."""

    def __init__(self, tree: Path, core: int, config: str, port: int) -> None:
        self.tree, self.port = tree, port
        fd, name = tempfile.mkstemp(suffix=".toml")
        os.close(fd)
        self.cfg = Path(name)
        self.cfg.write_text(config)
        self.cmd = ["taskset", "-c", str(core), sys.executable, "-m", "sokuji", "serve",
                    "--config", str(self.cfg)]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> TreeServer:
        # gRPC off (both trees run at once; a tree without it ignores the variable)
        env = {**os.environ, "PYTHONPATH": str(self.tree), "SOKUJI_GRPC_PORT": "0"}
        self.proc = subprocess.Popen(self.cmd, cwd=self.tree, env=env)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
                conn.request("GET", "/v2/health/ready")
                if conn.getresponse().status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)  # polling a child's start-up
        raise TimeoutError(f"{self.tree}: server did not become ready")

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        self.cfg.unlink()


def encoder_config(port: int, cache_dir: str) -> str:
    return f"""
port = {port}
cache_dir = "{cache_dir}"
log_level = "warning"
[[models]]
name = "minilm"
cache = false
intra_op_threads = 1
max_batch_size = 32
"""


def llm_config(port: int, cache_dir: str) -> str:
    return f"""
port = {port}
cache_dir = "{cache_dir}"
log_level = "warning"
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
threads = 1
slots = 8
context_size = 2048
"""


def c1_compare(ports: dict[str, int], texts: list[str], chunk: int, chunks: int
               ) -> dict[str, Any]:
    bodies = [v2_body(t) for t in texts]
    clients = {name: C1Client(port, bodies) for name, port in ports.items()}
    lat: dict[str, list[float]] = {name: [] for name in ports}
    pair_diffs: list[float] = []
    for i in range(chunks):
        order = ["a", "b"] if i % 2 == 0 else ["b", "a"]
        med: dict[str, float] = {}
        for name in order:
            got, _ = clients[name].run(chunk)
            lat[name] += got
            med[name] = statistics.median(got)
        pair_diffs.append(med["b"] - med["a"])
    out: dict[str, Any] = {name: {"p50_ms": percentile(v, 50), "mean_ms": statistics.fmean(v),
                                  "p99_ms": percentile(v, 99), "calls": len(v)}
                           for name, v in lat.items()}
    out["b_minus_a_p50_ms"] = out["b"]["p50_ms"] - out["a"]["p50_ms"]
    out["b_minus_a_paired_median_ms"] = statistics.median(pair_diffs)
    return out


async def saturated(ports: dict[str, int], texts: list[str], concurrency: int, rounds: int,
                    seconds: float) -> dict[str, Any]:
    bodies = [v2_body(t) for t in texts]
    runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    for i in range(rounds):
        for name in (["a", "b"] if i % 2 == 0 else ["b", "a"]):
            r = await closed_loop(ports[name], bodies, concurrency, 1.0, seconds)
            r.pop("latencies_ms")
            runs[name].append(r)
    rate = {name: pooled_rate(r) for name, r in runs.items()}
    return {"items_per_s": rate, "b_over_a": rate["b"] / rate["a"], "rounds": runs}


async def stream(session: aiohttp.ClientSession, port: int, text: str, max_tokens: int
                 ) -> list[float]:
    body = {"model": "smollm2", "prompt": text, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True}  # the same token count from both trees
    t0 = time.perf_counter()
    times: list[float] = []
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            doc = sse.data(line)
            if doc is not None and sse.piece(doc):
                times.append(time.perf_counter() - t0)
    return times


def llm_prompt(nonce: int) -> str:
    return (f"Note {nonce}. You are a helpful assistant. Answer briefly and plainly. "
            f"Question {nonce}: why is the sky blue, and what makes sunsets red? Answer:")


async def llm_compare(ports: dict[str, int], idle: int, streams: int, rounds: int,
                      max_tokens: int) -> dict[str, Any]:
    ttft: dict[str, list[float]] = {"a": [], "b": []}
    load: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    nonce = 1000
    async with aiohttp.ClientSession() as s:
        for i in range(idle):
            for name in (["a", "b"] if i % 2 == 0 else ["b", "a"]):
                nonce += 1
                t = await stream(s, ports[name], llm_prompt(nonce), 8)
                ttft[name].append(t[0] * 1e3)
        for i in range(rounds):
            for name in (["a", "b"] if i % 2 == 0 else ["b", "a"]):
                base = nonce = nonce + streams
                t0 = time.perf_counter()
                got = await asyncio.gather(*(stream(s, ports[name], llm_prompt(base + k),
                                                    max_tokens) for k in range(streams)))
                wall = time.perf_counter() - t0
                load[name].append({"tokens": sum(len(g) for g in got), "seconds": wall,
                                   "ttft_ms": [g[0] * 1e3 for g in got]})
    out: dict[str, Any] = {}
    for name in ("a", "b"):
        tf = [t for r in load[name] for t in r["ttft_ms"]]
        out[name] = {"idle_ttft_p50_ms": statistics.median(ttft[name]),
                     "tokens_per_s": sum(r["tokens"] for r in load[name])
                     / sum(r["seconds"] for r in load[name]),
                     "load_ttft_p99_ms": percentile(tf, 99)}
    out["idle_ttft_b_over_a"] = out["b"]["idle_ttft_p50_ms"] / out["a"]["idle_ttft_p50_ms"]
    out["tokens_per_s_b_over_a"] = out["b"]["tokens_per_s"] / out["a"]["tokens_per_s"]
    out["load_ttft_p99_b_over_a"] = out["b"]["load_ttft_p99_ms"] / out["a"]["load_ttft_p99_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, type=Path, help="tree A (e.g. before)")
    ap.add_argument("--b", type=Path, default=ROOT, help="tree B (default: this one)")
    ap.add_argument("--chunk", type=int, default=20, help="c=1 calls per chunk")
    ap.add_argument("--chunks", type=int, default=30, help="chunks per tree and dataset")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6, help="saturated rounds per tree")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--llm", action="store_true", help="also compare the LLM server")
    ap.add_argument("--idle", type=int, default=24, help="idle TTFT samples per tree")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--llm-rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--server-core", type=int, default=1)
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" /
                    "ab_trees.json")
    args = ap.parse_args()
    if args.quick:
        args.chunks, args.rounds, args.seconds, args.idle, args.llm_rounds = 8, 2, 2.0, 6, 2
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    for name, tree in trees.items():
        if not (tree / "sokuji" / "__init__.py").is_file():
            ap.error(f"--{name} {tree} is not a Sokuji source tree")
    os.sched_setaffinity(0, {args.client_core})
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "trees": {k: str(v) for k, v in trees.items()},
                              "args": {k: str(v) for k, v in vars(args).items()}}
    ports = {name: free_port() for name in trees}
    with TreeServer(trees["a"], args.server_core, encoder_config(ports["a"], args.cache_dir),
                    ports["a"]), \
         TreeServer(trees["b"], args.server_core, encoder_config(ports["b"], args.cache_dir),
                    ports["b"]):
        for dataset in ("short", "long"):
            texts = load_texts(dataset)
            c1_compare(ports, texts, args.chunk, 2)  # warm both
            r = c1_compare(ports, texts, args.chunk, args.chunks)
            result[f"c1_{dataset}"] = r
            print(f"c=1 {dataset:5s}: A p50 {r['a']['p50_ms']:.3f} ms, B p50 "
                  f"{r['b']['p50_ms']:.3f} ms; B - A {r['b_minus_a_p50_ms']:+.3f} ms "
                  f"(paired chunk medians {r['b_minus_a_paired_median_ms']:+.3f} ms)",
                  flush=True)
        for dataset in ("short", "long"):
            s = asyncio.run(saturated(ports, load_texts(dataset), args.concurrency,
                                      args.rounds, args.seconds))
            result[f"saturated_{dataset}"] = s
            print(f"saturated {dataset:5s}: A {s['items_per_s']['a']:.1f}/s, B "
                  f"{s['items_per_s']['b']:.1f}/s; B / A {s['b_over_a']:.3f}", flush=True)
    if args.llm:
        ports = {name: free_port() for name in trees}
        with TreeServer(trees["a"], args.server_core, llm_config(ports["a"], args.cache_dir),
                        ports["a"]), \
             TreeServer(trees["b"], args.server_core, llm_config(ports["b"], args.cache_dir),
                        ports["b"]):
            r = asyncio.run(llm_compare(ports, args.idle, args.streams, args.llm_rounds,
                                        args.max_tokens))
            result["llm"] = r
            print(f"LLM idle TTFT p50: A {r['a']['idle_ttft_p50_ms']:.1f} ms, B "
                  f"{r['b']['idle_ttft_p50_ms']:.1f} ms; B / A {r['idle_ttft_b_over_a']:.3f}")
            print(f"LLM {args.streams} streams: tokens/s B / A {r['tokens_per_s_b_over_a']:.3f}"
                  f", TTFT p99 B / A {r['load_ttft_p99_b_over_a']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""The load generator of benchmarks/llm_serving.py: OpenAI-compatible servers streamed over
SSE, the same way for every contestant, in closed loops of concurrent streams."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time
from typing import Any

import aiohttp
from _harness import percentile

from sokuji.bench import sse

TOPICS = ["a lighthouse keeper", "a lost robot", "a mountain village", "a clockmaker",
          "a river journey", "a dragon who cannot fly", "a city under the sea",
          "an old library", "a desert caravan", "a winter festival", "a tiny astronaut",
          "a talking cat"]
SYSTEM = ("You are a creative writing assistant. You write vivid, detailed stories with "
          "named characters, dialogue and a clear beginning, middle and end.")


def chat_prompt(nonce: int, topic: str) -> str:
    """A chat turn: the system prompt is shared, the question differs (every server may reuse
    the shared part: Sokuji's prefix cache, llama-server's slot and prompt cache)."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
            f"Write a long story about {topic} (story {nonce}).<|im_end|>\n"
            "<|im_start|>assistant\n")


class Contestant:
    """An OpenAI-compatible server, streamed over aiohttp."""

    def __init__(self, name: str, port: int, model: str, extras: dict[str, Any]) -> None:
        self.name, self.url, self.model = name, f"http://127.0.0.1:{port}/v1/completions", model
        self.extras = extras

    async def stream(self, session: aiohttp.ClientSession, text: str, max_tokens: int
                     ) -> tuple[list[float], int]:
        """Seconds from sending to each non-empty chunk, and the completion's tokens."""
        body = {"model": self.model, "prompt": text, "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True, **self.extras}
        t0 = time.perf_counter()
        times: list[float] = []
        usage: int | None = None
        async with session.post(self.url, json=body) as r:
            assert r.status == 200, f"{self.name}: {r.status} {await r.text()}"
            async for line in r.content:
                doc = sse.data(line)
                if doc is None:
                    continue
                if sse.piece(doc):
                    times.append(time.perf_counter() - t0)
                usage = sse.completion_tokens(doc) or usage
        return times, len(times) if usage is None else usage


def session_() -> aiohttp.ClientSession:
    """A connection a request (a reused one met llama-server's close mid-run; a loopback
    connect costs ~0.1 ms against TTFTs of 100+ ms, for both servers alike)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


def itls(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def turn_tokens(args: argparse.Namespace, nonce: int, w: int, streams: int, turn: int) -> int:
    """A turn's max_tokens, the same for every contestant: the first turn ramps with the
    stream's index so streams do not stay in lockstep (arriving all at once every turn);
    later turns spread ``--spread`` around ``--max-tokens``, as real answers vary."""
    if turn == 0:
        return max(1, round(args.max_tokens * (w + 1) / streams))
    return max(1, round(args.max_tokens * (1 + args.spread * random.Random(nonce).uniform(-1, 1))))


async def one_run(args: argparse.Namespace, c: Contestant, streams: int, base: int
                  ) -> dict[str, Any]:
    results: list[tuple[int, list[float], int]] = []
    async with session_() as session:
        async def worker(w: int) -> None:
            for r in range(args.turns):
                n = base + w * args.turns + r
                t, k = await c.stream(session, chat_prompt(n, TOPICS[n % len(TOPICS)]),
                                      turn_tokens(args, n, w, streams, r))
                results.append((r, t, k))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(streams)))
        wall = time.perf_counter() - t0
    tokens = sum(k for _, _, k in results)
    return {"tokens": tokens, "chunks": sum(len(t) for _, t, _ in results), "wall_s": wall,
            "tokens_per_s": tokens / wall, "requests": len(results),
            # the first turn's arrivals are the run's start, all at once: kept apart
            "ttft_ms": [t[0] * 1e3 for r, t, _ in results if t and r > 0],
            "ttft_start_ms": [t[0] * 1e3 for r, t, _ in results if t and r == 0],
            "itl_ms": [x * 1e3 for _, t, _ in results for x in itls(t)]}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [x for r in runs for x in r["ttft_ms"]]
    start = [x for r in runs for x in r["ttft_start_ms"]]
    itl = [x for r in runs for x in r["itl_ms"]]
    tokens, wall = sum(r["tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    return {"tokens_per_s": tokens / wall, "runs_tokens_per_s": [r["tokens_per_s"] for r in runs],
            "requests": sum(r["requests"] for r in runs), "tokens": tokens,
            "chunks": sum(r["chunks"] for r in runs), "ttft_ms": ttft,
            "ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": percentile(ttft, 99),
            "ttft_max_ms": max(ttft), "ttft_start_ms": start,
            "ttft_start_p50_ms": statistics.median(start), "ttft_start_max_ms": max(start),
            "itl_p50_ms": statistics.median(itl), "itl_p99_ms": percentile(itl, 99)}



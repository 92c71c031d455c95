"""Prefix-cache affinity on Ray Serve: what routing a conversation to the LLM replica holding
its prefix buys over Serve's default router, through Sokuji's own HTTP front.

    flock /tmp/sokuji-bench.lock .venv/bin/python benchmarks/ray_affinity.py
        [--rounds 2] [--convs 6] [--turns 4] [--in-flight 2] [--max-tokens 8] [--hop 30]
        [--out benchmarks/results/ray_affinity.json]        (~4 minutes on 2 cores)

One Ray cluster (``ray start --head``, Serve's high-throughput mode: HAProxy + direct
ingress, as ``tests/integration/ray_cluster.py`` starts it); in it the real ``sokuji serve
--ray --ray-address ...``: one ingress replica (the whole Sokuji app) and 2 LLM replicas of
the built-in SmolLM2 (llama.cpp, 1 thread, 4 slots, no speculation, its per-tenant prefix
cache), reached from the ingress through a handle (``sokuji/scale/ray_llm.py``). Contenders:

- ``affinity``: the LLM deployment behind ``ConsistentHashRouter``, keyed by the
  conversation's opening (tenant + system + first user message);
- ``random``: the same deployment behind Serve's default router (power of two choices on
  queue length), chosen by the hidden ``SOKUJI_RAY_LLM_ROUTER=default``.

Each round deploys each contender afresh (empty prefix caches; who goes first alternates)
and runs the same workload: --convs conversations, each with its own ~220-token system
prompt, --turns turns each (the history + a new question, --max-tokens tokens with
``ignore_eos``, greedy), --in-flight conversations at a time, streamed over HTTP. Per turn:
the client's TTFT (request sent -> first content chunk), the server's (``ttft`` of the
stream's closing ``server-timing`` comment: arrival at the ingress -> first token there), the
prefix cache's outcome and the replica (``x-sokuji-served-by``). Reported for the later turns
(2..N, where the prefix exists): TTFT p50 / p90 / mean, prefix hit rate, prompt tokens reused,
replicas a conversation touched; ratios random / affinity.

The hop (--hop N): after each affinity round's workload, N one-token completions of a cached
prompt in a row, and as many on single-process ``sokuji serve`` (same model and options) at
the end: the client's time and the server's ``queue`` stage (on Ray it spans the handle call:
ingress submit -> the replica's engine admits) say what the hop adds at idle. Writes the JSON
(every turn and probe, the machine probe before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _harness import percentile
from machine import describe

from sokuji.bench import sse
from tests.integration.ray_cluster import RAY_BIN, RayHead, ray_env, sokuji_ray
from tests.integration.serving import sokuji_server

ROOT = Path(__file__).resolve().parent.parent

TOPICS = ["astronomy", "gardening", "chess", "baking", "sailing", "geology", "jazz", "cycling"]
CONFIG = """log_level = "warning"
cache_dir = "{cache}"
[cache]
enabled = false
[jobs]
enabled = false
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
threads = 1
slots = 4
speculative = "off"
[ray]
num_cpus = 0
llm_replicas = 2
"""
TIMING = re.compile(r'([\w-]+)(?:;dur=([\d.]+))?(?:;desc="([^"]*)")?')


def system_prompt(conv: int, round_: int) -> str:
    topic = TOPICS[conv % len(TOPICS)]
    rnd = random.Random(conv * 1000 + round_)
    facts = " ".join(f"Fact {k}: the {topic} club meets on day {rnd.randint(1, 28)} in room "
                     f"{rnd.randint(100, 999)} with {rnd.randint(3, 40)} members."
                     for k in range(9))
    return f"You are a helpful assistant for the {topic} club. {facts} Answer briefly."


def server_timing(text: str) -> dict[str, tuple[float | None, str | None]]:
    return {m.group(1): (float(m.group(2)) if m.group(2) else None, m.group(3))
            for m in TIMING.finditer(text)}


async def turn(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]],
               max_tokens: int) -> dict[str, Any]:
    body = {"model": "smollm2", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first: float | None = None
    text, timing = [], ""
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return {"status": resp.status, "error": (await resp.text())[:300]}
        served_by = resp.headers.get("x-sokuji-served-by", "")
        async for line in resp.content:
            timing = sse.comment(line, "server-timing") or timing
            doc = sse.data(line)
            delta = sse.piece(doc) if doc is not None else None
            if delta:
                first = first or time.perf_counter()
                text.append(delta)
    st = server_timing(timing)
    prefix = (st.get("prefix-cache", (None, ""))[1] or "off 0").split()
    prefill = (st.get("prefill", (None, ""))[1] or "0 of 0").split()
    return {"status": 200, "client_ttft_ms": (first - t0) * 1e3 if first else None,
            "server_ttft_ms": st.get("ttft", (None, None))[0], "prefix": prefix[0],
            "reused_tokens": int(prefix[1]), "prompt_tokens": int(prefill[2]),
            "served_by": served_by, "text": "".join(text)}


async def workload(url: str, args: argparse.Namespace, round_: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    gate = asyncio.Semaphore(args.in_flight)

    async def conversation(session: aiohttp.ClientSession, conv: int) -> None:
        async with gate:
            messages = [{"role": "system", "content": system_prompt(conv, round_)}]
            for k in range(args.turns):
                messages.append({"role": "user",
                                 "content": f"Question {k}: what about meeting {k}?"})
                r = await turn(session, url, messages, args.max_tokens)
                r.update(conv=conv, turn=k)
                results.append(r)
                messages.append({"role": "assistant", "content": r.get("text", "")})

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(conversation(session, c) for c in range(args.convs)))
    return results


async def hop(url: str, n: int) -> list[dict[str, float]]:
    """What the handle hop adds at idle: ``n`` one-token completions of a cached ~60-token
    prompt in a row; the client's time and the server's ``queue`` stage (for a generator on
    Ray: the ingress's submit -> the replica's engine admitted it) and ``ttft``."""
    prompt = "Here is a short story about a lighthouse keeper and her cat. " * 4
    out = []
    async with aiohttp.ClientSession() as session:
        for i in range(n + 3):  # the first ones fill the prefix cache: not counted
            t0 = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json={
                    "model": "smollm2", "prompt": prompt, "max_tokens": 1,
                    "temperature": 0}) as resp:
                await resp.read()
                st = server_timing(resp.headers.get("server-timing", ""))
            if i >= 3:
                out.append({"client_ms": (time.perf_counter() - t0) * 1e3,
                            "queue_ms": st["queue"][0] or 0.0, "ttft_ms": st["ttft"][0] or 0.0})
    return out


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50": round(percentile(values, 50), 1),
            "p90": round(percentile(values, 90), 1),
            "mean": round(statistics.fmean(values), 1) if values else float("nan")}


def figures(turns: list[dict[str, Any]], convs: int) -> dict[str, Any]:
    ok = [t for t in turns if t["status"] == 200]
    later, first = [t for t in ok if t["turn"] > 0], [t for t in ok if t["turn"] == 0]
    touched = [len({t["served_by"] for t in ok if t["conv"] == c and t["round"] == r})
               for r in {t["round"] for t in ok} for c in range(convs)]
    return {
        "errors": len(turns) - len(ok),
        "later_client_ttft_ms": summary([t["client_ttft_ms"] for t in later]),
        "later_server_ttft_ms": summary([t["server_ttft_ms"] for t in later]),
        "first_turn_client_ttft_ms": summary([t["client_ttft_ms"] for t in first]),
        "later_hit_rate": round(sum(t["prefix"] == "hit" for t in later) / len(later), 3),
        "later_reused_tokens_mean": round(statistics.fmean(t["reused_tokens"] for t in later), 1),
        "later_prompt_tokens_mean": round(statistics.fmean(t["prompt_tokens"] for t in later), 1),
        "replicas_per_conversation_mean": round(statistics.fmean(touched), 2),
    }


def start_head(base: Path) -> tuple[subprocess.Popen[bytes], RayHead]:
    from sokuji.scale.ray_env import free_ports

    env = {**os.environ, **ray_env(base)}
    gcs, client, agent, http = free_ports(4)
    (base / "rt").mkdir()
    log = (base / "head.log").open("wb")
    head = subprocess.Popen(
        [str(RAY_BIN), "start", "--head", "--block", f"--port={gcs}",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
         "--num-cpus=2", f"--temp-dir={base / 'rt'}", "--include-dashboard=false",
         "--disable-usage-stats"], env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    until = time.monotonic() + 90
    while "Ray runtime started" not in (base / "head.log").read_text(errors="replace"):
        if head.poll() is not None or time.monotonic() > until:
            raise RuntimeError((base / "head.log").read_text()[-2000:])
        time.sleep(0.2)
    return head, RayHead(f"127.0.0.1:{gcs}", env, http, base)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--convs", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--in-flight", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--hop", type=int, default=30,
                    help="idle one-token requests per affinity round (and as many in all on "
                    "single-process sokuji serve): what the hop costs; 0: skip")
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ray_affinity.json"))
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"benchmark": "ray_affinity", "command": " ".join(sys.argv),
                              "args": vars(args), "machine_before": describe(), "turns": {}}
    began = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="skb", dir="/tmp"))  # short: HAProxy's socket path
    head, cluster = start_head(base)
    deploys: dict[str, list[float]] = {"affinity": [], "random": []}
    try:
        for r in range(args.rounds):
            order = ("affinity", "random") if r % 2 == 0 else ("random", "affinity")
            for name in order:
                cluster.env["SOKUJI_RAY_LLM_ROUTER"] = "default" if name == "random" else "hash"
                t0 = time.monotonic()
                with sokuji_ray(cluster, CONFIG.format(cache=args.cache_dir),
                                timeout_s=300) as serving:
                    deploys[name].append(round(time.monotonic() - t0, 1))
                    turns = asyncio.run(workload(serving.url, args, r))
                    if name == "affinity" and args.hop:
                        report.setdefault("hop", {}).setdefault("ray", []).extend(
                            asyncio.run(hop(serving.url, args.hop)))
                for t in turns:
                    t["round"] = r
                report["turns"].setdefault(name, []).extend(turns)
                f = figures(turns, args.convs)
                print(f"round {r + 1}/{args.rounds} {name:8s}: later-turn client TTFT "
                      f"{f['later_client_ttft_ms']}, hit rate {f['later_hit_rate']}",
                      flush=True)
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
        for pid in cluster.our_pids(""):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)
    report["deploy_s"] = deploys
    if args.hop:  # the same model and options in one process, for the hop's cost
        single = CONFIG.format(cache=args.cache_dir).split("[ray]")[0].replace(
            'log_level = "warning"\n', "")  # (sokuji_server sets it)
        with sokuji_server(single) as url:
            report["hop"]["single_process"] = asyncio.run(hop(url, args.hop * args.rounds))
        report["hop_ms"] = {who: {k: summary([x[k] for x in rows])
                                  for k in ("client_ms", "queue_ms", "ttft_ms")}
                            for who, rows in report["hop"].items()}
    report["figures"] = {name: figures(turns, args.convs)
                         for name, turns in report["turns"].items()}
    a, b = report["figures"]["affinity"], report["figures"]["random"]
    report["ratios_random_over_affinity"] = {
        f"later_{who}_ttft_{k}": round(b[f"later_{who}_ttft_ms"][k] /
                                       a[f"later_{who}_ttft_ms"][k], 2)
        for who in ("client", "server") for k in ("p50", "p90", "mean")}
    report["seconds"] = round(time.monotonic() - began, 1)
    report["machine_after"] = describe()
    print(json.dumps({"figures": report["figures"],
                      "ratios_random_over_affinity": report["ratios_random_over_affinity"],
                      "hop_ms": report.get("hop_ms")}, indent=1))
    out.write_text(json.dumps(report))
    print(f"raw figures: {out}")
    return 1 if a["errors"] or b["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

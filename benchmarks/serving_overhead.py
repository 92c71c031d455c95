"""What does Sokuji add on top of ONNX Runtime called directly? One run, side by side.

    .venv/bin/python benchmarks/serving_overhead.py [--rounds 4] [--seconds 5] [--out FILE]

Contenders, all pinned to the same server core while the load generator runs on the other:
- raw: a child process calling the same tokenisation and ONNX Runtime session code that Sokuji
  uses (``OnnxEncoderRuntime``), same thread count (1): one text at a time for latency, and at
  its best batch size (swept first) for throughput;
- sokuji: ``sokuji serve``, KServe V2 JSON over loopback HTTP/1.1 keep-alive, one text per
  request, ``max_batch_size`` set to the raw runtime's best batch size;
- http floor: the same HTTP stack with no model (``_bare_http.py``), for the latency split.

Shared machines drift, so contenders are measured in alternating rounds, never one after the
other, and the figures pool all rounds. Prints and writes (JSON):
  (a) Sokuji saturated throughput / raw best throughput        (short ~12, long ~120 tokens)
  (b) Sokuji p50 at concurrency 1 - raw single-call p50, in ms (short, long)
  (c) Sokuji saturated throughput, length-aware / first-come   (mixed 5-200 tokens)
and, to explain them, Sokuji's server stages at c=1 (Server-Timing) and the CPU per item at
saturation: the raw runtime's, and the server's event loop thread and worker threads' (from
/proc). ``--parts`` runs only some of the comparisons.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (
    C1Client,
    Server,
    closed_loop,
    percentile,
    pooled_rate,
    v2_body,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "sokuji" / "bench" / "data"
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
TARGETS = {"a": ">= 0.95", "b": "<= 0.3 ms", "c": ">= 1.8"}


def load_texts(name: str) -> list[str]:
    with open(DATA / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


# --- the raw runtime: a child process on the server core, driven over a pipe ----------------

def raw_worker_main(core: int, cache_dir: str) -> None:
    os.sched_setaffinity(0, {core})
    from sokuji.runtimes.onnx import OnnxEncoderRuntime
    from sokuji.weights import minilm

    rt = OnnxEncoderRuntime(minilm.ensure_onnx(cache_dir), minilm.tokenizer_path(),
                            intra_op_threads=1, max_sequence_length=minilm.max_sequence_length())
    rt.load()
    rt.warmup()
    datasets = {name: load_texts(name) for name in ("short", "long", "mixed")}
    cursor = 0

    def single(texts: list[str], calls: int) -> list[float]:
        nonlocal cursor
        out = []
        for _ in range(calls):
            t0 = time.perf_counter()
            rt.run_batch([rt.preprocess([texts[cursor % len(texts)]])])
            out.append((time.perf_counter() - t0) * 1e3)
            cursor += 1
        return out

    def throughput(texts: list[str], bs: int, seconds: float, order: str) -> dict[str, float]:
        if order == "sorted":  # offline ceiling for length grouping
            texts = sorted(texts, key=lambda t: len(rt.preprocess([t]).data[0]))
        batches = [texts[i:i + bs] for i in range(0, len(texts) - bs + 1, bs)]
        items, done, start, cpu0 = 0, 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < seconds or done < 3:
            chunk = batches[done % len(batches)]
            rt.run_batch([rt.preprocess([t]) for t in chunk])
            items, done = items + len(chunk), done + 1
        return {"items": items, "seconds": time.perf_counter() - start,
                "cpu_s": time.process_time() - cpu0}

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        texts = datasets[cmd["dataset"]]
        if cmd["cmd"] == "single":
            reply: Any = single(texts, cmd["calls"])
        else:
            reply = throughput(texts, cmd["bs"], cmd["seconds"], cmd.get("order", "arrival"))
        print(json.dumps(reply), flush=True)


class RawRuntime:
    def __init__(self, args: argparse.Namespace) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--raw-worker", "--server-core", str(args.server_core),
             "--cache-dir", args.cache_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, cwd=ROOT)
        self._read()

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        return json.loads(self.proc.stdout.readline())

    def call(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# --- the three figures ----------------------------------------------------------------------

def overhead(args: argparse.Namespace, raw: RawRuntime, dataset: str) -> dict[str, Any]:
    sweep = {bs: raw.call(cmd="throughput", dataset=dataset, bs=bs, seconds=args.sweep_seconds)
             for bs in BATCH_SIZES}
    rates = {bs: r["items"] / r["seconds"] for bs, r in sweep.items()}
    best = max(rates, key=lambda b: rates[b])
    print(f"[{dataset}] raw sweep (items/s): "
          + ", ".join(f"b{bs} {v:.1f}" for bs, v in rates.items()), flush=True)
    bodies = [v2_body(t) for t in load_texts(dataset)]
    concurrency = max(2 * best, args.min_concurrency)
    # Enough time per round for many batches, whatever the batch size.
    seconds = max(args.seconds, 15 * best / rates[best])
    out: dict[str, Any] = {"raw_sweep_items_per_s": rates, "best_batch_size": best,
                           "concurrency": concurrency}
    with Server.sokuji(args, best, "length") as sokuji, Server.bare_http(args) as bare:
        clients = {"raw": None, "sokuji": C1Client(sokuji.port, bodies),
                   "http_floor": C1Client(bare.port, bodies)}
        for client in clients.values():  # warm every path once
            if client is not None:
                client.run(20)
        raw.call(cmd="single", dataset=dataset, calls=20)
        lat: dict[str, list[float]] = {k: [] for k in clients}
        stages: list[dict[str, float]] = []
        # Latency interleaves in small chunks, so slow drift of the machine hits all alike.
        per_round = 10
        for _ in range(max(1, args.latency_calls // per_round)):
            lat["raw"] += raw.call(cmd="single", dataset=dataset, calls=per_round)
            sok_lat, sok_stages = clients["sokuji"].run(per_round)  # type: ignore[union-attr]
            lat["sokuji"] += sok_lat
            stages += sok_stages
            lat["http_floor"] += clients["http_floor"].run(per_round)[0]  # type: ignore[union-attr]
        out["c1"] = {k: {"p50_ms": statistics.median(v), "p99_ms": percentile(v, 99),
                         "samples_ms": v} for k, v in lat.items()}
        out["c1"]["sokuji"]["server_stage_mean_ms"] = {
            k: statistics.fmean(s[k] for s in stages) for k in stages[0]}
        print(f"[{dataset}] c=1 p50: raw {out['c1']['raw']['p50_ms']:.3f} ms, sokuji "
              f"{out['c1']['sokuji']['p50_ms']:.3f} ms, http floor "
              f"{out['c1']['http_floor']['p50_ms']:.3f} ms", flush=True)

        raw_rounds, sok_rounds = [], []
        for i in range(args.rounds):
            raw_rounds.append(raw.call(cmd="throughput", dataset=dataset, bs=best,
                                       seconds=seconds))
            assert sokuji.proc is not None
            cpu0 = thread_cpu_s(sokuji.proc.pid)
            sok_rounds.append(asyncio.run(closed_loop(sokuji.port, bodies, concurrency,
                                                      args.warmup_seconds, seconds)))
            sok_rounds[-1]["server_cpu_s"] = {
                k: v - cpu0.get(k, 0.0) for k, v in thread_cpu_s(sokuji.proc.pid).items()}
            print(f"[{dataset}] round {i + 1}: raw {pooled_rate(raw_rounds[-1:]):.1f}/s, "
                  f"sokuji {pooled_rate(sok_rounds[-1:]):.1f}/s", flush=True)
    sok_lat = [x for r in sok_rounds for x in r.pop("latencies_ms")]
    # CPU per item: the raw runtime's, and the server's event loop thread and other threads
    # (batch workers) over the whole closed loop, its warm-up included (items there counted
    # at the window's rate).
    sok_items = sum(r["items"] / r["seconds"] * (args.warmup_seconds + seconds)
                    for r in sok_rounds)
    out["cpu_ms_per_item"] = {
        "raw": 1e3 * sum(r["cpu_s"] for r in raw_rounds) / sum(r["items"] for r in raw_rounds),
        "sokuji_loop": 1e3 * sum(r["server_cpu_s"]["loop"] for r in sok_rounds) / sok_items,
        "sokuji_threads": 1e3 * sum(r["server_cpu_s"]["threads"] for r in sok_rounds)
        / sok_items}
    out["saturated"] = {
        "raw_items_per_s": pooled_rate(raw_rounds), "sokuji_items_per_s": pooled_rate(sok_rounds),
        "sokuji_p50_ms": statistics.median(sok_lat), "sokuji_p99_ms": percentile(sok_lat, 99),
        "errors": sum(r["errors"] for r in sok_rounds), "rounds_raw": raw_rounds,
        "rounds_sokuji": sok_rounds, "seconds_per_round": seconds}
    return out


def length_vs_fifo(args: argparse.Namespace, raw: RawRuntime) -> dict[str, Any]:
    bs = args.mixed_batch_size
    ceiling = {order: raw.call(cmd="throughput", dataset="mixed", bs=bs,
                               seconds=args.sweep_seconds * 2, order=order)
               for order in ("arrival", "sorted")}
    bodies = [v2_body(t) for t in load_texts("mixed")]
    rounds: dict[str, list[dict[str, Any]]] = {"length": [], "fifo": []}
    with Server.sokuji(args, bs, "length") as length, Server.sokuji(args, bs, "fifo") as fifo:
        for i in range(args.rounds):
            for policy, server in (("length", length), ("fifo", fifo)):
                rounds[policy].append(asyncio.run(closed_loop(
                    server.port, bodies, args.mixed_concurrency, args.warmup_seconds,
                    args.mixed_seconds)))
            print(f"[mixed] round {i + 1}: length {pooled_rate(rounds['length'][-1:]):.1f}/s, "
                  f"fifo {pooled_rate(rounds['fifo'][-1:]):.1f}/s", flush=True)
    out: dict[str, Any] = {"max_batch_size": bs, "concurrency": args.mixed_concurrency,
                           "raw_items_per_s": {k: v["items"] / v["seconds"]
                                               for k, v in ceiling.items()}}
    for policy, rs in rounds.items():
        lat = [x for r in rs for x in r.pop("latencies_ms")]
        out[policy] = {"items_per_s": pooled_rate(rs), "p50_ms": statistics.median(lat),
                       "p99_ms": percentile(lat, 99), "max_ms": max(lat),
                       "errors": sum(r["errors"] for r in rs), "rounds": rs}
    return out


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of a process: its main thread (the event loop) as ``loop``, the sum of
    the others (batch workers, and whatever else runs) as ``threads``. Linux /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"loop": 0.0, "threads": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out["loop" if int(tid) == pid else "threads"] += \
            (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds per comparison")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per round")
    p.add_argument("--warmup-seconds", type=float, default=1.5)
    p.add_argument("--sweep-seconds", type=float, default=1.5, help="per raw batch size")
    p.add_argument("--latency-calls", type=int, default=400)
    p.add_argument("--min-concurrency", type=int, default=32)
    p.add_argument("--mixed-batch-size", type=int, default=32)
    p.add_argument("--mixed-concurrency", type=int, default=256,
                   help="in-flight requests for the mixed run: the queue the batcher chooses from")
    p.add_argument("--mixed-seconds", type=float, default=15.0,
                   help="per mixed round: long enough for the deep queue to turn over")
    p.add_argument("--parts", default="short,long,mixed",
                   help="which comparisons to run: short, long (figures a and b), mixed (c)")
    p.add_argument("--server-core", type=int, default=1)
    p.add_argument("--client-core", type=int, default=0)
    p.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                        "serving_overhead.json"))
    p.add_argument("--raw-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.raw_worker:
        raw_worker_main(args.server_core, args.cache_dir)
        return

    os.sched_setaffinity(0, {args.client_core})
    subprocess.run([sys.executable, "-m", "sokuji", "export", "minilm", "--cache-dir",
                    args.cache_dir], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    report: dict[str, Any] = {
        "benchmark": "serving_overhead", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "settings": {k: v for k, v in vars(args).items() if k != "raw_worker"}}
    parts = args.parts.split(",")
    datasets = [d for d in ("short", "long") if d in parts]
    raw = RawRuntime(args)
    try:
        for dataset in datasets:
            report[dataset] = overhead(args, raw, dataset)
        if "mixed" in parts:
            report["mixed"] = length_vs_fifo(args, raw)
    finally:
        raw.close()

    ratios: dict[str, float] = {}
    explain: dict[str, float] = {}
    for dataset in datasets:
        r = report[dataset]
        ratios[f"a_throughput_ratio_{dataset}"] = \
            r["saturated"]["sokuji_items_per_s"] / r["saturated"]["raw_items_per_s"]
        ratios[f"b_c1_p50_overhead_ms_{dataset}"] = \
            r["c1"]["sokuji"]["p50_ms"] - r["c1"]["raw"]["p50_ms"]
        explain[f"http_floor_p50_ms_{dataset}"] = r["c1"]["http_floor"]["p50_ms"]
        explain[f"sokuji_minus_floor_ms_{dataset}"] = \
            ratios[f"b_c1_p50_overhead_ms_{dataset}"] - r["c1"]["http_floor"]["p50_ms"]
    m = report.get("mixed")
    if m is not None:
        ratios["c_length_over_fifo_mixed"] = \
            m["length"]["items_per_s"] / m["fifo"]["items_per_s"]
        explain["raw_sorted_over_arrival_mixed"] = \
            m["raw_items_per_s"]["sorted"] / m["raw_items_per_s"]["arrival"]
    report["ratios"], report["explain"] = ratios, explain

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\n{'figure':<44}{'measured':>12}{'target':>12}")
    for key, value in ratios.items():
        print(f"{key:<44}{value:>12.3f}{TARGETS[key[0]]:>12}")
    for key, value in explain.items():
        print(f"{key:<44}{value:>12.3f}")
    for dataset in datasets:
        stages = report[dataset]["c1"]["sokuji"]["server_stage_mean_ms"]
        print(f"server stages at c=1, {dataset} (mean ms): "
              + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()))
        cpu = report[dataset]["cpu_ms_per_item"]
        print(f"CPU per item saturated, {dataset} (ms): raw {cpu['raw']:.3f}; sokuji event "
              f"loop {cpu['sokuji_loop']:.3f} + worker threads {cpu['sokuji_threads']:.3f}")
    for policy in ("length", "fifo") if m is not None else ():
        r = report["mixed"][policy]
        print(f"mixed {policy:<6} {r['items_per_s']:7.1f} req/s  p50 {r['p50_ms']:7.0f} ms  "
              f"p99 {r['p99_ms']:7.0f} ms  max {r['max_ms']:7.0f} ms  errors {r['errors']}")
    print(f"raw JSON: {out}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()

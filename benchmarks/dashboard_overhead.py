"""What does the live dashboard cost? The same server three ways, side by side in one run:
``off`` (``dashboard = false``: no sampler), ``on`` (the sampler takes its point a second,
nobody watches) and ``watched`` (on, and a client polls ``/dashboard/data?since=`` every
second, as the page does, after one full fetch).

    flock /tmp/sokuji-bench.lock .venv/bin/python benchmarks/dashboard_overhead.py
        [--rounds 5] [--calls 2000] [--seconds 4] [--models 4]
        [--out benchmarks/results/dashboard_overhead.json]          (~2 minutes on 2 cores)

Each server has --models synthetic models of zero service time (the sampler reads every
model each tick; one of them takes the traffic): serving alone is measured, so the
dashboard's share is at its largest. Cache off. --rounds rounds; in each, every server in
turn (the order rotates) gets a closed loop at concurrency 1 (--calls requests over one
keep-alive connection, raw sockets): latency p50 / p99 / p99.9 (a tick blocks the loop for
its duration, so it would show in the tail first); then a throughput run at saturation
(--seconds, concurrency 16): requests/s and the server's CPU time per request. Also the
sampler's own cost: each point's ``tick_us`` from the watched server. Server on
--server-core (1), clients on --client-core (0). Writes the raw JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from _harness import C1Client, Server, free_port, percentile, v2_body  # noqa: E402
from machine import describe  # noqa: E402
from tracing_overhead import cpu_ns, requests_for, saturate  # noqa: E402

from sokuji.config import ServerConfig  # noqa: E402

MODES = ("off", "on", "watched")


def server(args: argparse.Namespace, mode: str) -> Server:
    port = free_port()
    models = "".join(f"""
[[models]]
name = "synth{i}"
runtime = "synthetic"
cache = false
max_batch_size = 32
options = {{base_ms = 0.0}}
""" for i in range(args.models))
    return Server(args, [sys.executable, "-m", "sokuji", "serve"], port, config=f"""
port = {port}
cache_dir = "{args.cache_dir}"
log_level = "warning"
dashboard = {"false" if mode == "off" else "true"}
[jobs]
enabled = false
{models}""")


class Watcher(threading.Thread):
    """Polls /dashboard/data as the page does: everything once, then ``since`` every second."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.base = f"http://127.0.0.1:{port}/dashboard/data"
        self.stop = threading.Event()
        self.ticks_us: list[int] = []
        self.bytes = 0

    def run(self) -> None:
        seq: int | None = None
        while not self.stop.wait(0 if seq is None else 1.0):
            url = self.base if seq is None else f"{self.base}?since={seq}"
            with urllib.request.urlopen(url, timeout=10) as r:
                body = r.read()
            self.bytes += len(body)
            doc = json.loads(body)
            seq = doc["seq"]
            self.ticks_us += [p["tick_us"] for p in doc["points"]]


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [x for r in runs for x in r["c1_ms"]]
    answers, seconds = sum(r["answers"] for r in runs), sum(r["seconds"] for r in runs)
    return {"c1_p50_ms": statistics.median(lat), "c1_p99_ms": percentile(lat, 99),
            "c1_p999_ms": percentile(lat, 99.9),
            "round_p50_ms": [statistics.median(r["c1_ms"]) for r in runs],
            "throughput_rps": answers / seconds,
            "cpu_us_per_request": sum(r["cpu_us_per_request"] * r["answers"] for r in runs)
            / answers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000, help="c=1 requests per server and round")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--models", type=int, default=4, help="synthetic models per server")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--server-core", type=int, default=1)
    p.add_argument("--client-core", type=int, default=0)
    p.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                        "dashboard_overhead.json"))
    args = p.parse_args()
    if "dashboard" not in ServerConfig.__struct_fields__:
        sys.exit("this Sokuji has no `dashboard` config key: the off arm cannot be served")
    os.sched_setaffinity(0, {args.client_core})
    bodies = [v2_body(f"sentence number {i}") for i in range(64)]
    requests = requests_for("synth0", bodies)
    report: dict[str, Any] = {"benchmark": "dashboard_overhead",
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "settings": dict(vars(args)), "machine_before": describe()}
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    servers = {mode: server(args, mode) for mode in MODES}
    watcher: Watcher | None = None
    try:
        for srv in servers.values():
            srv.__enter__()
            c = C1Client(srv.port, bodies)
            c.requests = requests
            c.run(300)  # warm-up
        watcher = Watcher(servers["watched"].port)
        watcher.start()
        for r in range(args.rounds):
            turn = list(MODES[r % 3:] + MODES[:r % 3])
            for mode in turn:
                srv = servers[mode]
                assert srv.proc is not None
                client = C1Client(srv.port, bodies)
                client.requests = requests
                lat, _ = client.run(args.calls)
                cpu0 = cpu_ns(srv.proc.pid)
                count, seconds = asyncio.run(saturate(srv.port, requests, args.concurrency,
                                                      args.seconds))
                cpu = cpu_ns(srv.proc.pid) - cpu0
                runs[mode].append({"c1_ms": lat, "answers": count, "seconds": seconds,
                                   "cpu_us_per_request": cpu / 1e3 / count})
                print(f"round {r + 1}/{args.rounds} {mode:7s}: c=1 p50 "
                      f"{statistics.median(lat):.3f} ms p99 {percentile(lat, 99):.3f} ms, "
                      f"{count / seconds:.0f} req/s, {cpu / 1e3 / count:.0f} us CPU/request",
                      flush=True)
    finally:
        if watcher is not None:
            watcher.stop.set()
            watcher.join(5)
        for srv in servers.values():
            if srv.proc is not None:
                srv.__exit__()
    report["machine_after"] = describe()
    report["runs"] = runs
    report["summary"] = summary = {mode: summarise(runs[mode]) for mode in MODES}
    off = summary["off"]
    for mode in ("on", "watched"):
        s = summary[mode]
        s["p50_added_ms"] = s["c1_p50_ms"] - off["c1_p50_ms"]
        s["p99_added_ms"] = s["c1_p99_ms"] - off["c1_p99_ms"]
        s["throughput_ratio"] = s["throughput_rps"] / off["throughput_rps"]
        s["cpu_ratio"] = s["cpu_us_per_request"] / off["cpu_us_per_request"]
    ticks = sorted(float(t) for t in watcher.ticks_us) if watcher is not None else []
    if ticks:
        report["tick_us"] = {"n": len(ticks), "p50": percentile(ticks, 50),
                             "p99": percentile(ticks, 99), "max": ticks[-1],
                             "poll_bytes": watcher.bytes if watcher else 0}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=float))
    print(f"\n{'mode':8s} {'c1 p50':>8s} {'added':>8s} {'c1 p99':>8s} {'added':>8s} "
          f"{'p99.9':>8s} {'req/s':>7s} {'ratio':>6s} {'CPU us':>7s} {'ratio':>6s}")
    for mode in MODES:
        s = summary[mode]
        add50 = f"{s['p50_added_ms']:+8.3f}" if mode != "off" else f"{'':8s}"
        add99 = f"{s['p99_added_ms']:+8.3f}" if mode != "off" else f"{'':8s}"
        print(f"{mode:8s} {s['c1_p50_ms']:8.3f} {add50} {s['c1_p99_ms']:8.3f} {add99} "
              f"{s['c1_p999_ms']:8.3f} {s['throughput_rps']:7.0f} "
              f"{s.get('throughput_ratio', 1.0):6.3f} {s['cpu_us_per_request']:7.0f} "
              f"{s.get('cpu_ratio', 1.0):6.3f}")
    if "tick_us" in report:
        t = report["tick_us"]
        print(f"sampler tick: p50 {t['p50']} us, p99 {t['p99']} us, max {t['max']} us "
              f"({t['n']} ticks)")
    print(f"raw JSON: {out}")


if __name__ == "__main__":
    main()

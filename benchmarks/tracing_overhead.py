"""What does tracing cost? The same server config three ways: tracing off, sampled at 1%, at
100%, side by side in one run, with a real OTLP receiver taking the spans.

    flock /tmp/sokuji-bench.lock .venv/bin/python benchmarks/tracing_overhead.py
        [--rounds 5] [--calls 400] [--seconds 4] [--models synth,minilm]
        [--out benchmarks/results/tracing_overhead.json]       (~4 minutes on 2 cores)

Three ``sokuji serve`` processes (``off``: ``[tracing] enabled = false``; ``1%`` and
``100%``: enabled, ``sample_ratio`` 0.01 and 1.0, exporting over OTLP/HTTP to the receiver,
``tests/integration/otlp_receiver.py --count``, which decodes every span), each serving:

- ``synth``: the synthetic runtime with no service time (``base_ms = 0``): what is measured
  is serving alone, so the tracing's share is at its largest (a pure-overhead view);
- ``minilm``: the built-in MiniLM on one ONNX Runtime thread, short sentences (the ``short``
  dataset): a real model's request.

Clients send no ``traceparent``: the ratio decides. Cache off (the dataset repeats).
--rounds rounds; in each, for each model:

1. concurrency 1, interleaved request by request: --calls rounds of one request to each
   server in turn (the order rotates; a lean raw-socket client, one keep-alive connection
   per server), so the three see the same moments of this shared machine: p50 / p99;
2. a throughput run at saturation on each server in turn (the order rotates by round;
   --seconds, closed loop at --concurrency over raw-socket connections): requests/s, and
   the server's CPU time per request (every thread, from ``/proc/<pid>/task/*/schedstat``),
   which gives its capacity (1 / CPU per request) even while other work on the machine or
   the client, not the server, sets the rate.

Reported per model and mode, pooled over the rounds, with ratios against ``off``: p50 and
its difference in ms (also the median over rounds of the per-round difference), throughput,
CPU per request and the capacity it gives (off's CPU per request / this one's). Targets at
1%: <= 2% throughput lost, <= 0.05 ms p50 added. Server on --server-core (1); client and
receiver on --client-core (0). Writes the raw JSON (every c=1 latency, the receiver's
counts, the machine probe before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from _harness import C1Client, Server, free_port, percentile, v2_body  # noqa: E402
from machine import describe  # noqa: E402

from sokuji.bench.dataset import load  # noqa: E402

MODES = {"off": None, "1%": 0.01, "100%": 1.0}


def server(args: argparse.Namespace, mode: str, receiver: str) -> Server:
    port = free_port()
    ratio = MODES[mode]
    tracing = "[tracing]\nenabled = false\n" if ratio is None else f"""[tracing]
enabled = true
endpoint = "{receiver}"
sample_ratio = {ratio}
service_name = "sokuji-{mode.replace('%', 'pct')}"
"""
    return Server(args, [sys.executable, "-m", "sokuji", "serve"], port, config=f"""
port = {port}
cache_dir = "{args.cache_dir}"
log_level = "warning"
{tracing}[jobs]
enabled = false
[[models]]
name = "synth"
runtime = "synthetic"
cache = false
max_batch_size = 32
[models.options]
base_ms = 0.0
[[models]]
name = "minilm"
cache = false
intra_op_threads = 1
max_batch_size = 32
""")


def requests_for(model: str, bodies: list[bytes]) -> list[bytes]:
    return [b"POST /v2/models/" + model.encode() + b"/infer HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body for body in bodies]


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in ns."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total


async def saturate(port: int, requests: list[bytes], concurrency: int,
                   seconds: float) -> tuple[int, float]:
    """Closed loop over ``concurrency`` raw keep-alive connections for ``seconds``: answers
    (all must be 200) and the measured seconds."""
    stop_at = time.perf_counter() + seconds
    count = 0

    async def worker(k: int) -> None:
        nonlocal count
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        i = k
        try:
            while time.perf_counter() < stop_at:
                writer.write(requests[i % len(requests)])
                i += concurrency
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(head[:200].decode("latin-1"))
                length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                count += 1
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return count, time.perf_counter() - t0


def interleaved_c1(servers: dict[str, Server], requests: list[bytes], calls: int
                   ) -> dict[str, list[float]]:
    """Concurrency 1 to every server at once, request by request: ``calls`` rounds, each
    sending one request to each server in turn (the order rotates), so all three see the
    same moment of this shared machine. Per server, the latencies in ms."""
    clients = {mode: C1Client(srv.port, [b""]) for mode, srv in servers.items()}
    socks = {mode: socket.create_connection(("127.0.0.1", srv.port))
             for mode, srv in servers.items()}
    lat: dict[str, list[float]] = {mode: [] for mode in servers}
    order = list(servers)
    try:
        for mode, sock in socks.items():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            clients[mode]._call(sock, requests[0])  # untimed: the connection opens
        for i in range(calls):
            request = requests[i % len(requests)]
            for mode in order[i % 3:] + order[:i % 3]:
                t0 = time.perf_counter()
                status, _ = clients[mode]._call(socks[mode], request)
                lat[mode].append((time.perf_counter() - t0) * 1e3)
                if status != 200:
                    raise RuntimeError(f"{mode}: HTTP {status}")
    finally:
        for sock in socks.values():
            sock.close()
    return lat


def throughput(args: argparse.Namespace, srv: Server, model: str, requests: list[bytes]
               ) -> dict[str, Any]:
    assert srv.proc is not None
    cpu0 = cpu_ns(srv.proc.pid)
    count, seconds = asyncio.run(saturate(srv.port, requests, args.concurrency[model],
                                          args.seconds))
    cpu = cpu_ns(srv.proc.pid) - cpu0
    return {"answers": count, "seconds": seconds, "cpu_us_per_request": cpu / 1e3 / count}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [x for r in runs for x in r["c1_ms"]]
    answers, seconds = sum(r["answers"] for r in runs), sum(r["seconds"] for r in runs)
    return {"c1_p50_ms": statistics.median(lat), "c1_p99_ms": percentile(lat, 99),
            "round_p50_ms": [statistics.median(r["c1_ms"]) for r in runs],
            "throughput_rps": answers / seconds,
            "cpu_us_per_request": sum(r["cpu_us_per_request"] * r["answers"] for r in runs)
            / answers}


def receiver_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url.replace("/v1/traces", "/stats"), timeout=5) as r:
        return dict(json.loads(r.read()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=400, help="c=1 requests per server and round")
    p.add_argument("--seconds", type=float, default=4.0, help="throughput run per server "
                   "and round")
    p.add_argument("--models", default="synth,minilm")
    p.add_argument("--synth-concurrency", type=int, default=16)
    p.add_argument("--minilm-concurrency", type=int, default=32)
    p.add_argument("--server-core", type=int, default=1)
    p.add_argument("--client-core", type=int, default=0)
    p.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                        "tracing_overhead.json"))
    args = p.parse_args()
    models = args.models.split(",")
    args.concurrency = {"synth": args.synth_concurrency, "minilm": args.minilm_concurrency}
    os.sched_setaffinity(0, {args.client_core})
    texts = [item.text for item in load("short")]
    bodies = [v2_body(t) for t in texts]
    report: dict[str, Any] = {"benchmark": "tracing_overhead",
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "settings": dict(vars(args)),
                              "machine_before": describe()}
    rx = subprocess.Popen(["taskset", "-c", str(args.client_core), sys.executable, "-m",
                           "tests.integration.otlp_receiver", "--count"], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None
    receiver = f"http://127.0.0.1:{int(rx.stdout.readline())}/v1/traces"
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        m: {mode: [] for mode in MODES} for m in models}
    servers = {mode: server(args, mode, receiver) for mode in MODES}
    try:
        for srv in servers.values():
            srv.__enter__()
        for model in models:  # warm-up: the model's arena, the loop, the exporter
            for srv in servers.values():
                c = C1Client(srv.port, bodies)
                c.requests = requests_for(model, bodies)
                c.run(200)
        order = list(MODES)
        for r in range(args.rounds):
            turn = order[r % 3:] + order[:r % 3]
            for model in models:
                requests = requests_for(model, bodies)
                c1 = interleaved_c1(servers, requests, args.calls)
                for mode in turn:
                    run = throughput(args, servers[mode], model, requests)
                    run["c1_ms"] = c1[mode]
                    runs[model][mode].append(run)
                    print(f"round {r + 1}/{args.rounds} {model:6s} {mode:4s}: c=1 p50 "
                          f"{statistics.median(run['c1_ms']):.3f} ms, "
                          f"{run['answers'] / run['seconds']:.0f} req/s, "
                          f"{run['cpu_us_per_request']:.1f} us CPU/request", flush=True)
        time.sleep(2.0)  # the last batches of spans reach the receiver (export delay 1 s)
        report["receiver"] = receiver_stats(receiver)
    finally:
        for srv in servers.values():
            if srv.proc is not None:
                srv.__exit__()
        rx.terminate()
        rx.wait(10)
    report["machine_after"] = describe()
    report["runs"] = runs
    report["summary"] = summary = {m: {mode: summarise(runs[m][mode]) for mode in MODES}
                                   for m in models}
    for m in models:
        off = summary[m]["off"]
        for mode in ("1%", "100%"):
            s = summary[m][mode]
            s["p50_added_ms"] = s["c1_p50_ms"] - off["c1_p50_ms"]
            s["p50_added_ms_median_of_rounds"] = statistics.median(
                a - b for a, b in zip(s["round_p50_ms"], off["round_p50_ms"], strict=True))
            s["throughput_ratio"] = s["throughput_rps"] / off["throughput_rps"]
            s["cpu_ratio"] = s["cpu_us_per_request"] / off["cpu_us_per_request"]
            s["capacity_ratio"] = off["cpu_us_per_request"] / s["cpu_us_per_request"]
            pairs = list(zip(runs[m]["off"], runs[m][mode], strict=True))
            s["throughput_ratio_median_of_rounds"] = statistics.median(
                (b["answers"] / b["seconds"]) / (a["answers"] / a["seconds"]) for a, b in pairs)
            s["capacity_ratio_median_of_rounds"] = statistics.median(
                a["cpu_us_per_request"] / b["cpu_us_per_request"] for a, b in pairs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=float))
    print(f"\n{'model':7s} {'mode':5s} {'c1 p50':>8s} {'added':>8s} {'(rounds)':>9s} "
          f"{'c1 p99':>8s} {'req/s':>7s} {'ratio':>6s} {'(rounds)':>8s} {'CPU us':>7s} "
          f"{'capacity':>8s} {'(rounds)':>8s}")
    for m in models:
        for mode in MODES:
            s = summary[m][mode]
            if mode == "off":
                extra, ratio, cap = f"{'':8s} {'':9s}", f"{'':6s} {'':8s}", f"{'':8s} {'':8s}"
            else:
                extra = f"{s['p50_added_ms']:+8.3f} {s['p50_added_ms_median_of_rounds']:+9.3f}"
                ratio = (f"{s['throughput_ratio']:6.3f} "
                         f"{s['throughput_ratio_median_of_rounds']:8.3f}")
                cap = f"{s['capacity_ratio']:8.3f} {s['capacity_ratio_median_of_rounds']:8.3f}"
            print(f"{m:7s} {mode:5s} {s['c1_p50_ms']:8.3f} {extra} {s['c1_p99_ms']:8.3f} "
                  f"{s['throughput_rps']:7.0f} {ratio} {s['cpu_us_per_request']:7.1f} {cap}")
    print("targets at 1%: throughput (capacity) ratio >= 0.98, p50 added <= 0.05 ms; "
          "(rounds): the median over rounds of the paired per-round figure")
    print(f"receiver: {report['receiver']}")
    print(f"raw JSON: {out}")


if __name__ == "__main__":
    main()

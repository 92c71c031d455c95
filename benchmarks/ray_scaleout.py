"""Sokuji on Ray Serve against single-process Sokuji, and the 1-100 replica model checked
against 2 local replicas.

    flock /tmp/sokuji-bench.lock .venv/bin/python benchmarks/ray_scaleout.py
        [--rounds 2] [--out benchmarks/recorded/ray_scaleout-<date>.json]   (~9 minutes)

Contenders, each its own process tree with the same config (MiniLM-L6, ONNX Runtime 1
thread, max_batch_size 32, queue 64, cache off; a synthetic sleep-based model beside it),
started afresh each round and alternated (round 2 runs them in reverse order):

- ``single``: ``sokuji serve`` pinned to --server-core;
- ``ray1``: ``sokuji serve --ray --replicas 1`` (its own local cluster, Ray Serve's fast
  path: HAProxy -> the replica's own HTTP server), the whole cluster pinned to --server-core;
- ``ray2``: the same with 2 replicas on both cores (the client then shares a core).

Each Ray command runs with its own HOME, Ray temp dir and auth token under one short
directory; its processes are found by a marker in their environment, so the CPU and memory
counted are this run's (other sessions' clusters on the machine are not). Per contender and
round: (a) idle latency at concurrency 1 (one keep-alive connection, prebuilt requests; for
ray1 also straight to the replica's direct-ingress port), (b) closed loops at 8 and 48
connections: throughput, and server CPU per request from /proc split into the replica(s),
HAProxy and the rest of Ray. Round 1's single server is also benched for ``sokuji plan``'s
fit (``sokuji bench`` at concurrency 1, 4, 48 and an open loop at half the capacity).

The model (``sokuji/plan/scaleout.py``): one replica under Ray = the single-process fit +
the measured Ray CPU per request and hop; then checked against a fresh 2-replica cluster:
the synthetic model (exponential 20 ms, one at a time: no CPU, so the 2 cores are not the
limit) at 1.5x one replica's capacity (leastconn, and the even random split, predicted), and
MiniLM at a rate between 1x and 2x one replica's capacity, predicted for this box (the
balancer, the client and Ray's background charged to the 2 cores they share). Then the
1..100-replica table. Writes the JSON and a PNG beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _harness import C1Client, closed_loop, percentile, v2_body  # noqa: E402
from _ray_contender import Contender, cpu_split  # noqa: E402
from _scaleout_plot import plot  # noqa: E402
from machine import describe  # noqa: E402

from sokuji.bench.dataset import load  # noqa: E402
from sokuji.plan import scaleout, simulate  # noqa: E402
from sokuji.plan.fit import EncoderFit, fit_encoder  # noqa: E402
from sokuji.plan.inputs import ServerInfo, load_bench  # noqa: E402

SYNTH_MS = 20.0
CONFIG = """port = {{port}}
cache_dir = "{cache}"
log_level = "warning"
[jobs]
enabled = false
[[models]]
name = "minilm"
cache = false
intra_op_threads = 1
max_batch_size = 32
max_queue_depth = 64
[[models]]
name = "synth"
runtime = "synthetic"
cache = false
max_batch_size = 1
max_queue_depth = 256
inline_max_ms = 0
[models.options]
base_ms = {synth}
distribution = "exponential"
[ray]
num_cpus = 0
draining_period_s = 0.5
temp_dir = "{{tmp}}"
"""


def config(args: argparse.Namespace) -> str:
    """The config, with {port} and {tmp} left for each contender."""
    return CONFIG.format(cache=args.cache_dir, synth=SYNTH_MS)


def throughput(c: Contender, bodies: list[bytes], conns: int, seconds: float) -> dict[str, Any]:
    """A closed loop of ``conns`` after a short warm-up; the server's CPU over the measured
    loop per request it answered."""
    asyncio.run(closed_loop(c.port, bodies, conns, 0.5, 0.5))
    waited = quiet(c)
    before, t0, busy0 = c.usage(), time.monotonic(), machine_busy_s()
    r = asyncio.run(closed_loop(c.port, bodies, conns, 0.0, seconds))
    wall, busy = time.monotonic() - t0, machine_busy_s() - busy0
    lat = r.pop("latencies_ms")
    out = {"rps": r["items"] / r["seconds"], "errors": r["errors"],
           "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
           "client_cpu_ms_per_request": r["client_cpu_s"] * 1e3 / len(lat)}
    out.update(cpu_split(before, c.usage(), len(lat), wall))
    # what other processes (other sessions' work) took of the machine meanwhile
    out["waited_for_quiet_s"] = round(waited, 1)
    out["others_cores"] = (busy - r["client_cpu_s"]) / wall - sum(
        v for k, v in out.items() if k.endswith("_cores"))
    return out


def quiet(c: Contender, bound_s: float = 60.0) -> float:
    """Wait (at most ``bound_s``) for a second in which other processes used under 0.15 of
    a core: other sessions' work would be measured as the server's. Returns the wait."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        before, busy0, own0 = c.usage(), machine_busy_s(), time.process_time()
        time.sleep(1.0)
        ours = sum(u["cpu_s"] - before.get(g, {}).get("cpu_s", 0.0)
                   for g, u in c.usage().items()) + time.process_time() - own0
        if machine_busy_s() - busy0 - ours < 0.15:
            break
    return time.monotonic() - t0


def machine_busy_s() -> float:
    """CPU seconds every core has spent busy since boot (all processes, kernel included)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")


def c1(c: Contender, bodies: list[bytes], calls: int, port: int | None = None
       ) -> dict[str, float]:
    lat, _ = C1Client(port or c.port, bodies).run(calls)
    return {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
            "mean_ms": float(np.mean(lat))}


def bench(url: str, out: Path, load_args: list[str], args: argparse.Namespace,
          seconds: float, model: str = "minilm") -> tuple[dict[str, Any], float]:
    """``sokuji bench`` on the client core; its JSON and its CPU seconds."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(["taskset", "-c", str(args.client_core), sys.executable, "-m", "sokuji",
                    "bench", url, "--quiet", "--out", str(out), "--model", model,
                    "--dataset", "short", "--duration", str(seconds), "--warmup", "2s",
                    "--timeout", "30", *load_args], check=True, cwd=ROOT)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return json.loads(out.read_text()), (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)


def fit_single(c: Contender, args: argparse.Namespace, work: Path
               ) -> tuple[EncoderFit, float]:
    """``sokuji plan``'s fit of the single server; and the bench client's CPU per request
    (its open loop)."""
    url = f"http://127.0.0.1:{c.port}"
    s = args.fit_seconds
    for name, load_args in (("c1", ["--concurrency", "1"]), ("c4", ["--concurrency", "4"]),
                            ("c48", ["--concurrency", "48"])):
        bench(url, work / f"{name}.json", load_args, args, s)
    cap = json.loads((work / "c48.json").read_text())["summary"]["throughput_rps"]
    doc, client_s = bench(url, work / "open.json", ["--rate", f"{0.5 * cap:.1f}"], args, s)
    runs = [r for n in ("c1", "c4", "c48", "open") for r in load_bench(str(work / f"{n}.json"))]
    fit = fit_encoder(runs, ServerInfo(source="config", max_batch_size=32, queue_depth=64))
    return fit, client_s * 1e3 / doc["summary"]["requests"]["sent"]


def mean_of(rows: list[dict[str, Any]], key: str) -> float:
    return float(np.mean([r[key] for r in rows]))


def measured_figures(doc: dict[str, Any]) -> dict[str, Any]:
    s = doc["summary"]
    return {"throughput_rps": s["throughput_rps"], "p50_ms": s["latency_ms"]["p50"],
            "p99_ms": s["latency_ms"]["p99"], "errors": s["requests"]["errors"],
            "sent": s["requests"]["sent"]}


def err(pred: float | None, meas: float | None) -> float | None:
    return None if not pred or not meas else round((pred - meas) / meas * 100, 1)


def checks(args: argparse.Namespace, base: Path, single: EncoderFit,
           costs: scaleout.RayCosts, client_cpu_ms: float, work: Path) -> dict[str, Any]:
    """Predicted against a fresh 2-replica cluster: synthetic (balancing), MiniLM (CPU)."""
    out: dict[str, Any] = {}
    sim = scaleout.Sim(requests=40_000, seeds=4)
    with Contender("chk", 2, "0,1", args, base, config(args)) as c:
        url = f"http://127.0.0.1:{c.port}"
        # Synthetic: exponential 20 ms, one at a time; the time outside from a lone request.
        lone, _ = bench(url, work / "s1.json", ["--concurrency", "1"], args, 8.0, "synth")
        outside = max(0.0, lone["summary"]["latency_ms"]["mean"] - SYNTH_MS)
        spread = np.random.default_rng(0).exponential(1.0, 100_000)
        sfit = EncoderFit(base_ms=0.0, per_item_ms=SYNTH_MS, inline_ms=SYNTH_MS,
                          overhead_ms=0.0, outside_ms=outside, spread=spread, max_batch=1,
                          queue_depth=256, anchor="configured", capacity_runs=(),
                          outside=np.full(1, outside))
        rate = 1.5 * sfit.capacity_rps()
        doc, _ = bench(url, work / "s2.json", ["--rate", f"{rate:.1f}"], args,
                       args.check_seconds, "synth")
        meas = measured_figures(doc)
        pred = {b: scaleout.predict(sfit, 2, rate, balance=b, sim=sim)
                for b in ("leastconn", "random")}
        out["synthetic"] = {"rate": rate, "one_replica_capacity_rps": sfit.capacity_rps(),
                            "outside_ms": outside, "measured": meas, **{
                                f"predicted_{b}": {"throughput_rps": f.throughput_rps,
                                                   "p50_ms": f.latency_ms["p50"],
                                                   "p99_ms": f.latency_ms["p99"]}
                                for b, f in pred.items()}}
        # MiniLM: between 1x and 2x one replica's capacity as this box gives it (one core
        # shared with the balancer and Ray, as ray1 ran), below what 2 replicas sharing the
        # 2 cores with the balancer, the client and Ray can take.
        one = scaleout.ray_replica(single, costs, costs.balancer_cpu_ms).capacity_rps()
        shared = costs.balancer_cpu_ms + client_cpu_ms
        box_fit = scaleout.ray_replica(single, costs, shared)
        rate = min(args.check_factor * one, args.check_cap * 2 * box_fit.capacity_rps())
        bg_ms = costs.background_cores * 1e3 / rate
        box_fit = scaleout.ray_replica(single, costs, shared + bg_ms)
        doc, client_s = bench(url, work / "m2.json", ["--rate", f"{rate:.1f}"], args,
                              args.check_seconds)
        meas = measured_figures(doc)
        f = scaleout.predict(box_fit, 2, rate, sim=sim)
        out["minilm"] = {"rate": rate, "one_replica_capacity_rps": one,
                         "factor_of_one_replica": rate / one,
                         "box_capacity_rps": 2 * box_fit.capacity_rps(),
                         "colocated_cpu_ms_per_request": shared + bg_ms, "measured": meas,
                         "client_cpu_ms_per_request": client_s * 1e3 / max(1, meas["sent"]),
                         "predicted_leastconn": {"throughput_rps": f.throughput_rps,
                                                 "p50_ms": f.latency_ms["p50"],
                                                 "p99_ms": f.latency_ms["p99"]}}
    for k in ("synthetic", "minilm"):
        m, p = out[k]["measured"], out[k]["predicted_leastconn"]
        out[k]["error_pct"] = {x: err(p[x], m[x]) for x in ("throughput_rps", "p50_ms",
                                                            "p99_ms")}
    return out


def contender_round(c: Contender, bodies: list[bytes], args: argparse.Namespace
                    ) -> dict[str, Any]:
    row: dict[str, Any] = {"start_s": round(c.start_s, 1)}
    before = c.usage()
    time.sleep(args.idle_seconds)
    idle = cpu_split(before, c.usage(), 1, args.idle_seconds)
    row["idle_cores"] = {k[:-6]: v for k, v in idle.items() if k.endswith("_cores")}
    quiet(c)
    row["c1"] = c1(c, bodies, args.calls)
    if c.replicas == 1:
        port = c.direct_port()
        row["c1_direct"] = c1(c, bodies, args.calls, port) if port else None
    for conns in (8, 48):
        row[f"c{conns}"] = throughput(c, bodies, conns, args.seconds)
    row["rss_mb"] = {g: round(u["rss_mb"], 1) for g, u in c.usage().items()}
    row["processes"] = {g: u["processes"] for g, u in c.usage().items()}
    return row


def pooled(rounds: list[dict[str, Any]], *path: str) -> float:
    values = []
    for r in rounds:
        v: Any = r
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if v is not None:
            values.append(v)
    return float(np.mean(values)) if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=300, help="concurrency-1 calls a round")
    ap.add_argument("--seconds", type=float, default=5.0, help="each closed loop")
    ap.add_argument("--idle-seconds", type=float, default=3.0)
    ap.add_argument("--fit-seconds", type=float, default=8.0)
    ap.add_argument("--check-seconds", type=float, default=20.0)
    ap.add_argument("--check-factor", type=float, default=1.3,
                    help="MiniLM check rate, x one replica's capacity (on one core here)")
    ap.add_argument("--check-cap", type=float, default=0.75,
                    help="... at most this x what 2 replicas can take on this box")
    ap.add_argument("--price-per-core-hour", type=float, default=0.04,
                    help="an example price for the cost column")
    ap.add_argument("--server-core", type=int, default=1)
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "recorded" /
                                         f"ray_scaleout-{time.strftime('%Y-%m-%d')}.json"))
    args = ap.parse_args()
    began = time.monotonic()
    os.sched_setaffinity(0, {args.client_core})
    subprocess.run([sys.executable, "-m", "sokuji", "export", "minilm", "--cache-dir",
                    args.cache_dir], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    bodies = [v2_body(item.text) for item in load("short")]
    report: dict[str, Any] = {"benchmark": "ray_scaleout", "command": " ".join(sys.argv),
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "settings": vars(args), "machine_before": describe()}
    base = Path(tempfile.mkdtemp(prefix="s17b", dir="/tmp"))  # short: HAProxy, Ray sockets
    work = base / "w"
    work.mkdir()
    plans = {"single": (0, str(args.server_core)), "ray1": (1, str(args.server_core)),
             "ray2": (2, f"{args.client_core},{args.server_core}")}
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in plans}
    single_fit: EncoderFit | None = None
    client_cpu = 0.0
    try:
        for r in range(args.rounds):
            order = list(plans) if r % 2 == 0 else list(reversed(plans))
            for name in order:
                replicas, cores = plans[name]
                with Contender(name, replicas, cores, args, base, config(args)) as c:
                    row = contender_round(c, bodies, args)
                    if name == "single" and single_fit is None:
                        single_fit, client_cpu = fit_single(c, args, work)
                results[name].append(row)
                print(f"round {r + 1} {name:6s}: c1 p50 {row['c1']['p50_ms']:.2f} ms; c8 "
                      f"{row['c8']['rps']:.0f} req/s, {row['c8']['server_cpu_ms_per_request']:.2f}"
                      f" ms CPU/req; c48 {row['c48']['rps']:.0f} req/s; start {row['start_s']} s",
                      flush=True)
        assert single_fit is not None
        s, r1 = results["single"], results["ray1"]
        costs = scaleout.RayCosts(
            replica_cpu_ms=pooled(r1, "c8", "replica_cpu_ms_per_request")
            - pooled(s, "c8", "replica_cpu_ms_per_request"),
            hop_ms=pooled(r1, "c1", "p50_ms") - pooled(s, "c1", "p50_ms"),
            balancer_cpu_ms=pooled(r1, "c8", "haproxy_cpu_ms_per_request"),
            replica_mb=pooled(r1, "rss_mb", "replica"),
            cluster_mb=sum(pooled(r1, "rss_mb", g) for g in ("ray", "haproxy", "driver")),
            background_cores=sum(pooled(r1, "idle_cores", g)
                                 for g in ("ray", "haproxy", "driver")))
        report["rounds"] = results
        report["model_inputs"] = {"single_fit": scaleout.fit_as_dict(single_fit),
                                  "ray_costs": vars(costs),
                                  "client_cpu_ms_per_request": client_cpu}
        ray_fit = scaleout.ray_replica(single_fit, costs)
        report["summary"] = summary(results, single_fit, ray_fit, costs)
        print(json.dumps(report["summary"], indent=1), flush=True)
        report["checks"] = checks(args, base, single_fit, costs, client_cpu, work)
        print(json.dumps(report["checks"], indent=1), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    pricing = scaleout.Pricing(args.price_per_core_hour)
    t = scaleout.table(ray_fit, costs, pricing, sim=scaleout.Sim(requests=20_000, seeds=2))
    print(scaleout.render(t, pricing))
    report["model"] = {"rows": t.rows, "per_replica_capacity_rps": t.per_replica_capacity_rps,
                       "balancer_capacity_rps": t.balancer_capacity_rps,
                       "utilisation": 0.7, "price_per_core_hour": args.price_per_core_hour,
                       "assumptions": list(t.assumptions),
                       "curve": [{"replicas": n, **scaleout.resources(
                           costs, n, 0.7 * n * t.per_replica_capacity_rps, pricing)}
                           for n in range(1, 101)]}
    report["seconds"] = round(time.monotonic() - began, 1)
    report["machine_after"] = describe()
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    print(f"raw figures: {out} (+ .png); {report['seconds']} s")
    return 0


def summary(results: dict[str, list[dict[str, Any]]], single: EncoderFit, ray: EncoderFit,
            costs: scaleout.RayCosts) -> dict[str, Any]:
    """The side-by-side ratios, and the fitted replica's capacity against the measured."""
    s, r1, r2 = results["single"], results["ray1"], results["ray2"]
    out: dict[str, Any] = {
        "idle_p50_ms": {"single": pooled(s, "c1", "p50_ms"), "ray1": pooled(r1, "c1", "p50_ms"),
                        "ray1_direct": pooled(r1, "c1_direct", "p50_ms"),
                        "ray2": pooled(r2, "c1", "p50_ms")},
        "idle_p99_ms": {"single": pooled(s, "c1", "p99_ms"), "ray1": pooled(r1, "c1", "p99_ms"),
                        "ray1_direct": pooled(r1, "c1_direct", "p99_ms"),
                        "ray2": pooled(r2, "c1", "p99_ms")}}
    out["added_p50_ms"] = {"haproxy": out["idle_p50_ms"]["ray1"] - out["idle_p50_ms"]["single"],
                           "direct": out["idle_p50_ms"]["ray1_direct"]
                           - out["idle_p50_ms"]["single"], "target": 2.0}
    for conns in ("c8", "c48"):
        rps = {n: pooled(results[n], conns, "rps") for n in results}
        cpu = {n: pooled(results[n], conns, "server_cpu_ms_per_request") for n in results}
        out[conns] = {"rps": rps, "server_cpu_ms_per_request": cpu,
                      "ray1_over_single": rps["ray1"] / rps["single"],
                      "ray2_over_ray1": rps["ray2"] / rps["ray1"],
                      "per_core_efficiency_ray_vs_single": cpu["single"] / cpu["ray1"]}
    box = scaleout.ray_replica(single, costs, costs.balancer_cpu_ms)
    out["capacity_check_c48"] = {
        "single": {"measured": pooled(s, "c48", "rps"), "predicted": simulate.closed_load(
            48, single.service(), max_batch=single.max_batch, outside_ms=single.outside,
            seconds=20.0).throughput_rps},
        "ray1_one_core": {"measured": pooled(r1, "c48", "rps"), "predicted": simulate.closed_load(
            48, box.service(), max_batch=box.max_batch, outside_ms=box.outside,
            seconds=20.0).throughput_rps}}
    both = scaleout.ray_replica(single, costs, costs.balancer_cpu_ms + pooled(
        r2, "c48", "client_cpu_ms_per_request") + costs.background_cores * 1e3
        / pooled(r2, "c48", "rps"))
    out["capacity_check_c48"]["ray2_two_cores_shared"] = {
        "measured": pooled(r2, "c48", "rps"), "predicted": 2 * simulate.closed_load(
            24, both.service(), max_batch=both.max_batch, outside_ms=both.outside,
            seconds=20.0).throughput_rps}
    for v in out["capacity_check_c48"].values():
        v["error_pct"] = err(v["predicted"], v["measured"])
    out["capacity_rps_model"] = {"single": single.capacity_rps(), "ray_replica": ray.capacity_rps()}
    return out


if __name__ == "__main__":
    sys.exit(main())

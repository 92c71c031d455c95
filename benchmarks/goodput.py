"""Goodput under an SLO: how much open-loop load can each server take while p99 <= 100 ms?

    .venv/bin/python benchmarks/goodput.py [--quick] [--out FILE]         (~5 minutes)

One short sentence a request (the built-in ``short`` dataset, ~12 tokens), Poisson arrivals
from Sokuji's own load generator (``sokuji.bench``: latency from each request's intended send
time, so a stall cannot hide), servers on one core (--server-core 1), this client on the other.

1. The limit: the raw runtime, a child process on the server core calling the same
   tokenisation and ONNX Runtime session code Sokuji uses (``OnnxEncoderRuntime``, 1 thread),
   one batch after another, for batch sizes B = 1, 2, 3, ... Each call is timed (tokenising
   the B texts one by one, as a server does per request, plus ``run_batch``): t_B. Under a
   steady stream of batches a request that arrives just after a batch started waits for it,
   then for its own batch: ~2 t_B. So a batch size fits the SLO when 2 x p99(t_B) <= SLO,
   and the limit is the best B / mean(t_B) among the sizes that fit. It is optimistic in one
   way (no queueing: batches are always full, back to back, with no Poisson bursts) and
   conservative in another (a server whose batches are smaller at lower load waits less),
   so it is a fair ceiling, not a promise. The whole grid is measured first; the sizes near
   the best are measured again after every round of server runs, and all samples pooled.
2. Each server: offered rates swept (up by --factor from a start, down if the start fails,
   then bisected to --tolerance), each rate a fresh open-loop run of --seconds (after
   --warmup-seconds not counted). A rate passes when p99 <= SLO over all answers and nothing
   failed (no error, 429, 5xx or timeout) and the client kept to its schedule. The highest
   passing rate is run again with another seed and pooled; if the pool fails, the search
   goes on below it. Goodput = requests answered within the SLO per second at that rate.
   A run in which this client lagged its schedule (p99 over 5 ms: something else took its
   core) is run again, twice at most per contender.
3. Contenders: ``sokuji serve`` (V2 JSON, length-aware batching, max_batch_size = the limit's
   B unless --sokuji-max-batch), and a plain FastAPI app (``_fastapi_peer.py``) over the same
   session code, one request -> one call: ``fastapi-sync`` (a ``def`` endpoint in FastAPI's
   threadpool, what its docs recommend for blocking calls) and ``fastapi-async`` (an
   ``async def`` endpoint calling the session on the loop). Rounds alternate the contenders
   step by step, so drift of a shared machine hits all alike.

4. What limits each: the server process's CPU time per request (from /proc) against the raw
   runtime's time per item at the batch size it ran (Sokuji's from its Triton statistics),
   and an ideal server simulated on the measured call times and the same Poisson schedules
   (``_goodput_model.py``): with no cost per request, with Sokuji's, and the largest cost per
   request that would still reach the 0.9 target.

Prints a table and the ratios Sokuji / limit (target >= 0.9) and Sokuji / the better FastAPI
(target >= 1.5); writes JSON and a plot of p99 against offered rate (PNG beside the JSON).
The figures depend on the machine's core speed (the limit), its thread wake-up cost (servers
hand work between threads) and on how quiet the other core is (the client).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _goodput_model import analyse, explain_best
from _goodput_raw import Limit, RawRuntime
from _goodput_search import DISTURBED_SHARE, Search, judge, probed_run, settle
from _harness import Server, free_port

ROOT = Path(__file__).resolve().parent.parent
CONTENDERS = ("sokuji", "fastapi-sync", "fastapi-async")
TARGETS = {"sokuji_over_limit": 0.9, "sokuji_over_fastapi": 1.5}


# --- servers, the run, the report -----------------------------------------------------------

def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def source_tree() -> dict[str, Any]:
    """Which Sokuji was measured: the commit and the files changed since (read-only git)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout
    return {"commit": git("rev-parse", "HEAD").strip(),
            "modified": git("status", "--porcelain", "--", "sokuji").split("\n")[:-1]}


def verdict(step: dict[str, Any]) -> str:
    if step.get("discarded"):
        return (f"(disturbed: client lag p99 {step['client_lag_p99_ms']:.0f} ms, other on "
                f"the server core {step['server_core_other']:.0%}: run again)")
    return "ok" if step["ok"] else f"FAIL: {step['reason']}"


def fastapi_server(args: argparse.Namespace, mode: str) -> Server:
    port = free_port()
    return Server(args, ["env", f"FASTAPI_PEER_MODE={mode}",
                         f"FASTAPI_PEER_CACHE_DIR={args.cache_dir}", sys.executable, "-m",
                         "uvicorn", "--app-dir", str(ROOT / "benchmarks"), "_fastapi_peer:app",
                         "--port", str(port), "--loop", "uvloop", "--http", "httptools",
                         "--no-access-log", "--log-level", "warning"], port)


def run_contenders(args: argparse.Namespace, limit: Limit, slo_ms: float) -> dict[str, Any]:
    first = limit.first
    bs = args.sokuji_max_batch or first["batch_size"]
    starts = {"sokuji": args.start_fraction * first["items_per_s"],
              "fastapi-sync": args.start_fraction * first["single_call_items_per_s"],
              "fastapi-async": args.start_fraction * first["single_call_items_per_s"]}
    servers = {name: (Server.sokuji(args, bs, "length") if name == "sokuji"
                      else fastapi_server(args, name.split("-")[1]))
               for name in args.contenders}
    searches = {name: Search(name, starts[name], args) for name in args.contenders}
    started: list[Server] = []
    try:
        for server in servers.values():
            started.append(server.__enter__())
            settle(server.port, slo_ms)  # warm: the first requests of a process are slow
        while pending := [(s, nxt) for s in searches.values() if (nxt := s.next_rate())]:
            for search, (rate, confirm) in pending:
                server = servers[search.name]
                assert server.proc is not None
                run = probed_run(server.port, server.proc.pid, search.name == "sokuji", rate,
                                 args.seed + (1 if confirm else 0), args)
                step = search.record(rate, run, confirm, slo_ms)
                print(f"  {search.name:<14}{rate:7.1f} req/s{' (again)' if confirm else '':8}"
                      f" p99 {step['p99_ms'] or math.inf:7.1f} ms  errors {step['errors']:<4}"
                      f" goodput {step['goodput_rps']:6.1f}/s  server busy "
                      f"{step['server_busy']:4.0%} (+{step['server_core_other']:.0%} other), "
                      f"{step['server_cpu_ms_per_request']:.2f} ms/req; client "
                      f"{step['client_busy']:.0%} (+{step['client_core_other']:.0%})  "
                      f"{verdict(step)}",
                      flush=True)
                settle(server.port, slo_ms)
            limit.remeasure()
    finally:
        for server in started:
            server.__exit__(None, None, None)
    out = {name: s.result(slo_ms) for name, s in searches.items()}
    if "sokuji" in out:
        out["sokuji"]["max_batch_size"] = bs
    return out


def http_floor(args: argparse.Namespace, rate: float, slo_ms: float) -> dict[str, Any]:
    """The HTTP stack alone under the same open loop: ``_bare_http.py`` (uvicorn, httptools,
    Starlette, orjson; parses the V2 request, answers 384 floats, no model). Its CPU per
    request is what that stack costs any server built on it (Sokuji skips Starlette on its
    inference path, so for Sokuji it is an upper bound of that part)."""
    with Server.bare_http(args) as bare:
        assert bare.proc is not None
        settle(bare.port, slo_ms)
        step = judge([probed_run(bare.port, bare.proc.pid, False, rate, args.seed, args)],
                     rate, slo_ms)
    step.pop("stages")
    print(f"  http floor    {rate:7.1f} req/s          p99 {step['p99_ms'] or math.inf:7.1f} "
          f"ms  server busy {step['server_busy']:4.0%}, "
          f"{step['server_cpu_ms_per_request']:.3f} ms/req", flush=True)
    return step


def plot(path: Path, results: dict[str, Any], limit: dict[str, Any], ideal: dict[str, Any],
         slo_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colours = {}
    for name, res in results.items():
        runs = [s for s in res["steps"] if s["p99_ms"] is not None and not s.get("discarded")]
        dots = ax.scatter([s["rate"] for s in runs], [s["p99_ms"] for s in runs], label=name)
        colours[name] = dots.get_facecolor()[0]
        if res["max_rate_meeting_slo"]:
            ax.axvline(res["max_rate_meeting_slo"], ls=":", lw=1, color=colours[name])
    curves = ideal["curves"]
    for name, p99 in curves["p99_ms"].items():
        label = ("ideal server, simulated" if name == "ideal"
                 else f"ideal + {name}'s cost per request, simulated")
        ax.plot(curves["rates"], p99, ls="--" if name == "ideal" else "-.", lw=1,
                color=colours.get(name, "grey"), label=label)
    ax.axhline(slo_ms, color="red", ls="--", lw=1, label=f"SLO p99 {slo_ms:g} ms")
    ax.axvline(limit["items_per_s"], color="black", ls="--", lw=1,
               label=f"raw limit {limit['items_per_s']:.0f}/s (B={limit['batch_size']})")
    ax.set(xlabel="offered rate (requests/s, Poisson)", ylabel="p99 latency (ms)",
           yscale="log", ylim=(5, 5000),
           title="p99 against offered load, one short sentence a request, server on one core")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short runs for development")
    p.add_argument("--slo-ms", type=float, default=100.0, help="p99 bound")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per rate")
    p.add_argument("--warmup-seconds", type=float, default=2.0)
    p.add_argument("--factor", type=float, default=1.25, help="step while searching up/down")
    p.add_argument("--tolerance", type=float, default=0.04, help="bisect until hi/lo <= 1+this")
    p.add_argument("--start-fraction", type=float, default=0.75,
                   help="start rate: this x the limit (sokuji) or x the raw single-call rate")
    p.add_argument("--max-steps", type=int, default=10, help="per contender")
    p.add_argument("--max-reruns", type=int, default=2,
                   help="per contender: runs repeated because the client lagged")
    p.add_argument("--min-rate", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=2.0,
                   help="per request, seconds (20x the SLO: a failure either way)")
    p.add_argument("--raw-seconds", type=float, default=0.75, help="per batch size, first grid")
    p.add_argument("--raw-min-calls", type=int, default=30, help="per batch size, first grid")
    p.add_argument("--raw-round-seconds", type=float, default=1.5,
                   help="raw re-measurement after each round of server runs")
    p.add_argument("--sokuji-max-batch", type=int, default=0, help="0: the limit's B")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-core", type=int, default=1)
    p.add_argument("--client-core", type=int, default=0)
    p.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "goodput.json"))
    args = p.parse_args()
    if args.quick:
        args.seconds, args.warmup_seconds, args.tolerance = 3.0, 1.0, 0.1
        args.raw_seconds, args.raw_min_calls, args.max_steps = 0.3, 10, 6
        args.raw_round_seconds = 0.5
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    if unknown := set(args.contenders) - set(CONTENDERS):
        p.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    slo_ms = args.slo_ms

    os.sched_setaffinity(0, {args.client_core})
    subprocess.run([sys.executable, "-m", "sokuji", "export", "minilm", "--cache-dir",
                    args.cache_dir], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    began = time.monotonic()
    raw = RawRuntime(args)
    try:
        limits = Limit(raw, args, slo_ms)
        print(f"raw limit (first grid): {limits.first['items_per_s']:.1f} items/s at B="
              f"{limits.first['batch_size']}; single call "
              f"{limits.first['single_call_items_per_s']:.1f}/s; re-measured each round: "
              f"B in {limits.candidates}", flush=True)
        results = run_contenders(args, limits, slo_ms)
    finally:
        raw.close()
    limit = limits.result()
    best_sokuji = (results.get("sokuji", {}).get("best") or {}).get("rate")
    floor = http_floor(args, best_sokuji or limit["items_per_s"] * 0.7, slo_ms)

    peers = {n: r["goodput_rps"] for n, r in results.items() if n.startswith("fastapi")}
    ratios: dict[str, float] = {}
    if "sokuji" in results:
        ratios["sokuji_over_limit"] = results["sokuji"]["goodput_rps"] / limit["items_per_s"]
        if peers and max(peers.values()) > 0:
            ratios["sokuji_over_fastapi"] = results["sokuji"]["goodput_rps"] / max(peers.values())
    for name, value in peers.items():
        ratios[f"{name}_over_limit"] = value / limit["items_per_s"]
    kept = [st for r in results.values() for st in r["steps"] if not st.get("discarded")]
    disturbance = {"runs": len(kept), "runs_disturbed": sum(st["disturbed"] for st in kept),
                   "mean_server_core_other": sum(st["server_core_other"] for st in kept)
                   / max(1, len(kept)),
                   "max_server_core_other": max((st["server_core_other"] for st in kept),
                                                default=0.0)}
    explain = {name: explain_best(res["best"], limit) for name, res in results.items()
               if res["best"]}
    # Below zero only when the raw measurement was disturbed: simulate no cost then.
    overheads = {"sokuji": max(0.0, explain["sokuji"]["serving_ms_per_request"])} \
        if "sokuji" in explain else {}
    ideal = analyse(limits.samples, limit["items_per_s"], limit["batch_size"], slo_ms,
                    overheads, TARGETS["sokuji_over_limit"])
    limit["call_ms"] = {str(bs): v for bs, v in sorted(limits.samples.items())}
    report = {"benchmark": "goodput", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                          "python": platform.python_version()},
              "sokuji_tree": source_tree(),
              "settings": vars(args),
              "slo": {"p99_ms": slo_ms, "errors": 0}, "limit": limit, "contenders": results,
              "ratios": ratios, "targets": TARGETS, "explain": explain,
              "disturbance": disturbance,
              "http_floor": floor,
              "ideal_server": ideal,
              "wall_s": time.monotonic() - began}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(out.with_suffix(".png"), results, limit, ideal, slo_ms)

    print(f"\nlimit: raw runtime at B={limit['batch_size']}: {limit['items_per_s']:.1f} items/s "
          f"(mean t_B {limit['by_batch_size'][str(limit['batch_size'])]['mean_ms']:.1f} ms, "
          f"p99 {limit['by_batch_size'][str(limit['batch_size'])]['p99_ms']:.1f} ms; "
          f"{limit['measurements_disturbed']} raw measurements repeated, disturbed)")
    print(f"{'contender':<16}{'max rate':>10}{'goodput':>10}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'/ limit':>9}  confirmed")
    for name, res in results.items():
        b = res["best"] or {}
        print(f"{name:<16}{b.get('rate', 0):>10.1f}{res['goodput_rps']:>10.1f}"
              f"{b.get('p50_ms') or 0:>9.1f}{b.get('p99_ms') or 0:>9.1f}"
              f"{res['goodput_rps'] / limit['items_per_s']:>9.3f}  {b.get('confirmed')}")
    for key, value in ratios.items():
        target = f"  (target >= {TARGETS[key]})" if key in TARGETS else ""
        print(f"{key:<28}{value:8.3f}{target}")
    print("\nat each one's best rate: the server core's use, and its CPU per request against "
          "the raw runtime's time per item at the same batch size:")
    for name, e in explain.items():
        print(f"  {name:<14} busy {e['server_busy']:4.0%}  cpu {e['cpu_ms_per_request']:.3f} "
              f"ms/req  mean batch {e['batch_mean']:5.1f}  raw {e['raw_ms_per_item']:.3f} "
              f"ms/item  serving {e['serving_ms_per_request']:+.3f} ms/req")
    print(f"  http floor     uvicorn + Starlette, no model: "
          f"{floor['server_cpu_ms_per_request']:.3f} ms/req at {floor['rate']:.0f} req/s")
    print(f"an ideal server (no cost per request; the same runtime and Poisson arrivals, "
          f"simulated): {ideal['ideal_over_limit']:.3f} x the limit")
    for name, w in ideal["with_overhead"].items():
        print(f"  ... plus {name}'s {w['overhead_ms_per_request']:.3f} ms/req: "
              f"{w['over_limit']:.3f} x the limit")
    budget = ideal["overhead_budget_ms"]
    print(f"  cost per request that still reaches {TARGETS['sokuji_over_limit']} x the limit: "
          + (f"{budget:.3f} ms" if budget is not None else "none (not even at zero)"))
    if disturbance["runs_disturbed"]:
        print(f"WARNING: in {disturbance['runs_disturbed']} of {disturbance['runs']} runs "
              f"something else took over {DISTURBED_SHARE:.0%} of the server core (up to "
              f"{disturbance['max_server_core_other']:.0%}): these figures are not the "
              "servers' own; run again on a quiet machine")
    print(f"raw JSON: {out}; plot: {out.with_suffix('.png')}; "
          f"{report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

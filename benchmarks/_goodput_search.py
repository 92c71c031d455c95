"""For ``goodput.py``: one open-loop run at a rate, its verdict under the SLO, the search for
the highest rate that meets it, and what the server process spent meanwhile (its CPU time;
for Sokuji also its batch sizes, from the Triton statistics)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import math
import os
import time
from collections import Counter
from typing import Any

from sokuji.bench import dataset, stats
from sokuji.bench.engine import Engine, RunResult
from sokuji.bench.schedule import Arrivals, intended_times
from sokuji.bench.targets import Target, TargetKind

INFER_PATH = "/v2/models/minilm/infer"
DISTURBED_SHARE = 0.1
"""A run in which anything but the server kept its core busier than this was disturbed
(loopback interrupts alone take 0-3% here)."""
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def open_loop(port: int, rate: float, seed: int, args: argparse.Namespace,
              target: Any = None) -> RunResult:
    """Poisson arrivals at ``rate`` for warm-up + measured seconds, one short text each (or
    what ``target`` sends: anything with ``url``, ``body(item)``, ``request_headers()`` and
    ``streaming``, as ``sokuji.bench.targets.Target``)."""
    if target is None:
        target = Target(kind=TargetKind.V2, base_url=f"http://127.0.0.1:{port}",
                        model="minilm")
    engine = Engine(target, dataset.Sampler(dataset.load("short"), seed),
                    timeout_s=args.timeout)
    times = intended_times(rate, Arrivals.POISSON, seed,
                           duration_s=args.warmup_seconds + args.seconds)
    return asyncio.run(engine.open(times, warmup_s=args.warmup_seconds))


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def core_busy_s(core: int) -> float:
    """CPU seconds one core has spent busy since boot (all processes, kernel included)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(f"cpu{core} "):
                v = [int(x) for x in line.split()[1:]]
                return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / TICKS_PER_S
    raise RuntimeError(f"no cpu{core} in /proc/stat")


def batch_counts(port: int, model: str = "minilm") -> Counter[int]:
    """Sokuji's executions by batch size so far (Triton statistics extension)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", f"/v2/models/{model}/stats")
    doc = json.loads(conn.getresponse().read())
    conn.close()
    return Counter({int(b["batch_size"]): int(b["compute_infer"]["count"])
                    for b in doc["model_stats"][0]["batch_stats"]})


def probed_run(port: int, pid: int, sokuji: bool, rate: float, seed: int,
               args: argparse.Namespace, target: Any = None, model: str = "minilm",
               pids: tuple[int, ...] = ()) -> tuple[RunResult, dict[str, Any]]:
    """``open_loop`` plus the server's CPU time over it (and Sokuji's batches), and how busy
    its core was with anything else (other processes, interrupts). ``pids``: more processes
    of the same server (worker processes), their CPU time counted as the server's."""
    before = batch_counts(port, model) if sokuji else Counter()
    cpu0, core0 = _cpu_s((pid, *pids)), core_busy_s(args.server_core)
    client0, mine0 = core_busy_s(args.client_core), time.process_time()
    t0 = time.perf_counter()
    run = open_loop(port, rate, seed, args, target)
    cpu_s = _cpu_s((pid, *pids)) - cpu0
    probe: dict[str, Any] = {
        "cpu_s": cpu_s, "wall_s": time.perf_counter() - t0, "requests": len(run.records),
        "other_cpu_s": core_busy_s(args.server_core) - core0 - cpu_s,
        "client_cpu_s": time.process_time() - mine0,
        "client_core_other_cpu_s": core_busy_s(args.client_core) - client0
        - (time.process_time() - mine0)}
    if sokuji:
        probe["batches"] = dict(batch_counts(port, model) - before)
    return run, probe


def _cpu_s(pids: tuple[int, ...]) -> float:
    total = 0.0
    for p in pids:
        with contextlib.suppress(OSError):  # a worker process that ended meanwhile
            total += process_cpu_s(p)
    return total


def probe_figures(probes: list[dict[str, Any]]) -> dict[str, Any]:
    cpu = sum(p["cpu_s"] for p in probes)
    wall = sum(p["wall_s"] for p in probes)
    out = {"server_busy": cpu / wall,
           "server_core_other": sum(p.get("other_cpu_s", 0.0) for p in probes) / wall,
           "client_busy": sum(p.get("client_cpu_s", 0.0) for p in probes) / wall,
           "client_core_other": sum(p.get("client_core_other_cpu_s", 0.0)
                                    for p in probes) / wall,
           "server_cpu_ms_per_request": cpu / sum(p["requests"] for p in probes) * 1e3}
    batches: Counter[int] = Counter()
    for p in probes:
        batches.update({int(k): v for k, v in p.get("batches", {}).items()})
    if batches:
        out["batch_mean"] = sum(k * v for k, v in batches.items()) / batches.total()
        out["batch_sizes"] = {str(k): batches[k] for k in sorted(batches)}
    return out


def judge(runs: list[tuple[RunResult, dict[str, Any]]], rate: float,
          slo_ms: float) -> dict[str, Any]:
    """One rate's verdict over one or more runs (pooled): it passes when p99 <= SLO, nothing
    failed, and the client kept to its schedule. Goodput: answers within the SLO a second."""
    pooled = RunResult([r for run, _ in runs for r in run.records], 0.0,
                       sum(run.wall_s for run, _ in runs),
                       sum(run.client_cpu_s for run, _ in runs), "open")
    summary = stats.summarize(pooled)
    measured = [r for r in pooled.records if not r.warmup]
    good = sum(1 for r in measured if r.error is None and r.latency_s * 1e3 <= slo_ms)
    window_s = sum(stats.summarize(run)["window_s"] for run, _ in runs)
    latency = summary["latency_ms"] or {}
    errors = len(measured) - summary["requests"]["ok"]
    behind = min(stats.send_rate_ratio([r for r in run.records if not r.warmup])
                 for run, _ in runs) < stats.MIN_SEND_RATE_RATIO
    p99 = latency.get("p99", math.inf)
    reason = ("errors" if errors else "client behind" if behind else
              "p99" if p99 > slo_ms else None)
    return {"rate": rate, "runs": len(runs), "sent": len(measured), "errors": errors,
            "error_kinds": summary["requests"]["errors"], "p50_ms": latency.get("p50"),
            "p99_ms": latency.get("p99"), "p99_9_ms": latency.get("p99_9"),
            "max_ms": latency.get("max"), "good": good, "goodput_rps": good / window_s,
            "throughput_rps": summary["requests"]["ok"] / window_s,
            "client_lag_p99_ms": (summary["client"].get("lag_ms") or {}).get("p99"),
            "client_lagged": bool(summary["client"].get("behind_schedule")),
            "disturbed": probe_figures([p for _, p in runs])["server_core_other"]
            > DISTURBED_SHARE,
            **probe_figures([probe for _, probe in runs]),
            "stages": summary.get("stages"), "slo_ms": slo_ms, "ok": reason is None,
            "reason": reason}


class Search:
    """The highest rate meeting the SLO for one contender: up by ``factor`` until a failure
    (down if the start fails), then bisect (geometric mean) until hi / lo <= 1 + tolerance,
    then confirm the best pass with a second run under another seed, pooled; a pool that
    fails counts as a failure there and the search goes on below it.

    A failure the surroundings may explain is kept in the record but run again, up to
    ``max_reruns`` times per contender; after that its verdict stands: a p99 missed by no
    more than the client's own send lag (p99 over 5 ms; late sends count in the latencies
    and go out bunched, a burst no schedule asked for), or any failure while something else
    took more than ``DISTURBED_SHARE`` of the server's core. A pass stands regardless:
    either only makes passing harder."""

    def __init__(self, name: str, start: float, args: argparse.Namespace) -> None:
        self.name, self.start, self.args = name, start, args
        self.lo: float | None = None   # highest pass below hi
        self.hi: float | None = None   # lowest failure
        self.steps: list[dict[str, Any]] = []
        self.runs: dict[float, tuple[RunResult, dict[str, Any]]] = {}
        self.final: dict[str, Any] | None = None
        self.reruns = 0

    def next_rate(self) -> tuple[float, bool] | None:
        """(rate, whether it is a confirmation), or None when done."""
        if self.final is not None or len(self.steps) - self.reruns >= self.args.max_steps:
            return None
        lo, hi, f = self.lo, self.hi, self.args.factor
        if lo is None and hi is None:
            return self.start, False
        if hi is None:
            assert lo is not None
            return lo * f, False
        if lo is None:
            return (hi / f, False) if hi / f >= self.args.min_rate else None
        if hi / lo > 1 + self.args.tolerance:
            return math.sqrt(lo * hi), False
        return lo, True

    def record(self, rate: float, run: tuple[RunResult, dict[str, Any]], confirm: bool,
               slo_ms: float) -> dict[str, Any]:
        step = judge([run], rate, slo_ms)
        step["confirmation"] = confirm
        self.steps.append(step)
        if self.surroundings_explain(step) and self.reruns < self.args.max_reruns:
            step["discarded"] = "disturbed: run again"
            self.reruns += 1
            return step
        if confirm:
            pooled = judge([self.runs[rate], run], rate, slo_ms)
            pooled["confirmed"] = pooled["ok"]
            if pooled["ok"]:
                self.final = pooled
            else:
                self.hi = rate
                passes = [s["rate"] for s in self.steps
                          if s["ok"] and s["rate"] < rate and not s.get("discarded")]
                self.lo = max(passes, default=None)
        else:
            self.runs[rate] = run
            if step["ok"]:
                self.lo = rate if self.lo is None else max(self.lo, rate)
            else:
                self.hi = rate if self.hi is None else min(self.hi, rate)
        return step

    @staticmethod
    def surroundings_explain(step: dict[str, Any]) -> bool:
        if step["ok"]:
            return False
        lag = step["client_lag_p99_ms"] or 0.0
        return bool(step["disturbed"] or (step["client_lagged"] and step["reason"] == "p99"
                                          and step["p99_ms"] - lag <= step["slo_ms"]))

    def result(self, slo_ms: float) -> dict[str, Any]:
        if self.final is None and self.lo is not None:  # out of steps: unconfirmed
            self.final = judge([self.runs[self.lo]], self.lo, slo_ms)
            self.final["confirmed"] = False
        return {"best": self.final, "steps": self.steps,
                "goodput_rps": self.final["goodput_rps"] if self.final else 0.0,
                "max_rate_meeting_slo": self.final["rate"] if self.final else None}


def settle(port: int, slo_ms: float, bound_s: float = 20.0,
           request: tuple[str, bytes, dict[str, str]] | None = None) -> None:
    """After an overloaded run, wait until the server has worked off what it still holds (a
    threadpool finishes calls whose clients left): one request at a time until one returns
    within half the SLO; bounded in time. ``request``: (path, body, headers) to send instead
    of one short text to minilm."""
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                   "data": ["is the server idle again"]}]}).encode()
    path, headers = INFER_PATH, {"content-type": "application/json"}
    if request is not None:
        path, body, headers = request
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=bound_s)
        t0 = time.perf_counter()
        conn.request("POST", path, body, headers)
        conn.getresponse().read()
        conn.close()
        if (time.perf_counter() - t0) * 1e3 < slo_ms / 2:
            return

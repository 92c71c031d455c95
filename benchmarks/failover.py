"""An upstream dies under load: what do clients of a router see, with a circuit breaker and
without one (the "LiteLLM-style" baseline: every request pays a failed attempt first)?

    flock /tmp/sokuji-bench.lock .venv/bin/python benchmarks/failover.py
        [--modes kill,stop] [--rate 20] [--rounds 1] [--out benchmarks/results/failover.json]
                                                       (~40 s a mode and round on 2 cores)

Server B (``sokuji serve``: a synthetic encoder, --b-ms per request) is the upstream of
server A. A has a local synthetic encoder ``local`` (the same answers, --local-ms) and two
routers, side by side in the same process and the same load:

- ``breaker``: default ``far`` (B over KServe V2), fallbacks [local], a circuit breaker
  (--failures in a row open it for --cooldown-s, doubled per failed probe up to
  --max-cooldown-s);
- ``nobreak``: the same over ``far-nb`` (another upstream model, same B: breakers are per
  target), with a breaker that never opens (failures 10^9): every request tries B first.

Open-loop load, --rate requests/s to each router and --rate/2 straight to ``local`` (the
reference latency), interleaved on one schedule. At --kill-at-s B fails; at --restart-at-s
it comes back. Modes:
- ``kill``: SIGKILL, then a new B on the same port (connection refused meanwhile: a failed
  attempt costs about a millisecond);
- ``stop``: SIGSTOP, then SIGCONT (a hung server: connections are accepted, nothing
  answers; a failed attempt costs the upstream's --timeout-ms).

Reported per router and phase (before / outage / after B is back): status counts (5xx),
latency p50 / p99, attempts per request (failed attempts at B + the one that answered), the
share answered by ``local``; the time to skip (kill -> the first request answered by
``local`` without a failed attempt first), failed attempts at B during the outage (from
Server-Timing, and A's ``sokuji_upstream_requests_total``), and the time to recover (B ready
-> the first request answered by B again). Every answer is checked (the text's length).

Writes the JSON (every request, the machine probe before and after) and a plot beside it
(latency against time, coloured by who answered, kill and recovery marked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import free_port, percentile
from machine import describe
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
ROUTERS = {"breaker": "far", "nobreak": "far-nb"}
"""router -> its upstream target."""
console = Console(width=150)


# -- the servers --------------------------------------------------------------------------------
class Proc:
    """``sokuji serve`` pinned with taskset on a fixed port: killed, stopped, started again."""

    def __init__(self, body: str, cores: str, cache_dir: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cfg = Path(tempfile.mkstemp(suffix=".toml")[1])
        self.cfg.write_text(f'port = {self.port}\ngrpc_port = 0\nlog_level = "error"\n'
                            f'cache_dir = "{cache_dir}"\n{body}')
        self.command = ["taskset", "-c", cores, sys.executable, "-m", "sokuji", "serve",
                        "--config", str(self.cfg)]
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        self.proc = subprocess.Popen(self.command, cwd=ROOT, stdout=subprocess.DEVNULL)

    def start(self) -> Proc:
        self.spawn()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}: {self.command}")
            try:
                with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)  # polling a child's start-up
        raise SystemExit(f"server not ready: {self.command}")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def close(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        if self.proc is not None:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.cfg.unlink(missing_ok=True)


def b_config(args: argparse.Namespace) -> str:
    return ('[cache]\nenabled = false\n[[models]]\nname = "enc"\nruntime = "synthetic"\n'
            f'warmup = false\noptions = {{ base_ms = {args.b_ms} }}\n')


def a_config(args: argparse.Namespace, b_url: str) -> str:
    body = ('[cache]\nenabled = false\n[[models]]\nname = "local"\nruntime = "synthetic"\n'
            f'warmup = false\nmax_batch_size = 8\noptions = {{ base_ms = {args.local_ms} }}\n')
    breakers = {"breaker": f"failures = {args.failures}, cooldown_s = {args.cooldown_s}, "
                           f"max_cooldown_s = {args.max_cooldown_s}",
                "nobreak": f"failures = 1000000000, cooldown_s = {args.cooldown_s}"}
    for router, target in ROUTERS.items():
        body += (f'[[models]]\nname = "{target}"\nruntime = "upstream"\n[models.options]\n'
                 f'protocol = "v2"\nurl = "{b_url}"\nupstream_model = "enc"\n'
                 f"timeout_ms = {args.timeout_ms}\nconnect_timeout_ms = {args.timeout_ms}\n"
                 f'[[models]]\nname = "{router}"\nruntime = "router"\n[models.options]\n'
                 f'kind = "rules"\ndefault = "{target}"\nfallbacks = ["local"]\n'
                 f"breaker = {{ {breakers[router]} }}\n")
    return body


# -- the load -----------------------------------------------------------------------------------
@dataclass
class Call:
    model: str
    text: str
    intended_s: float
    """Seconds from the start of the run."""
    sent_s: float = 0.0
    done_s: float = 0.0
    status: int = 0
    served_by: str = ""
    route: str = ""
    """Server-Timing's route description: who answered, why, the attempts before."""
    route_ms: float = 0.0
    ok: bool = False
    """A 200 with the right answer."""

    @property
    def latency_ms(self) -> float:
        return (self.done_s - self.intended_s) * 1e3

    @property
    def failed_attempts(self) -> int:
        return len(re.findall(r"\bfar(?:-nb)? (?:error|timeout|refused)", self.route))


ROUTE = re.compile(r'route;dur=([0-9.]+);desc="([^"]*)"')


async def send(session: aiohttp.ClientSession, base: str, call: Call, t0: float) -> None:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                        "data": [call.text]}]}
    call.sent_s = time.perf_counter() - t0
    try:
        async with session.post(f"{base}/v2/models/{call.model}/infer", json=body) as resp:
            call.status = resp.status
            call.served_by = resp.headers.get("x-sokuji-served-by", "")
            m = ROUTE.search(resp.headers.get("server-timing", ""))
            if m:
                call.route_ms, call.route = float(m.group(1)), m.group(2)
            data = await resp.read()
        if call.status == 200:
            call.ok = json.loads(data)["outputs"][0]["data"] == [float(len(call.text))]
    except (aiohttp.ClientError, TimeoutError) as exc:
        call.status, call.route = -1, type(exc).__name__
    call.done_s = time.perf_counter() - t0


async def until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0.002:
        await asyncio.sleep(delay - 0.002)
    while time.perf_counter() < t:
        await asyncio.sleep(0)


async def upstream_counts(session: aiohttp.ClientSession, a_url: str) -> dict[str, float]:
    """A's ``sokuji_upstream_requests_total`` by upstream (every code)."""
    async with session.get(f"{a_url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for m in re.finditer(r'^sokuji_upstream_requests_total\{([^}]*)\} ([0-9.e+]+)$', text,
                         re.M):
        up = re.search(r'upstream="([^"]+)"', m.group(1))
        if up:
            out[up.group(1)] = out.get(up.group(1), 0.0) + float(m.group(2))
    return out


async def scenario(args: argparse.Namespace, mode: str, a: Proc, b: Proc,
                   bar: Progress, task: Any) -> dict[str, Any]:
    """One outage under load. Returns the calls and the events' times (seconds from the
    start): kill, restart, ready (B answers again), breaker_open (first sample of the
    ``breaker`` router's target open)."""
    calls: list[Call] = []
    events: dict[str, float | None] = {"kill": None, "restart": None, "ready": None,
                                       "breaker_open": None}
    counts: dict[str, dict[str, float]] = {}
    pending: list[asyncio.Task[None]] = []
    # one schedule, interleaved: breaker, nobreak, (every other slot) local
    period = 1.0 / args.rate
    slots = int(args.seconds * args.rate)
    schedule: list[tuple[float, str]] = []
    for i in range(slots):
        t = i * period
        first, second = ("breaker", "nobreak") if i % 2 == 0 else ("nobreak", "breaker")
        schedule += [(t, first), (t + period / 3, second)]
        if i % 2 == 0:
            schedule.append((t + 2 * period / 3, "local"))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        t0 = time.perf_counter()

        async def outage() -> None:
            await until(t0 + args.kill_at_s)
            counts["before"] = await upstream_counts(session, a.url)
            events["kill"] = time.perf_counter() - t0
            b.signal(signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
            if mode == "kill":
                await asyncio.to_thread(b.proc.wait, 10)  # type: ignore[union-attr]
            await until(t0 + args.restart_at_s)
            counts["outage"] = await upstream_counts(session, a.url)
            events["restart"] = time.perf_counter() - t0
            if mode == "kill":
                b.spawn()
            else:
                b.signal(signal.SIGCONT)
            while True:  # B is back when it answers its health check
                try:
                    async with session.get(f"{b.url}/v2/health/ready",
                                           timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200:
                            break
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.01)
            events["ready"] = time.perf_counter() - t0

        async def watch() -> None:
            while time.perf_counter() - t0 < args.seconds:
                async with session.get(f"{a.url}/metrics") as resp:
                    text = await resp.text()
                if events["kill"] is not None and events["breaker_open"] is None and \
                        f'sokuji_breaker_state{{target="{ROUTERS["breaker"]}"}} 2.0' in text:
                    events["breaker_open"] = time.perf_counter() - t0
                await asyncio.sleep(0.05)

        side = [asyncio.create_task(outage()), asyncio.create_task(watch())]
        for i, (t, model) in enumerate(schedule):
            await until(t0 + t)
            call = Call(model, f"{'x' * (1 + i % 50)} {mode} {i}", t)
            calls.append(call)
            pending.append(asyncio.create_task(send(session, a.url, call, t0)))
            if i % 20 == 0:
                bar.update(task, now=f"{mode}: t={t:4.1f} s")
        await asyncio.gather(*pending, *side)
        counts["after"] = await upstream_counts(session, a.url)
    bar.advance(task)
    return {"calls": calls, "events": events, "upstream_attempts": counts}


# -- the figures --------------------------------------------------------------------------------
def phase_stats(calls: list[Call]) -> dict[str, Any]:
    if not calls:
        return {"n": 0}
    lat = [c.latency_ms for c in calls]
    statuses: dict[str, int] = {}
    for c in calls:
        statuses[str(c.status)] = statuses.get(str(c.status), 0) + 1
    return {"n": len(calls), "statuses": statuses,
            "5xx": sum(1 for c in calls if c.status >= 500 or c.status < 0),
            "wrong": sum(1 for c in calls if c.status == 200 and not c.ok),
            "p50_ms": statistics.median(lat), "p99_ms": percentile(lat, 99),
            "mean_ms": statistics.fmean(lat), "max_ms": max(lat),
            "attempts_per_request": statistics.fmean(c.failed_attempts + 1 for c in calls),
            "requests_with_failed_attempt": sum(1 for c in calls if c.failed_attempts),
            "local_share": sum(1 for c in calls if c.served_by == "local") / len(calls)}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    calls: list[Call] = run["calls"]
    ev = run["events"]
    kill, ready = ev["kill"], ev["ready"]
    opened = ev["breaker_open"] or ready
    out: dict[str, Any] = {"events_s": ev}
    counts = run["upstream_attempts"]
    local = [c for c in calls if c.model == "local"]
    out["local_direct"] = {p: phase_stats([c for c in local if lo <= c.intended_s < hi])
                           for p, (lo, hi) in {"before": (0, kill), "outage": (kill, ready),
                                               "after": (ready, 1e9)}.items()}
    for router, target in ROUTERS.items():
        mine = [c for c in calls if c.model == router]
        phases = {"before": [c for c in mine if c.done_s < kill],
                  "in_flight_at_kill": [c for c in mine if c.sent_s <= kill < c.done_s],
                  "outage": [c for c in mine if kill < c.sent_s < ready],
                  # the same window for both: once the breaker router's target is open
                  "outage_after_open": [c for c in mine if opened <= c.sent_s < ready],
                  "after": [c for c in mine if c.sent_s >= ready]}
        skip = next((c.sent_s - kill for c in phases["outage"]
                     if c.served_by == "local" and not c.failed_attempts), None)
        back = next((c.sent_s - ready for c in phases["after"] if c.served_by == target),
                    None)
        out[router] = {
            "phases": {p: phase_stats(cs) for p, cs in phases.items()},
            "time_to_skip_s": skip,
            "time_to_recover_s": back,
            "failed_attempts_in_outage": sum(c.failed_attempts for c in phases["outage"]
                                             + phases["in_flight_at_kill"]),
            "upstream_http_attempts_in_outage":
                counts.get("outage", {}).get(target, 0.0) - counts.get("before", {}).get(
                    target, 0.0),
            "5xx_total": sum(1 for c in mine if c.status >= 500 or c.status < 0),
            "5xx_beyond_in_flight": sum(1 for c in mine if (c.status >= 500 or c.status < 0)
                                        and not c.sent_s <= kill < c.done_s),
        }
    ratios: dict[str, float | None] = {}
    for phase in ("outage", "outage_after_open"):
        b, n = out["breaker"]["phases"][phase], out["nobreak"]["phases"][phase]
        for stat in ("p50_ms", "p99_ms", "mean_ms"):
            ratios[f"{phase}_{stat[:-3]}_breaker_over_nobreak"] = _div(b.get(stat),
                                                                       n.get(stat))
    ratios["failed_attempts_breaker_over_nobreak"] = _div(
        out["breaker"]["failed_attempts_in_outage"], out["nobreak"]["failed_attempts_in_outage"])
    ratios["outage_after_open_p50_breaker_over_local_direct"] = _div(
        out["breaker"]["phases"]["outage_after_open"].get("p50_ms"),
        out["local_direct"]["outage"].get("p50_ms"))
    out["ratios"] = ratios
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_report(report: dict[str, Any]) -> None:
    for key, s in report["summaries"].items():
        ev = s["events_s"]
        table = Table(title=f"{key}: B fails at {ev['kill']:.2f} s, back (ready) at "
                            f"{_fmt(ev['ready'], '.2f')} s; breaker opened at "
                            f"{_fmt(ev['breaker_open'], '.2f')} s")
        for col in ("router", "phase", "n", "5xx", "wrong", "p50 ms", "p99 ms", "mean ms",
                    "attempts/req", "with failed attempt", "by local"):
            table.add_column(col, justify="right")
        rows = [(r, s[r]["phases"]) for r in ROUTERS] + [("local direct", s["local_direct"])]
        for router, phases in rows:
            for phase, p in phases.items():
                if not p.get("n"):
                    continue
                table.add_row(router, phase, str(p["n"]), str(p["5xx"]), str(p["wrong"]),
                              _fmt(p["p50_ms"]), _fmt(p["p99_ms"]), _fmt(p["mean_ms"]),
                              _fmt(p["attempts_per_request"], ".2f"),
                              str(p["requests_with_failed_attempt"]),
                              f"{p['local_share']:.0%}")
        console.print(table)
        for router in ROUTERS:
            r = s[router]
            console.print(
                f"  {router:<8} time to skip {_fmt(r['time_to_skip_s'], '.3f')} s, failed "
                f"attempts at B in the outage {r['failed_attempts_in_outage']} (A's upstream "
                f"HTTP attempts {r['upstream_http_attempts_in_outage']:.0f}), time to "
                f"recover {_fmt(r['time_to_recover_s'], '.3f')} s, 5xx {r['5xx_total']} "
                f"({r['5xx_beyond_in_flight']} beyond those in flight at the kill)")
        console.print("  ratios: " + ", ".join(f"{k} {_fmt(v, '.3f')}"
                                                 for k, v in s["ratios"].items()))


def plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(len(runs), 2, figsize=(15, 4.2 * len(runs)), squeeze=False,
                             sharey="row")
    colours = {"upstream": "tab:blue", "local, no failed attempt": "tab:green",
               "local after a failed attempt": "tab:orange", "error": "tab:red"}
    for row, (key, run) in zip(axes, runs.items(), strict=True):
        ev = run["events"]
        for ax, router in zip(row, ROUTERS, strict=True):
            groups: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in colours}
            for c in run["calls"]:
                if c["model"] != router:
                    continue
                failed = len(re.findall(r"\bfar(?:-nb)? (?:error|timeout|refused)",
                                        c["route"]))
                kind = ("error" if c["status"] != 200 else "upstream"
                        if c["served_by"] == ROUTERS[router] else
                        "local after a failed attempt" if failed else
                        "local, no failed attempt")
                groups[kind][0].append(c["intended_s"])
                groups[kind][1].append(max((c["done_s"] - c["intended_s"]) * 1e3, 0.1))
            for kind, (xs, ys) in groups.items():
                if xs:
                    ax.scatter(xs, ys, s=9, color=colours[kind], label=kind)
            for name, style in (("kill", "k-"), ("ready", "k--"), ("breaker_open", "r:")):
                if ev.get(name) is not None and (name != "breaker_open" or
                                                 router == "breaker"):
                    ax.axvline(ev[name], color=style[0], linestyle=style[1:],
                               label={"kill": "B fails", "ready": "B back",
                                      "breaker_open": "breaker open"}[name])
            ax.set(yscale="log", xlabel="seconds (intended send time)",
                   ylabel="latency (ms)", title=f"{key}: router '{router}'")
            ax.legend(fontsize=7, loc="upper right")
    fig.suptitle("Upstream failure under load: circuit breaker vs a failed attempt on every "
                 "request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="kill,stop", help="kill (SIGKILL, restart), stop "
                    "(SIGSTOP, SIGCONT)")
    ap.add_argument("--rounds", type=int, default=1, help="each mode this many times")
    ap.add_argument("--rate", type=float, default=20.0, help="requests/s to each router")
    ap.add_argument("--seconds", type=float, default=16.0)
    ap.add_argument("--kill-at-s", type=float, default=3.0)
    ap.add_argument("--restart-at-s", type=float, default=9.0)
    ap.add_argument("--failures", type=int, default=3)
    ap.add_argument("--cooldown-s", type=float, default=2.0)
    ap.add_argument("--max-cooldown-s", type=float, default=4.0)
    ap.add_argument("--timeout-ms", type=float, default=500.0,
                    help="the upstreams' connect and attempt timeout")
    ap.add_argument("--b-ms", type=float, default=2.0, help="B's service time")
    ap.add_argument("--local-ms", type=float, default=2.0, help="local's service time")
    ap.add_argument("--server-cores", default="1", help="taskset CPU list: A and B")
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "failover.json"))
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.client_core})
    modes = [m for m in args.modes.split(",") if m]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"benchmark": "failover", "command": " ".join(sys.argv),
                              "args": vars(args), "machine_before": describe(), "runs": {},
                              "summaries": {}}
    began = time.monotonic()
    bad = 0
    with tempfile.TemporaryDirectory() as tmp, Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[now]}"),
            TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("failover", total=len(modes) * args.rounds, now="")
        for r in range(args.rounds):
            for mode in modes:
                bar.update(task, now=f"{mode}: starting servers")
                b = Proc(b_config(args), args.server_cores, f"{tmp}/b").start()
                a = Proc(a_config(args, b.url), args.server_cores, f"{tmp}/a")
                try:
                    a.start()
                    asyncio.run(_warm(a.url))
                    run = asyncio.run(scenario(args, mode, a, b, bar, task))
                finally:
                    a.close()
                    b.close()
                key = f"{mode}" if args.rounds == 1 else f"{mode} #{r + 1}"
                report["summaries"][key] = summarize(run)
                report["runs"][key] = {"events": run["events"],
                                       "upstream_attempts": run["upstream_attempts"],
                                       "calls": [asdict(c) for c in run["calls"]]}
                bad += sum(1 for c in run["calls"] if c.status == 200 and not c.ok)
    report["seconds"] = round(time.monotonic() - began, 1)
    report["machine_after"] = describe()
    print_report(report)
    out.write_text(json.dumps(report))
    png = out.with_suffix(".png")
    plot(png, report)
    console.print(f"raw figures: {out}; plot: {png}")
    if bad:
        console.print(f"[red]{bad} wrong answers[/red]")
    return 1 if bad else 0


async def _warm(base: str) -> None:
    """Each router once through its upstream (pooled connections, breakers closed)."""
    async with aiohttp.ClientSession() as session:
        for i in range(5):
            for model in (*ROUTERS, "local"):
                await send(session, base, Call(model, f"warm {i}", 0.0), time.perf_counter())


if __name__ == "__main__":
    sys.exit(main())

"""Canary rollouts (issue 15, item 5): how fast a bad canary is rolled back, what clients
see meanwhile, how often a good one is rolled back by mistake; Sokuji's checks against live
stable beside a Flagger-style absolute-threshold analysis of the same traffic.

    flock /tmp/sokuji-bench.lock .venv/bin/python benchmarks/canary.py [--quick]
        [--server-core 1] [--client-core 0] [--out benchmarks/results/canary.json]
                                      (~8 minutes; --quick ~4; writes the JSON and a .png)

(i) REAL SERVER per cell (fault x weight x rate), open-loop load; each request goes to three
canary routers over their own copies of two synthetic models (lognormal, mean 2 ms), seeded
alike so they split the traffic alike; ``--degrade-after-s`` after load the canary fails
every request (``broken``) or takes 200 ms more (``slow``). ``sokuji``: default breaker, as a
user writes it; ``sokuji, breaker off``: the controller sees every canary request;
``observe``: never judges, and a Flagger-style analysis (fluxcd.io/flagger/usage/metrics)
runs on its requests: every interval (= ``--window-s``) the canary's requests of that
interval need success >= 99% and p99 <= 500 ms (Flagger's example) or 50 ms (tuned here); no
data halts; rollback at the ``--flagger-checks``-th failure (its examples use 5-10: 2 favours
it); its first check after the degradation at 10 phases spread over an interval (median); no
per-request fallback, so each canary failure before its rollback reaches a client (Sokuji
answers them from stable). Times from the server's log.

(ii) A/A, SIMULATED (a real server would need hours per cell): canary = stable's twin (1%
errors, same latency); ``CanaryController`` driven directly (fake clock, Poisson traffic,
each request recorded and judged as the router does, plus its 1 s timer), Flagger on the
same traffic; a rollout is ``--aa-steps`` windows, any rollback in it false (Wilson 95%).
Figures depend on alpha, min_samples (20), min_failures (3), the window, canary requests per
window, the evaluation cadence, the breaker and the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import free_port
from machine import describe
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sokuji.routing.canary import CanaryController
from sokuji.routing.config import CanaryOptions
from sokuji.routing.stats import wilson

ROOT = Path(__file__).resolve().parent.parent
console = Console(width=160)
ROUTERS = {"sokuji": "a", "sokuji, breaker off": "c", "observe": "b"}
NAMES = {label: f"{label.split(',')[0]}{x}" for label, x in ROUTERS.items()}
FAULTS = {"broken": "degrade_error_rate = 1.0", "slow": "degrade_extra_ms = 200.0"}
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
PHASES = 10
Row = dict[str, Any]


class Req(NamedTuple):
    t: float  # completion: epoch s, simulated s in (ii)
    canary: bool
    ok: bool
    ms: float


def flagger(reqs: list[Req], start: float, end: float, interval: float, checks: int,
            min_success: float, max_p99_ms: float) -> float | None:
    """When Flagger would roll back: checks at ``start + k * interval`` on the canary's last
    interval (no requests: halt), rollback at the ``checks``-th failure; None: not by end."""
    canary = sorted((r for r in reqs if r.canary), key=lambda r: r.t)
    failed, t = 0, start + interval
    while t <= end:
        window = [r for r in canary if t - interval < r.t <= t]
        if window:
            lat = sorted(r.ms for r in window)
            p99 = lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]
            success = 100.0 * sum(r.ok for r in window) / len(window)
            failed += success < min_success or p99 > max_p99_ms
            if failed >= checks:
                return t
        t += interval
    return None


def server_config(port: int, tmp: str, fault: str, weight: float, args: argparse.Namespace,
                  seed: int) -> str:
    body = [f'port = {port}\ngrpc_port = 0\nlog_level = "info"\ncache_dir = "{tmp}"\n']
    for label, x in ROUTERS.items():
        degrade = f", degrade_after_s = {args.degrade_after_s}, {FAULTS[fault]}"
        for name, extra in ((f"v1{x}", ""), (f"v2{x}", degrade)):
            body.append(f'[[models]]\nname = "{name}"\nruntime = "synthetic"\ncache = false\n'
                        'inline_max_ms = 0\noptions = { base_ms = 2.0, distribution = '
                        f'"lognormal", sigma = 0.5, seed = {seed}{extra} }}\n')
        judge = "min_samples = 20, min_failures = 3" if label != "observe" else \
            "min_samples = 1000000000, min_failures = 1000000000, max_hold_windows = 1000000"
        breaker = "" if label == "sokuji" else ", breaker = { failures = 1000000 }"
        body.append(f'[[models]]\nname = "{NAMES[label]}"\nruntime = "router"\ncache = false\n'
                    f'options = {{ kind = "canary"{breaker}, canary = {{ stable = "v1{x}", '
                    f'canary = "v2{x}", steps = [{weight}], window_s = {args.window_s}, '
                    f'alpha = {args.alpha}, seed = {seed}, {judge} }} }}\n')
    return "".join(body)


@contextmanager
def serve(config: str, port: int, tmp: str, core: int) -> Iterator[tuple[str, Path]]:
    """``sokuji serve`` pinned to ``core``, its log (level info) in a file."""
    cfg, log, url = Path(tmp) / "sokuji.toml", Path(tmp) / "server.log", f"http://127.0.0.1:{port}"
    cfg.write_text(config)
    with log.open("wb") as sink:
        proc = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-m", "sokuji",
                                 "serve", "--config", str(cfg)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=sink)
        try:
            while True:
                with suppress(OSError), urllib.request.urlopen(url + "/v2/health/ready", timeout=1):
                    break
                if proc.poll() is not None:
                    raise RuntimeError(f"no server: {log.read_text()[-2000:]}")
                time.sleep(0.1)  # polling a child's start-up
            yield url, log
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def log_time(log: Path, needle: str) -> tuple[float | None, str]:  # epoch s, the line
    for line in log.read_text().splitlines():
        m = LOG_TIME.match(line)
        if m and needle in line:
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), line
    return None, ""


async def open_loop(url: str, routers: list[str], rate: float,
                    seconds: float) -> tuple[dict[str, list[Row]], float]:
    """Request k to every router at ``k / rate``: the answers, the largest lag behind that."""
    import aiohttp

    out: dict[str, list[Row]] = {r: [] for r in routers}
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}

    async def one(session: aiohttp.ClientSession, router: str) -> None:
        answer: Row = {"status": 0, "by": "", "route": "", "ms": 0.0}
        try:
            async with session.post(f"{url}/v2/models/{router}/infer", json=body) as r:
                await r.read()
                timing = r.headers.get("server-timing", "")
                route = re.search(r'route;[^,]*?desc="([^"]*)"', timing)
                total = re.search(r"total;dur=([\d.]+)", timing)
                answer.update(status=r.status, by=r.headers.get("x-sokuji-served-by", ""),
                              route=route.group(1) if route else "",
                              ms=float(total.group(1)) if total else 0.0)
        except aiohttp.ClientError:
            pass  # status 0: counted as an error
        out[router].append({**answer, "done": time.time()})

    slip, tasks, start = 0.0, [], time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=30)) as session:
        for k in range(int(rate * seconds)):
            delay = start + k / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            slip = max(slip, -delay)
            tasks += [asyncio.create_task(one(session, r)) for r in routers]
        await asyncio.gather(*tasks)
    return out, slip


def run_cell(args: argparse.Namespace, fault: str, weight: float, rate: float,
             seed: int) -> Row:
    seconds, port = args.degrade_after_s + args.flagger_checks * args.window_s + 1.5, free_port()
    with tempfile.TemporaryDirectory() as tmp:
        with serve(server_config(port, tmp, fault, weight, args, seed), port, tmp,
                   args.server_core) as (url, log):
            answers, slip = asyncio.run(open_loop(url, list(NAMES.values()), rate, seconds))
        row: Row = {"fault": fault, "weight": weight, "rate": rate, "client_slip_s": slip}
        for label, x in ROUTERS.items():
            name, canary = NAMES[label], f"v2{x}"
            loaded = log_time(log, f"model {canary} loaded")[0] or math.nan
            degraded, reqs = loaded + args.degrade_after_s, []
            for a in answers[name]:
                failed = re.search(rf"\b{canary} error ([\d.]+)ms", a["route"])
                reqs.append(Req(a["done"], a["by"] == canary or failed is not None,
                                a["status"] == 200 and failed is None,
                                float(failed.group(1)) if failed else a["ms"]))
            slow = [r for r in reqs if r.canary and r.ok and r.t > degraded]
            if label != "observe":
                rolled, line = log_time(log, f"canary {name} rolled back")
                row[label] = {
                    "rollback_s": None if rolled is None else round(rolled - degraded, 3),
                    "promoted": bool(log_time(log, f"canary {name} promoted")[1]), "log": line[24:],
                    "canary_failures": sum(1 for r in reqs if r.canary and not r.ok),
                    "skipped_open": sum(f"{canary} open" in a["route"] for a in answers[name]),
                    "client_errors": sum(a["status"] != 200 for a in answers[name]),
                    "slow_answers": len(slow)}
                continue
            for limit in args.flagger_p99_ms:
                runs = []
                for j in range(PHASES):  # its first check (j + 0.5) I / PHASES after degrading
                    t = flagger(reqs, degraded + (j + 0.5 - PHASES) * args.window_s / PHASES,
                                reqs[-1].t, args.window_s, args.flagger_checks,
                                args.flagger_min_success[0], limit)
                    until = math.inf if t is None else t
                    runs.append((None if t is None else t - degraded,
                                 sum(1 for r in reqs if r.canary and not r.ok and r.t <= until),
                                 sum(1 for r in slow if r.t <= until)))
                times = [r[0] for r in runs if r[0] is not None]
                row[f"flagger p99<={limit:g}ms"] = {
                    "rollback_s": round(statistics.median(times), 3)
                    if len(times) > PHASES // 2 else None, "phases_rolled_back": len(times),
                    "client_errors": statistics.median(r[1] for r in runs),
                    "slow_answers": statistics.median(r[2] for r in runs)}
    return row


def aa_cell(args: argparse.Namespace, weight: float, rate: float, seed: int) -> Row:
    rng, mu = random.Random(seed), math.log(2e-3) - 0.5 ** 2 / 2
    steps, window, horizon = args.aa_steps, args.window_s, args.aa_steps * args.window_s + 0.5
    tally: defaultdict[str, Counter[str]] = defaultdict(Counter)  # sokuji's first, as updated
    now = [0.0]
    for _ in range(args.aa_rollouts):
        now[0] = 0.0  # before the controllers: their first step starts at their creation
        ctl = {f"sokuji alpha={a:g}": CanaryController("aa", CanaryOptions(
            stable="s", canary="c", steps=(weight,) * steps, window_s=window, min_samples=20,
            min_failures=3, alpha=a), clock=lambda: now[0]) for a in args.aa_alphas}
        reqs, t, tick = [], 0.0, 1.0
        while t < horizon:
            t += rng.expovariate(rate)
            arm = "canary" if rng.random() * 100 < weight else "stable"
            ok, lat = rng.random() >= args.aa_error_rate, rng.lognormvariate(mu, 0.5)
            reqs.append(Req(t + lat, arm == "canary", ok, lat * 1e3))
            running = [c for c in ctl.values() if c.state == "running"]
            while tick <= t:  # the router's 1 s timer
                now[0], tick = tick, tick + 1.0
                for c in running:
                    c.evaluate()
            now[0] = t
            for c in running:
                c.record(arm, ok, lat)
                c.evaluate()
        for label, c in ctl.items():
            tally[label].update(
                rollouts=1, checks=sum(c.checks.values()), holds=c.checks["hold"],
                passed=c.step + (c.state == "promoted"), rollbacks=c.state == "rolled_back",
                windows=c.step + 1 if c.state == "rolled_back" else steps,
                **{"reason:" + c.reason.split(":")[0]: 1} if c.state == "rolled_back" else {})
        for s in args.flagger_min_success:
            tally[f"flagger success>={s:g}%"].update(rollouts=1, rollbacks=flagger(
                reqs, 0.0, horizon, window, args.flagger_checks, s,
                args.flagger_p99_ms[0]) is not None)
    row: Row = {"weight": weight, "rate": rate, "rollouts": args.aa_rollouts, "steps": steps}
    for label, acc in tally.items():
        k, n, w, checks = acc["rollbacks"], acc["rollouts"], acc["windows"], acc["checks"]
        row[label] = {"false_rollbacks": k, "per_rollout": k / n, "per_rollout_ci": wilson(k, n)}
        if w:
            row[label].update(
                per_window=k / w, per_window_ci=wilson(k, w), windows=w,
                checks_per_window=checks / w, steps_passed=acc["passed"] / n,
                naive_bound=min(1.0, float(label.split("=")[1]) * checks / w),
                hold_share=acc["holds"] / max(1, checks),
                reasons={r[7:]: v for r, v in acc.items() if r.startswith("reason:")})
    return row


def contenders(rows: list[Row]) -> list[str]:
    return [k for k in rows[0] if isinstance(rows[0][k], dict)] if rows else []


def table(title: str, rows: list[Row], head: list[str], cell: Any) -> None:
    keys, t = contenders(rows), Table(title=title)
    for col in (*head, *keys):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(*(f"{r[h]:g}" if isinstance(r[h], float) else r[h] for h in head),
                  *(cell(r, r[k]) for k in keys))
    console.print(t)


def cell_i(r: Row, v: Row) -> str:
    broken, s = r["fault"] == "broken", v["rollback_s"]
    return ("-" if s is None else f"{s:.2f}") + \
        f" / {v['client_errors' if broken else 'slow_answers']:g}" + \
        (" PROMOTED" if v.get("promoted") else "") + \
        (f" ({v['canary_failures']} failed, {v['skipped_open']} skipped)"
         if broken and "canary_failures" in v else "")


def cell_ii(r: Row, v: Row) -> str:
    (lo, hi), holds = v["per_rollout_ci"], v.get("hold_share")
    return f"{v['false_rollbacks']}/{r['rollouts']} [{lo:.2f}-{hi:.2f}]" + \
        ("" if holds is None else f" holds {holds:.0%}, {v['steps_passed']:.1f} passed")


def plot(rows_i: list[Row], rows_ii: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(19, 5.5))
    for ax, fault in zip(axes[:2], FAULTS, strict=True):
        rows = [r for r in rows_i if r["fault"] == fault]
        for k, rate in [(k, rate) for k in contenders(rows)
                        for rate in sorted({r["rate"] for r in rows})]:
            pts = [(r["weight"], r[k]["rollback_s"]) for r in rows
                   if r["rate"] == rate and r[k]["rollback_s"] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), "-o" if rate == rows[0]["rate"] else "--s",
                        label=f"{k}, {rate:g} req/s")
        ax.set(title=f"{fault} canary (real server)", xlabel="canary weight (%)", yscale="log",
               ylabel="s from degrading to rollback")
    for i, k in enumerate(contenders(rows_ii)):
        ys = [r[k]["per_rollout"] for r in rows_ii]
        err = [[abs(y - r[k]["per_rollout_ci"][j]) for y, r in zip(ys, rows_ii, strict=True)]
               for j in (0, 1)]
        axes[2].errorbar([j + i * 0.15 for j in range(len(ys))], ys, yerr=err, fmt="o",
                         label=k)
    axes[2].set(title="A/A false rollbacks per rollout (simulated, Wilson 95%)", xticks=range(
        len(rows_ii)), xticklabels=[f"{r['weight']:g}%\n{r['rate']:g}/s" for r in rows_ii])
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="weights 5,50; 30 A/A rollouts")
    ap.add_argument("--skip", choices=("i", "ii"), default=None)
    for flag, kind, default in [
            ("--weights", floats, [5.0, 25.0, 50.0]), ("--rates", floats, [20.0, 100.0]),
            ("--faults", str, "broken,slow"), ("--window-s", float, 10.0),
            ("--alpha", float, 1e-3), ("--degrade-after-s", float, 4.0),
            ("--flagger-checks", int, 2), ("--flagger-min-success", floats, [99.0, 98.0]),
            ("--flagger-p99-ms", floats, [500.0, 50.0]), ("--aa-rollouts", int, 100),
            ("--aa-steps", int, 10), ("--aa-alphas", floats, [1e-3, 1e-4]),
            ("--aa-error-rate", float, 0.01), ("--server-core", int, 1),
            ("--client-core", int, 0),
            ("--out", str, str(ROOT / "benchmarks" / "results" / "canary.json"))]:
        ap.add_argument(flag, type=kind, default=default)  # type: ignore[arg-type]
    args = ap.parse_args()
    if args.quick:
        args.weights, args.aa_rollouts = [5.0, 50.0], 30
    os.sched_setaffinity(0, {args.client_core})
    machine, t0 = describe(), time.perf_counter()
    rows_i: list[Row] = []
    rows_ii: list[Row] = []
    cells = [(w, r) for w in args.weights for r in args.rates]
    jobs = [(f"(i) {f} {w:g}% {r:g} req/s", rows_i, partial(run_cell, args, f, w, r, k))
            for k, (f, (w, r)) in enumerate((f, c) for f in args.faults.split(",")
                                            for c in cells) if args.skip != "i"]
    jobs += [(f"(ii) A/A {w:g}% {r:g} req/s", rows_ii, partial(aa_cell, args, w, r, 1000 + k))
             for k, (w, r) in enumerate(cells) if args.skip != "ii"]
    logging.getLogger("sokuji.routing.canary").setLevel(logging.ERROR)  # (ii): 1000s of lines
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn(
            "{task.completed}/{task.total}"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("", total=len(jobs))
        for description, rows, job in jobs:
            bar.update(task, description=description)
            rows.append(job())
            bar.advance(task)
    table("(i) REAL SERVER: s from the canary degrading to its rollback / client-visible bad "
          "answers (broken: errors; slow: +200 ms)", rows_i, ["fault", "weight", "rate"], cell_i)
    table(f"(ii) SIMULATED A/A: false rollbacks per rollout of {args.aa_steps} windows [Wilson 95%]"
          " (holds: share of checks; steps passed)", rows_ii, ["weight", "rate"], cell_ii)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "args": vars(args), "machine_before": machine, "machine_after": describe(probe=False),
        "wall_s": round(time.perf_counter() - t0, 1), "time_to_rollback": rows_i,
        "aa_false_rollbacks": rows_ii, "notes": "(ii) is SIMULATED (see the docstring)"},
        indent=1))
    plot(rows_i, rows_ii, out.with_suffix(".png"))
    console.print(f"wrote {out} and .png in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

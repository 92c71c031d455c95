"""The Python kind (``runtime = "python"``) under load: one user class served by Sokuji,
LitServe, Ray Serve, BentoML and plain FastAPI, against the class's ``predict`` called
directly (issue 27, item 6).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/python_serving.py [--quick] [--parts ...]
    (full ~12 minutes, --quick ~3)

The class (``_python_model.py``, ``BreastCancer``): a standard-scaled logistic regression
trained at setup on scikit-learn's bundled breast-cancer data, with a little feature code,
``predict(list of dicts) -> list of dicts`` vectorised over the batch (one scikit-learn call a
batch; scikit-learn's per-call overhead dominates one row, so batching pays). Every contender
runs exactly this class (``_python_peers.py`` and the files it names):

- ``sokuji``: ``runtime = "python"``, ``options.entry = "benchmarks/_python_model.py:
  BreastCancer"``, ``workers = 0`` (``predict`` in the server's threads, or on the event loop
  for a lone request), V2 JSON (``POST /v2/models/breast/infer``, FP64 [1, 30]);
  ``sokuji_w1``: the same class with ``workers = 1`` (a worker process: what the process hop
  costs); ``sokuji_predict``: the plain JSON route (``/v2/models/breast/predict``) with the
  peers' very body (c=1 only).
- ``fastapi``: a ``def`` endpoint, Pydantic request model, one ``predict`` of one item a
  request, no batching. ``litserve``: ``LitAPI`` with ``max_batch_size`` / ``batch_timeout``.
  ``ray``: ``@serve.deployment`` + ``@serve.batch`` on a local cluster (HAProxy fast path).
  ``bentoml``: ``@bentoml.service`` + ``@bentoml.api(batchable=True)``, in a side venv that
  ``setup_bentoml.sh`` makes (skipped, saying why, when it cannot). The peers get
  ``{"features": [[30 numbers]]}`` on ``POST /predict``: the same 30 numbers as Sokuji's V2
  body, one dataset row a request, the rows in turn.

Every server (and the direct call) is pinned to the server core, this process (the load
generator) to the client core. Batching contenders get the same max batch size and batch
wait (``--max-batch``, ``--batch-wait-ms``; BentoML's adaptive window has no wait setting:
its ``max_latency_ms`` stays at its default). A Ray cluster idles at ~11% of a core and
LitServe's worker at ~18% (``ISOLATED``; each server's idle share is measured and recorded),
so each of those two is measured in a phase of its own, with Sokuji and the direct call
beside it at c=1; Sokuji, FastAPI and BentoML are up at once.

Parts (``--parts``, all by default):
- ``c1``: concurrency 1 over one keep-alive connection (``_harness.C1Client``), contenders
  alternating chunk by chunk with ``predict`` called directly in a process on the server core
  (``_python_direct.py``); added ms = contender - direct at p50 and p99 (target <= 0.3 ms for
  Sokuji in-thread; ``sokuji_w1`` says what the process hop costs); Sokuji's ``Server-Timing``
  stages; the HTTP floor (uvicorn answering as many bytes with no model) for scale.
- ``goodput``: open-loop Poisson load swept per server under a p99 SLO (``_goodput_search``:
  the search, verdicts, CPU probes and settling of ``goodput.py``), steps of the contenders
  interleaved; Sokuji against each peer and the best one (target >= 1.5x). Plot.
- ``profile``: py-spy samples of the Sokuji server, at c=1 and under a closed loop: where its
  time goes.

Writes JSON (``--out``; the machine probe of ``machine.py`` included) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine
from _goodput_search import Search, probed_run, settle
from _harness import C1Client, closed_loop
from _python_direct import DirectModel
from _python_model import load_rows
from goodput import source_tree
from tensor_serving import (
    GroupServer,
    Wire,
    WireTarget,
    bucket_of,
    capacity,
    one_call,
    plot,
    summary_ms,
    uvicorn_cmd,
)

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
MODEL = "breast"
ENTRY = "benchmarks/_python_model.py:BreastCancer"
TARGETS = {"c1_added_ms": 0.3, "goodput_over_best_peer": 1.5}
PEERS = ("fastapi", "litserve", "ray", "bentoml")
BENTO_VENV = ROOT / ".cache" / "bench-venvs" / "bentoml"
JSON_HEADERS = {"content-type": "application/json"}


# --- requests ------------------------------------------------------------------------------

def wires() -> dict[str, Wire]:
    """Every contender's requests: the dataset's rows, one a request, the same numbers in
    V2 JSON (Sokuji) and in the peers' plain body."""
    rows = [r.tolist() for r in load_rows()]
    v2 = [json.dumps({"inputs": [{"name": "features", "datatype": "FP64",
                                  "shape": [1, len(r)], "data": r}]}).encode() for r in rows]
    plain = [json.dumps({"features": [r]}).encode() for r in rows]
    return {"sokuji": Wire(f"/v2/models/{MODEL}/infer", JSON_HEADERS, v2),
            "sokuji_w1": Wire(f"/v2/models/{MODEL}_w1/infer", JSON_HEADERS, v2),
            "sokuji_predict": Wire(f"/v2/models/{MODEL}/predict", JSON_HEADERS, plain),
            "peer": Wire("/predict", JSON_HEADERS, plain)}


def wire_of(name: str, w: dict[str, Wire]) -> Wire:
    return w[name] if name in w else w["peer"]


# --- servers -------------------------------------------------------------------------------

class TreeServer(GroupServer):
    """A ``GroupServer`` whose processes may leave its process group and its tree (Ray's
    actors start sessions of their own, HAProxy is restarted by its manager): its processes
    are found by a marker in their environment as well (``_ray_contender``'s way), counted
    as the server's, and killed if they outlive the group's stop."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.mark = f"PY_BENCH_MARK={os.getpid()}-{id(self)}-{time.monotonic_ns()}"
        self.command[3:3] = ["env", self.mark]  # after "taskset -c CORE"

    def pids(self) -> tuple[int, ...]:
        found = set(super().pids())
        needle = self.mark.encode() + b"\0"
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if needle in (d / "environ").read_bytes() + b"\0":
                        found.add(int(d.name))
                except OSError:
                    continue
        assert self.proc is not None
        found.discard(self.proc.pid)
        return tuple(sorted(found))

    def __exit__(self, *exc: object) -> None:
        left = self.pids()
        super().__exit__(*exc)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def sokuji_config(args: argparse.Namespace, port: int) -> str:
    models = "".join(f"""
[[models]]
name = "{name}"
runtime = "python"
cache = false
max_batch_size = {args.max_batch}
max_queue_delay_ms = {args.batch_wait_ms}
options = {{ entry = "{ENTRY}", workers = {workers} }}
""" for name, workers in ((MODEL, 0), (f"{MODEL}_w1", 1)))
    return f"""
port = {port}
grpc_port = 0
cache_dir = "{args.cache_dir}"
log_level = "warning"
{models}"""


def peer_env(args: argparse.Namespace) -> list[str]:
    return ["env", f"PY_PEER_MAX_BATCH={args.max_batch}",
            f"PY_PEER_TIMEOUT_S={args.batch_wait_ms / 1e3}"]


def make_server(name: str, args: argparse.Namespace) -> GroupServer:
    from _harness import free_port

    port = free_port()
    timeout = str(args.batch_wait_ms / 1e3)
    if name == "sokuji":
        return GroupServer(args, [sys.executable, "-m", "sokuji", "serve"], port,
                           config=sokuji_config(args, port))
    if name == "fastapi":
        return GroupServer(args, [*peer_env(args), *uvicorn_cmd("_python_peers:fastapi_app",
                                                                port)],
                           port, ready_path="/health")
    if name == "litserve":
        return GroupServer(args, [*peer_env(args), sys.executable,
                                  str(BENCH / "_python_litserve.py"), str(port),
                                  str(args.max_batch), timeout], port, ready_path="/health")
    if name == "ray":
        return TreeServer(args, [*peer_env(args), f"PYTHONPATH={ROOT}", sys.executable,
                                 str(BENCH / "_python_ray.py"), str(port),
                                 str(args.max_batch), timeout], port, ready_path="/predict")
    if name == "bentoml":
        home = ROOT / ".cache" / "bench-venvs" / "bentoml-home"
        return TreeServer(args, [*peer_env(args), f"BENTOML_HOME={home}",
                                 "BENTOML_DO_NOT_TRACK=True", str(BENTO_VENV / "bin" / "python"),
                                 "-m", "bentoml", "serve", "_python_bentoml:PythonService",
                                 "--host", "127.0.0.1", "--port", str(port), "--working-dir",
                                 str(BENCH)], port, ready_path="/readyz")
    if name == "http_floor":
        return GroupServer(args, ["env", f"TENSOR_FLOOR_BYTES={args.floor_bytes}",
                                  *uvicorn_cmd("_tensor_peers:floor", port)], port,
                           ready_path="/health")
    raise ValueError(name)


def bentoml_ready() -> str | None:
    """None when BentoML's side venv is ready (made now if need be), else why not."""
    try:
        r = subprocess.run(["bash", str(BENCH / "setup_bentoml.sh"), str(BENTO_VENV)],
                           env={**os.environ, "MAIN_PY": sys.executable}, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"setup_bentoml.sh failed: {exc}"
    lines = [x for x in (r.stdout + r.stderr).splitlines() if not x.startswith("WARNING")]
    if r.returncode:
        return f"setup_bentoml.sh exited {r.returncode}: {' | '.join(lines[-3:])}"
    print(lines[-1] if lines else "bentoml venv ready", flush=True)
    return None


ISOLATED = {"litserve": "its inference worker polls its queues: ~18% of a core while idle",
            "ray": "a Ray cluster (GCS, raylet, agents, controller, HAProxy) idles at ~11% "
                   "of a core"}
"""Peers measured in a phase of their own (Sokuji up beside them, idle or measured alongside
at c=1): what they spend idle on the server core would disturb every other contender."""


def idle_share(srv: GroupServer, seconds: float = 2.0) -> float:
    """The share of a core ``srv``'s processes use while nobody sends anything."""
    from _goodput_search import _cpu_s

    assert srv.proc is not None
    pids = (srv.proc.pid, *srv.pids())
    c0 = _cpu_s(pids)
    time.sleep(seconds)
    return (_cpu_s(pids) - c0) / seconds


def stable(srv: GroupServer, wire: Wire, seconds: float = 30.0) -> None:
    """Until 3 rounds of c=1 calls over a keep-alive connection in a row go through (Ray's
    HAProxy reloads its configuration once the replica is up, closing the connections it
    holds)."""
    client, ok, deadline = wire.c1(srv.port), 0, time.monotonic() + seconds
    while ok < 3:
        try:
            client.run(20)
            ok += 1
        except (ConnectionError, OSError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            ok = 0
            time.sleep(1.0)


def checked(name: str, srv: GroupServer, w: dict[str, Wire]) -> dict[str, Any]:
    """One request through ``srv`` (retried while a just-started server warms up): its
    status and answer, which must hold the class's result."""
    wire = wire_of(name, w)
    last: Any = None
    for _ in range(30):
        status, body, _headers = one_call(srv.port, wire)
        if status == 200:
            text = body.decode()
            if "probabilities" not in text and name != "http_floor":
                raise RuntimeError(f"{name}: an answer without the class's result: {text[:300]}")
            return {"status": status, "bytes": len(body), "body": text[:400]}
        last = (status, body[:300])
        time.sleep(1.0)
    raise RuntimeError(f"{name} answers {last}")


def start_all(names: list[str], args: argparse.Namespace, w: dict[str, Wire],
              report: dict[str, Any]) -> dict[str, GroupServer]:
    """The servers of ``names`` started, each checked with one request; a peer that fails
    to start is left out, its reason in the report."""
    up: dict[str, GroupServer] = {}
    for name in names:
        srv = make_server(name, args)
        t0 = time.monotonic()
        try:
            srv.__enter__()
            report.setdefault("answers", {})[name] = checked(name, srv, w)
            if name != "http_floor":
                stable(srv, wire_of(name, w))
        except Exception as exc:  # a peer that cannot run: say why, go on
            if name == "sokuji":
                raise
            with contextlib.suppress(Exception):
                srv.__exit__(None, None, None)
            report.setdefault("skipped", {})[name] = f"did not start: {exc}"
            print(f"[{name}] skipped: {exc}", flush=True)
            continue
        report.setdefault("start_s", {})[name] = round(time.monotonic() - t0, 2)
        print(f"[{name}] up on {srv.port} in {time.monotonic() - t0:.1f} s", flush=True)
        up[name] = srv
    return up


# --- the parts -----------------------------------------------------------------------------

def direct_sweep(args: argparse.Namespace, direct: DirectModel) -> dict[str, Any]:
    out = {}
    for bs in (1, 4, 16, 64, 256):
        r = direct.call(cmd="throughput", bs=bs, seconds=args.sweep_seconds)
        out[str(bs)] = {"items_per_s": r["items"] / r["seconds"], "batch_ms": r["batch_ms"]}
    print("direct predict (items/s, ms a batch): " + ", ".join(
        f"b{k} {v['items_per_s']:.0f} ({v['batch_ms']:.3f} ms)" for k, v in out.items()),
        flush=True)
    return out


def c1_phase(args: argparse.Namespace, direct: DirectModel,
             clients: dict[str, C1Client]) -> dict[str, Any]:
    """The contenders and the direct call in turn, chunk by chunk (the order rotating)."""
    for c in clients.values():
        c.run(5)
    direct.call(cmd="single", calls=5)
    lat: dict[str, list[float]] = {k: [] for k in ("direct", *clients)}
    stages: dict[str, list[dict[str, float]]] = {k: [] for k in clients}
    names, per = list(clients), 10
    for i in range(max(1, args.c1_calls // per)):
        lat["direct"] += direct.call(cmd="single", calls=per)
        k = i % len(names)
        for name in names[k:] + names[:k]:
            got, st = clients[name].run(per)
            lat[name] += got
            stages[name] += st
    out: dict[str, Any] = {k: {**summary_ms(v), "samples_ms": v} for k, v in lat.items()}
    for name, st in stages.items():
        if st:
            keys = sorted({key for x in st for key in x})
            out[name]["server_stage_mean_ms"] = {key: statistics.fmean(x.get(key, 0.0)
                                                                       for x in st)
                                                 for key in keys}
    for name in clients:
        out[name]["added_p50_ms"] = out[name]["p50_ms"] - out["direct"]["p50_ms"]
        out[name]["added_p99_ms"] = out[name]["p99_ms"] - out["direct"]["p99_ms"]
    print("c=1 p50 / p99 ms (added p50): " + "; ".join(
        f"{k} {v['p50_ms']:.3f} / {v['p99_ms']:.3f}"
        + (f" (+{v['added_p50_ms']:.3f})" if "added_p50_ms" in v else "")
        for k, v in out.items()), flush=True)
    return out


def goodput_group(args: argparse.Namespace, servers: dict[str, GroupServer],
                  w: dict[str, Wire]) -> tuple[dict[str, Any], dict[str, float]]:
    """The goodput search for each of ``servers``, their steps interleaved."""
    slo = args.slo_ms
    caps = {}
    for name, srv in servers.items():
        wire = wire_of(name, w)
        settle(srv.port, slo, request=wire.settle_request())
        caps[name] = capacity(srv.port, wire, max(2 * args.max_batch, 8),
                              args.capacity_seconds)
        settle(srv.port, slo, request=wire.settle_request())
    print("closed-loop capacity (req/s): "
          + ", ".join(f"{k} {v:.1f}" for k, v in caps.items()), flush=True)
    searches = {name: Search(name, args.start_fraction * caps[name], args) for name in servers}
    while pending := [(x, nxt) for x in searches.values() if (nxt := x.next_rate())]:
        for search, (rate, confirm) in pending:
            srv = servers[search.name]
            wire = wire_of(search.name, w)
            assert srv.proc is not None
            sok = search.name.startswith("sokuji")
            model = f"{MODEL}_w1" if search.name == "sokuji_w1" else MODEL
            run = probed_run(srv.port, srv.proc.pid, sok, rate,
                             args.seed + (1 if confirm else 0), args,
                             WireTarget(srv.port, wire), model, srv.pids())
            step = search.record(rate, run, confirm, slo)
            step.pop("stages", None)
            print(f"  {search.name:<10}{rate:8.1f} req/s{' (again)' if confirm else '':8} p99 "
                  f"{step['p99_ms'] or math.inf:8.2f} ms errors {step['errors']:<4} goodput "
                  f"{step['goodput_rps']:7.1f}/s server {step['server_busy']:4.0%} "
                  f"(+{step['server_core_other']:.0%} other) "
                  f"{step['server_cpu_ms_per_request']:.3f} ms/req"
                  + (f" batch {step['batch_mean']:.1f}" if "batch_mean" in step else "")
                  + f" {'ok' if step['ok'] else 'FAIL ' + str(step['reason'])}"
                  f"{' (disturbed: again)' if step.get('discarded') else ''}", flush=True)
            settle(srv.port, slo, request=wire.settle_request())
    results = {name: x.result(slo) for name, x in searches.items()}
    for r in results.values():
        if r["best"]:
            r["best"].pop("stages", None)
    return results, caps


def goodput_summary(args: argparse.Namespace, results: dict[str, Any],
                    caps: dict[str, float]) -> dict[str, Any]:
    peers = {n: results[n]["goodput_rps"] for n in PEERS if n in results}
    best = max(peers, key=lambda n: peers[n]) if peers else None
    sok = results["sokuji"]["goodput_rps"]
    return {"slo_p99_ms": args.slo_ms, "closed_loop_capacity": caps, "contenders": results,
            "max_batch_size": args.max_batch, "batch_wait_ms": args.batch_wait_ms,
            "best_peer": best,
            "ratio": sok / peers[best] if best and peers[best] else math.inf,
            "ratio_to_each_peer": {n: sok / v if v else math.inf for n, v in peers.items()}}


PY_PROFILE_BUCKETS = (
    ("the class (scikit-learn, numpy)", ("sklearn/", "numpy/", "scipy/", "_python_model.py",
                                         "threadpoolctl")),
    ("Python kind (values, runner, results)", ("kinds/python/", "pycode/")),
    ("encode (V2 encode)", ("v2_encode.py",)),
    ("decode (V2 codec)", ("sokuji/server/v2.py",)),
    ("batcher: submit, forming, hand-off", ("core/batcher.py", "core/forming.py",
                                            "core/workers.py", "core/inline.py",
                                            "core/policy.py", "core/batcher_config.py",
                                            "kinds/encoder/model.py")),
    ("scheduling + admission", ("server/scheduling.py", "slo_admission", "check_admission")),
    ("accounting, metrics, timing", ("server/accounting.py", "observability/", "prometheus",
                                     "core/timing.py", "core/request.py")),
    ("Sokuji app + inference glue", ("server/app.py", "server/inference.py",
                                     "server/http.py", "server/hosts.py", "server/auth.py",
                                     "server/predict.py")),
    ("HTTP stack (uvicorn, httptools)", ("uvicorn/", "httptools")),
    ("asyncio / threads machinery", ("asyncio/", "concurrent/", "threading.py")),
)


def spy(args: argparse.Namespace, pid: int, seconds: float, drive: Any) -> dict[str, Any]:
    """py-spy samples of ``pid``'s threads while ``drive(stop_at)`` runs (returns requests
    done), by bucket of ``PY_PROFILE_BUCKETS``."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        return {"skipped": "py-spy is not installed"}
    out_file = Path(tempfile.mkstemp(suffix=".txt")[1])
    proc = subprocess.Popen([exe, "record", "--format", "raw", "--rate", "500", "--duration",
                             str(int(seconds)), "--nonblocking", "--pid", str(pid),
                             "--output", str(out_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaching
    t0 = time.monotonic()
    calls = drive(t0 + seconds - 1.0)
    wall = time.monotonic() - t0
    _, err = proc.communicate(timeout=60)
    stacks = Counter[str]()
    if out_file.exists():
        for line in out_file.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                stacks[stack] += int(count)
        out_file.unlink()
    counts, leaves, idle = Counter[str](), Counter[str](), 0
    for st, n in stacks.items():
        label = bucket_of(st, PY_PROFILE_BUCKETS)
        if label is None:
            idle += n
            continue
        counts[label] += n
        leaves[st.split(";")[-1]] += n
    busy = sum(counts.values())
    if not busy or not calls:
        return {"skipped": f"py-spy gave no samples: {err.decode()[-300:]}"}
    labels = [k for k, _ in PY_PROFILE_BUCKETS] + ["other"]
    return {"samples_busy": busy, "samples_idle": idle, "requests_during": calls,
            "rate_hz": 500, "wall_s": wall, "busy_ms_per_request": busy / 500 / calls * 1e3,
            "ms_per_request": {k: counts[k] / 500 / calls * 1e3 for k in labels if counts[k]},
            "top_leaf_frames": [(f, n / busy) for f, n in leaves.most_common(20)],
            "note": "py-spy samples of the server process's threads (the worker process of "
                    "workers = 1 is not sampled); a sample counts in the bucket of its "
                    "innermost matching frame; waiting threads are left out"}


def profile_part(args: argparse.Namespace, sok: GroupServer, w: Wire) -> dict[str, Any]:
    assert sok.proc is not None
    client = w.c1(sok.port)
    client.run(20)

    def c1(stop_at: float) -> int:
        n = 0
        while time.monotonic() < stop_at:
            client.run(50)
            n += 50
        return n

    def loaded(stop_at: float) -> int:
        r = asyncio.run(closed_loop(sok.port, w.bodies, max(2 * args.max_batch, 8), 0.0,
                                    max(1.0, stop_at - time.monotonic()), w.path, w.headers))
        return int(r["items"])

    out = {"c1": spy(args, sok.proc.pid, args.profile_seconds, c1),
           "closed_loop": spy(args, sok.proc.pid, args.profile_seconds, loaded)}
    for k, p in out.items():
        if "ms_per_request" in p:
            print(f"profile {k} ({p['samples_busy']} busy samples, "
                  f"{p['busy_ms_per_request']:.3f} ms busy a request), ms a request: "
                  + ", ".join(f"{b} {v:.3f}" for b, v in p["ms_per_request"].items()),
                  flush=True)
        else:
            print(f"profile {k}: {p.get('skipped')}", flush=True)
    return out


# --- the report ----------------------------------------------------------------------------

def print_table(report: dict[str, Any]) -> None:
    rows: list[tuple[str, str, str, str]] = []
    c1 = report.get("c1", {})
    for name, x in c1.get("contenders", {}).items():
        target = f"<= {TARGETS['c1_added_ms']} ms" if name == "sokuji" else "(measure)"
        rows.append((f"c=1 added p50 / p99, {name}",
                     f"{x['added_p50_ms']:.3f} / {x['added_p99_ms']:.3f} ms", target,
                     f"p50 {x['p50_ms']:.3f} ms; x{x['added_p50_over_sokuji']:.1f} Sokuji's "
                     f"added" + (f" ({x['phase']})" if x.get("phase") else "")))
    if "direct" in c1:
        rows.append(("c=1 predict called directly", f"{c1['direct']['p50_ms']:.3f} / "
                     f"{c1['direct']['p99_ms']:.3f} ms", "", "p50 / p99, one item"))
    g = report.get("goodput")
    if g:
        c = g["contenders"]
        rows.append(("goodput: Sokuji / best peer", f"{g['ratio']:.2f}",
                     f">= {TARGETS['goodput_over_best_peer']}",
                     f"best peer {g['best_peer']}; p99 <= {g['slo_p99_ms']:g} ms"))
        for n, v in g["ratio_to_each_peer"].items():
            rows.append((f"goodput: Sokuji / {n}", f"{v:.2f}", "",
                         f"{c['sokuji']['goodput_rps']:.0f} vs {c[n]['goodput_rps']:.0f} req/s"))
        for n, r in c.items():
            best = r.get("best") or {}
            rows.append((f"goodput {n}", f"{r['goodput_rps']:.0f} req/s", "",
                         f"p99 {best.get('p99_ms') or math.nan:.2f} ms, server CPU "
                         f"{best.get('server_cpu_ms_per_request', math.nan):.3f} ms/req"
                         + (f", batch {best['batch_mean']:.1f}" if "batch_mean" in best else "")
                         + ("" if best.get("confirmed") else " (unconfirmed)")))
    print(f"\n{'figure':<40}{'measured':>24}{'target':>12}  detail")
    for a, b, t, d in rows:
        print(f"{a:<40}{b:>24}{t:>12}  {d}")
    for name, x in c1.get("contenders", {}).items():
        st = x.get("server_stage_mean_ms")
        if st:
            print(f"{name} server stages at c=1 (mean ms): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in st.items()))
    for name, why in report.get("skipped", {}).items():
        print(f"skipped {name}: {why}")


def merge_c1(phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every contender's c=1 figures, each against the direct call of its own phase."""
    out: dict[str, Any] = {"phases": phases}
    a = phases.get("shared", {})
    contenders: dict[str, Any] = {}
    for name, x in a.items():
        if name != "direct":
            contenders[name] = {k: v for k, v in x.items() if k != "samples_ms"}
    for phase, b in phases.items():
        if phase != "shared" and phase in b:
            contenders[phase] = {k: v for k, v in b[phase].items() if k != "samples_ms"}
            contenders[phase]["phase"] = f"its own phase; Sokuji beside it added " \
                f"{b['sokuji']['added_p50_ms']:.3f} ms p50 there"
            contenders[phase]["sokuji_beside_added_p50_ms"] = b["sokuji"]["added_p50_ms"]
    sok = contenders.get("sokuji", {}).get("added_p50_ms")
    for x in contenders.values():
        x["added_p50_over_sokuji"] = x["added_p50_ms"] / sok if sok else math.nan
    out["contenders"] = contenders
    if "direct" in a:
        out["direct"] = {k: v for k, v in a["direct"].items() if k != "samples_ms"}
    if "sokuji_w1" in contenders and "sokuji" in contenders:
        out["process_hop_p50_ms"] = contenders["sokuji_w1"]["p50_ms"] \
            - contenders["sokuji"]["p50_ms"]
        out["process_hop_p99_ms"] = contenders["sokuji_w1"]["p99_ms"] \
            - contenders["sokuji"]["p99_ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~3 minutes: short runs")
    p.add_argument("--parts", default="c1,goodput,profile")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--goodput-sokuji-w1", action="store_true",
                   help="search sokuji_w1's goodput too (the process hop under load)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="every batching contender's max batch size (requests)")
    p.add_argument("--batch-wait-ms", type=float, default=2.0,
                   help="Sokuji's max_queue_delay_ms, LitServe's batch_timeout, Ray's "
                   "batch_wait_timeout_s")
    p.add_argument("--slo-ms", type=float, default=25.0, help="the goodput's p99 SLO")
    p.add_argument("--c1-calls", type=int, default=400, help="per contender")
    p.add_argument("--warmup-seconds", type=float, default=1.0)
    p.add_argument("--sweep-seconds", type=float, default=1.0)
    p.add_argument("--capacity-seconds", type=float, default=3.0)
    p.add_argument("--profile-seconds", type=float, default=6.0)
    p.add_argument("--nice", type=int, default=0,
                   help="run this process and every server under this niceness (root: below "
                   "0 gives them the cores before other work on a shared machine)")
    # the goodput search (``_goodput_search.Search`` reads these)
    p.add_argument("--seconds-goodput", dest="seconds", type=float, default=5.0,
                   help="measured seconds per offered rate")
    p.add_argument("--factor", type=float, default=1.25)
    p.add_argument("--tolerance", type=float, default=0.06)
    p.add_argument("--start-fraction", type=float, default=0.7,
                   help="start rate: this x the contender's closed-loop capacity")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--max-reruns", type=int, default=2)
    p.add_argument("--min-rate", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=10.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-core", type=int, default=1)
    p.add_argument("--client-core", type=int, default=0)
    p.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "recorded" / "python_serving.json"))
    args = p.parse_args()
    if args.quick:
        args.c1_calls, args.sweep_seconds, args.capacity_seconds = 100, 0.3, 1.0
        args.warmup_seconds, args.profile_seconds = 0.5, 3.0
        args.seconds, args.max_steps, args.tolerance, args.max_reruns = 1.5, 4, 0.3, 0
        args.start_fraction = 0.5
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    os.sched_setaffinity(0, {args.client_core})
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)  # the children inherit it
    began = time.monotonic()
    report: dict[str, Any] = {"benchmark": "python_serving",
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "command": " ".join([Path(sys.executable).name, *sys.argv]),
                              "machine": machine.describe(), "sokuji_tree": source_tree(),
                              "settings": dict(vars(args)), "targets": TARGETS,
                              "model": {"entry": ENTRY, "request": "one breast-cancer row "
                                        "(30 FP64 features) a request"}}
    if "bentoml" in peers and (why := bentoml_ready()):
        report.setdefault("skipped", {})["bentoml"] = why
        print(f"[bentoml] skipped: {why}", flush=True)
        peers.remove("bentoml")
    w = wires()
    direct = DirectModel(args.server_core)
    c1_phases: dict[str, Any] = {}
    goodput: dict[str, Any] = {}
    caps: dict[str, float] = {}
    try:
        report["direct_sweep"] = direct_sweep(args, direct)
        sok = start_all(["sokuji"], args, w, report)["sokuji"]
        args.floor_bytes = report["answers"]["sokuji"]["bytes"]
        try:
            report.setdefault("idle_cpu_share", {})["sokuji"] = idle_share(sok)
            shared = [n for n in peers if n not in ISOLATED]
            up = start_all(shared, args, w, report)
            try:
                for name in up:
                    report["idle_cpu_share"][name] = idle_share(up[name])
                if "c1" in parts:
                    floor = start_all(["http_floor"], args, w, report)
                    clients = {n: wire_of(n, w).c1(srv.port) for n, srv in
                               {"sokuji": sok, **up}.items()}
                    clients["sokuji_predict"] = w["sokuji_predict"].c1(sok.port)
                    clients["sokuji_w1"] = w["sokuji_w1"].c1(sok.port)
                    if "http_floor" in floor:
                        clients["http_floor"] = C1Client(floor["http_floor"].port,
                                                         w["sokuji"].bodies, "/infer",
                                                         JSON_HEADERS)
                    print(f"[c1] {', '.join(clients)}", flush=True)
                    c1_phases["shared"] = c1_phase(args, direct, clients)
                    for srv in floor.values():
                        srv.__exit__(None, None, None)
                if "profile" in parts:
                    report["profile"] = profile_part(args, sok, w["sokuji"])
                if "goodput" in parts:
                    group = {"sokuji": sok, **up}
                    if args.goodput_sokuji_w1:
                        group["sokuji_w1"] = sok
                    print(f"[goodput] {', '.join(group)}", flush=True)
                    res, cp = goodput_group(args, group, w)
                    goodput.update(res)
                    caps.update(cp)
            finally:
                for srv in up.values():
                    srv.__exit__(None, None, None)
            for name in [n for n in peers if n in ISOLATED]:
                alone = start_all([name], args, w, report)
                if name not in alone:
                    continue
                srv = alone[name]
                try:
                    report["idle_cpu_share"][name] = idle_share(srv)
                    if "c1" in parts:
                        print(f"[c1] {name} (its own phase), with Sokuji beside it", flush=True)
                        c1_phases[name] = c1_phase(args, direct, {
                            name: w["peer"].c1(srv.port), "sokuji": w["sokuji"].c1(sok.port)})
                    if "goodput" in parts:
                        print(f"[goodput] {name} (its own phase)", flush=True)
                        res, cp = goodput_group(args, {name: srv}, w)
                        goodput.update(res)
                        caps.update(cp)
                finally:
                    srv.__exit__(None, None, None)
        finally:
            sok.__exit__(None, None, None)
    finally:
        direct.close()
    if c1_phases:
        report["c1"] = merge_c1(c1_phases)
    if goodput:
        report["goodput"] = goodput_summary(args, goodput, caps)
    report["wall_s"] = time.monotonic() - began
    report["load_average_end"] = list(os.getloadavg())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    if "goodput" in report:
        plot(out.with_suffix(".png"), {"breast-cancer class": report["goodput"]})
    print_table(report)
    png = f"; plot: {out.with_suffix('.png')}" if "goodput" in report else ""
    print(f"raw JSON: {out}{png}; {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

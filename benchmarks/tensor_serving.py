"""The tensor kind (``runtime = "tensor"``) under load: Sokuji against ONNX Runtime called
directly, plain FastAPI and LitServe, and Sokuji's own app under uvicorn against granian.

    .venv/bin/python benchmarks/tensor_serving.py [--quick] [--parts ...] [--out FILE]
    (full ~15 minutes, --quick under 2)

Two real graphs (``_tensor_models.py``): ``tabular``, a scikit-learn gradient-boosting
classifier on the bundled breast-cancer data, exported by skl2onnx (zipmap off), one row a
request; ``ocr``, PP-OCRv4's text detector from rapidocr-onnxruntime, one 1x3x320x320 FP32
image a request. Servers (and the raw runtime) are pinned to the server core, this process
(the load generator: its own process, never the servers' loop) to the client core; every
session has 1 intra-op thread. Contenders alternate chunk by chunk or round by round, so a
shared machine's drift falls on all alike.

Parts (``--parts``, all by default):
- ``c1``: concurrency 1 over one keep-alive connection (``_harness.C1Client``): Sokuji with
  V2 binary tensors as tritonclient sends them, Sokuji with V2 JSON, the HTTP floor (uvicorn
  with no model answering as many bytes) and ``InferenceSession.run`` called in-process on the
  same input (``_tensor_raw.py``); added ms = Sokuji - raw at p50 and p99 (target <= 0.3 ms),
  with Sokuji's own stages (``Server-Timing``).
- ``saturated``: Sokuji, closed loop at high concurrency (``_harness.closed_loop``), against
  the raw session at its best batch size (swept); target >= 0.95.
- ``goodput``: open-loop Poisson load swept per server (``_goodput_search``: the search,
  verdicts, CPU probes and settling of ``goodput.py``) under a p99 SLO, for Sokuji, plain
  FastAPI (one session, no batching) and LitServe (``max_batch_size``, ``batch_timeout``) on
  one model code (``_tensor_peers.py``); target Sokuji >= 1.5 x the better peer. Plot.
- ``front``: the same Sokuji app under uvicorn and under granian (``_granian_serve.py``), for
  ``tabular`` (V2 binary) and the built-in text encoder ``minilm`` (V2 JSON): c=1 and
  saturated.
- ``profile``: py-spy samples of the Sokuji server at c=1 on ``tabular`` (binary V2): where
  the loop thread's time goes.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine
from _goodput_search import Search, probed_run, settle
from _harness import C1Client, Server, closed_loop, free_port, percentile, pooled_rate
from _tensor_models import TensorModelSpec, inputs, spec, v2_binary, v2_json
from _tensor_raw import RawTensorRuntime
from goodput import source_tree
from serving_overhead import load_texts, thread_cpu_s

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
TARGETS = {"c1_added_ms": 0.3, "saturated_over_raw": 0.95, "goodput_over_best_peer": 1.5}
PEERS = ("fastapi", "litserve")
SLO_MS = {"tabular": 10.0, "ocr": 1000.0}
SOKUJI_MAX_BATCH_CAP = {"tabular": 64, "ocr": 8}
"""Sokuji's max_batch_size: the raw best batch size, at most this (the closed loop keeps
2 x that many requests in flight)."""


# --- requests ------------------------------------------------------------------------------

@dataclass
class Wire:
    """One contender's requests for one model: path, headers, bodies."""

    path: str
    headers: dict[str, str]
    bodies: list[bytes]

    def c1(self, port: int) -> C1Client:
        return C1Client(port, self.bodies, self.path, self.headers)

    def settle_request(self) -> tuple[str, bytes, dict[str, str]]:
        return self.path, self.bodies[0], self.headers


class WireTarget:
    """A ``sokuji.bench`` target sending ``Wire``'s bodies in turn (the engine's duck type)."""

    streaming = False

    def __init__(self, port: int, wire: Wire) -> None:
        self.url = f"http://127.0.0.1:{port}{wire.path}"
        self.wire = wire
        self.i = 0

    def body(self, item: object) -> bytes:
        self.i += 1
        return self.wire.bodies[self.i % len(self.wire.bodies)]

    def request_headers(self) -> dict[str, str]:
        return self.wire.headers


def wires(s: TensorModelSpec) -> dict[str, Wire]:
    xs = inputs(s)
    binary = [v2_binary(s, x) for x in xs]
    heads = {h for _, h in binary}
    assert len(heads) == 1, "one shape: one JSON header length"
    path = f"/v2/models/{s.name}/infer"
    return {
        "binary": Wire(path, {"content-type": "application/octet-stream",
                              "inference-header-content-length": str(heads.pop())},
                       [b for b, _ in binary]),
        "json": Wire(path, {"content-type": "application/json"}, [v2_json(s, x) for x in xs]),
        "raw": Wire("/infer", {"content-type": "application/octet-stream"},
                    [x.tobytes() for x in xs])}


# --- servers -------------------------------------------------------------------------------

class GroupServer(Server):
    """A server started in its own process group and stopped as one (LitServe leaves its
    worker processes behind on SIGTERM otherwise)."""

    def __enter__(self) -> GroupServer:
        self.proc = subprocess.Popen(self.command, cwd=ROOT, start_new_session=True)
        self.wait_ready(180)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        if self.cfg is not None:
            self.cfg.unlink()

    def pids(self) -> tuple[int, ...]:
        """The server's processes below its first one (LitServe's workers)."""
        assert self.proc is not None
        kids: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                kids.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(
                    int(entry))
        out, todo = [], [self.proc.pid]
        while todo:
            for child in kids.get(todo.pop(), []):
                out.append(child)
                todo.append(child)
        return tuple(out)


def sokuji_config(args: argparse.Namespace, port: int, specs: dict[str, TensorModelSpec],
                  batch: dict[str, int]) -> str:
    models = "".join(f"""
[[models]]
name = "{s.name}"
runtime = "tensor"
path = "{s.path}"
cache = false
intra_op_threads = 1
max_batch_size = {batch[s.name]}
max_request_bytes = 16777216
""" for s in specs.values())
    return f"""
port = {port}
grpc_port = 0
cache_dir = "{args.cache_dir}"
log_level = "warning"
{models}
[[models]]
name = "minilm"
cache = false
intra_op_threads = 1
max_batch_size = 32
"""


def sokuji_server(args: argparse.Namespace, specs: dict[str, TensorModelSpec],
                  batch: dict[str, int], front: str = "uvicorn") -> GroupServer:
    port = free_port()
    cmd = [sys.executable, "-m", "sokuji", "serve"] if front == "uvicorn" \
        else [sys.executable, str(BENCH / "_granian_serve.py")]
    return GroupServer(args, cmd, port, config=sokuji_config(args, port, specs, batch))


def peer_env(args: argparse.Namespace, model: str) -> list[str]:
    return ["env", f"TENSOR_PEER_MODEL={model}", f"TENSOR_PEER_CACHE_DIR={args.cache_dir}"]


def uvicorn_cmd(factory: str, port: int) -> list[str]:
    return [sys.executable, "-m", "uvicorn", "--factory", "--app-dir", str(BENCH), factory,
            "--port", str(port), "--loop", "uvloop", "--http", "httptools", "--no-access-log",
            "--log-level", "warning", "--lifespan", "off"]


def fastapi_server(args: argparse.Namespace, model: str) -> GroupServer:
    port = free_port()
    return GroupServer(args, [*peer_env(args, model), *uvicorn_cmd(
        "_tensor_peers:fastapi_app", port)], port, ready_path="/health")


def litserve_server(args: argparse.Namespace, model: str, max_batch: int) -> GroupServer:
    port = free_port()
    return GroupServer(args, [*peer_env(args, model), sys.executable,
                              str(BENCH / "_tensor_litserve.py"), str(port),
                              str(max_batch), str(args.litserve_timeout_ms / 1e3)],
                       port, ready_path="/health")


def floor_server(args: argparse.Namespace, size: int) -> GroupServer:
    port = free_port()
    return GroupServer(args, ["env", f"TENSOR_FLOOR_BYTES={size}",
                              *uvicorn_cmd("_tensor_peers:floor", port)], port,
                       ready_path="/health")


def one_call(port: int, wire: Wire) -> tuple[int, bytes, dict[str, str]]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", wire.path, wire.bodies[0], wire.headers)
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, body, {k.lower(): v for k, v in r.getheaders()}


# --- the parts -----------------------------------------------------------------------------

def summary_ms(values: list[float]) -> dict[str, float]:
    return {"p50_ms": statistics.median(values), "p99_ms": percentile(values, 99),
            "mean_ms": statistics.fmean(values), "calls": len(values)}


def raw_sweep(args: argparse.Namespace, raw: RawTensorRuntime, s: TensorModelSpec
              ) -> dict[str, Any]:
    rates = {}
    for bs in s.batch_sizes:
        r = raw.call(cmd="throughput", model=s.name, bs=bs, seconds=args.sweep_seconds)
        rates[bs] = r["items"] / r["seconds"]
    best = max(rates, key=lambda b: rates[b])
    print(f"[{s.name}] raw sweep (items/s): "
          + ", ".join(f"b{bs} {v:.1f}" for bs, v in rates.items()) + f"; best b{best}",
          flush=True)
    return {"items_per_s": {str(k): v for k, v in rates.items()}, "best_batch_size": best}


def c1_part(args: argparse.Namespace, raw: RawTensorRuntime, s: TensorModelSpec,
            w: dict[str, Wire], port: int) -> dict[str, Any]:
    status, body, _headers = one_call(port, w["binary"])
    assert status == 200, body[:300]
    calls = args.c1_calls[s.name]
    with floor_server(args, len(body)) as floor:
        clients = {"sokuji_binary": w["binary"].c1(port), "sokuji_json": w["json"].c1(port),
                   "http_floor": C1Client(floor.port, w["binary"].bodies, "/infer",
                                          w["binary"].headers)}
        for c in clients.values():
            c.run(5)
        raw.call(cmd="single", model=s.name, calls=5)
        lat: dict[str, list[float]] = {k: [] for k in ("raw", *clients)}
        stages: dict[str, list[dict[str, float]]] = {"sokuji_binary": [], "sokuji_json": []}
        per = 10
        for _ in range(max(1, calls // per)):
            lat["raw"] += raw.call(cmd="single", model=s.name, calls=per)
            for name, c in clients.items():
                got, st = c.run(per)
                lat[name] += got
                if name in stages:
                    stages[name] += st
    out: dict[str, Any] = {k: {**summary_ms(v), "samples_ms": v} for k, v in lat.items()}
    for name, st in stages.items():
        if st:
            out[name]["server_stage_mean_ms"] = {k: statistics.fmean(x.get(k, 0.0) for x in st)
                                                 for k in st[0]}
    for name in ("sokuji_binary", "sokuji_json", "http_floor"):
        out[name]["added_p50_ms"] = out[name]["p50_ms"] - out["raw"]["p50_ms"]
        out[name]["added_p99_ms"] = out[name]["p99_ms"] - out["raw"]["p99_ms"]
    out["response_bytes_binary"] = len(body)
    print(f"[{s.name}] c=1 p50 / p99 ms: " + "; ".join(
        f"{k} {v['p50_ms']:.3f} / {v['p99_ms']:.3f}" for k, v in out.items()
        if isinstance(v, dict)), flush=True)
    return out


def saturated_part(args: argparse.Namespace, raw: RawTensorRuntime, s: TensorModelSpec,
                   w: Wire, server: GroupServer, best: int, max_batch: int) -> dict[str, Any]:
    concurrency = max(2 * max_batch, 8)
    raw_rounds, raw_same, sok_rounds = [], [], []
    assert server.proc is not None
    seconds = args.seconds_sat[s.name]
    for i in range(args.rounds):
        raw_rounds.append(raw.call(cmd="throughput", model=s.name, bs=best, seconds=seconds))
        if max_batch != best:
            raw_same.append(raw.call(cmd="throughput", model=s.name, bs=max_batch,
                                     seconds=seconds))
        cpu0 = thread_cpu_s(server.proc.pid)
        r = asyncio.run(closed_loop(server.port, w.bodies, concurrency, args.warmup_seconds,
                                    seconds, w.path, w.headers))
        cpu1 = thread_cpu_s(server.proc.pid)
        r["server_cpu_s"] = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}
        r["latencies_ms"] = [percentile(r["latencies_ms"], 50),
                             percentile(r["latencies_ms"], 99)]
        sok_rounds.append(r)
        print(f"[{s.name}] saturated round {i + 1}: raw b{best} "
              f"{pooled_rate(raw_rounds[-1:]):.1f}/s, sokuji "
              f"{pooled_rate(sok_rounds[-1:]):.1f}/s (c={concurrency}, errors {r['errors']})",
              flush=True)
    sok = pooled_rate(sok_rounds)
    items = sum(r["items"] / r["seconds"] * (args.warmup_seconds + seconds) for r in sok_rounds)
    out = {"concurrency": concurrency, "max_batch_size": max_batch, "raw_best_batch": best,
           "raw_items_per_s": pooled_rate(raw_rounds), "sokuji_items_per_s": sok,
           "ratio": sok / pooled_rate(raw_rounds),
           "errors": sum(r["errors"] for r in sok_rounds),
           "server_loop_cpu_ms_per_request": 1e3 * sum(r["server_cpu_s"]["loop"]
                                                       for r in sok_rounds) / items,
           "server_threads_cpu_ms_per_request": 1e3 * sum(r["server_cpu_s"]["threads"]
                                                          for r in sok_rounds) / items,
           "rounds_raw": raw_rounds, "rounds_sokuji": sok_rounds}
    if raw_same:
        out["raw_items_per_s_at_max_batch"] = pooled_rate(raw_same)
        out["ratio_at_max_batch"] = sok / pooled_rate(raw_same)
    return out


def capacity(port: int, w: Wire, concurrency: int, seconds: float) -> float:
    """A closed loop's rate: where the goodput search starts (a fraction of it)."""
    for _ in range(3):
        try:
            r = asyncio.run(closed_loop(port, w.bodies, concurrency, 0.5, seconds, w.path,
                                        w.headers))
            return pooled_rate([r])
        except RuntimeError:  # too few completions in the window: a slow model
            seconds *= 3
    raise RuntimeError("no closed-loop rate: the server answers almost nothing")


def goodput_part(args: argparse.Namespace, s: TensorModelSpec, w: dict[str, Wire],
                 sokuji: GroupServer, max_batch: int) -> dict[str, Any]:
    slo = args.slo_ms[s.name]
    servers: dict[str, GroupServer] = {"sokuji": sokuji}
    wire = {"sokuji": w["binary"], "fastapi": w["raw"], "litserve": w["raw"]}
    started: list[GroupServer] = []
    try:
        for name, make in (("fastapi", lambda: fastapi_server(args, s.name)),
                           ("litserve", lambda: litserve_server(args, s.name, max_batch))):
            servers[name] = make()
            started.append(servers[name].__enter__())
        caps = {}
        for name, srv in servers.items():
            settle(srv.port, slo, request=wire[name].settle_request())
            caps[name] = capacity(srv.port, wire[name], max(2 * max_batch, 8),
                                  args.capacity_seconds)
            settle(srv.port, slo, request=wire[name].settle_request())
        print(f"[{s.name}] closed-loop capacity (req/s): "
              + ", ".join(f"{k} {v:.1f}" for k, v in caps.items()), flush=True)
        searches = {name: Search(name, args.start_fraction * caps[name], args)
                    for name in servers}
        while pending := [(x, nxt) for x in searches.values() if (nxt := x.next_rate())]:
            for search, (rate, confirm) in pending:
                srv = servers[search.name]
                assert srv.proc is not None
                run = probed_run(srv.port, srv.proc.pid, search.name == "sokuji", rate,
                                 args.seed + (1 if confirm else 0), args,
                                 WireTarget(srv.port, wire[search.name]), s.name, srv.pids())
                step = search.record(rate, run, confirm, slo)
                step.pop("stages", None)
                print(f"  [{s.name}] {search.name:<9}{rate:8.1f} req/s"
                      f"{' (again)' if confirm else '':8} p99 {step['p99_ms'] or math.inf:8.2f}"
                      f" ms errors {step['errors']:<4} goodput {step['goodput_rps']:7.1f}/s"
                      f" server {step['server_busy']:4.0%} (+{step['server_core_other']:.0%}"
                      f" other) {step['server_cpu_ms_per_request']:.3f} ms/req "
                      f"{'ok' if step['ok'] else 'FAIL ' + str(step['reason'])}"
                      f"{' (disturbed: again)' if step.get('discarded') else ''}", flush=True)
                settle(srv.port, slo, request=wire[search.name].settle_request())
    finally:
        for srv in started:
            srv.__exit__(None, None, None)
    results = {name: x.result(slo) for name, x in searches.items()}
    for r in results.values():
        if r["best"]:
            r["best"].pop("stages", None)
    peers = {n: results[n]["goodput_rps"] for n in PEERS}
    best_peer = max(peers.values())
    return {"slo_p99_ms": slo, "closed_loop_capacity": caps, "contenders": results,
            "sokuji_max_batch_size": max_batch,
            "litserve": {"max_batch_size": max_batch,
                         "batch_timeout_s": args.litserve_timeout_ms / 1e3},
            "ratio": results["sokuji"]["goodput_rps"] / best_peer if best_peer else math.inf}


def front_part(args: argparse.Namespace, specs: dict[str, TensorModelSpec],
               batch: dict[str, int], w: dict[str, dict[str, Wire]]) -> dict[str, Any]:
    texts = load_texts("short")
    minilm = Wire("/v2/models/minilm/infer", {"content-type": "application/json"},
                  [json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                           "data": [t]}]}).encode() for t in texts])
    cases = {} if args.quick else {"minilm": (minilm, 32)}
    if "tabular" in w:
        cases["tabular"] = (w["tabular"]["binary"], batch["tabular"])
    out: dict[str, Any] = {}
    with sokuji_server(args, specs, batch, "uvicorn") as uv, \
            sokuji_server(args, specs, batch, "granian") as gr:
        ports = {"uvicorn": uv.port, "granian": gr.port}
        pids = {"uvicorn": uv.proc.pid, "granian": gr.proc.pid}  # type: ignore[union-attr]
        for case, (wire, max_batch) in cases.items():
            clients = {k: wire.c1(p) for k, p in ports.items()}
            for c in clients.values():
                c.run(10)
            lat: dict[str, list[float]] = {k: [] for k in ports}
            for i in range(args.front_chunks):
                for k in (("uvicorn", "granian") if i % 2 == 0 else ("granian", "uvicorn")):
                    lat[k] += clients[k].run(20)[0]
            conc = max(2 * max_batch, 8) if case == "tabular" else 64
            rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in ports}
            cpu: dict[str, float] = dict.fromkeys(ports, 0.0)
            for i in range(args.rounds):
                for k in (("uvicorn", "granian") if i % 2 == 0 else ("granian", "uvicorn")):
                    c0 = thread_cpu_s(pids[k])["loop"]
                    r = asyncio.run(closed_loop(ports[k], wire.bodies, conc,
                                                args.warmup_seconds, args.front_seconds,
                                                wire.path, wire.headers))
                    cpu[k] += thread_cpu_s(pids[k])["loop"] - c0
                    r.pop("latencies_ms")
                    rounds[k].append(r)
            res: dict[str, Any] = {}
            for k in ports:
                n = sum(r["items"] / r["seconds"] * (args.warmup_seconds + args.front_seconds)
                        for r in rounds[k])
                res[k] = {**summary_ms(lat[k]), "saturated_items_per_s": pooled_rate(rounds[k]),
                          "saturated_concurrency": conc,
                          "saturated_loop_cpu_ms_per_request": 1e3 * cpu[k] / n,
                          "errors": sum(r["errors"] for r in rounds[k])}
            res["c1_p50_granian_minus_uvicorn_ms"] = \
                res["granian"]["p50_ms"] - res["uvicorn"]["p50_ms"]
            res["saturated_granian_over_uvicorn"] = \
                res["granian"]["saturated_items_per_s"] / res["uvicorn"]["saturated_items_per_s"]
            out[case] = res
            print(f"[front {case}] c=1 p50 uvicorn {res['uvicorn']['p50_ms']:.3f} ms, granian "
                  f"{res['granian']['p50_ms']:.3f} ms; saturated uvicorn "
                  f"{res['uvicorn']['saturated_items_per_s']:.1f}/s, granian "
                  f"{res['granian']['saturated_items_per_s']:.1f}/s", flush=True)
    return out


def ab_part(args: argparse.Namespace, specs: dict[str, TensorModelSpec],
            batch: dict[str, int], w: Wire) -> dict[str, Any]:
    """``--ab-before TREE``: that tree's Sokuji (A) and this one (B) up at once on the server
    core, ``tabular`` (V2 binary): c=1 chunks and saturated rounds alternating, as
    ``ab_trees.py`` does for the encoder."""
    from ab_trees import TreeServer

    trees = {"a": Path(args.ab_before).resolve(), "b": ROOT}
    ports = {k: free_port() for k in trees}
    with TreeServer(trees["a"], args.server_core, sokuji_config(args, ports["a"], specs, batch),
                    ports["a"]) as sa, \
            TreeServer(trees["b"], args.server_core,
                       sokuji_config(args, ports["b"], specs, batch), ports["b"]) as sb:
        pids = {"a": sa.proc.pid, "b": sb.proc.pid}  # type: ignore[union-attr]
        clients = {k: w.c1(p) for k, p in ports.items()}
        for c in clients.values():
            c.run(20)
        lat: dict[str, list[float]] = {"a": [], "b": []}
        pair: list[float] = []
        for i in range(args.ab_chunks):
            med = {}
            for k in (("a", "b") if i % 2 == 0 else ("b", "a")):
                got = clients[k].run(20)[0]
                lat[k] += got
                med[k] = statistics.median(got)
            pair.append(med["b"] - med["a"])
        conc = max(2 * batch["tabular"], 8)
        rounds: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        cpu = {"a": 0.0, "b": 0.0}
        for i in range(args.rounds * 2):
            for k in (("a", "b") if i % 2 == 0 else ("b", "a")):
                c0 = sum(thread_cpu_s(pids[k]).values())
                r = asyncio.run(closed_loop(ports[k], w.bodies, conc, args.warmup_seconds,
                                            args.front_seconds, w.path, w.headers))
                cpu[k] += sum(thread_cpu_s(pids[k]).values()) - c0
                r.pop("latencies_ms")
                rounds[k].append(r)
    out: dict[str, Any] = {"trees": {k: str(v) for k, v in trees.items()}}
    for k in trees:
        n = sum(r["items"] / r["seconds"] * (args.warmup_seconds + args.front_seconds)
                for r in rounds[k])
        out[k] = {**summary_ms(lat[k]), "saturated_items_per_s": pooled_rate(rounds[k]),
                  "saturated_cpu_ms_per_request": 1e3 * cpu[k] / n}
    out["c1_p50_b_minus_a_ms"] = out["b"]["p50_ms"] - out["a"]["p50_ms"]
    out["c1_paired_chunk_median_b_minus_a_ms"] = statistics.median(pair)
    out["saturated_b_over_a"] = out["b"]["saturated_items_per_s"] / \
        out["a"]["saturated_items_per_s"]
    out["cpu_per_request_b_minus_a_ms"] = out["b"]["saturated_cpu_ms_per_request"] - \
        out["a"]["saturated_cpu_ms_per_request"]
    print(f"[ab tabular] c=1 p50 A {out['a']['p50_ms']:.3f} B {out['b']['p50_ms']:.3f} ms "
          f"(paired {out['c1_paired_chunk_median_b_minus_a_ms']:+.3f}); saturated A "
          f"{out['a']['saturated_items_per_s']:.0f} B {out['b']['saturated_items_per_s']:.0f}/s;"
          f" CPU/request B - A {out['cpu_per_request_b_minus_a_ms']:+.3f} ms", flush=True)
    return out


PROFILE_BUCKETS = (
    ("ONNX Runtime run", ("onnxruntime/",)),
    ("encode (to_tensors, V2 encode)", ("encode_infer", "encode_outputs", "_blob ", "_json ",
                                        "to_tensors")),
    ("decode (V2 codec)", ("sokuji/server/v2.py",)),
    ("check + arrays (from_tensors)", ("from_tensors", "_array ", "core/limits.py")),
    ("prepare", ("TensorModel.prepare",)),
    ("batcher: submit, forming, hand-off", ("core/batcher.py", "core/forming.py",
                                            "core/workers.py", "core/inline.py",
                                            "core/policy.py", "core/batcher_config.py",
                                            "kinds/encoder/model.py")),
    ("scheduling + admission", ("server/scheduling.py", "slo_admission", "check_admission")),
    ("accounting, metrics, timing", ("server/accounting.py", "observability/", "prometheus",
                                     "core/timing.py", "core/request.py")),
    ("Sokuji app + inference glue", ("server/app.py", "server/inference.py",
                                     "server/http.py", "server/hosts.py", "server/auth.py")),
    ("HTTP stack (uvicorn, httptools)", ("uvicorn/", "httptools")),
    ("asyncio / threads machinery", ("asyncio/", "concurrent/", "threading.py")),
)
IDLE_LEAVES = ("asyncio/runners.py", "concurrent/futures/thread.py", "threading.py",
               "selectors.py", "queue.py")
"""A stack whose innermost frame is one of these is a thread waiting (uvloop's poll shows as
``Runner.run``): not counted."""


def bucket_of(stack: str, buckets: tuple[tuple[str, tuple[str, ...]], ...] = PROFILE_BUCKETS
              ) -> str | None:
    """The first bucket a frame matches, from the innermost frame out; None: idle."""
    frames = stack.split(";")
    if any(k in frames[-1] for k in IDLE_LEAVES):
        return None
    for frame in reversed(frames):
        for label, keys in buckets:
            if any(k in frame for k in keys):
                return label
    return "other"


def profile_part(args: argparse.Namespace, w: Wire, server: GroupServer,
                 buckets: tuple[tuple[str, tuple[str, ...]], ...] = PROFILE_BUCKETS
                 ) -> dict[str, Any]:
    """py-spy samples of ``server`` while a c=1 client sends ``w``'s requests, by bucket."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return {"skipped": "py-spy is not installed"}
    assert server.proc is not None
    out_file = Path(tempfile.mkstemp(suffix=".txt")[1])
    client = w.c1(server.port)
    client.run(20)
    spy_proc = subprocess.Popen([spy, "record", "--format", "raw", "--rate", "500",
                                 "--duration", str(int(args.profile_seconds)), "--nonblocking",
                                 "--pid", str(server.proc.pid), "--output", str(out_file)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaching
    calls, t0 = 0, time.monotonic()
    while spy_proc.poll() is None and time.monotonic() - t0 < args.profile_seconds + 10:
        client.run(50)
        calls += 50
    _, err = spy_proc.communicate(timeout=30)
    stacks = Counter[str]()
    if out_file.exists():
        for line in out_file.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                stacks[stack] += int(count)
        out_file.unlink()
    counts, leaves = Counter[str](), Counter[str]()
    idle = 0
    for st, n in stacks.items():
        label = bucket_of(st, buckets)
        if label is None:
            idle += n
            continue
        counts[label] += n
        leaves[st.split(";")[-1]] += n
    busy = sum(counts.values())
    if not busy:
        return {"skipped": f"py-spy gave no samples: {err.decode()[-300:]}"}
    wall = max(1e-9, time.monotonic() - t0 - 1.0)
    return {"samples_busy": busy, "samples_idle": idle, "calls_during": calls, "rate_hz": 500,
            "busy_ms_per_call": busy / 500 / calls * 1e3 if calls else None,
            "wall_s": wall, "share_of_busy": {k: counts[k] / busy for k, _ in buckets
                                              if counts[k]} | {"other": counts["other"] / busy},
            "ms_per_call": {k: counts[k] / 500 / calls * 1e3 for k, _ in buckets}
            | {"other": counts["other"] / 500 / calls * 1e3} if calls else {},
            "top_leaf_frames": [(f, n / busy) for f, n in leaves.most_common(20)],
            "note": "py-spy samples of every server thread; a sample counts in the bucket of "
                    "its innermost matching frame; waiting threads (poll, queue get) are "
                    "left out"}


# --- the report ----------------------------------------------------------------------------

def plot(path: Path, goodput: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in goodput if "contenders" in goodput[m]]
    if not models:
        return
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8.5), squeeze=False)
    for col, m in enumerate(models):
        g = goodput[m]
        for name, res in g["contenders"].items():
            steps = sorted((st for st in res["steps"] if not st.get("discarded")),
                           key=lambda st: st["rate"])
            rates = [st["rate"] for st in steps]
            line = axes[0][col].plot(rates, [st["goodput_rps"] for st in steps], "o-",
                                     label=f"{name} (goodput {res['goodput_rps']:.0f}/s)")
            axes[1][col].plot(rates, [st["p99_ms"] or math.nan for st in steps], "o-",
                              color=line[0].get_color(), label=name)
        top = max(st["rate"] for r in g["contenders"].values() for st in r["steps"])
        axes[0][col].plot([0, top], [0, top], ls=":", color="grey", lw=1, label="offered")
        axes[0][col].set(title=f"{m}: goodput at p99 <= {g['slo_p99_ms']:g} ms",
                         xlabel="offered rate (requests/s, Poisson)",
                         ylabel="requests/s answered within the SLO")
        axes[1][col].axhline(g["slo_p99_ms"], color="red", ls="--", lw=1, label="SLO")
        axes[1][col].set(xlabel="offered rate (requests/s, Poisson)", ylabel="p99 (ms)",
                         yscale="log")
        for ax in (axes[0][col], axes[1][col]):
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def print_table(report: dict[str, Any]) -> None:
    rows: list[tuple[str, str, str, str]] = []
    for m, r in report.get("c1", {}).items():
        for form in ("sokuji_binary", "sokuji_json"):
            x = r[form]
            rows.append((f"{m} c=1 added p50 / p99, {form.split('_')[1]}",
                         f"{x['added_p50_ms']:.3f} / {x['added_p99_ms']:.3f} ms",
                         f"<= {TARGETS['c1_added_ms']} ms",
                         f"raw {r['raw']['p50_ms']:.3f} ms; HTTP floor (no model) "
                         f"{r['http_floor']['p50_ms']:.3f} ms"))
    for m, r in report.get("saturated", {}).items():
        extra = f"; at b{r['max_batch_size']}: {r['ratio_at_max_batch']:.3f}" \
            if "ratio_at_max_batch" in r else ""
        rows.append((f"{m} saturated / raw best", f"{r['ratio']:.3f}",
                     f">= {TARGETS['saturated_over_raw']}",
                     f"{r['sokuji_items_per_s']:.0f} vs {r['raw_items_per_s']:.0f}/s "
                     f"(b{r['raw_best_batch']}){extra}"))
    for m, g in report.get("goodput", {}).items():
        c = g["contenders"]
        rows.append((f"{m} goodput / better peer", f"{g['ratio']:.2f}",
                     f">= {TARGETS['goodput_over_best_peer']}",
                     ", ".join(f"{k} {v['goodput_rps']:.0f}" for k, v in c.items())
                     + f" req/s at p99 <= {g['slo_p99_ms']:g} ms"))
    for case, f in report.get("front", {}).items():
        rows.append((f"front {case}: granian vs uvicorn",
                     f"{f['c1_p50_granian_minus_uvicorn_ms']:+.3f} ms, "
                     f"x{f['saturated_granian_over_uvicorn']:.3f}", "(measure)",
                     f"c=1 p50 {f['uvicorn']['p50_ms']:.3f} / {f['granian']['p50_ms']:.3f} ms;"
                     f" sat {f['uvicorn']['saturated_items_per_s']:.0f} / "
                     f"{f['granian']['saturated_items_per_s']:.0f}/s"))
    print(f"\n{'figure':<42}{'measured':>24}{'target':>12}  detail")
    for a, b, c, d in rows:
        print(f"{a:<42}{b:>24}{c:>12}  {d}")
    for m, r in report.get("c1", {}).items():
        for form in ("sokuji_binary", "sokuji_json"):
            st = r[form].get("server_stage_mean_ms")
            if st:
                print(f"{m} {form} server stages at c=1 (mean ms): "
                      + ", ".join(f"{k} {v:.3f}" for k, v in st.items()))
    for m, r in report.get("saturated", {}).items():
        print(f"{m} saturated: server CPU per request: loop "
              f"{r['server_loop_cpu_ms_per_request']:.3f} ms + worker threads "
              f"{r['server_threads_cpu_ms_per_request']:.3f} ms")
    ab = report.get("ab")
    if ab:
        print(f"A/B (A {ab['trees']['a']}, B this tree), tabular binary: c=1 p50 "
              f"{ab['a']['p50_ms']:.3f} -> {ab['b']['p50_ms']:.3f} ms (paired chunk medians "
              f"{ab['c1_paired_chunk_median_b_minus_a_ms']:+.3f} ms); saturated "
              f"x{ab['saturated_b_over_a']:.3f}; CPU a request "
              f"{ab['cpu_per_request_b_minus_a_ms']:+.3f} ms")
    p = report.get("profile")
    if p and "ms_per_call" in p:
        print(f"profile (py-spy at c=1, tabular binary; {p['samples_busy']} busy samples, "
              f"{p['busy_ms_per_call']:.3f} ms busy a call), ms a call: "
              + ", ".join(f"{k} {v:.3f}" for k, v in p["ms_per_call"].items() if v))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="< 2 minutes: short runs; goodput and the front on tabular only")
    p.add_argument("--models", default="tabular,ocr")
    p.add_argument("--parts", default="c1,saturated,goodput,front,profile")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-seconds", type=float, default=1.0)
    p.add_argument("--sweep-seconds", type=float, default=1.5)
    p.add_argument("--litserve-timeout-ms", type=float, default=2.0,
                   help="LitServe's batch_timeout (Sokuji's max_queue_delay_ms default is 2)")
    p.add_argument("--capacity-seconds", type=float, default=3.0)
    p.add_argument("--front-chunks", type=int, default=16)
    p.add_argument("--front-seconds", type=float, default=3.0)
    p.add_argument("--profile-seconds", type=float, default=8.0)
    p.add_argument("--ab-before", default="",
                   help="another Sokuji source tree, served beside this one (tabular, c=1 and "
                   "saturated, alternating): a change measured before/after in one run")
    p.add_argument("--ab-chunks", type=int, default=30)
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
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tensor_serving.json"))
    args = p.parse_args()
    args.c1_calls = {"tabular": 400, "ocr": 40}
    args.seconds_sat = {"tabular": 3.0, "ocr": 6.0}
    args.slo_ms = dict(SLO_MS)
    if args.quick:
        args.c1_calls = {"tabular": 100, "ocr": 10}
        args.seconds_sat = {"tabular": 1.5, "ocr": 2.5}
        args.rounds, args.warmup_seconds, args.sweep_seconds = 1, 0.5, 0.5
        args.capacity_seconds, args.front_chunks, args.front_seconds = 1.0, 4, 1.0
        args.profile_seconds, args.ab_chunks = 3.0, 6
        args.seconds, args.max_steps, args.tolerance, args.max_reruns = 1.5, 3, 0.3, 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    os.sched_setaffinity(0, {args.client_core})
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)  # the children inherit it
    began = time.monotonic()
    report: dict[str, Any] = {"benchmark": "tensor_serving",
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "command": " ".join([Path(sys.executable).name, *sys.argv]),
                              "machine": machine.describe(), "sokuji_tree": source_tree(),
                              "settings": {k: v for k, v in vars(args).items()},
                              "targets": TARGETS}
    if "front" in parts and not args.quick:
        subprocess.run([sys.executable, "-m", "sokuji", "export", "minilm", "--cache-dir",
                        args.cache_dir], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    specs = {m: spec(m, args.cache_dir) for m in models}
    w = {m: wires(s) for m, s in specs.items()}
    raw = RawTensorRuntime(args.server_core, args.cache_dir)
    try:
        sweeps = {m: raw_sweep(args, raw, s) for m, s in specs.items()}
        report["raw_sweep"] = sweeps
        batch = {m: min(sweeps[m]["best_batch_size"], SOKUJI_MAX_BATCH_CAP[m]) for m in models}
        with sokuji_server(args, specs, batch) as sok:
            for m, s in specs.items():
                one_call(sok.port, w[m]["binary"])  # warm
                if "c1" in parts:
                    report.setdefault("c1", {})[m] = c1_part(args, raw, s, w[m], sok.port)
            if "profile" in parts and "tabular" in specs:
                report["profile"] = profile_part(args, w["tabular"]["binary"], sok)
            for m, s in specs.items():
                if "saturated" in parts:
                    report.setdefault("saturated", {})[m] = saturated_part(
                        args, raw, s, w[m]["binary"], sok, sweeps[m]["best_batch_size"],
                        batch[m])
            for m, s in specs.items():
                if "goodput" in parts and not (args.quick and m != "tabular"):
                    report.setdefault("goodput", {})[m] = goodput_part(args, s, w[m], sok,
                                                                      batch[m])
    finally:
        raw.close()
    if "front" in parts:
        report["front"] = front_part(args, specs, batch, w)
    if args.ab_before and "tabular" in specs:
        report["ab"] = ab_part(args, specs, batch, w["tabular"]["binary"])
    report["wall_s"] = time.monotonic() - began
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    if "goodput" in report:
        plot(out.with_suffix(".png"), report["goodput"])
    print_table(report)
    png = f"; plot: {out.with_suffix('.png')}" if "goodput" in report else ""
    print(f"raw JSON: {out}{png}; {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

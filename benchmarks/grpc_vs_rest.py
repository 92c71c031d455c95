"""KServe V2 over gRPC against V2 over REST (binary tensors), side by side in one server
process, with ONNX Runtime called directly as the baseline.

    .venv/bin/python benchmarks/grpc_vs_rest.py [--quick] [--rounds 4] [--out FILE]
    (--quick: under 2 minutes; the full run ~5 minutes)

One ``sokuji serve`` with ``grpc_port`` serves two models: ``minilm`` (the built-in text
encoder, one text of ``sokuji/bench/data/short.jsonl`` a request) and ``tabular``
(``_tensor_models.py``: a scikit-learn gradient-boosting classifier exported to ONNX, one
FP32 row of 30 features a request). Every session has 1 intra-op thread and the response
cache is off. The server and the raw runtime are pinned to the server core, this process
(the load generator) to the client core.

Contenders, alternated round by round (a shared machine's drift falls on all alike):
- ``rest``: ``tritonclient.http`` with ``binary_data=True`` on the input and every output
  (Triton's binary tensor extension);
- ``grpc``: ``tritonclient.grpc`` (raw contents, as it always sends);
- ``raw``: the runtime called directly in a child process on the server core: for minilm the
  tokenisation and ONNX Runtime session Sokuji uses (``serving_overhead.py``'s raw runtime),
  for tabular ``InferenceSession.run`` on the same session options (``_tensor_raw.py``).

Figures: at concurrency 1, p50 and p99 and the ms each protocol adds over the raw call (the
client library's own cost is in it: both clients are the ones users run); saturated (a closed
loop of ``tritonclient.*.aio`` clients, 2 x max_batch_size in flight), items/s and the ratio
to the raw runtime's throughput at the batch size the server formed in that round (its
statistics: inference_count / execution_count, printed: compare it between the protocols),
and gRPC / REST. ``--inline-max-ms 0`` turns the inline path off (every request through the
batcher); by default the server's setting holds. Prints them; writes the raw
samples as JSON under ``benchmarks/results/`` (git-ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine
from _harness import Server, free_port, percentile
from _tensor_models import inputs as tensor_inputs
from _tensor_models import spec as tensor_spec
from _tensor_raw import RawTensorRuntime
from serving_overhead import RawRuntime, load_texts

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("minilm", "tabular")
PROTOCOLS = ("rest", "grpc")


# --- the models' inputs, as each client sends them ------------------------------------------

class Workload:
    """One model's requests: one input array each, and the outputs asked for."""

    def __init__(self, name: str, arrays: list[np.ndarray], input_name: str,
                 outputs: tuple[str, ...], max_batch: int) -> None:
        self.name, self.arrays, self.input_name = name, arrays, input_name
        self.outputs, self.max_batch = outputs, max_batch

    def inputs(self, module: Any, binary: bool) -> list[list[Any]]:
        from tritonclient.utils import np_to_triton_dtype

        out = []
        for array in self.arrays:
            x = module.InferInput(self.input_name, list(array.shape),
                                  np_to_triton_dtype(array.dtype))
            if binary:
                x.set_data_from_numpy(array, binary_data=True)
            else:
                x.set_data_from_numpy(array)
            out.append([x])
        return out

    def requested(self, module: Any, binary: bool) -> list[Any]:
        if binary:
            return [module.InferRequestedOutput(o, binary_data=True) for o in self.outputs]
        return [module.InferRequestedOutput(o) for o in self.outputs]


def workloads(args: argparse.Namespace) -> dict[str, Workload]:
    texts = load_texts("short")
    tab = tensor_spec("tabular", args.cache_dir)
    return {
        "minilm": Workload("minilm", [np.array([t], dtype=np.object_) for t in texts], "text",
                           ("embedding",), args.minilm_batch),
        "tabular": Workload("tabular", tensor_inputs(tab, 64), tab.input_name, tab.outputs,
                            args.tabular_batch)}


def config(args: argparse.Namespace, port: int, grpc_port: int) -> str:
    tab = tensor_spec("tabular", args.cache_dir)
    inline = "" if args.inline_max_ms is None else f"inline_max_ms = {args.inline_max_ms}\n"
    return f"""
port = {port}
grpc_port = {grpc_port}
cache_dir = "{args.cache_dir}"
log_level = "warning"
[[models]]
name = "minilm"
cache = false
intra_op_threads = 1
max_batch_size = {args.minilm_batch}
{inline}[[models]]
name = "tabular"
runtime = "tensor"
path = "{tab.path}"
cache = false
intra_op_threads = 1
max_batch_size = {args.tabular_batch}
{inline}"""


# --- the raw runtime --------------------------------------------------------------------------

class Raw:
    """Both models' raw runtimes (child processes on the server core)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.encoder = RawRuntime(args)
        self.tensor = RawTensorRuntime(args.server_core, args.cache_dir)

    def single(self, model: str, calls: int) -> list[float]:
        if model == "minilm":
            return list(self.encoder.call(cmd="single", dataset="short", calls=calls))
        return list(self.tensor.call(cmd="single", model=model, calls=calls))

    def rate(self, model: str, bs: int, seconds: float) -> float:
        if model == "minilm":
            r = self.encoder.call(cmd="throughput", dataset="short", bs=bs, seconds=seconds)
        else:
            r = self.tensor.call(cmd="throughput", model=model, bs=bs, seconds=seconds)
        return float(r["items"] / r["seconds"])

    def close(self) -> None:
        self.encoder.close()
        self.tensor.close()


# --- concurrency 1 ----------------------------------------------------------------------------

class C1:
    """The sync tritonclient of one protocol, its requests prebuilt."""

    def __init__(self, protocol: str, http_url: str, grpc_url: str, w: Workload) -> None:
        if protocol == "rest":
            import tritonclient.http as module

            self.client: Any = module.InferenceServerClient(http_url)
        else:
            import tritonclient.grpc as module  # type: ignore[no-redef]

            self.client = module.InferenceServerClient(grpc_url)
        binary = protocol == "rest"
        self.w, self.reqs = w, w.inputs(module, binary)
        self.outs = w.requested(module, binary)
        self.cursor = 0

    def run(self, calls: int) -> list[float]:
        out = []
        for _ in range(calls):
            x = self.reqs[self.cursor % len(self.reqs)]
            self.cursor += 1
            t0 = time.perf_counter()
            self.client.infer(self.w.name, x, outputs=self.outs)
            out.append((time.perf_counter() - t0) * 1e3)
        return out


def latency(args: argparse.Namespace, raw: Raw, http_url: str, grpc_url: str,
            w: Workload) -> dict[str, Any]:
    clients = {p: C1(p, http_url, grpc_url, w) for p in PROTOCOLS}
    for c in clients.values():
        c.run(20)  # warm each path
    raw.single(w.name, 20)
    lat: dict[str, list[float]] = {k: [] for k in ("raw", *PROTOCOLS)}
    order = ["raw", *PROTOCOLS]
    for r in range(args.rounds * args.c1_chunks):
        for k in order[r % 3:] + order[:r % 3]:  # the order rotates chunk by chunk
            lat[k] += raw.single(w.name, args.c1_calls) if k == "raw" \
                else clients[k].run(args.c1_calls)
    out: dict[str, Any] = {"samples_ms": lat}
    for k, v in lat.items():
        out[k] = {"p50": statistics.median(v), "p99": percentile(v, 99), "n": len(v)}
    for p in PROTOCOLS:
        out[p]["added_p50_ms"] = out[p]["p50"] - out["raw"]["p50"]
        out[p]["added_p99_ms"] = out[p]["p99"] - out["raw"]["p99"]
    return out


# --- saturated --------------------------------------------------------------------------------

async def closed_loop(protocol: str, http_url: str, grpc_url: str, w: Workload,
                      concurrency: int, warmup_s: float, seconds: float) -> dict[str, Any]:
    """``concurrency`` workers over the protocol's aio client, each sending when its last
    reply arrived; the completions inside the window (after ``warmup_s``) counted."""
    if protocol == "rest":
        import tritonclient.http as sync
        import tritonclient.http.aio as aio

        client: Any = aio.InferenceServerClient(http_url, conn_limit=concurrency)
    else:
        import tritonclient.grpc as sync  # type: ignore[no-redef]
        import tritonclient.grpc.aio as aio  # type: ignore[no-redef]

        client = aio.InferenceServerClient(grpc_url)
    binary = protocol == "rest"
    reqs, outs = w.inputs(sync, binary), w.requested(sync, binary)
    done: list[tuple[float, float]] = []
    errors = 0
    begin = time.perf_counter()
    start, stop = begin + warmup_s, begin + warmup_s + seconds

    async def worker(k: int) -> None:
        nonlocal errors
        i = k
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            try:
                await client.infer(w.name, reqs[i % len(reqs)], outputs=outs)
            except Exception:  # noqa: BLE001 - counted, the load goes on
                errors += 1
            t1 = time.perf_counter()
            done.append((t1, t1 - t0))
            i += concurrency

    try:
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    finally:
        await client.close()
    window = sorted(t for t, _ in done if start <= t < stop)
    if len(window) < 2:
        raise RuntimeError(f"{protocol}: only {len(window)} completions in the window")
    return {"items": sum(1 for t in window if t > window[0]),
            "seconds": window[-1] - window[0], "errors": errors,
            "latencies_ms": [lat * 1e3 for t, lat in done if start <= t < stop]}


def counts(port: int, model: str) -> tuple[int, int]:
    """The model's inference and execution counts (REST statistics)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", f"/v2/models/{model}/stats")
    doc = json.loads(conn.getresponse().read())
    s = doc["model_stats"][0]
    return int(s["inference_count"]), int(s["execution_count"])


def saturated(args: argparse.Namespace, raw: Raw, port: int, http_url: str, grpc_url: str,
              w: Workload) -> dict[str, Any]:
    concurrency = 2 * w.max_batch
    rounds: dict[str, list[dict[str, Any]]] = {p: [] for p in PROTOCOLS}
    for r in range(args.rounds):
        for p in (PROTOCOLS if r % 2 == 0 else PROTOCOLS[::-1]):
            i0, e0 = counts(port, w.name)
            got = asyncio.run(closed_loop(p, http_url, grpc_url, w, concurrency,
                                          args.warmup_seconds, args.seconds))
            i1, e1 = counts(port, w.name)
            batch = (i1 - i0) / max(1, e1 - e0)
            got["mean_batch"] = batch
            bs = max(1, round(batch))
            got["raw_batch"] = bs
            got["raw_items_per_s"] = raw.rate(w.name, bs, args.seconds)
            got["items_per_s"] = got["items"] / got["seconds"]
            got["over_raw"] = got["items_per_s"] / got["raw_items_per_s"]
            rounds[p].append(got)
    out: dict[str, Any] = {"concurrency": concurrency, "rounds": rounds}
    for p in PROTOCOLS:
        rs = rounds[p]
        out[p] = {"items_per_s": sum(r["items"] for r in rs) / sum(r["seconds"] for r in rs),
                  "over_raw": statistics.median(r["over_raw"] for r in rs),
                  "mean_batch": statistics.mean(r["mean_batch"] for r in rs),
                  "errors": sum(r["errors"] for r in rs)}
    out["grpc_over_rest"] = out["grpc"]["items_per_s"] / out["rest"]["items_per_s"]
    return out


# --- the run ----------------------------------------------------------------------------------

def report(doc: dict[str, Any]) -> None:
    for model, res in doc["models"].items():
        c1 = res["c1"]
        print(f"[{model}] c=1 ms     raw p50 {c1['raw']['p50']:.3f} p99 {c1['raw']['p99']:.3f}")
        for p in PROTOCOLS:
            print(f"[{model}] c=1 ms    {p:>4} p50 {c1[p]['p50']:.3f} p99 {c1[p]['p99']:.3f}"
                  f"  added over raw: p50 {c1[p]['added_p50_ms']:+.3f} "
                  f"p99 {c1[p]['added_p99_ms']:+.3f}")
        sat = res["saturated"]
        for p in PROTOCOLS:
            s = sat[p]
            print(f"[{model}] saturated {p:>4} {s['items_per_s']:8.1f} items/s, "
                  f"{s['over_raw']:.2f} x raw at the batch formed (mean {s['mean_batch']:.1f}),"
                  f" errors {s['errors']}")
        print(f"[{model}] saturated grpc / rest {sat['grpc_over_rest']:.2f}; "
              f"c=1 p50 grpc - rest {c1['grpc']['p50'] - c1['rest']['p50']:+.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (under 2 minutes)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--c1-chunks", type=int, default=5, help="c=1 chunks per round")
    p.add_argument("--c1-calls", type=int, default=20, help="calls per c=1 chunk")
    p.add_argument("--seconds", type=float, default=6.0, help="saturated window per round")
    p.add_argument("--warmup-seconds", type=float, default=1.0)
    p.add_argument("--minilm-batch", type=int, default=8)
    p.add_argument("--tabular-batch", type=int, default=32)
    p.add_argument("--inline-max-ms", type=float, default=None,
                   help="both models' inline_max_ms (default: the server's)")
    p.add_argument("--server-core", type=int, default=1)
    p.add_argument("--client-core", type=int, default=0)
    p.add_argument("--cache-dir", default=str(ROOT / ".cache" / "sokuji"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grpc_vs_rest.json"))
    args = p.parse_args()
    if args.quick:
        args.rounds, args.c1_chunks, args.c1_calls = 2, 2, 15
        args.seconds, args.warmup_seconds = 2.0, 0.5
    models = [m for m in args.models.split(",") if m]
    if unknown := set(models) - set(MODELS):
        raise SystemExit(f"unknown models {sorted(unknown)}: {', '.join(MODELS)}")
    os.sched_setaffinity(0, {args.client_core})
    loads = workloads(args)
    port, grpc_port = free_port(), free_port()
    http_url, grpc_url = f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    doc: dict[str, Any] = {"args": vars(args), "machine": machine.describe(), "models": {}}
    raw = Raw(args)
    try:
        with Server(args, [sys.executable, "-m", "sokuji", "serve"], port,
                    config=config(args, port, grpc_port)):
            for model in models:
                w = loads[model]
                print(f"[{model}] c=1 ...", flush=True)
                c1 = latency(args, raw, http_url, grpc_url, w)
                print(f"[{model}] saturated ...", flush=True)
                sat = saturated(args, raw, port, http_url, grpc_url, w)
                doc["models"][model] = {"c1": c1, "saturated": sat}
    finally:
        raw.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    report(doc)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

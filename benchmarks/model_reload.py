"""Model reloads under load: what a reload costs the requests around it.

    .venv/bin/python benchmarks/model_reload.py [--seconds 10] [--every 0.5]   (~30 s)

One ``sokuji serve`` (core 1) of an iris classifier (scikit-learn, exported by skl2onnx;
runtime tensor, cache off); four closed-loop client threads (core 0, keep-alive, V2 JSON, 1-8
rows a request). Side by side in one run, each for --seconds: ``steady`` (no reloads), then
``reloading`` (the model file replaced and ``POST .../load`` every --every seconds, two
classifiers in turn). Reported for each: requests, failures (target 0), p50 / p99 / max
latency, and the reloading phase's p99 over the steady one's; the load calls' own durations.
Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _harness import Server, free_port, percentile  # noqa: E402


def _files() -> tuple[dict[str, bytes], np.ndarray]:
    from skl2onnx import to_onnx
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression
    from sklearn.tree import DecisionTreeClassifier

    x, y = load_iris(return_X_y=True)
    x = x.astype(np.float32)
    models = {"a": LogisticRegression(max_iter=500).fit(x, y),
              "b": DecisionTreeClassifier(max_depth=3, random_state=0).fit(x, y + 3)}
    return {k: to_onnx(m, x[:1], options={"zipmap": False}).SerializeToString()
            for k, m in models.items()}, x


def _phase(port: int, x: np.ndarray, seconds: float, reload: Any) -> dict[str, Any]:
    stop = threading.Event()
    lat: list[float] = []
    failures: list[str] = []

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while not stop.is_set():
            rows = x[rng.choice(len(x), size=int(rng.integers(1, 9)), replace=False)]
            body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32",
                                           "shape": list(rows.shape),
                                           "data": rows.ravel().tolist()}]})
            t0 = time.perf_counter()
            conn.request("POST", "/v2/models/iris/infer", body,
                         {"content-type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            lat.append((time.perf_counter() - t0) * 1e3)
            if r.status != 200:
                failures.append(f"{r.status} {data[:200]!r}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    loads = reload(seconds) if reload else time.sleep(seconds) or []
    stop.set()
    for t in threads:
        t.join()
    return {"requests": len(lat), "failures": len(failures), "failure_samples": failures[:5],
            "p50_ms": round(percentile(lat, 50), 3), "p99_ms": round(percentile(lat, 99), 3),
            "max_ms": round(max(lat), 3), "reloads": len(loads),
            "load_call_ms": {"p50": round(percentile(loads, 50), 1),
                             "max": round(max(loads), 1)} if loads else None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--every", type=float, default=0.5)
    p.add_argument("--server-core", type=int, default=1)
    p.add_argument("--out", default="model_reload.json")
    args = p.parse_args()
    files, x = _files()
    tmp = Path(tempfile.mkdtemp(prefix="sokuji-reload-"))
    path = tmp / "iris.onnx"
    path.write_bytes(files["a"])
    port = free_port()
    config = f"""port = {port}
cache_dir = "{tmp}"
log_level = "warning"
builtin_pipelines = false
dashboard = false
[[models]]
name = "iris"
runtime = "tensor"
path = "{path}"
cache = false
max_batch_size = 16
"""

    def reload(seconds: float) -> list[float]:
        took: list[float] = []
        end, i = time.monotonic() + seconds, 0
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while time.monotonic() < end:
            i += 1
            new = path.with_suffix(".tmp")
            new.write_bytes(files["ab"[i % 2]])
            os.replace(new, path)
            t0 = time.perf_counter()
            conn.request("POST", "/v2/repository/models/iris/load", b"")
            r = conn.getresponse()
            r.read()
            assert r.status == 200, r.status
            took.append((time.perf_counter() - t0) * 1e3)
            time.sleep(args.every)
        return took

    with Server(args, [sys.executable, "-m", "sokuji", "serve"], port, config=config):
        os.sched_setaffinity(0, {0})
        _phase(port, x, 1.0, None)  # warm the connections and the model
        steady = _phase(port, x, args.seconds, None)
        reloading = _phase(port, x, args.seconds, reload)
    doc = {"steady": steady, "reloading": reloading,
           "p99_ratio": round(reloading["p99_ms"] / steady["p99_ms"], 3)}
    Path(args.out).write_text(json.dumps(doc, indent=2))
    for name in ("steady", "reloading"):
        r = doc[name]
        print(f"{name:10s} requests {r['requests']:6d}  failures {r['failures']}  "
              f"p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  max {r['max_ms']:.1f} ms"
              + (f"  reloads {r['reloads']} (load call p50 {r['load_call_ms']['p50']} ms)"
                 if r["reloads"] else ""))
    print(f"p99 reloading / steady: {doc['p99_ratio']}x")


if __name__ == "__main__":
    main()

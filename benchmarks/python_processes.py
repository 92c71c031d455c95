"""Worker processes escape the GIL: a pure-Python, GIL-bound scorer
(``tests/data/pymodels/pool_scorer.py``, ~2-5 ms a request) through ``ProcessRunner`` with
1 worker and with 2, and through ``ThreadRunner`` with 2 instances (threads of one
process: the GIL lets one run at a time), each driven by 2 threads calling ``run`` with
batches, as a model's batcher does (one thread per worker). Issue 27's target: 2 workers on
2 cores >= 1.7x one worker.

    PYTHONPATH=. .venv/bin/python benchmarks/python_processes.py [--seconds 5]   (~20 s)

Prints requests/s and the ratios, with the load average (other work on the machine's cores
takes from the 2-worker figure first); writes ``benchmarks/results/python_processes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sokuji.pycode import entry  # noqa: E402
from sokuji.pycode.inthread import ThreadRunner  # noqa: E402
from sokuji.pycode.pool import ProcessRunner  # noqa: E402

TARGET = str(ROOT / "tests" / "data" / "pymodels" / "pool_scorer.py") + ":Scorer"


def drive(runner: Any, batch: list[dict[str, Any]], seconds: float, threads: int = 2
          ) -> dict[str, float]:
    """``threads`` threads calling ``runner.run(batch)`` for ``seconds``: requests/s."""
    for _ in range(3):
        runner.run(batch)
    counts = [0] * threads
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    def body(i: int) -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            runner.run(batch)
            latencies.append(time.perf_counter() - t0)
            counts[i] += len(batch)

    workers = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    return {"requests_per_s": round(sum(counts) / elapsed, 1),
            "batch_ms_p50": round(statistics.median(latencies) * 1000, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--floats", type=int, default=2000)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                             "python_processes.json"))
    args = parser.parse_args()
    code = entry.load(TARGET, "options.entry")
    rng = np.random.default_rng(0)
    batch = [{"x": rng.random(args.floats)} for _ in range(args.batch)]
    direct = ThreadRunner(code, {}, "scorer")
    direct.start()
    t0 = time.perf_counter()
    for _ in range(20):
        direct.run(batch[:1])
    per_request_ms = (time.perf_counter() - t0) / 20 * 1000
    direct.close()
    print(f"one request scored in {per_request_ms:.2f} ms; load average before "
          f"{os.getloadavg()}", flush=True)
    results: dict[str, Any] = {}
    for name, make in (("processes_1", lambda: ProcessRunner(code, {}, "scorer", 1, 0, None)),
                       ("processes_2", lambda: ProcessRunner(code, {}, "scorer", 2, 0, None)),
                       ("threads_2", lambda: ThreadRunner(code, {}, "scorer", instances=2))):
        runner = make()
        runner.start()
        try:
            results[name] = drive(runner, batch, args.seconds)
        finally:
            runner.close()
        print(f"{name:>12}: {results[name]['requests_per_s']:8.1f} requests/s  batch p50 "
              f"{results[name]['batch_ms_p50']:.2f} ms", flush=True)
    one = results["processes_1"]["requests_per_s"]
    ratio = results["processes_2"]["requests_per_s"] / one
    threads_ratio = results["threads_2"]["requests_per_s"] / one
    load = os.getloadavg()
    print(f"2 workers / 1 worker: {ratio:.2f}x (target >= 1.7x); 2 threads in one process / "
          f"1 worker: {threads_ratio:.2f}x; load average after {load}")
    report = {"benchmark": "python_processes", "per_request_ms": round(per_request_ms, 3),
              "batch": args.batch, "floats": args.floats, "seconds": args.seconds,
              "results": results, "two_over_one": round(ratio, 3),
              "threads_over_one": round(threads_ratio, 3), "target": 1.7,
              "loadavg_after": load, "cpus": os.cpu_count(),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

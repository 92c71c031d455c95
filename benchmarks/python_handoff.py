"""The hand-off of a batch to a Python model's worker process and back: shared memory for
numpy buffers against plain pickling over the pipe (``sokuji/pycode/shm.py``), per batch
size, and the in-thread call beside them (what a process hop costs).

    PYTHONPATH=. .venv/bin/python benchmarks/python_handoff.py [--reps 200]   (~20 s)

One worker of an echo model (``tests/data/pymodels/pool_faulty.py``: y = x * 2) runs a
batch of one request whose ``x`` is a float32 array of the size; the figure is the median
round trip of ``ProcessRunner.run`` with ``min_bytes = 0`` (every buffer through shared
memory) and with ``min_bytes = NEVER`` (plain pickling), and ``ThreadRunner.run`` for the
same batch. Prints the ratios; writes ``benchmarks/results/python_handoff.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sokuji.pycode import entry, shm  # noqa: E402
from sokuji.pycode.inthread import ThreadRunner  # noqa: E402
from sokuji.pycode.pool import ProcessRunner  # noqa: E402

SIZES = {"1KB": 1 << 10, "64KB": 64 << 10, "128KB": 128 << 10, "256KB": 256 << 10,
         "1MB": 1 << 20, "16MB": 16 << 20}
TARGET = str(ROOT / "tests" / "data" / "pymodels" / "pool_faulty.py") + ":Faulty"


def median_ms(runner: Any, batch: list[dict[str, Any]], reps: int) -> float:
    for _ in range(5):
        runner.run(batch)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.run(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                             "python_handoff.json"))
    args = parser.parse_args()
    code = entry.load(TARGET, "options.entry")
    runners = {"shm": ProcessRunner(code, {}, "handoff", 1, 0, None, min_bytes=0),
               "pickle": ProcessRunner(code, {}, "handoff", 1, 0, None,
                                       min_bytes=shm.NEVER),
               "thread": ThreadRunner(code, {}, "handoff")}
    for r in runners.values():
        r.start()
    rows = []
    try:
        for label, nbytes in SIZES.items():
            batch = [{"x": np.ones(nbytes // 4, np.float32)}]
            reps = max(20, args.reps if nbytes <= 1 << 20 else args.reps // 5)
            got = {name: median_ms(r, batch, reps) for name, r in runners.items()}
            row = {"size": label, "bytes": nbytes, "reps": reps,
                   **{f"{k}_ms": round(v, 4) for k, v in got.items()},
                   "pickle_over_shm": round(got["pickle"] / got["shm"], 2),
                   "hop_ms": round(min(got["shm"], got["pickle"]) - got["thread"], 4)}
            rows.append(row)
            print(f"{label:>5}: shm {got['shm']:8.3f} ms  pickle {got['pickle']:8.3f} ms  "
                  f"thread {got['thread']:7.3f} ms  pickle/shm {row['pickle_over_shm']:.2f}x"
                  f"  hop {row['hop_ms']:.3f} ms", flush=True)
    finally:
        for r in runners.values():
            r.close()
    report = {"benchmark": "python_handoff", "rows": rows, "min_bytes": shm.MIN_BYTES,
              "loadavg": os.getloadavg(), "cpus": os.cpu_count(),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

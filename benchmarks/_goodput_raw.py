"""For ``goodput.py``: the raw runtime, a child process on the server core calling the same
tokenisation and ONNX Runtime session code Sokuji uses (``OnnxEncoderRuntime``, 1 thread),
one batch of short texts after another; and the limit derived from its call times.

The rule: a batch of B takes t_B. Under a steady stream of batches a request that arrives
just after a batch started waits for it, then for its own: ~2 t_B. So B fits the SLO when
2 x p99(t_B) <= SLO, and the limit is the best B / mean(t_B) among the sizes that fit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _goodput_search import DISTURBED_SHARE, core_busy_s, process_cpu_s

from sokuji.bench import dataset

ROOT = Path(__file__).resolve().parent.parent
BATCH_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64)


def raw_worker_main(core: int, cache_dir: str) -> None:
    os.sched_setaffinity(0, {core})
    from sokuji.runtimes.onnx import OnnxEncoderRuntime
    from sokuji.weights import minilm

    rt = OnnxEncoderRuntime(minilm.ensure_onnx(cache_dir), minilm.tokenizer_path(),
                            intra_op_threads=1, max_sequence_length=minilm.max_sequence_length())
    rt.load()
    rt.warmup()
    sampler = dataset.Sampler(dataset.load("short"), seed=0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        bs, times_ms = cmd["bs"], list[float]()
        start = time.perf_counter()
        while time.perf_counter() - start < cmd["seconds"] or len(times_ms) < cmd["min_calls"]:
            texts = [sampler.next().text for _ in range(bs)]
            t0 = time.perf_counter()
            rt.run_batch([rt.preprocess([t]) for t in texts])
            times_ms.append((time.perf_counter() - t0) * 1e3)
        print(json.dumps(times_ms), flush=True)


class RawRuntime:
    def __init__(self, args: argparse.Namespace) -> None:
        self.core = args.server_core
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(args.server_core), args.cache_dir],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self._read()
        self.disturbed = 0
        """Measurements thrown away because something else used the core meanwhile."""

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        return json.loads(self.proc.stdout.readline())

    def calls(self, bs: int, seconds: float, min_calls: int) -> list[float]:
        """Per-call milliseconds of batches of ``bs`` short texts, back to back. Measured
        again (twice at most) when anything else took over ``DISTURBED_SHARE`` of the core
        meanwhile; judged only over 0.25 s or more (the kernel counts CPU time in ticks)."""
        assert self.proc.stdin is not None
        for _ in range(3):
            core0, cpu0, t0 = core_busy_s(self.core), process_cpu_s(self.proc.pid), \
                time.perf_counter()
            self.proc.stdin.write(json.dumps({"bs": bs, "seconds": seconds,
                                              "min_calls": min_calls}) + "\n")
            self.proc.stdin.flush()
            times_ms = list(self._read())
            wall_s = time.perf_counter() - t0
            other_s = core_busy_s(self.core) - core0 - (process_cpu_s(self.proc.pid) - cpu0)
            if wall_s < 0.25 or other_s / wall_s <= DISTURBED_SHARE:
                break
            self.disturbed += 1
        return times_ms

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def raw_sweep(raw: RawRuntime, args: argparse.Namespace, slo_ms: float,
              sizes: tuple[int, ...]) -> dict[int, list[float]]:
    """Per-call times for each size; without ``sizes``, up the grid until two sizes in a row
    miss the SLO (larger batches only take longer)."""
    out: dict[int, list[float]] = {}
    misses = 0
    for bs in sizes or BATCH_SIZES:
        out[bs] = raw.calls(bs, args.raw_seconds, args.raw_min_calls)
        misses = misses + 1 if 2 * _p99(out[bs]) > slo_ms else 0
        if not sizes and misses == 2:
            break
    return out


def derive_limit(samples: dict[int, list[float]], slo_ms: float) -> dict[str, Any]:
    table = {bs: {"calls": len(v), "mean_ms": statistics.fmean(v), "p99_ms": _p99(v),
                  "items_per_s": bs / statistics.fmean(v) * 1e3,
                  "fits": 2 * _p99(v) <= slo_ms} for bs, v in sorted(samples.items())}
    fitting = [bs for bs, row in table.items() if row["fits"]]
    if not fitting:
        raise RuntimeError(f"no batch size fits the SLO: a single call's p99 is "
                           f"{table[min(table)]['p99_ms']:.1f} ms")
    best = max(fitting, key=lambda bs: table[bs]["items_per_s"])
    return {"rule": "best B with 2 x p99(t_B) <= SLO; limit = B / mean(t_B)",
            "batch_size": best, "items_per_s": table[best]["items_per_s"],
            "single_call_items_per_s": table[1]["items_per_s"],
            "by_batch_size": {str(bs): row for bs, row in table.items()}}


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class Limit:
    """The raw runtime's per-call samples by batch size, pooled over the whole run: the full
    grid at the start, then the sizes near the best one again after every round of server
    runs, so the limit sees the same drift of the machine as the servers do."""

    def __init__(self, raw: RawRuntime, args: argparse.Namespace, slo_ms: float) -> None:
        self.raw, self.args, self.slo_ms = raw, args, slo_ms
        self.samples = raw_sweep(raw, args, slo_ms, ())
        first = derive_limit(self.samples, slo_ms)
        best = first["batch_size"]
        rows = first["by_batch_size"]
        near = [bs for bs in self.samples if rows[str(bs)]["fits"]
                and rows[str(bs)]["items_per_s"] >= 0.9 * first["items_per_s"]]
        above = [bs for bs in self.samples if bs > best][:2]
        self.candidates = sorted(set(near[-3:]) | {best} | set(above))
        self.first = first
        self.rounds: list[dict[str, float]] = []

    def remeasure(self) -> None:
        """One round of the candidate sizes, ~``raw_round_seconds`` in all."""
        share_s = self.args.raw_round_seconds / len(self.candidates)
        row: dict[str, float] = {}
        for bs in self.candidates:
            mean_ms = statistics.fmean(self.samples[bs])
            more = self.raw.calls(bs, 0.0, max(3, round(share_s * 1e3 / mean_ms)))
            self.samples[bs] += more
            row[str(bs)] = bs / statistics.fmean(more) * 1e3
        self.rounds.append(row)

    def result(self) -> dict[str, Any]:
        out = derive_limit(self.samples, self.slo_ms)
        out.update(first_grid_items_per_s=self.first["items_per_s"],
                   first_grid_batch_size=self.first["batch_size"],
                   candidates=self.candidates, rounds_items_per_s=self.rounds,
                   measurements_disturbed=self.raw.disturbed)
        return out


if __name__ == "__main__":  # the child: python _goodput_raw.py CORE CACHE_DIR
    raw_worker_main(int(sys.argv[1]), sys.argv[2])

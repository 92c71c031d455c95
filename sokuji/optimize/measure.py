"""Measuring one variant, in a child process of its own (``python -m
sokuji.optimize.measure``), so its peak memory is its own and no variant warms another's
caches.

Figures: load time, peak resident memory (``ru_maxrss``), p50 latency at batch 1 over the
evaluation texts, items/s at batch sizes 1, 8 and 32 (length-sorted batches, as the server's
length-aware batcher forms them; the best is reported), and the embeddings of the evaluation
texts and queries for the parent to judge quality against FP32.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

BATCH_SIZES = (1, 8, 32)


class Encoder:
    """The server's own ONNX runtime (same session options, tokenisation and padding), with
    no batcher in front."""

    def __init__(self, model: Path, tokenizer: Path, threads: int, max_length: int) -> None:
        from sokuji.runtimes.onnx import OnnxEncoderRuntime

        self.runtime = OnnxEncoderRuntime(model, tokenizer, intra_op_threads=threads,
                                          max_sequence_length=max_length)
        self.runtime.load()

    def length(self, text: str) -> int:
        return self.runtime.preprocess([text]).length

    def feeds(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        return self.runtime.feeds(self.runtime.preprocess(texts).data)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = self.runtime.run_batch([self.runtime.preprocess(texts)])[0]
        return np.asarray(out, dtype=np.float32)


def measure(model: Path, tokenizer: Path, texts: list[str], queries: list[str],
            threads: int, max_length: int, out_dir: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    enc = Encoder(model, tokenizer, threads, max_length)
    load_s = time.perf_counter() - t0
    for text in texts[:5]:
        enc.embed([text])
    lat = []
    for text in texts:
        t = time.perf_counter()
        enc.embed([text])
        lat.append(time.perf_counter() - t)
    by_length = sorted(texts, key=enc.length)
    throughput = {}
    for size in BATCH_SIZES:
        batches = [by_length[i:i + size] for i in range(0, len(by_length), size)]
        enc.embed(batches[-1])  # the longest shapes once, before timing
        t = time.perf_counter()
        for batch in batches:
            enc.embed(batch)
        throughput[str(size)] = len(texts) / (time.perf_counter() - t)
    best = max(throughput, key=lambda k: throughput[k])
    emb = np.concatenate([enc.embed(texts[i:i + 16]) for i in range(0, len(texts), 16)])
    qemb = np.concatenate([enc.embed(queries[i:i + 16]) for i in range(0, len(queries), 16)])
    np.save(out_dir / "texts.npy", emb)
    np.save(out_dir / "queries.npy", qemb)
    return {"load_s": load_s, "p50_ms_batch1": statistics.median(lat) * 1e3,
            "throughput_items_per_s": throughput, "best_batch": int(best),
            "best_items_per_s": throughput[best],
            "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's high-water resident memory. ``VmHWM`` starts afresh at exec;
    ``ru_maxrss`` would carry over the parent's peak from before the fork."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = measure(Path(spec["model"]), Path(spec["tokenizer"]), spec["texts"],
                     spec["queries"], spec["threads"], spec["max_length"],
                     Path(spec["out_dir"]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

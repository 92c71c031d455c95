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
    """A plain session over the tokenizer (the same inputs the server's runtime feeds)."""

    def __init__(self, model: Path, tokenizer: Path, threads: int, max_length: int) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer))
        self.tokenizer.enable_truncation(max_length=max_length)
        self.tokenizer.no_padding()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(model), opts,
                                            providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.output = self.session.get_outputs()[0].name

    def feeds(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        ids = [e.ids for e in self.tokenizer.encode_batch(list(texts))]
        longest = max(len(i) for i in ids)
        input_ids = np.zeros((len(ids), longest), dtype=np.int64)
        mask = np.zeros_like(input_ids)
        for row, seq in enumerate(ids):
            input_ids[row, :len(seq)] = seq
            mask[row, :len(seq)] = 1
        out = {"input_ids": input_ids, "attention_mask": mask}
        if "token_type_ids" in self.inputs:
            out["token_type_ids"] = np.zeros_like(input_ids)
        return out

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return np.asarray(self.session.run([self.output], self.feeds(texts))[0],
                          dtype=np.float32)


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
    by_length = sorted(texts, key=lambda s: len(enc.tokenizer.encode(s).ids))
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

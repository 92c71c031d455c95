"""What does one token's sampling cost on the engine thread (``sokuji/llm/sampling.py``)?
Microseconds per token, median of --rounds rounds of --tokens samples each, over 16 logits
rows of SmolLM2's vocabulary (49152): real ones (``--rows real``, the default: SmolLM2-135M
decoding a prompt greedily, rows read from llama.cpp) or random normal(0, 3) ones (``--rows
flat``: a far flatter distribution than a model's, the worst case for top_p), for: plain
greedy (one argmax, as before the sampler), greedy with logprobs (5 alternatives), sampled
top_p 0.9 or top_k 40 (temperature 0.8), greedy with presence / frequency / repetition
penalties (a 500-token prompt, 200 generated), greedy
with a grammar's bitmask (half the vocabulary allowed), and a sampled request with all of it.

    taskset -c 1 .venv/bin/python benchmarks/sampling_cost.py [--tokens 2000] [--rounds 5]
        [--rows real|flat]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from sokuji.llm.sampling import SamplingConfig, TokenSampler

VOCAB = 49152


def real_rows(n: int = 16) -> list[np.ndarray]:
    from sokuji.llm.native import ContextShape, LlamaModel, smollm2_path

    model = LlamaModel(smollm2_path(), ContextShape(slots=1, context_size=256, n_batch=64,
                                                    threads=1))
    tokens = model.tokenize("Once upon a time, in a small village by the sea,", True)
    model.decode([(t, i, 0, i == len(tokens) - 1) for i, t in enumerate(tokens)])
    rows, pos, index = [], len(tokens), len(tokens) - 1
    for _ in range(n):
        row = model.logits(index).copy()
        index = 0
        rows.append(row)
        model.decode([(int(row.argmax()), pos, 0, True)])
        pos += 1
    model.close()
    return rows


def measure(rows: list[np.ndarray], cfg: SamplingConfig, tokens: int, rounds: int,
            mask: bool = False, history: bool = False) -> float:
    rng = np.random.default_rng(0)
    allowed = None
    if mask:
        allowed = rng.integers(-2 ** 31, 2 ** 31, VOCAB // 32, dtype=np.int64).astype(np.int32)
    prompt = rng.integers(0, VOCAB, 500).tolist() if history else []
    out = []
    for _ in range(rounds):
        s = TokenSampler(cfg, VOCAB, prompt)
        if history:
            for t in rng.integers(0, VOCAB, 200).tolist():
                s.accept(t)
        t0 = time.perf_counter()
        for i in range(tokens):
            s.sample(rows[i % 16], allowed)
        out.append((time.perf_counter() - t0) / tokens * 1e6)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", choices=("real", "flat"), default="real")
    a = ap.parse_args()
    rng = np.random.default_rng(1)
    rows = (real_rows() if a.rows == "real" else
            [rng.normal(0, 3, VOCAB).astype(np.float32) for _ in range(16)])
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1}
    cases = [
        ("greedy (plain argmax)", SamplingConfig(temperature=0), {}),
        ("greedy + logprobs(5)", SamplingConfig(temperature=0, logprobs=5), {}),
        ("sampled T=0.8 top_p=0.9", SamplingConfig(temperature=0.8, top_p=0.9, seed=1), {}),
        ("sampled T=0.8 top_k=40", SamplingConfig(temperature=0.8, top_k=40, seed=1), {}),
        ("greedy + penalties", SamplingConfig(temperature=0, **penalties), {"history": True}),
        ("greedy + mask", SamplingConfig(temperature=0), {"mask": True}),
        ("sampled top_p + penalties + mask + logprobs(5)",
         SamplingConfig(temperature=0.8, top_p=0.9, seed=1, logprobs=5, **penalties),
         {"mask": True, "history": True}),
    ]
    print(f"vocabulary {VOCAB}, {a.rows} rows, {a.tokens} tokens x {a.rounds} rounds, median")
    for name, cfg, kw in cases:
        print(f"{name:48s} {measure(rows, cfg, a.tokens, a.rounds, **kw):8.1f} us/token")


if __name__ == "__main__":
    main()

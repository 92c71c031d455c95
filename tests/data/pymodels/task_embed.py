"""An embeddings class (``task = "embeddings"``): each text's character trigrams hashed
into a vector of ``dims`` (feature hashing, signed), L2-normalised. Deterministic, and
similar texts get similar vectors: real, if small, embedding code in plain numpy."""

from __future__ import annotations

import zlib

import numpy as np


class HashingEmbedder:
    task = "embeddings"
    deterministic = True

    def setup(self, options: dict) -> None:
        self.dims = int(options.get("dims", 64))
        self.n = int(options.get("ngram", 3))
        self.calls = 0

    def vector(self, text: str) -> np.ndarray:
        v = np.zeros(self.dims, dtype=np.float32)
        padded = f" {text.lower()} "
        for i in range(max(1, len(padded) - self.n + 1)):
            h = zlib.crc32(padded[i:i + self.n].encode("utf-8"))
            v[h % self.dims] += 1.0 if (h >> 16) & 1 else -1.0
        norm = float(np.linalg.norm(v))
        return v / norm if norm else v

    def predict(self, inputs: list[dict[str, np.ndarray]]) -> list[dict[str, object]]:
        self.calls += 1
        return [{"embedding": np.stack([self.vector(str(t)) for t in i["input"]]),
                 "prompt_tokens": sum(len(str(t).split()) for t in i["input"])}
                for i in inputs]

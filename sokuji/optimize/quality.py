"""Quality of a variant against the FP32 reference, on the shipped evaluation sets."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import numpy as np


def load_set(name: str) -> list[str]:
    text = resources.files("sokuji.optimize.data").joinpath(name).read_text(encoding="utf-8")
    return [json.loads(line)["text"] for line in text.splitlines() if line.strip()]


def eval_texts() -> tuple[list[str], list[str]]:
    return load_set("eval_sentences.jsonl"), load_set("eval_queries.jsonl")


def calibration_texts(limit: int = 256) -> list[str]:
    texts: list[str] = []
    for name in ("short.jsonl", "mixed.jsonl"):
        data = resources.files("sokuji.bench.data").joinpath(name).read_text(encoding="utf-8")
        texts += [json.loads(line)["text"] for line in data.splitlines() if line.strip()]
    return texts[::max(1, len(texts) // limit)][:limit]


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


@dataclass(frozen=True)
class Quality:
    mean_cosine: float
    min_cosine: float
    recall_at_10: float

    def as_dict(self) -> dict[str, float]:
        return {"mean_cosine": self.mean_cosine, "min_cosine": self.min_cosine,
                "recall_at_10": self.recall_at_10}


def compare(ref_texts: np.ndarray, ref_queries: np.ndarray, texts: np.ndarray,
            queries: np.ndarray, k: int = 10) -> Quality:
    """Cosine of each text's embedding to FP32's; and recall@k of FP32's ranking: for each
    query, the share of FP32's top-k documents (the texts) that the variant ranks top-k."""
    cos = np.sum(_unit(ref_texts) * _unit(texts), axis=1)
    ref_top = np.argsort(-(_unit(ref_queries) @ _unit(ref_texts).T), axis=1)[:, :k]
    top = np.argsort(-(_unit(queries) @ _unit(texts).T), axis=1)[:, :k]
    recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(ref_top, top, strict=True)])
    return Quality(float(cos.mean()), float(cos.min()), float(recall))

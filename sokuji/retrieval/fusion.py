"""Reciprocal rank fusion (Cormack, Clarke & Büttcher, SIGIR 2009): a document's fused score
is the sum over the rankings that hold it of ``1 / (k + rank)``, ranks from 1. Pure."""

from __future__ import annotations

from collections.abc import Sequence

RRF_K = 60
"""The paper's constant; larger flattens the advantage of the top ranks."""


def rrf(rankings: Sequence[Sequence[int]], k: int = RRF_K) -> list[tuple[int, float]]:
    """``(doc, score)`` by descending fused score. Ties go to the better best rank, then the
    lower doc number (deterministic). A doc listed twice in one ranking counts once, at its
    better rank."""
    if k < 0:
        raise ValueError(f"rrf k must be >= 0, got {k}")
    scores: dict[int, float] = {}
    best: dict[int, int] = {}
    for ranking in rankings:
        seen: set[int] = set()
        for rank, doc in enumerate(ranking, start=1):
            if doc in seen:
                continue
            seen.add(doc)
            scores[doc] = scores.get(doc, 0.0) + 1.0 / (k + rank)
            best[doc] = min(best.get(doc, rank), rank)
    return sorted(scores.items(), key=lambda item: (-item[1], best[item[0]], item[0]))

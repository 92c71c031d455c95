"""One search: its input checked (``plan``), then run over the two scorers (``execute``).

Both scorers see the filter mask before they score. Hybrid asks each method for its top
``candidates`` and fuses them by RRF; re-ranking orders the top ``candidates`` of the fused
(or single-method) list by exact cosine with the query vector."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sokuji.errors import InvalidInput
from sokuji.retrieval import filters as flt
from sokuji.retrieval.bm25 import Bm25
from sokuji.retrieval.dense import DenseIndex
from sokuji.retrieval.fusion import rrf

MODES = ("bm25", "dense", "hybrid")
MAX_K = 100
MAX_CANDIDATES = 1000
MAX_QUERY_CHARS = 4096


@dataclass(frozen=True)
class Plan:
    query: str
    vector: np.ndarray | None
    k: int
    mode: str
    admitted: np.ndarray | None
    candidates: int
    rerank: bool
    rrf_k: int


def _int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidInput(f"{name} must be an integer from {low} to {high}, got {value!r}",
                           param=name)
    return value


def plan(query: object, vector: object, *, k: object, mode: object, filters: object,
         candidates: object, rerank: object, rrf_k: object, dim: int,
         metadata_keys: Sequence[str], columns: Mapping[str, np.ndarray]) -> Plan:
    if mode not in MODES:
        raise InvalidInput(f"mode must be one of {', '.join(MODES)}, got {mode!r}",
                           param="mode")
    k = _int("k", k, 1, MAX_K)
    candidates = max(k, _int("candidates", candidates, 1, MAX_CANDIDATES))
    rrf_k = _int("rrf_k", rrf_k, 0, 10_000)
    if not isinstance(query, str) or len(query) > MAX_QUERY_CHARS:
        raise InvalidInput(f"query must be a string of at most {MAX_QUERY_CHARS} characters",
                           param="query")
    if not isinstance(rerank, bool):
        raise InvalidInput("rerank must be true or false", param="rerank")
    needs_vector = mode != "bm25" or rerank
    vec = None
    if vector is not None:
        arr = np.asarray(vector, dtype=np.float32)
        if arr.ndim == 2 and arr.shape[0] == 1:
            arr = arr[0]
        if arr.shape != (dim,):
            raise InvalidInput(f"vector must have {dim} dimensions (the index's encoder), "
                               f"got shape {arr.shape}", param="vector")
        norm = float(np.linalg.norm(arr))
        if not math.isfinite(norm) or norm == 0.0:
            raise InvalidInput("vector must be finite and non-zero", param="vector")
        vec = arr / norm
    elif needs_vector:
        raise InvalidInput(f"vector is required for mode {mode}"
                           + (" and for rerank" if rerank else ""), param="vector")
    if mode == "bm25" and not query.strip():
        raise InvalidInput("query must not be empty in mode bm25", param="query")
    admitted = flt.mask(columns, flt.validate(filters, metadata_keys))
    return Plan(query, vec, k, str(mode), admitted, candidates, rerank, rrf_k)


Found = list[tuple[int, float, dict[str, int]]]


def execute(p: Plan, bm25: Bm25, dense: DenseIndex) -> Found:
    """``(passage number, score, ranks)`` best first, at most ``p.k``."""
    if p.admitted is not None and not p.admitted.any():
        return []
    depth = p.candidates if (p.mode == "hybrid" or p.rerank) else p.k
    ranked: dict[str, np.ndarray] = {}
    scores: dict[str, np.ndarray] = {}
    if p.mode in ("bm25", "hybrid"):
        ranked["bm25"], scores["bm25"] = bm25.search(p.query, depth, p.admitted)
    if p.mode in ("dense", "hybrid"):
        assert p.vector is not None
        ranked["dense"], scores["dense"] = dense.search(p.vector, depth, p.admitted)
    ranks = {m: {int(d): r for r, d in enumerate(docs, start=1)} for m, docs in ranked.items()}
    if p.mode == "hybrid":
        order = rrf([ranked["bm25"].tolist(), ranked["dense"].tolist()], p.rrf_k)
    else:
        order = list(zip(ranked[p.mode].tolist(), scores[p.mode].tolist(), strict=True))
    if p.rerank:
        assert p.vector is not None
        docs = np.array([d for d, _ in order[:p.candidates]], dtype=np.int64)
        cosines = dense.vectors[docs] @ p.vector if len(docs) else np.empty(0)
        best = np.argsort(-cosines, kind="stable")
        order = [(int(docs[i]), float(cosines[i])) for i in best]
    return [(d, float(s), {m: r[d] for m, r in ranks.items() if d in r})
            for d, s in order[:p.k]]

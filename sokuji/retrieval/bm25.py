"""BM25 over the passages with ``bm25s``: a stopword list (recorded in the index manifest:
queries must drop the same words), Snowball (PyStemmer) English stemming, saved and loaded
with bm25s' own format. Filters arrive as a weight mask, so a masked-out passage scores 0
inside the scorer and never takes a candidate's place."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

STEMMER = "english"


def english_stopwords(keep: frozenset[str] = frozenset()) -> list[str]:
    """bm25s' English list (33 words), less ``keep``."""
    from bm25s.stopwords import STOPWORDS_EN

    return sorted(w for w in STOPWORDS_EN if w not in keep)

for _name in ("bm25s",):  # bm25s logs each save/load at INFO
    logging.getLogger(_name).setLevel(logging.WARNING)


class Bm25:
    def __init__(self, retriever: Any, count: int, stopwords: list[str]) -> None:
        import Stemmer

        self._retriever = retriever
        self.stopwords = stopwords
        self._stemmer = Stemmer.Stemmer(STEMMER)
        self.count = count

    @classmethod
    def build(cls, texts: Sequence[str], stopwords: list[str]) -> Bm25:
        import bm25s
        import Stemmer

        tokens = bm25s.tokenize(list(texts), stopwords=stopwords,
                                stemmer=Stemmer.Stemmer(STEMMER), show_progress=False)
        retriever = bm25s.BM25()
        retriever.index(tokens, show_progress=False)
        return cls(retriever, len(texts), stopwords)

    def save(self, directory: Path) -> None:
        self._retriever.save(str(directory), show_progress=False)

    @classmethod
    def load(cls, directory: Path, count: int, stopwords: list[str]) -> Bm25:
        import bm25s

        retriever = bm25s.BM25.load(str(directory), show_progress=False, verbosity=0)
        return cls(retriever, count, stopwords)

    def tokens(self, query: str) -> list[str]:
        import bm25s

        out = bm25s.tokenize([query], stopwords=self.stopwords, stemmer=self._stemmer,
                             return_ids=False, show_progress=False)
        words: list[str] = out[0] if out else []
        vocab = self._retriever.vocab_dict
        return [w for w in words if w in vocab]

    def search(self, query: str, limit: int,
               admitted: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``limit`` passage numbers and their scores, best first; only passages that
        share a term with the query (score > 0) and that ``admitted`` (a boolean mask, applied
        inside the scorer) lets through."""
        words = self.tokens(query)
        limit = min(limit, self.count)
        if not words or limit <= 0:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        weight = None if admitted is None else admitted.astype(np.float32)
        docs, scores = self._retriever.retrieve([words], k=limit, show_progress=False,
                                                n_threads=0, weight_mask=weight)
        docs, scores = docs[0], scores[0]
        keep = scores > 0
        return docs[keep].astype(np.int64), scores[keep].astype(np.float32)

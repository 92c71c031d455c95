"""``runtimes/corpus_embedding.py`` on a fake runtime: batches by token length within both
budgets, rows back in the texts' order, progress after each batch. On the real MiniLM:
``test_classifier.py`` (prototypes) and ``test_retrieval_index.py`` (the built-in index)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sokuji.runtimes.base import ModelMetadata, Prepared
from sokuji.runtimes.corpus_embedding import corpus_batches, embed_corpus


class WordsRuntime:
    """A text's length is its word count; its embedding ``[word count, first letter]``."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def load(self) -> None: ...
    def warmup(self) -> None: ...
    def close(self) -> None: ...

    def describe(self) -> ModelMetadata:
        raise NotImplementedError

    def preprocess(self, texts: Sequence[str]) -> Prepared:
        lengths = [len(t.split()) for t in texts]
        return Prepared(data=list(texts), num_items=len(texts), length=max(lengths),
                        num_tokens=sum(lengths))

    def run_batch(self, batch: Sequence[Prepared]) -> list[np.ndarray]:
        self.batches.append([t for p in batch for t in p.data])
        return [np.asarray([[len(t.split()), ord(t[0])] for t in p.data], np.float32)
                for p in batch]


def words(n: int, letter: str = "w") -> str:
    return " ".join([letter * 2] * n)


def test_batches_by_length_within_both_budgets() -> None:
    rt = WordsRuntime()
    texts = [words(5, "a"), words(1, "b"), words(3, "c"), words(1, "d"), words(9, "e"),
             words(3, "f")]
    seen: list[tuple[int, int]] = []
    out = embed_corpus(rt, texts, max_batch_size=3, max_batch_tokens=10,
                       progress=lambda done, total: seen.append((done, total)))
    # 1, 1, 3 (3 x 3 <= 10) | 3, 5 (2 x 5) | 9 alone
    assert rt.batches == [[texts[1], texts[3], texts[2]], [texts[5], texts[0]], [texts[4]]]
    assert seen == [(3, 6), (5, 6), (6, 6)]
    assert out.dtype == np.float32
    assert out.tolist() == [[len(t.split()), ord(t[0])] for t in texts]


def test_a_text_over_the_token_budget_runs_alone() -> None:
    prepared = [Prepared(data=None, num_items=1, length=n, num_tokens=n) for n in (2, 50, 2)]
    assert corpus_batches(prepared, max_batch_size=8, max_batch_tokens=16) == [[0, 2], [1]]
    assert corpus_batches([], max_batch_size=8, max_batch_tokens=16) == []


def test_no_texts() -> None:
    rt = WordsRuntime()
    assert embed_corpus(rt, []).shape == (0, 0)
    assert rt.batches == []

"""Retrieval parts without the encoder: RRF math, filters, the corpus chunking, the shipped
questions' answers, BM25's weight mask and the ANN index's selector (real bm25s, real
faiss)."""

from __future__ import annotations

import numpy as np
import pytest

from sokuji.errors import InvalidInput
from sokuji.retrieval import filters as flt
from sokuji.retrieval.bm25 import Bm25, english_stopwords
from sokuji.retrieval.corpus import MAX_UNITS, Passage, _units, find, pydoc_passages
from sokuji.retrieval.dense import DenseIndex
from sokuji.retrieval.fusion import rrf
from sokuji.retrieval.questions import load_questions, recall_at, reciprocal_rank


def test_rrf_sums_reciprocal_ranks() -> None:
    fused = dict(rrf([[7, 3, 5], [3, 9]], k=60))
    assert fused[3] == pytest.approx(1 / 62 + 1 / 61)
    assert fused[7] == pytest.approx(1 / 61)
    assert fused[5] == pytest.approx(1 / 63)
    assert fused[9] == pytest.approx(1 / 62)
    assert [d for d, _ in rrf([[7, 3, 5], [3, 9]], k=60)] == [3, 7, 9, 5]


def test_rrf_ties_and_duplicates() -> None:
    # 1 and 2 tie (each first in one list): the lower number wins; a repeat counts once.
    assert rrf([[1, 1, 2], [2, 1]], k=0)[0][0] == 1
    assert dict(rrf([[1, 1]], k=0))[1] == pytest.approx(1.0)
    assert rrf([], k=60) == []
    # k flattens: with k=0 a first place beats two second places, with k=60 it does not.
    assert rrf([[1, 2], [3, 2]], k=0)[0][0] == 1
    assert rrf([[1, 2], [3, 2]], k=60)[0][0] == 2
    with pytest.raises(ValueError):
        rrf([[1]], k=-1)


def test_filters_validate_and_mask() -> None:
    columns = {"topic": np.array(["a", "b", "c", "a"], dtype=object),
               "category": np.array(["x", "x", "y", "y"], dtype=object)}
    keys = list(columns)
    f = flt.validate({"topic": "a", "category": ["y", "z"]}, keys)
    assert flt.mask(columns, f).tolist() == [False, False, False, True]
    assert flt.mask(columns, flt.validate(None, keys)) is None
    for bad, field in (({"colour": "red"}, "filters.colour"), ({"topic": 3}, "filters.topic"),
                       ({"topic": []}, "filters.topic"), ({"topic": ["a", 1]}, "filters.topic"),
                       (["topic"], "filters")):
        with pytest.raises(InvalidInput) as err:
            flt.validate(bad, keys)
        assert err.value.param == field and field in err.value.message


def test_pydoc_corpus_passages() -> None:
    passages = pydoc_passages()
    ids = [p.id for p in passages]
    assert len(ids) == len(set(ids)) and len(passages) > 300
    assert max(_units(p.text) for p in passages) <= MAX_UNITS + 20  # + its heading
    assert {p.metadata["category"] for p in passages} >= {
        "statements", "expressions", "data-model", "lexical", "builtin-types"}
    # "if" and "else" have the same text: indexed once, under the topic its title names.
    assert [p.id for p in passages if p.metadata["topic"] in ("if", "else")] == ["if:0"]
    # compound's copies of "while", "for", ... went to those topics.
    assert find(passages, "as long as an expression is true") == ["while:0"]


def test_questions_resolve_and_mix_styles() -> None:
    questions = load_questions(pydoc_passages())
    assert len(questions) >= 60
    styles = [q.style for q in questions]
    assert styles.count("keyword") >= 20 and styles.count("paraphrase") >= 20
    assert all(q.answers for q in questions)
    assert recall_at(["a", "b"], frozenset({"b"}), 1) == 0.0
    assert recall_at(["a", "b"], frozenset({"b"}), 2) == 1.0
    assert reciprocal_rank(["a", "b"], frozenset({"b"}), 10) == 0.5


TEXTS = ["the cat sat on the mat", "a dog chased the cat", "cats and dogs are pets",
         "the stock market fell", "a cat video went viral", "dogs bark at night"]


def test_bm25_mask_applies_inside_the_scorer() -> None:
    bm = Bm25.build(TEXTS, english_stopwords())
    docs, scores = bm.search("cat", 10)
    assert set(docs.tolist()) == {0, 1, 2, 4} and (scores > 0).all()  # stemmed: cats
    admitted = np.array([False, True, False, True, True, True])
    docs, _ = bm.search("cat", 10, admitted)
    assert set(docs.tolist()) == {1, 4}
    # Enough admitted matches: the limit is filled from them, none lost to refused ones.
    docs, _ = bm.search("cat", 2, admitted)
    assert set(docs.tolist()) == {1, 4}
    assert bm.search("the of and", 5)[0].size == 0


def test_bm25_save_load(tmp_path) -> None:
    Bm25.build(TEXTS, english_stopwords()).save(tmp_path / "b")
    docs, _ = Bm25.load(tmp_path / "b", len(TEXTS), english_stopwords()).search("dogs bark", 2)
    assert docs[0] == 5


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, 64)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("exact_below", [0, 10_000])
def test_dense_filter_before_scoring(vectors: np.ndarray, exact_below: int) -> None:
    dense = DenseIndex.build(vectors)
    dense.exact_below = exact_below  # 0: the graph with its bitmap selector; else exact
    admitted = np.zeros(len(vectors), bool)
    admitted[::7] = True
    query = vectors[1]  # itself refused: its nearest admitted neighbours must come back
    ids, scores = dense.search(query, 10, admitted)
    assert len(ids) == 10 and admitted[ids].all()
    assert (np.diff(scores) <= 1e-6).all()
    exact, _ = dense.exact(query, 10, admitted)
    assert len(set(ids.tolist()) & set(exact.tolist())) >= 8
    few = np.zeros(len(vectors), bool)
    few[[5, 50, 500]] = True
    assert sorted(dense.search(query, 10, few)[0].tolist()) == [5, 50, 500]


def test_passage_is_plain_data() -> None:
    p = Passage("t:0", "text", {"topic": "t"})
    assert p.metadata == {"topic": "t"}


def test_pydoc_stopwords_keep_python_keywords() -> None:
    from sokuji.retrieval.corpus import pydoc_stopwords

    stop = pydoc_stopwords()
    assert "the" in stop and not {"with", "for", "if", "in", "is", "not", "as"} & set(stop)
    bm = Bm25.build(["the with statement", "the for statement"], stop)
    assert bm.tokens("what does the with statement do") == ["with", "statement"]

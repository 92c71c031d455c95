"""Questions with known answers over the built-in corpus (``data/questions.jsonl``), written
for this project. Each answer is a topic and a phrase from the passage that answers; the phrase
is resolved to passage ids at load, so the questions survive re-chunking. ``style``: keyword
(the reference's own words: BM25's ground) or paraphrase (plain words: the encoder's)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sokuji.retrieval.corpus import Passage, find

QUESTIONS = Path(__file__).with_name("data") / "questions.jsonl"


@dataclass(frozen=True)
class Question:
    text: str
    style: str
    answers: frozenset[str]
    """Passage ids any of which answers it."""


def load_questions(passages: Sequence[Passage], path: Path = QUESTIONS) -> list[Question]:
    """The questions with their answers resolved; ``ValueError`` naming the line when a
    phrase matches no passage of its topic (the corpus changed under it)."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        ids: set[str] = set()
        for answer in row["answers"]:
            found = find(passages, answer["phrase"], answer.get("topic"))
            if not found:
                raise ValueError(f"{path.name}:{n}: no passage of topic "
                                 f"{answer.get('topic')!r} contains {answer['phrase']!r}")
            ids.update(found)
        out.append(Question(row["q"], row["style"], frozenset(ids)))
    return out


def recall_at(ranked: Sequence[str], answers: frozenset[str], k: int) -> float:
    """1.0 when an answer is among the first ``k``, else 0.0 (one relevant unit per
    question: any passage that answers it)."""
    return 1.0 if any(i in answers for i in ranked[:k]) else 0.0


def reciprocal_rank(ranked: Sequence[str], answers: frozenset[str], k: int) -> float:
    return next((1.0 / r for r, i in enumerate(ranked[:k], start=1) if i in answers), 0.0)

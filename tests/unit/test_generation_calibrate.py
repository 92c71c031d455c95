"""The generation cascade's calibration pieces: what counts as a right answer, and the
threshold fit over log-probabilities (negative confidences: "never escalate" is -inf)."""

from __future__ import annotations

import numpy as np

from sokuji.routing.generation import is_right, read_questions
from sokuji.routing.threshold_fit import Scored, candidates, fit_quality, row
from tests.conftest import ROOT


def test_an_answer_is_right_when_an_accepted_one_is_a_whole_word_of_it() -> None:
    assert is_right("The capital of France is Paris.", ["paris"])
    assert is_right("2 + 2 = 4", ["4", "four"])
    assert not is_right("It is 14.", ["4"])  # "4" inside "14" is not the answer
    assert not is_right("Parisian food", ["paris"])


def test_the_question_sets_hold_text_and_accepted_answers() -> None:
    for name, n in (("qa_calib", 40), ("qa_test", 20)):
        texts, answers = read_questions(ROOT / f"sokuji/routing/data/{name}.jsonl")
        assert len(texts) == n and all(a and all(x == x.lower() for x in a) for a in answers)


def test_the_fit_escalates_the_least_confident_answers() -> None:
    """Mutant: ``candidates`` starting at 0 (a margin's floor): every log-probability is
    below it, so "never escalate" would escalate everything."""
    sc = Scored(small_ok=np.array([True, False, True, False]),
                large_ok=np.array([True, True, True, True]),
                margin=np.array([-0.1, -2.0, -0.3, -1.5]))
    floor = candidates(sc)[0]
    assert floor == -np.inf and row(sc, floor, 0.2).escalated == 0.0
    theta, _ = fit_quality(sc, 0.99)
    r = row(sc, theta, 0.2)
    assert r.accuracy == 1.0 and r.escalated == 0.5  # exactly the two unsure ones
    assert -1.5 < theta <= -0.3

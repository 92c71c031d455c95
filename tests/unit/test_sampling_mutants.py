"""``llm/sampling.py``'s ``truncate`` pinned exactly, without draws: which token ids it keeps,
in which order, and their unnormalised probabilities. Each test names the mutmut mutants of
``x_truncate`` it kills (docs/mutation.md; numbers as at the commit recorded there)."""

from __future__ import annotations

import numpy as np

from sokuji.llm.sampling import truncate

# not monotone, so token order and likelihood order differ
Z = np.log(np.array([0.05, 0.3, 0.1, 0.4, 0.15], dtype=np.float32))


def test_a_fully_masked_row_leaves_token_zero_with_probability_one() -> None:
    """Kills 5-11 (the argmax lost, the probability's length, value or dtype changed)."""
    ids, p = truncate(np.full(6, -np.inf, dtype=np.float32), 0, 1.0, 0.0)
    assert ids.tolist() == [0]
    assert p.dtype == np.float32 and p.shape == (1,) and p.tolist() == [1.0]


def test_top_k_one_keeps_only_the_best() -> None:
    """Kills 14 (``1 < top_k``: top_k = 1 would keep every token)."""
    ids, p = truncate(Z, 1, 1.0, 0.0)
    assert ids.tolist() == [3] and p.tolist() == [1.0]


def test_probabilities_are_relative_to_the_best_token() -> None:
    """Kills 27 (``z + max`` for ``z - max``): the best token's weight is exactly 1."""
    ids, p = truncate(Z, 3, 1.0, 0.0)
    assert ids.tolist() == [1, 3, 4]  # the three largest, in token order
    np.testing.assert_allclose(p, np.exp(Z[ids] - Z.max()), rtol=1e-6)
    assert float(p.max()) == 1.0


def test_top_p_one_keeps_every_token_in_token_order() -> None:
    """Kills 33 and 34 (top_p = 1.0 taken as a nucleus: the same set, most likely first)."""
    ids, p = truncate(Z, 0, 1.0, 0.0)
    assert ids.tolist() == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(p, np.exp(Z - Z.max()), rtol=1e-6)


def test_top_p_and_min_p_after_top_k_give_token_ids_not_positions() -> None:
    """Kills 42 and 53 (the positions within the top-k subset returned as token ids)."""
    ids, _ = truncate(Z, 3, 0.5, 0.0)  # of {1, 3, 4}: 0.4 + 0.3 reaches half of 0.85
    assert ids.tolist() == [3, 1]  # most likely first
    ids, _ = truncate(Z, 3, 1.0, 0.5)  # of {1, 3, 4}: at least half the best (0.4)
    assert ids.tolist() == [1, 3]


def test_min_p_keeps_a_token_exactly_at_the_threshold() -> None:
    """Kills 48 (``>`` for ``>=``): two tokens tied for best, min_p = 1 keeps both."""
    ids, p = truncate(np.array([0.0, 0.0, -1.0], dtype=np.float32), 0, 1.0, 1.0)
    assert ids.tolist() == [0, 1] and p.tolist() == [1.0, 1.0]

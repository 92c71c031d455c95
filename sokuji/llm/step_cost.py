"""What a decode step costs, by the tokens in it, as measured on this machine.

The engine times every pure-decode ``llama_decode`` (no prompt tokens in it; every row has
logits) and keeps an EWMA of its seconds by the number of tokens in the step. Two decisions
read the table:

- **Split small batches** (``split_is_cheaper``): llama.cpp's 2-row Q8_0 step took 28-30 ms
  where two 1-row steps took 2 x 10.7 ms, so when k rows together measured dearer than k
  single rows, the engine decodes them one by one (re-trying the batch every 32nd step).
- **Speculation** (``speculative.py``): whether verifying k draft tokens more is worth it
  depends on how much a step of n + k tokens costs against one of n tokens. On this CPU a
  step is nearly linear in its tokens (SmolLM2 Q4_1, 1 thread: 1 token 6.5 ms, 2 tokens
  17 ms, 9 tokens 49 ms: the kernels re-read the weights for every token), on a GPU or with
  repacked weights it is nearly flat; the table is what tells them apart.

``estimate(n)`` interpolates between measured sizes. Above the largest it extrapolates
optimistically (a token more costs ``PRIOR_MARGINAL`` of a token's share), so that a larger
step is tried once when it might pay and is then known. Only the engine thread uses it.
"""

from __future__ import annotations

import bisect

PRIOR_MARGINAL = 0.25
"""Above the largest measured size, each token more is assumed to cost this fraction of a
token's average share of that step (batching's gain on memory-bound hardware), until
measured."""


class StepCosts:
    def __init__(self, split_small_batches: bool = True) -> None:
        self.split_small_batches = split_small_batches
        self._ewma: dict[int, float] = {}
        self._sizes: list[int] = []
        """The measured sizes, sorted."""
        self._probe: dict[int, int] = {}

    def learn(self, tokens: int, seconds: float) -> None:
        """One pure-decode step of ``tokens`` tokens took ``seconds``."""
        old = self._ewma.get(tokens)
        if old is None:
            bisect.insort(self._sizes, tokens)
            self._ewma[tokens] = seconds
        else:
            self._ewma[tokens] = 0.8 * old + 0.2 * seconds

    def measured(self, tokens: int) -> float | None:
        return self._ewma.get(tokens)

    def estimate(self, tokens: int) -> float | None:
        """Seconds a pure-decode step of ``tokens`` tokens should take (None: nothing
        measured yet)."""
        known = self._ewma.get(tokens)
        if known is not None:
            return known
        sizes = self._sizes
        if not sizes:
            return None
        i = bisect.bisect_left(sizes, tokens)
        if i == 0:  # below the smallest: proportional
            return self._ewma[sizes[0]] * tokens / sizes[0]
        lo = sizes[i - 1]
        if i == len(sizes):
            per_token = self._ewma[lo] / lo
            return self._ewma[lo] + (tokens - lo) * PRIOR_MARGINAL * per_token
        hi = sizes[i]
        a, b = self._ewma[lo], self._ewma[hi]
        return a + (b - a) * (tokens - lo) / (hi - lo)

    def baseline(self, rows: int) -> float | None:
        """What a step of ``rows`` single-token rows costs the way the engine would run it
        (together, or row by row where that measured cheaper)."""
        together = self.estimate(rows)
        one = self._ewma.get(1)
        if together is None or not self.split_small_batches or one is None or rows < 2:
            return together
        return min(together, rows * one)

    def split_is_cheaper(self, rows: int) -> bool:
        """Whether ``rows`` one-row decodes measured cheaper than one ``rows``-row decode.
        Every 32nd such step is decoded together anyway, to keep measuring."""
        if not self.split_small_batches or rows < 2 or rows not in self._ewma \
                or 1 not in self._ewma:
            return False
        self._probe[rows] = self._probe.get(rows, 0) + 1
        if self._probe[rows] % 32 == 0:
            return False
        return self._ewma[rows] > 1.05 * rows * self._ewma[1]

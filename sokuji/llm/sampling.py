"""One sequence's sampler, in numpy, over the logits of its batch row.

The logits go through, in this order:

1. ``logit_bias``: ``logit[t] += bias[t]`` (OpenAI's: -100..100, added to the raw logit);
2. OpenAI's penalties over the tokens *generated* so far (never the prompt):
   ``logit[t] -= count[t] * frequency_penalty + (count[t] > 0) * presence_penalty``;
3. ``repetition_penalty`` (HF / llama.cpp) over the prompt and the generated tokens: a
   positive logit of such a token is divided by it, a negative one multiplied;
4. the grammar's mask (``allowed``: a packed bitmask, bit ``i % 32`` of int32 word
   ``i // 32`` set when token ``i`` may come: the llguidance / xgrammar layout) and the bans
   (``banned``: end-of-generation tokens while ``min_tokens`` / ``ignore_eos`` hold): -inf.

**The log-probabilities reported** (``logprobs``) are the log-softmax of exactly these
processed logits, before temperature and truncation: what the model, biased, penalised and
masked as asked, gives each token (so a banned token has -inf, and ``temperature``,
``top_k``, ``top_p``, ``min_p`` do not change them; vLLM's default ``raw_logprobs`` reports
the model's unprocessed ones instead).

Then temperature 0 takes the argmax (the first of equal ones); otherwise the logits are
divided by the temperature, and truncated: ``top_k`` (the k largest; 0: off), ``top_p`` (the
smallest set of most likely tokens whose probability, renormalised over what top_k left,
reaches top_p: exact, ties at the boundary broken by token order), ``min_p`` (tokens below
min_p times the most likely one's probability dropped), and one token drawn from what is
left with the sequence's own ``np.random.Generator(PCG64(seed))`` (no seed: seeded from
``os.urandom``). A sequence draws one number a sampled token, whatever else is in the batch,
so a seeded request gives the same text alone or beside others.

A request without bias, penalties, mask, bans or logprobs at temperature 0 costs one argmax
over the row, as before (``benchmarks/sampling_cost.py`` measures each path).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

MAX_TOP_LOGPROBS = 20
"""OpenAI's bound on ``top_logprobs`` (and on the legacy completions ``logprobs``)."""
LOGIT_BIAS_BOUND = 100.0
_NUCLEUS_FIRST = 256
"""top_p sorts this many most likely tokens first, four times more while their mass falls
short of top_p (``_nucleus``)."""

_MASK_ADD = np.array([-np.inf, 0.0], dtype=np.float32)


@dataclass(frozen=True)
class SamplingConfig:
    """How one request samples (validated before it gets here)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    """None: no log-probabilities; n (0..20): the chosen token's and its n most likely
    alternatives'."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampled(NamedTuple):
    token: int
    logprob: float | None
    """Its log-probability (None unless asked: ``SamplingConfig.logprobs``)."""
    top: tuple[tuple[int, float], ...]
    """The ``logprobs`` most likely tokens and theirs, most likely first."""


class TokenSampler:
    """One sequence's sampling state: its configuration, its token counts, its generator."""

    def __init__(self, config: SamplingConfig, vocab_size: int,
                 prompt_tokens: list[int] | tuple[int, ...] = ()) -> None:
        self.config = c = config
        self.vocab_size = vocab_size
        self.greedy = c.greedy
        self._penalised = c.presence_penalty != 0.0 or c.frequency_penalty != 0.0
        self._repeating = c.repetition_penalty != 1.0
        self.plain = (self.greedy and not c.logit_bias and not self._penalised
                      and not self._repeating and c.logprobs is None)
        """Nothing but an argmax (with no mask and no bans given)."""
        self._bias_ids = np.asarray([t for t, _ in c.logit_bias], dtype=np.int64)
        self._bias_values = np.asarray([v for _, v in c.logit_bias], dtype=np.float32)
        self.counts: dict[int, int] = {}
        """Generated tokens so far, by id (``accept``)."""
        self._count_arrays: tuple[np.ndarray, np.ndarray] | None = None
        self._seen = np.zeros(vocab_size, dtype=bool) if self._repeating else None
        self._seen_ids: np.ndarray | None = None
        if self._seen is not None:
            self._seen[np.asarray(prompt_tokens, dtype=np.int64)] = True
        self.rng: np.random.Generator | None = None
        if not self.greedy:
            seed = c.seed if c.seed is not None else int.from_bytes(os.urandom(16), "little")
            self.rng = np.random.Generator(np.random.PCG64(seed & (2 ** 128 - 1)))

    def accept(self, token: int) -> None:
        """``token`` was generated (the penalties count it from the next sample on)."""
        if self._penalised:
            self.counts[token] = self.counts.get(token, 0) + 1
            self._count_arrays = None
        if self._seen is not None and not self._seen[token]:
            self._seen[token] = True
            self._seen_ids = None

    def processed(self, logits: np.ndarray, allowed: np.ndarray | None = None,
                  banned: np.ndarray | None = None) -> np.ndarray:
        """Steps 1 to 4 on a copy of ``logits`` (float32)."""
        c = self.config
        x = np.array(logits[:self.vocab_size], dtype=np.float32)
        if len(self._bias_ids):
            x[self._bias_ids] += self._bias_values
        if self._penalised and self.counts:
            if self._count_arrays is None:
                ids = np.fromiter(self.counts, dtype=np.int64, count=len(self.counts))
                n = np.fromiter(self.counts.values(), dtype=np.float32, count=len(ids))
                self._count_arrays = ids, (n * np.float32(c.frequency_penalty)
                                           + np.float32(c.presence_penalty))
            ids, amounts = self._count_arrays
            x[ids] -= amounts
        if self._seen is not None:
            if self._seen_ids is None:
                self._seen_ids = np.flatnonzero(self._seen)
            ids = self._seen_ids
            v = x[ids]
            r = np.float32(c.repetition_penalty)
            x[ids] = np.where(v > 0, v / r, v * r)
        if allowed is not None:
            bits = np.unpackbits(np.ascontiguousarray(allowed, dtype=np.int32).view(np.uint8),
                                 bitorder="little", count=self.vocab_size)
            x += _MASK_ADD.take(bits)  # (-inf where 0: 5x faster than a boolean index)
        if banned is not None and len(banned):
            x[banned] = -np.inf
        return x

    def sample(self, logits: np.ndarray, allowed: np.ndarray | None = None,
               banned: np.ndarray | None = None) -> Sampled:
        if self.plain and allowed is None and (banned is None or not len(banned)):
            return Sampled(int(logits.argmax()), None, ())
        x = self.processed(logits, allowed, banned)
        token = int(x.argmax()) if self.greedy else self._draw(x)
        n = self.config.logprobs
        if n is None:
            return Sampled(token, None, ())
        lse = log_sum_exp(x)
        top: tuple[tuple[int, float], ...] = ()
        if n > 0:
            k = min(n, len(x))
            ids = np.argpartition(x, len(x) - k)[len(x) - k:]
            ids = ids[np.lexsort((ids, -x[ids]))]
            top = tuple((int(t), float(x[t]) - lse) for t in ids)
        return Sampled(token, float(x[token]) - lse, top)

    def _draw(self, x: np.ndarray) -> int:
        c = self.config
        z = x / np.float32(c.temperature) if c.temperature != 1.0 else x
        ids, keep = truncate(z, c.top_k, c.top_p, c.min_p)
        assert self.rng is not None
        if len(ids) == 1:
            self.rng.random()  # one draw a token, whatever is left
            return int(ids[0])
        cum = np.cumsum(keep, dtype=np.float64)
        u = self.rng.random() * cum[-1]
        i = int(np.searchsorted(cum, u, side="right"))
        return int(ids[min(i, len(ids) - 1)])

    def close(self) -> None:
        """Nothing to free (it holds numpy arrays only)."""


def log_sum_exp(x: np.ndarray) -> float:
    m = float(x.max())
    if not math.isfinite(m):
        return m
    return m + math.log(float(np.exp(x - np.float32(m)).sum(dtype=np.float64)))


def truncate(z: np.ndarray, top_k: int, top_p: float, min_p: float
             ) -> tuple[np.ndarray, np.ndarray]:
    """The tokens left after top_k, top_p and min_p over the tempered logits ``z``, and
    their unnormalised probabilities (float32), most likely first where top_p ordered them
    (in token order otherwise)."""
    m = float(z.max())
    if not math.isfinite(m):  # everything masked: the argmax (token 0) is all there is
        return np.asarray([int(z.argmax())]), np.ones(1, dtype=np.float32)
    n = len(z)
    ids: np.ndarray | None = None  # None: every token, in order
    if 0 < top_k < n:
        ids = np.sort(np.argpartition(z, n - top_k)[n - top_k:])
        p = np.exp(z[ids] - np.float32(m))
    else:
        p = np.exp(z - np.float32(m))
    if top_p < 1.0:
        at = _nucleus(p, top_p)
        ids, p = (at if ids is None else ids[at]), p[at]
    if min_p > 0.0:
        at = np.flatnonzero(p >= np.float32(min_p) * p.max())
        ids, p = (at if ids is None else ids[at]), p[at]
    return (np.arange(n) if ids is None else ids), p


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """The positions in ``p`` of the smallest most-likely set whose mass reaches top_p of
    the whole, most likely first, ties broken by position (token order). Only a head is
    sorted: the positions at or above the ``size``-th largest probability (ties included
    whole, so the order is exact), ``size`` growing fourfold from ``_NUCLEUS_FIRST`` until
    the head holds the mass (one O(n) partition a try; a model's peaked row needs one)."""
    need = top_p * float(p.sum(dtype=np.float64))
    n = len(p)
    size = _NUCLEUS_FIRST
    while True:
        if size >= n:
            part = np.arange(n)
            break
        floor = np.partition(p, n - size)[n - size]
        part = np.flatnonzero(p >= floor)  # (ascending: token order)
        if float(p[part].sum(dtype=np.float64)) >= need:
            break
        size *= 4
    order = part[np.argsort(-p[part], kind="stable")]
    cum = np.cumsum(p[order], dtype=np.float64)
    cut = int(np.searchsorted(cum, need, side="left")) + 1
    return order[:min(cut, len(order))]

"""Speculative decoding: propose a few tokens ahead of a greedy sequence; the engine verifies
them in its next step, in the same ``llama_batch`` as everything else.

Drafting (``mode``):

- ``ngram`` (prompt lookup): the sequence's last n tokens (n from ``ngram_max`` down to
  ``ngram_min``) are looked up earlier in its own context (prompt + generated); the tokens
  that followed their most recent earlier occurrence are the draft. Costs a numpy scan a
  step; pays where the answer quotes its context (RAG, code edits, summaries).
- ``draft``: a second, smaller model with the same vocabulary (its own llama.cpp context,
  one KV stream per slot, like the target's) proposes tokens greedily, one
  ``llama_decode`` per draft position across the drafting sequences. Its KV cells follow
  the sequence lazily (the prompt is fed only once the sequence drafts) and are cut back to
  the accepted tokens after each verification.

Verification (``engine.py``): the sequence's last token and its k drafts go into the step
with logits on every row; the target's greedy token of row i is emitted, and row i + 1 is
read only while that token equals draft i. So the text is the target's own greedy text,
token for token (llama.cpp's logits for a token are the same whether it is decoded alone or
in a multi-token batch: measured bit-equal here, and tested end to end); the rejected
drafts' KV cells are removed.

**Only greedy sequences speculate** (temperature 0; with penalties, ``logit_bias`` or a
grammar's mask too: the engine samples the rows of a step in order and counts each accepted
token before the next, so a draft is kept exactly where it is the token the sequence's
sampler picks given the ones before). A sampled sequence (temperature > 0) draws from its
seeded generator (``sampling.py``) one token per step. Exact speculative sampling (accept a
draft with probability p/q) would give the same distribution but other draws for the same
seed, and whether a step drafts depends on measured timings, so a seeded request would no
longer repeat. Sampled sequences therefore decode as before.

**Adaptive** (default): whether drafting pays depends on the machine. On this CPU a step of
n + k tokens costs nearly (n + k) / n times a step of n (the kernels re-read the weights per
token); on hardware that batches well it costs little more. Each step, the planner takes the
measured step costs (``step_cost.py``), each sequence's estimated acceptance p (per-token,
from its recent verifications and, before it has any, from the engine's by drafter and
n-gram length), counts draft j of a sequence as worth p^j expected tokens, and picks the
number of drafts (best first) that maximises expected tokens per second of the step. It
drafts only when that beats the plain step by ``MARGIN``. Estimates change only by
drafting, so when the plan drafts nothing, 2% of the step time is saved up to pay for an
occasional probe (``_probe``): the most promising sequence verifies its whole draft, which
measures that step size and the acceptance. Where verification is as dear as decoding (this
CPU with the shipped Q4_1, a same-size draft model) it thus drafts only in probes, and free
text pays a lookup a step and at most ~2% in probes. ``adaptive = false`` always drafts
what it can (tests, benchmarks of the mechanism).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sokuji.llm.step_cost import StepCosts

if TYPE_CHECKING:
    from sokuji.llm.native import LlamaModel
    from sokuji.llm.options import LlamaOptions

log = logging.getLogger(__name__)

MARGIN = 1.05
"""Draft only when the plan's expected tokens per second beat the plain step's by 5%."""
MIN_GAIN = 0.05
"""Draft positions whose expected yield (p^j) is below this are not considered."""
MATCH_BUCKETS = (1, 2, 3, 4, 8, 16)
"""Acceptance is learned by the length of the match a draft came from, in these buckets (a
bucket holds lengths up to the next): while a model quotes its context, its last tokens
match the context over dozens of tokens, and such drafts are nearly always right; a short
match in free text mostly is not. The length costs nothing to observe, where testing a
sequence by drafting costs a whole verification step."""
NGRAM_PRIOR = {1: 0.3, 2: 0.5, 3: 0.6, 4: 0.7, 8: 0.8, 16: 0.9}
"""Acceptance assumed for a match bucket before any is measured; a draft model's:
``DRAFT_PRIOR``."""
DRAFT_PRIOR = 0.6
SEQ_WEIGHT, SEQ_DECAY = 2.0, 0.95
"""A sequence's own evidence (per token: accepted drafts, and verifications that stopped
short), blended with the engine-wide estimate as ``SEQ_WEIGHT`` pseudo-observations, fades
by ``SEQ_DECAY`` a step: recent verifications weigh most, and a rejection long ago no longer
stops a sequence that has reached a passage it quotes."""
GLOBAL_WEIGHT, GLOBAL_DECAY = 4.0, 0.95
"""The engine-wide estimate a sequence starts from is the share of drafted tokens accepted,
per verification (decayed): what a new sequence can expect. Counted per token instead, a few
long accepted runs of quoting sequences would outweigh many failures of the others, and
every new free-text sequence would start drafting as if it quoted."""
EXPLORE_SHARE = 0.01
"""Of each drafting-eligible step's estimated time, this share is saved up to pay for probes
(``_probe``, charged at their measured cost). Free text thus pays about 1% for the chance to
find where drafting pays."""
EXPLORE_START_S, EXPLORE_CAP_S = 0.1, 0.5
"""Savings at start (once per engine: its first probes measure the step sizes it will use),
and at most."""


@dataclass(frozen=True)
class SpecConfig:
    mode: str = "off"
    """off | ngram | draft"""
    max_tokens: int = 8
    """Draft tokens per sequence and step, at most."""
    ngram_max: int = 16
    ngram_min: int = 2
    adaptive: bool = True

    @classmethod
    def of(cls, o: LlamaOptions) -> SpecConfig:
        return cls(o.speculative, o.speculative_tokens, o.speculative_ngram_max,
                   o.speculative_ngram_min, o.speculative_adaptive)


class Acceptance:
    """Per-token acceptance as decayed counts: accepted drafts, and rejections (a verification
    that stopped before the end of its draft)."""

    __slots__ = ("accepted", "rejected")

    def __init__(self) -> None:
        self.accepted = 0.0
        self.rejected = 0.0

    def observe(self, drafted: int, accepted: int, decay: float = 1.0) -> None:
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (accepted < drafted)

    def fade(self, decay: float) -> None:
        self.accepted *= decay
        self.rejected *= decay

    def p(self, prior: float, weight: float) -> float:
        return (self.accepted + weight * prior) / (self.accepted + self.rejected + weight)


class History:
    """A sequence's tokens (prompt, then generated) in a numpy buffer, for the lookup."""

    __slots__ = ("n", "tokens")

    def __init__(self, prompt: list[int], capacity: int) -> None:
        self.tokens = np.zeros(max(capacity, len(prompt) + 1), dtype=np.int32)
        self.tokens[:len(prompt)] = prompt
        self.n = len(prompt)

    def append(self, token: int) -> None:
        if self.n == len(self.tokens):
            self.tokens = np.concatenate([self.tokens, np.zeros_like(self.tokens)])
        self.tokens[self.n] = token
        self.n += 1

    def lookup(self, ngram_max: int, ngram_min: int, k: int) -> tuple[list[int], int]:
        """The up to ``k`` tokens that followed the most recent earlier occurrence of the
        longest suffix n-gram (``ngram_min`` <= n <= ``ngram_max``), and n; ([], 0) if none."""
        a, n = self.tokens, self.n
        if n < 2 or k < 1:
            return [], 0
        found = np.flatnonzero(a[:n - 1] == a[n - 1])  # earlier ends of the 1-gram
        m = 1
        while len(found) > 1 and m < ngram_max:
            longer = found[found >= m]
            longer = longer[a[longer - m] == a[n - 1 - m]]
            if not len(longer):
                break
            found, m = longer, m + 1
        if len(found) == 1 and m < ngram_max:  # one candidate left: the rest of it at once
            end = int(found[0])
            span = min(ngram_max, end + 1)
            same = a[end - span + 1:end + 1][::-1] == a[n - span:n][::-1]
            m = span if same.all() else int(np.argmin(same))
        if not len(found) or m < ngram_min:
            return [], 0
        start = int(found[-1]) + 1
        return a[start:min(start + k, n)].tolist(), m


class SeqSpec:
    """One greedy sequence's speculation state."""

    __slots__ = ("dpos", "history", "match", "own")

    def __init__(self, prompt: list[int], capacity: int) -> None:
        self.history = History(prompt, capacity)
        self.own = Acceptance()
        self.match = 0
        """The n-gram length of the last proposal (0: a draft model's)."""
        self.dpos = 0
        """Draft model: its KV cells hold this sequence's tokens at positions < dpos."""


Row = tuple[SeqSpec | None, int, int]
"""(a decoding sequence's state, or None if it does not speculate; its slot; how many draft
tokens it may take: max_tokens and the context cells left)"""


class Speculator:
    def __init__(self, config: SpecConfig, costs: StepCosts, draft: LlamaModel | None = None,
                 catch_up_tokens: int = 128) -> None:
        if config.mode == "draft" and draft is None:
            raise ValueError("mode 'draft' needs a draft model")
        self.config = config
        self.costs = costs
        self.draft = draft
        self.draft_costs = StepCosts(split_small_batches=False)
        self.catch_up_tokens = catch_up_tokens
        self._global: dict[int, Acceptance] = {}
        """Engine-wide acceptance by n-gram length (0: the draft model)."""
        self.drafted = 0
        self.accepted = 0
        self.draft_seconds = 0.0
        self.explore_s = EXPLORE_START_S
        """Seconds of step time saved up for probes."""
        self.probes = 0
        self._probe_charge: tuple[int, float, float] | None = None
        """The last probe's (step size, plain step's cost, what was charged), settled at its
        measured cost once timed."""

    # -- per sequence ---------------------------------------------------------------------
    def admit(self, prompt: list[int], greedy: bool, max_new: int) -> SeqSpec | None:
        if self.config.mode == "off" or not greedy:
            return None
        return SeqSpec(prompt, len(prompt) + max_new + 1)

    def p(self, st: SeqSpec, match: int) -> float:
        """``st``'s per-token acceptance, from its own evidence and the engine's for drafts
        from matches of this length (0: the draft model)."""
        prior = DRAFT_PRIOR if match == 0 else NGRAM_PRIOR[match]
        glob = self._global.get(match)
        if glob is not None:
            prior = glob.p(prior, GLOBAL_WEIGHT)
        return st.own.p(prior, SEQ_WEIGHT)

    def observe(self, st: SeqSpec, slot: int, before: int, drafted: int, accepted: int) -> None:
        """A verification of ``drafted`` tokens accepted ``accepted``; ``before`` is the
        history's length when they were drafted."""
        self.drafted += drafted
        self.accepted += accepted
        st.own.observe(drafted, accepted)
        rate = accepted / drafted
        glob = self._global.setdefault(st.match, Acceptance())
        glob.accepted = glob.accepted * GLOBAL_DECAY + rate
        glob.rejected = glob.rejected * GLOBAL_DECAY + 1.0 - rate
        if self.draft is not None and st.dpos > before + accepted:
            st.dpos = before + accepted  # cells of rejected drafts
            self.draft.forget(slot, st.dpos)

    def release(self, st: SeqSpec | None, slot: int) -> None:
        if self.draft is not None and st is not None and st.dpos:
            self.draft.forget(slot)
            st.dpos = 0

    def move(self, st: SeqSpec | None, old: int, new: int) -> None:
        """The engine moved the sequence to another slot: its draft cells follow."""
        if self.draft is None or st is None or not st.dpos:
            return
        if not self.draft.load_state(new, self.draft.save_state(old)):
            st.dpos = 0  # it will be fed again
        self.draft.forget(old)

    # -- one step -------------------------------------------------------------------------
    def propose(self, rows: list[Row], budget: int) -> list[list[int]]:
        """Draft tokens for each decoding row (most rows: none), within ``budget`` tokens
        in all."""
        out: list[list[int]] = [[] for _ in rows]
        cfg = self.config
        # (row, most drafts, p, the n-gram proposal or None)
        wanted: list[tuple[int, int, float, list[int] | None]] = []
        for i, (st, _, room) in enumerate(rows):
            cap = min(room, cfg.max_tokens)
            if st is None or cap < 1:
                continue
            st.own.fade(SEQ_DECAY)
            if cfg.mode == "ngram":
                tokens, length = st.history.lookup(cfg.ngram_max, cfg.ngram_min, cap)
                st.match = max(b for b in MATCH_BUCKETS if b <= length) if tokens else 0
                if tokens:
                    wanted.append((i, len(tokens), self.p(st, st.match), tokens))
            else:
                st.match = 0
                wanted.append((i, cap, self.p(st, 0), None))
        if self._probe_charge is not None:
            size, base, charged = self._probe_charge
            measured = self.costs.measured(size)
            if measured is not None:
                self.explore_s -= max(0.0, measured - base) - charged
            self._probe_charge = None
        if not wanted or budget < 1:
            return out
        if cfg.adaptive:
            ks = self._choose(len(rows), wanted, budget)
        else:
            ks, left = [], budget
            for _, most, _, _ in wanted:
                ks.append(min(most, left))
                left -= ks[-1]
        if cfg.mode == "ngram":
            for (i, _, _, proposal), k in zip(wanted, ks, strict=True):
                out[i] = proposal[:k] if proposal else []
            return out
        chosen = [(i, k) for (i, _, _, _), k in zip(wanted, ks, strict=True) if k > 0]
        return self._draft_tokens(rows, chosen, out)

    def _choose(self, n_rows: int, wanted: list[tuple[int, int, float, list[int] | None]],
                budget: int) -> list[int]:
        """Drafts per wanted row that maximise expected tokens per second of the step."""
        ks = [0] * len(wanted)
        base = self.costs.baseline(n_rows)
        if base is None or base <= 0:
            return ks
        cands = sorted(((p ** j, w, j) for w, (_, most, p, _) in enumerate(wanted)
                        for j in range(1, most + 1) if p ** j >= MIN_GAIN),
                       key=lambda c: -c[0])[:budget]
        expected, best, best_t = float(n_rows), n_rows / base * MARGIN, 0
        depth: Counter[int] = Counter()
        drafting = 0.0
        for t, (gain, _, j) in enumerate(cands, 1):
            expected += gain
            if self.draft is not None:
                drafting += self._draft_cost(depth[j] + 1) - self._draft_cost(depth[j])
                depth[j] += 1
            cost = self.costs.estimate(n_rows + t)
            if cost is None:
                break
            if expected / (cost + drafting) > best:
                best, best_t = expected / (cost + drafting), t
        self.explore_s = min(EXPLORE_CAP_S, self.explore_s + EXPLORE_SHARE * base)
        if best_t == 0 and cands:
            return self._probe(n_rows, wanted, base, budget)
        for _, w, _ in cands[:best_t]:
            ks[w] += 1
        return ks

    def _probe(self, n_rows: int, wanted: list[tuple[int, int, float, list[int] | None]],
               base: float, budget: int) -> list[int]:
        """The estimates are revised only by drafting: a step size never tried keeps its
        guess, and an acceptance estimate that says "no" would never be tested again. So when
        the plan drafts nothing, the most promising sequence (highest p, then longest draft)
        verifies its whole draft anyway if the savings (``EXPLORE_SHARE``) cover what that
        step is estimated to cost more than a plain one."""
        ks = [0] * len(wanted)
        w = max(range(len(wanted)), key=lambda i: (wanted[i][2], wanted[i][1]))
        most = min(wanted[w][1], budget)
        cost = self.costs.estimate(n_rows + most)
        if cost is None:
            return ks
        extra = cost - base + (most * self._draft_cost(1) if self.draft is not None else 0.0)
        if extra > self.explore_s:
            return ks
        self.explore_s -= max(0.0, extra)
        self._probe_charge = (n_rows + most, base, max(0.0, extra))
        self.probes += 1
        ks[w] = most
        return ks

    def _draft_cost(self, tokens: int) -> float:
        return (self.draft_costs.estimate(tokens) or 0.0) if tokens else 0.0

    # -- the draft model ------------------------------------------------------------------
    def _draft_tokens(self, rows: list[Row], chosen: list[tuple[int, int]],
                      out: list[list[int]]) -> list[list[int]]:
        """Run the draft model: its cells are caught up with each chosen sequence (a
        sequence far behind, e.g. its prompt not yet fed, is fed ``catch_up_tokens`` a step
        and drafts once caught up), then one greedy token per position."""
        model = self.draft
        assert model is not None
        t0 = time.perf_counter()
        ready: list[tuple[int, SeqSpec, int, int]] = []  # (row, state, slot, k)
        entries: list[tuple[int, int, int, bool]] = []
        catch_up = self.catch_up_tokens
        for i, k in chosen:
            st, slot, _ = rows[i]
            assert st is not None
            h, tokens = st.history.n, st.history.tokens
            behind = h - st.dpos
            if behind > self.config.max_tokens + 1:  # far behind: feed a chunk, no draft
                take = min(behind - 1, catch_up)
                if take > 0:
                    entries.extend((int(tokens[p]), p, slot, False)
                                   for p in range(st.dpos, st.dpos + take))
                    st.dpos += take
                    catch_up -= take
                continue
            entries.extend((int(tokens[p]), p, slot, p == h - 1) for p in range(st.dpos, h))
            st.dpos = h
            ready.append((i, st, slot, k))
        last: list[int] = []
        index = 0
        for _ in ready:  # the logits row of each ready sequence's last token, in order
            while not entries[index][3]:
                index += 1
            last.append(index)
            index += 1
        depth = 1
        while entries:
            step0 = time.perf_counter()
            if model.decode(entries) != 0:
                log.error("the draft model's llama_decode failed; no drafts this step")
                for i, st, slot, _ in ready:
                    out[i] = []
                    self.release(st, slot)
                break
            if all(e[3] for e in entries):
                self.draft_costs.learn(len(entries), time.perf_counter() - step0)
            entries, next_last = [], []
            for (i, st, slot, k), row in zip(ready, last, strict=True):
                if len(out[i]) >= k:
                    continue
                out[i].append(int(model.logits(row).argmax()))
                if len(out[i]) < k:  # feed it to get the next one
                    entries.append((out[i][-1], st.dpos, slot, True))
                    st.dpos += 1
                    next_last.append(len(entries) - 1)
            ready = [r for r in ready if len(out[r[0]]) < r[3]]
            last = next_last
            depth += 1
        self.draft_seconds += time.perf_counter() - t0
        return out

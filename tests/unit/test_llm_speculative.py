"""Speculative decoding in the engine, with a stand-in for llama.cpp whose greedy text is
scripted by position (the real model: tests/integration/test_llm_speculative.py): drafts,
verification, the KV cells of rejected drafts, and the limits that must hold when several
tokens come out of one step; the n-gram lookup, the cost table and the planner."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from sokuji.config import ModelConfig
from sokuji.errors import ConfigError
from sokuji.llm import native
from sokuji.llm.engine import EngineConfig, GenerationEngine
from sokuji.llm.options import LlamaOptions
from sokuji.llm.request import Delta, Finish, GenerationRequest, SamplingParams
from sokuji.llm.sequence import Sequence
from sokuji.llm.speculative import EXPLORE_SHARE, EXPLORE_START_S, History, SpecConfig, Speculator
from sokuji.llm.step_cost import StepCosts
from tests.conftest import options_of

EOG = 0
PROMPT = [7, 8, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 7, 8]
"""A context that repeats itself: the n-gram lookup finds drafts in it."""


class ScriptedModel:
    """Greedy text fixed by position: the token after position ``p`` is ``script[p + 1]``
    (whatever was fed). Records decodes and cut KV cells."""

    shape = SimpleNamespace(slots=2)
    n_vocab = 32
    eog_ids = np.array([EOG])

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.calls: list[list[tuple[int, int, int, bool]]] = []
        self.cut: list[tuple[int, int]] = []

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> int:
        self.calls.append(entries)
        return 0

    def logits(self, index: int) -> np.ndarray:
        pos = self.calls[-1][index][1]
        row = np.zeros(self.n_vocab, dtype=np.float32)
        row[self.script[pos + 1] if pos + 1 < len(self.script) else EOG] = 5.0
        row[31] = 1.0  # the runner-up, when the end is banned
        return row

    def ban_eog(self, index: int) -> None:
        pass  # (the tests that need it script no end)

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def piece(self, token: int) -> bytes:
        return b"%d " % token

    def forget(self, seq: int, from_pos: int = 0) -> None:
        self.cut.append((seq, from_pos))


def run(script: list[int], spec: SpecConfig | None, **params: object
        ) -> tuple[str, Finish, ScriptedModel, GenerationEngine, GenerationRequest]:
    model = ScriptedModel(script)
    config = EngineConfig(prefix_cache_bytes=0, speculative=spec or SpecConfig("off"))
    eng = GenerationEngine("m", model, config)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    try:
        req = GenerationRequest("m", PROMPT, SamplingParams(temperature=0, **params),  # type: ignore[arg-type]
                                loop, arrival_ns=0)
        eng.queue.waiting.append(req)
        eng._admit(0)
        for _ in range(200):
            if not eng._active:
                break
            eng._step()
        assert not eng._active
        events: list[Delta | Finish] = []
        while not events or not isinstance(events[-1], Finish):
            events += loop.run_until_complete(req.next_events())
    finally:
        loop.close()
    finish = events[-1]
    assert isinstance(finish, Finish)
    return "".join(e.text for e in events if isinstance(e, Delta)), finish, model, eng, req


FORCED = SpecConfig("ngram", max_tokens=8, ngram_max=4, ngram_min=1, adaptive=False)
# After the prompt, the model goes on with the repeating pattern, then departs from it.
CONTINUES = [*PROMPT, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 20, 21, 22, 23, 24, 25, 26, 27, 28]


def test_forced_drafts_give_the_same_text_in_fewer_steps() -> None:
    plain, f0, m0, _, _ = run(CONTINUES, None, max_tokens=20)
    text, f1, m1, eng, req = run(CONTINUES, FORCED, max_tokens=20)
    assert text == plain and (f1.reason, f1.completion_tokens) == (f0.reason, 20)
    assert len(m1.calls) < len(m0.calls) - 5  # several tokens came out of some steps
    t = req.timing
    assert t.accepted_tokens >= 10 and t.drafted_tokens > t.accepted_tokens  # one departure
    assert eng.spec is not None and (eng.spec.drafted, eng.spec.accepted) == (
        t.drafted_tokens, t.accepted_tokens)
    assert t.steps == len(m1.calls)  # every decode gave it tokens (the first: the prompt)
    assert f"accepted {t.accepted_tokens}" in t.speculation()


def test_rejected_drafts_cells_are_cut_and_positions_stay_consecutive() -> None:
    _, _, model, _, _ = run(CONTINUES, FORCED, max_tokens=20)
    steps = model.calls[1:]  # after the prompt's
    expected_cuts = []
    for this, after in itertools.pairwise(steps):
        start, fed = this[0][1], len(this)
        assert [pos for _, pos, _, _ in this] == list(range(start, start + fed))
        nxt = after[0][1]
        assert start < nxt <= start + fed  # on from the last accepted token
        if nxt < start + fed:  # some drafts were rejected: their cells must go
            expected_cuts.append((0, nxt))
    assert expected_cuts and model.cut[:-1] == expected_cuts  # (the last frees the slot)
    assert model.cut[-1] == (0, 0)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 13])
def test_max_tokens_is_never_overrun_by_accepted_drafts(max_tokens: int) -> None:
    plain, _, _, _, _ = run(CONTINUES, None, max_tokens=max_tokens)
    text, finish, model, _, _ = run(CONTINUES, FORCED, max_tokens=max_tokens)
    assert (text, finish.reason, finish.completion_tokens) == (plain, "length", max_tokens)
    for entries in model.calls[1:]:  # no step drafts beyond what max_tokens leaves
        assert len(entries) <= max_tokens


def test_a_stop_string_inside_an_accepted_run_ends_there() -> None:
    plain, _, _, _, _ = run(CONTINUES, None, max_tokens=20)
    stop = "4 5 "  # in the middle of a run the drafts predict correctly
    text, finish, _, _, req = run(CONTINUES, FORCED, max_tokens=20, stop=(stop,))
    assert text == plain[:plain.index(stop)] and finish.reason == "stop"
    assert req.timing.accepted_tokens > 0


def test_the_end_of_generation_inside_an_accepted_run_ends_it() -> None:
    script = [*PROMPT, 9, 1, 2, 3, EOG, 5, 6]  # the model ends where the pattern goes on
    plain, f0, _, _, _ = run(script, None, max_tokens=20)
    text, f1, _, _, _ = run(script, FORCED, max_tokens=20)
    assert (text, f1.reason, f1.completion_tokens) == (plain, "stop", f0.completion_tokens)
    assert f1.completion_tokens == 4


def test_sampled_sequences_do_not_speculate() -> None:
    model = ScriptedModel(CONTINUES)
    eng = GenerationEngine("m", model, EngineConfig(  # type: ignore[arg-type]
        prefix_cache_bytes=0, speculative=FORCED))
    loop = asyncio.new_event_loop()
    try:
        req = GenerationRequest("m", PROMPT, SamplingParams(max_tokens=4, temperature=0.7,
                                                            seed=1), loop, arrival_ns=0)
        eng.queue.waiting.append(req)
        eng._admit(0)
        assert eng._active[0].spec is None and req.timing.speculative == "off sampled"
    finally:
        loop.close()


# -- the n-gram lookup ----------------------------------------------------------------------
def test_lookup_takes_the_longest_suffix_match_most_recent_first() -> None:
    h = History([5, 1, 2, 3, 9, 1, 2, 4, 8, 2, 3], capacity=32)  # suffix ... 2 3
    assert h.lookup(4, 1, 8) == ([9, 1, 2, 4, 8, 2, 3], 2)  # "2 3" at 2-3, not "3" alone
    assert h.lookup(1, 1, 3) == ([9, 1, 2], 1)  # 1-gram "3": its only earlier place
    assert h.lookup(4, 3, 8) == ([], 0)  # no 3-gram "8 2 3" earlier
    h.append(9)  # ... 2 3 9: occurred at 2-4
    assert h.lookup(4, 1, 2) == ([1, 2], 3)
    assert History([1, 2, 3], 8).lookup(3, 1, 4) == ([], 0)
    rep = History([4, 4, 4, 4], 8)  # a repeat: the most recent earlier 4 is followed by one 4
    assert rep.lookup(2, 1, 4) == ([4], 2)


def brute_lookup(a: list[int], nmax: int, nmin: int, k: int) -> tuple[list[int], int]:
    """The definition: the longest suffix match (up to nmax), the most recent among equals."""
    n, best = len(a), (0, -1)
    for end in range(n - 1):
        m = 0
        while m < nmax and end - m >= 0 and a[end - m] == a[n - 1 - m]:
            m += 1
        if m and m >= best[0]:
            best = (m, end)
    if best[0] < nmin:
        return [], 0
    return a[best[1] + 1:min(best[1] + 1 + k, n)], best[0]


def test_lookup_agrees_with_its_definition_on_random_histories() -> None:
    rng = np.random.default_rng(7)
    for _ in range(2000):
        alphabet = int(rng.choice([2, 3, 5, 50]))
        a = rng.integers(0, alphabet, int(rng.integers(2, 60))).tolist()
        nmax = int(rng.integers(1, 20))
        nmin, k = int(rng.integers(1, nmax + 1)), int(rng.integers(1, 9))
        assert History(a, len(a) + 1).lookup(nmax, nmin, k) == brute_lookup(a, nmax, nmin, k)


# -- costs and the planner -------------------------------------------------------------------
def test_step_costs_interpolate_and_extrapolate_optimistically() -> None:
    c = StepCosts()
    assert c.estimate(3) is None
    c.learn(1, 0.010)
    c.learn(5, 0.030)
    assert c.estimate(3) == pytest.approx(0.020)
    assert c.estimate(9) == pytest.approx(0.030 + 4 * 0.25 * 0.006)  # untried: optimistic
    c.learn(9, 0.060)
    assert c.estimate(9) == pytest.approx(0.060)
    assert c.baseline(2) == pytest.approx(0.015)


def plan(costs: dict[int, float], p_hist: list[int], adaptive: bool = True) -> list[int]:
    step = StepCosts(split_small_batches=False)
    for n, s in costs.items():
        step.learn(n, s)
    spec = Speculator(SpecConfig("ngram", 8, 4, 1, adaptive), step)
    spec.explore_s = 0.0  # the plan alone, no probes
    st = spec.admit(p_hist, greedy=True, max_new=64)
    assert st is not None
    return spec.propose([(st, 0, 64)], budget=64)[0]


REPEAT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4]


def test_the_planner_drafts_where_verifying_is_cheap_and_not_where_it_is_linear() -> None:
    flat = {1: 0.010, 9: 0.012}  # a GPU-like step: 9 tokens cost little more than 1
    linear = {1: 0.010, 9: 0.090}  # this CPU: each token costs its own share
    offered = [5, 6, 7, 8, 9, 10, 1, 2]
    got = plan(flat, REPEAT)  # drafts what the match offers, while a draft's expected yield
    assert len(got) >= 6 and got == offered[:len(got)]  # (p^j) pays for its cost
    assert plan(linear, REPEAT) == []
    assert plan(linear, REPEAT, adaptive=False) == offered
    assert plan({}, REPEAT) == []  # nothing measured yet: plain steps first


def test_the_planner_follows_a_sequences_acceptance() -> None:
    step = StepCosts(split_small_batches=False)
    step.learn(1, 0.010)
    step.learn(9, 0.030)  # 9 tokens for 3x one: pays from p of about 0.6 at k = 8
    spec = Speculator(SpecConfig("ngram", 8, 4, 1, True), step)
    st = spec.admit(REPEAT, greedy=True, max_new=64)
    assert st is not None

    def one_step(accepted: bool) -> int:
        spec.explore_s = 0.0  # the plan alone, no probes
        drafts = spec.propose([(st, 0, 64)], 64)[0]
        if drafts:
            spec.observe(st, 0, st.history.n, len(drafts), len(drafts) if accepted else 0)
        return len(drafts)

    accepted = [one_step(True) for _ in range(4)]
    assert accepted == sorted(accepted) and accepted[-1] == 8  # k grows with acceptance
    rejected = [one_step(False) for _ in range(20)]
    assert rejected == sorted(rejected, reverse=True) and rejected[-1] <= 1  # and shrinks
    assert spec.p(st, 4) < 0.5
    step.learn(2, 0.020)  # one more token costs a token's share: no more drafts at that p
    assert one_step(False) == 0


# -- configuration ---------------------------------------------------------------------------
def llama(**options: object) -> LlamaOptions:
    """The options of a llama model as the config makes them when it loads."""
    opts: LlamaOptions = options_of(ModelConfig(name="smollm2", runtime="llama",
                                                options=options))
    return opts


@pytest.mark.parametrize(("options", "key"), [
    ({"speculative": "eagle"}, "models[0].options.speculative"),
    ({"speculative": "draft"}, "models[0].options.speculative"),  # no draft model named
    # without speculative = "draft":
    ({"draft_requantize": "q4_0"}, "models[0].options.draft_requantize"),
    ({"speculative": "draft", "draft_requantize": "q2_k"}, "models[0].options.draft_requantize"),
    ({"speculative_ngram_max": 1, "speculative_ngram_min": 2},
     "models[0].options.speculative_ngram_max"),
    ({"speculative_tokens": 0}, "models[0].options.speculative_tokens"),
    ({"speculative_tokens": 33}, "models[0].options.speculative_tokens"),
    ({"speculative": "ngram", "flash_attn": False}, "models[0].options.speculative"),
    ({"speculative_adaptive": "yes"}, "models[0].options.speculative_adaptive"),
])
def test_speculative_options_are_checked_naming_the_key(options: dict[str, object],
                                                        key: str) -> None:
    with pytest.raises(ConfigError) as exc:  # when the config loads, before any build
        llama(**options)
    assert exc.value.param == key and f"'{key}'" in str(exc.value)


def test_without_flash_attention_the_default_speculation_gives_way() -> None:
    assert llama(flash_attn=False).speculative == "off"
    assert llama().speculative == "ngram"


def test_the_engine_takes_its_speculation_from_the_options() -> None:
    opts = llama(speculative="ngram", speculative_tokens=3, speculative_adaptive=False)
    got = EngineConfig.from_options(opts, 8, 0.0).speculative
    assert got == SpecConfig("ngram", 3, opts.speculative_ngram_max,
                             opts.speculative_ngram_min, False)


def test_vocabularies_are_compared_token_by_token() -> None:
    def vocab(pieces: list[bytes], add_bos: bool = False) -> SimpleNamespace:
        digest = b"".join(pieces)
        return SimpleNamespace(n_vocab=len(pieces), add_bos=add_bos, vocab_digest=digest,
                               piece=lambda t, special=False: pieces[t])

    a = vocab([b"a", b"b", b"c"])
    assert native.vocab_difference(a, vocab([b"a", b"b", b"c"])) == ""
    assert "2 tokens against 3" in native.vocab_difference(a, vocab([b"a", b"b"]))
    assert "token 1 differs" in native.vocab_difference(a, vocab([b"a", b"x", b"c"]))
    assert "BOS" in native.vocab_difference(a, vocab([b"a", b"b", b"c"], add_bos=True))


def test_probes_are_paid_from_a_small_share_of_step_time() -> None:
    step = StepCosts(split_small_batches=False)
    step.learn(1, 0.010)
    step.learn(9, 0.090)  # linear: the plan never drafts
    spec = Speculator(SpecConfig("ngram", 8, 4, 1, True), step)
    st = spec.admit(REPEAT, greedy=True, max_new=1 << 20)
    assert st is not None
    spent = 0.0
    for _ in range(2000):
        if spec.propose([(st, 0, 64)], 64)[0]:
            spent += 0.080  # a probe's step cost 80 ms more than a plain one
            spec.observe(st, 0, st.history.n, 8, 0)  # and its drafts were rejected
    assert spec.probes >= 2  # it keeps testing its "no"...
    assert spent <= EXPLORE_START_S + EXPLORE_SHARE * 2000 * 0.010 + 1e-9  # ...within 2%


# -- prompt pieces: every prompt token through the kernel a whole-prompt decode uses ----------
def piece_sizes(prompt_len: int, budgets: list[int], room: int = 512) -> list[int]:
    loop = asyncio.new_event_loop()
    try:
        seq = Sequence(GenerationRequest("m", list(range(prompt_len)), SamplingParams(
            max_tokens=4, temperature=0), loop, arrival_ns=0), 0, 32)
        sizes = []
        for budget in budgets:
            if not seq.pending:
                break
            sizes.append(len(seq.prompt_piece(budget, room)))
        return sizes
    finally:
        loop.close()


def test_long_prompts_come_in_pieces_of_a_tile_or_more_with_no_short_tail() -> None:
    assert piece_sizes(300, [512]) == [300]  # alone: whole
    assert piece_sizes(300, [128] * 3) == [128, 108, 64]  # no 44-token tail
    assert piece_sizes(180, [128] * 2) == [116, 64]
    assert piece_sizes(200, [10, 128, 128]) == [64, 72, 64]  # a tile even on a small budget
    assert piece_sizes(50, [20, 20, 20]) == [20, 20, 10]  # short: as it comes
    assert piece_sizes(100, [128], room=80) == [0]  # does not fit now: waits


def test_long_pieces_get_a_decode_call_of_their_own() -> None:
    model = ScriptedModel(CONTINUES * 4)
    model.shape = SimpleNamespace(slots=3)  # type: ignore[misc]
    eng = GenerationEngine("m", model, EngineConfig(  # type: ignore[arg-type]
        prefix_cache_bytes=0, speculative=FORCED))
    loop = asyncio.new_event_loop()
    try:
        for prompt in (PROMPT, [5] * 150, [6] * 90):  # one short, two long
            eng.queue.waiting.append(GenerationRequest(
                "m", prompt, SamplingParams(max_tokens=6, temperature=0), loop, arrival_ns=0))
        eng._admit(0)
        eng._step()
    finally:
        loop.close()
    per_call = [{s: sum(1 for e in call if e[2] == s) for s in {e[2] for e in call}}
                for call in model.calls]
    assert per_call == [{1: 150}, {2: 90}, {0: len(PROMPT)}]

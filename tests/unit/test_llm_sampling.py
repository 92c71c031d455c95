"""The per-sequence sampler (``sokuji/llm/sampling.py``): each logit processor against a
reference computed here independently (float64, plain loops), log-probabilities against a
reference log-softmax, and the support and distribution of each truncation."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from sokuji.llm.sampling import SamplingConfig, TokenSampler, truncate

V = 64


def row(seed: int = 0, n: int = V) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2, n).astype(np.float32)


def ref_log_softmax(x: list[float]) -> list[float]:
    finite = [v for v in x if v != -math.inf]
    m = max(finite)
    s = sum(math.exp(v - m) for v in finite)
    return [v - m - math.log(s) if v != -math.inf else -math.inf for v in x]


def ref_processed(logits: np.ndarray, prompt: list[int], generated: list[int],
                  bias: dict[int, float], presence: float, frequency: float,
                  repetition: float) -> list[float]:
    out = [float(v) for v in logits]
    for t, b in bias.items():
        out[t] += b
    counts = Counter(generated)
    for t, n in counts.items():
        out[t] -= n * frequency + presence
    for t in set(prompt) | set(generated):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    return out


def test_greedy_plain_is_the_argmax_and_reports_nothing() -> None:
    x = row(1)
    s = TokenSampler(SamplingConfig(temperature=0), V).sample(x)
    assert s == (int(np.argmax(x)), None, ())


def test_logit_bias_adds_to_the_raw_logit() -> None:
    """Catches: the bias multiplied, applied after penalties' sign test, or to another id."""
    x = row(2)
    bias = {3: 100.0, 7: -100.0, 11: 2.5}
    s = TokenSampler(SamplingConfig(temperature=0, logit_bias=tuple(bias.items())), V)
    got = s.processed(x)
    ref = ref_processed(x, [], [], bias, 0, 0, 1)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-5)
    assert s.sample(x).token == 3  # +100 forces it


def test_presence_and_frequency_penalties_count_generated_tokens_only() -> None:
    """Catches: presence penalty applied to prompt tokens; frequency not multiplied by the
    count; a token counted before ``accept``."""
    x = row(3)
    prompt = [1, 2, 3, 4]
    cfg = SamplingConfig(temperature=0, presence_penalty=0.7, frequency_penalty=0.3)
    s = TokenSampler(cfg, V, prompt)
    np.testing.assert_allclose(s.processed(x), x, atol=0)  # nothing generated yet
    generated = [5, 9, 5, 5, 2]
    for t in generated:
        s.accept(t)
    ref = ref_processed(x, prompt, generated, {}, 0.7, 0.3, 1.0)
    np.testing.assert_allclose(s.processed(x), ref, rtol=1e-6, atol=1e-5)


def test_negative_penalties_favour_repeats() -> None:
    x = row(4)
    s = TokenSampler(SamplingConfig(temperature=0, presence_penalty=-1.5,
                                    frequency_penalty=-0.5), V)
    s.accept(8)
    s.accept(8)
    assert s.processed(x)[8] == pytest.approx(float(x[8]) + 1.5 + 2 * 0.5, abs=1e-5)


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output(
        ) -> None:
    """Catches: the prompt left out; negative logits divided (pushed towards 0, i.e.
    favoured); a token penalised once per occurrence instead of once."""
    x = row(5)
    prompt = [int(np.argmax(x)), int(np.argmin(x)), 6, 6]
    s = TokenSampler(SamplingConfig(temperature=0, repetition_penalty=1.3), V, prompt)
    s.accept(10)
    s.accept(10)
    ref = ref_processed(x, prompt, [10, 10], {}, 0, 0, 1.3)
    np.testing.assert_allclose(s.processed(x), ref, rtol=1e-6, atol=1e-5)
    assert s.processed(x)[prompt[1]] < x[prompt[1]] < 0


def test_mask_and_bans_set_minus_infinity() -> None:
    """The packed bitmask: bit i % 32 of int32 word i // 32 (llguidance's layout)."""
    x = row(6)
    allowed_ids = [0, 5, 31, 32, 33, 63]
    words = np.zeros((V + 31) // 32, dtype=np.int32)
    for t in allowed_ids:
        words[t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-2 ** 31)
    s = TokenSampler(SamplingConfig(temperature=0), V)
    got = s.processed(x, allowed=words, banned=np.array([5]))
    finite = sorted(int(t) for t in np.flatnonzero(np.isfinite(got)))
    assert finite == [0, 31, 32, 33, 63]
    assert s.sample(x, allowed=words, banned=np.array([5])).token == \
        max(finite, key=lambda t: x[t])


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_the_log_softmax_of_the_processed_logits(temperature: float) -> None:
    """Catches: logprobs of the raw logits (bias / penalties / bans ignored), of tempered
    logits, or a top list not ordered / not the most likely."""
    x = row(7)
    cfg = SamplingConfig(temperature=temperature, seed=1, logprobs=5,
                         logit_bias=((4, 3.0),), presence_penalty=1.0)
    s = TokenSampler(cfg, V)
    s.accept(int(np.argmax(x)))
    banned = np.array([9])
    got = s.sample(x, banned=banned)
    proc = ref_processed(x, [], [int(np.argmax(x))], {4: 3.0}, 1.0, 0, 1)
    proc[9] = -math.inf
    ref = ref_log_softmax(proc)
    assert got.logprob == pytest.approx(ref[got.token], abs=1e-5)
    order = sorted(range(V), key=lambda t: (-ref[t], t))[:5]
    assert [t for t, _ in got.top] == order
    for t, lp in got.top:
        assert lp == pytest.approx(ref[t], abs=1e-5)
    if temperature == 0:
        assert got.token == order[0]


def test_top_logprobs_zero_gives_the_chosen_token_only() -> None:
    s = TokenSampler(SamplingConfig(temperature=0, logprobs=0), V).sample(row(8))
    assert s.logprob is not None and s.top == ()


def support(cfg: SamplingConfig, x: np.ndarray, draws: int = 3000) -> Counter[int]:
    s = TokenSampler(cfg, len(x))
    return Counter(s.sample(x).token for _ in range(draws))


def probs(z: np.ndarray) -> np.ndarray:
    e = np.exp(z.astype(np.float64) - z.max())
    return e / e.sum()


def test_top_k_support_is_exactly_the_k_largest() -> None:
    x = np.linspace(0, 1, 16).astype(np.float32)  # flat enough that every kept token shows
    seen = support(SamplingConfig(temperature=1.0, top_k=4, seed=2), x)
    assert set(seen) == {12, 13, 14, 15}


def test_top_p_support_is_the_smallest_prefix_reaching_p() -> None:
    """Catches: the token that crosses top_p left out, or one more kept."""
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    x = np.log(p).astype(np.float32)
    seen = support(SamplingConfig(temperature=1.0, top_p=0.75, seed=3), x)
    assert set(seen) == {0, 1, 2}  # 0.4 + 0.25 = 0.65 < 0.75 <= 0.8
    seen = support(SamplingConfig(temperature=1.0, top_p=0.8, seed=3), x)
    assert set(seen) <= {0, 1, 2, 3} and {0, 1, 2} <= set(seen)


def test_top_p_on_a_large_vocabulary_falls_back_to_a_full_sort() -> None:
    """A flat row: the first 256 tokens hold too little mass, so the whole row is sorted;
    the kept set is exactly the reference nucleus."""
    x = np.zeros(2000, dtype=np.float32)
    x[:10] = 0.5
    s = TokenSampler(SamplingConfig(temperature=1.0, top_p=0.5, seed=4), 2000)
    ids, _ = truncate(x, 0, 0.5, 0.0)
    pr = probs(x)
    order = sorted(range(2000), key=lambda t: (-pr[t], t))
    cum, ref = 0.0, []
    for t in order:
        ref.append(t)
        cum += pr[t]
        if cum >= 0.5:
            break
    assert sorted(ids.tolist()) == sorted(ref)
    assert all(s.sample(x).token in set(ref) for _ in range(200))


def test_min_p_drops_tokens_below_min_p_times_the_best() -> None:
    p = np.array([0.5, 0.2, 0.1, 0.09, 0.06, 0.05])
    x = np.log(p).astype(np.float32)
    seen = support(SamplingConfig(temperature=1.0, min_p=0.19, seed=5), x)
    assert set(seen) == {0, 1, 2}  # 0.1 >= 0.095, 0.09 < 0.095


def test_temperature_scales_the_distribution_as_specified() -> None:
    """Frequencies match softmax(logits / T): sharper below 1, flatter above."""
    x = np.log(np.array([0.6, 0.3, 0.1])).astype(np.float32)
    for t in (0.5, 1.0, 2.0):
        n = 20000
        seen = support(SamplingConfig(temperature=t, seed=6), x, n)
        want = probs(x / t)
        got = np.array([seen[i] / n for i in range(3)])
        assert np.abs(got - want).max() < 0.015, (t, got, want)


def test_the_same_seed_repeats_and_another_seed_differs() -> None:
    x = np.zeros(V, dtype=np.float32)

    def draws(seed: int) -> list[int]:
        s = TokenSampler(SamplingConfig(temperature=1.0, seed=seed), V)
        return [s.sample(x).token for _ in range(40)]

    assert draws(42) == draws(42)
    assert draws(42) != draws(43)
    a, b = (TokenSampler(SamplingConfig(temperature=1.0), V) for _ in range(2))
    assert [a.sample(x).token for _ in range(40)] != [b.sample(x).token for _ in range(40)]


def chi_square(seen: Counter[int], want: dict[int, float], n: int) -> float:
    """Pearson's statistic of ``n`` draws against the probabilities ``want`` (a token drawn
    outside ``want`` makes it infinite)."""
    if set(seen) - set(want):
        return math.inf
    return sum((seen[t] - n * q) ** 2 / (n * q) for t, q in want.items())


CHI2_999 = {2: 13.82, 3: 16.27, 5: 20.52}
"""The chi-square quantile 0.999 by degrees of freedom: a fixed seed, so no flake; a wrong
distribution lands far beyond it with this many draws."""


def test_draws_follow_the_softmax_at_the_temperature_chi_square() -> None:
    """Kills the mutants: ignoring the temperature, multiplying by it instead of dividing,
    or drawing uniformly among the kept tokens in ``llm/sampling.py`` ``_draw``."""
    x = np.array([1.5, 1.0, 0.4, 0.0, -0.3, -1.2], dtype=np.float32)
    n = 6000
    for t in (0.6, 1.0, 1.7):
        seen = support(SamplingConfig(temperature=t, seed=11), x, n)
        want = dict(enumerate(probs(x / t)))
        assert chi_square(seen, want, n) < CHI2_999[5], (t, seen)


def test_top_p_keeps_exactly_the_nucleus_renormalised() -> None:
    """Kills the mutants: drawing uniformly within the nucleus, or keeping one token more or
    less, in ``llm/sampling.py`` (``_draw`` / ``_nucleus``)."""
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    x = np.log(p).astype(np.float32)
    n = 6000
    seen = support(SamplingConfig(temperature=1.0, top_p=0.75, seed=12), x, n)
    kept = p[:3] / p[:3].sum()  # 0.65 < 0.75 <= 0.8: exactly three, in proportion
    assert chi_square(seen, dict(enumerate(kept)), n) < CHI2_999[2], seen


def test_temperature_applies_before_top_p() -> None:
    """Kills the mutant: truncating (top_p) the untempered distribution and tempering what
    is left, in ``llm/sampling.py`` ``_draw``. At T=2 the distribution flattens to
    p ** 0.5 (normalised): its 0.6 nucleus holds three tokens; untempered it holds two."""
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    x = np.log(p).astype(np.float32)
    q = probs(x / 2.0)
    assert q[:2].sum() < 0.6 <= q[:3].sum() and p[:2].sum() >= 0.6  # the premise
    n = 6000
    seen = support(SamplingConfig(temperature=2.0, top_p=0.6, seed=13), x, n)
    kept = q[:3] / q[:3].sum()
    assert chi_square(seen, dict(enumerate(kept)), n) < CHI2_999[2], seen


def test_temperature_towards_zero_is_greedy() -> None:
    """Kills the mutants: treating a small temperature as 1 (or multiplying by it). Near 0
    every draw is the argmax; at 0 it is the argmax without a draw (no generator)."""
    x = row(14)
    best = int(x.argmax())
    gap = float(np.sort(x)[-1] - np.sort(x)[-2])
    t = gap / 50  # the runner-up is exp(-50) as likely
    assert set(support(SamplingConfig(temperature=t, seed=15), x, 2000)) == {best}
    zero = TokenSampler(SamplingConfig(temperature=0.0, seed=15), V)
    assert zero.rng is None and {zero.sample(x).token for _ in range(50)} == {best}


def test_twenty_seeds_give_twenty_different_draws() -> None:
    """Kills the mutant: a seed ignored (a constant or a fixed seed used instead); another
    seed gives another sequence of draws, the same seed the same one."""
    x = np.zeros(V, dtype=np.float32)

    def draws(seed: int) -> tuple[int, ...]:
        s = TokenSampler(SamplingConfig(temperature=1.0, seed=seed), V)
        return tuple(s.sample(x).token for _ in range(10))

    runs = [draws(seed) for seed in range(20)]
    assert len(set(runs)) == 20
    assert runs == [draws(seed) for seed in range(20)]


def test_one_draw_a_token_whatever_the_truncation_leaves() -> None:
    """A sequence's later draws do not depend on whether a step had one candidate left."""
    x = row(9)
    one = np.full(V, -np.inf, dtype=np.float32)
    one[3] = 0.0
    a = TokenSampler(SamplingConfig(temperature=1.0, seed=7), V)
    b = TokenSampler(SamplingConfig(temperature=1.0, seed=7), V)
    a.sample(x)
    b.sample(one)
    assert [a.sample(x).token for _ in range(20)] == [b.sample(x).token for _ in range(20)]


# -- logprobs beside the text (sequence.py) and in OpenAI's formats (llm_codec) ------------
def emitted(pieces: list[bytes], stop: tuple[str, ...] = ()) -> list[tuple[str, list[str]]]:
    """Each Delta a Sequence pushes for ``pieces``: (text, the tokens whose logprobs ride
    on it), the final flush included."""
    import asyncio

    from sokuji.core.events import Delta
    from sokuji.llm.request import GenerationRequest, SamplingParams
    from sokuji.llm.sampling import Sampled
    from sokuji.llm.sequence import Sequence

    loop = asyncio.new_event_loop()
    pushed: list[Delta] = []
    try:
        req = GenerationRequest("m", [1], SamplingParams(max_tokens=50, temperature=0,
                                                         logprobs=1, stop=stop),
                                loop, arrival_ns=0)
        req.push = pushed.append  # type: ignore[method-assign,assignment]
        seq = Sequence(req, 0, V)
        for i, piece in enumerate(pieces):
            if seq.emit(i, piece, Sampled(i, -0.5, ((i, -0.5),)), lambda t: pieces[t]):
                break
        tail = seq.flush()
        if tail is not None:
            pushed.append(tail)
    finally:
        loop.close()
    return [(d.text, [e.token for e in d.logprobs]) for d in pushed]


def test_logprobs_ride_with_the_text_they_end() -> None:
    """A partial UTF-8 character: its first token's entry waits for the token that completes
    it. Catches: entries sent before their text, or lost at the flush."""
    e_acute = "é".encode()
    got = emitted([b"a", e_acute[:1], e_acute[1:], b"b"])
    assert "".join(t for t, _ in got) == "aéb"
    assert [tok for _, toks in got for tok in toks] == ["a", "\ufffd", "\ufffd", "b"]
    assert got == [("a", ["a"]), ("é", ["\ufffd", "\ufffd"]), ("b", ["b"])]


def test_logprobs_of_tokens_inside_a_stop_string_are_not_sent() -> None:
    """Held text (a possible stop) holds its tokens; the tokens wholly inside the stop
    string that ended the sequence are dropped with their text."""
    got = emitted([b"Hello", b" wor", b"ld", b"!"], stop=("world",))
    assert "".join(t for t, _ in got) == "Hello "
    assert [tok for _, toks in got for tok in toks] == ["Hello", " wor"]
    got = emitted([b"Hi", b" w", b"x"], stop=("wo",))  # held " w" was not a stop after all
    assert got == [("Hi", ["Hi"]), (" ", []), ("wx", [" w", "x"])]


def test_the_codec_writes_openai_logprob_formats() -> None:
    from sokuji.core.events import TokenLogprob
    from sokuji.llm.request import Timing
    from sokuji.server import llm_codec

    entries = [TokenLogprob("Hi", b"Hi", -0.25, 0, (("Hi", b"Hi", -0.25), ("Yo", b"Yo", -2.0))),
               TokenLogprob("!", b"!", -float("inf"), 2, ())]
    chat = llm_codec.decode(b'{"model": "m", "messages": [{"role": "user", "content": "x"}],'
                            b' "logprobs": true, "top_logprobs": 2}', chat=True)
    assert chat.logprobs == 2
    doc = llm_codec.Encoder(chat, "m", Timing(0)).logprobs_doc(entries)
    assert doc == {"refusal": None, "content": [
        {"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": [
            {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
            {"token": "Yo", "logprob": -2.0, "bytes": [89, 111]}]},
        {"token": "!", "logprob": -9999.0, "bytes": [33], "top_logprobs": []}]}
    text = llm_codec.decode(b'{"model": "m", "prompt": "x", "logprobs": 1}', chat=False)
    doc = llm_codec.Encoder(text, "m", Timing(0)).logprobs_doc(entries)
    assert doc == {"tokens": ["Hi", "!"], "token_logprobs": [-0.25, -9999.0],
                   "top_logprobs": [{"Hi": -0.25, "Yo": -2.0}, {"!": -9999.0}],
                   "text_offset": [0, 2]}
    plain = llm_codec.decode(b'{"model": "m", "prompt": "x"}', chat=False)
    assert plain.logprobs is None
    assert llm_codec.Encoder(plain, "m", Timing(0)).logprobs_doc(entries) is None


def test_logit_bias_ids_are_checked_against_the_vocabulary() -> None:
    """The codec cannot know the vocabulary; the model's prompt rules refuse an id past it
    (400 naming logit_bias)."""
    from types import SimpleNamespace

    from sokuji.errors import InvalidInput
    from sokuji.llm.prompt import PromptBuilder

    model = SimpleNamespace(n_vocab=100, max_piece_bytes=8, lossless=True)
    limits = SimpleNamespace(context_size=64, max_new_tokens=32, prompt_limit=63)
    b = PromptBuilder("m", model, None, limits)  # type: ignore[arg-type]
    assert b.sampling(3, chat=False, max_tokens=4, logit_bias=((99, 1.0),)).logit_bias == \
        ((99, 1.0),)
    with pytest.raises(InvalidInput) as exc:
        b.sampling(3, chat=False, max_tokens=4, logit_bias=((100, 1.0),))
    assert exc.value.param == "logit_bias"


def test_an_upstream_gets_the_sampling_fields_and_logprobs_are_refused() -> None:
    """The relay carries text only: logprobs would come back null, so they are a 400; the
    rest is forwarded as the client sent it."""
    import orjson

    from sokuji.errors import InvalidInput
    from sokuji.routing.upstream_codec import completion_request
    from sokuji.server import llm_codec

    req = llm_codec.decode(b'{"model": "m", "prompt": "x", "presence_penalty": 0.5, '
                           b'"logit_bias": {"12": -3}, "top_k": 5}', chat=False)
    _, body = completion_request(req, "up")
    doc = orjson.loads(body)
    assert (doc["presence_penalty"], doc["logit_bias"], doc["top_k"]) == (0.5, {"12": -3.0}, 5)
    assert "frequency_penalty" not in doc
    req = llm_codec.decode(b'{"model": "m", "prompt": "x", "logprobs": 2}', chat=False)
    with pytest.raises(InvalidInput) as exc:
        completion_request(req, "up")
    assert exc.value.param == "logprobs"

"""Sampling features through a real ``sokuji serve`` of SmolLM2-135M, driven by the openai
SDK: logprobs (chat and the legacy completions format, streamed and whole) against a
log-softmax of llama.cpp's own logits, seeded sampling that repeats whatever else runs in
the batch, logit_bias, penalties, and the 400s for bad values."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest

from sokuji.llm import native
from tests.conftest import CACHE_DIR
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

CONFIG = f"""cache_dir = "{CACHE_DIR}"
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
slots = 4
context_size = 512
max_new_tokens = 200
prefix_cache_mb = 0
split_small_batches = false
"""
PROMPT = "The three primary colors are"
OTHERS = ["Once upon a time", "def fibonacci(n):", "My favourite animal is"]
FRANCE: Any = [{"role": "system", "content": "You are a helpful assistant."},
               {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with sokuji_server(CONFIG) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def direct() -> Any:
    import llama_cpp

    return llama_cpp.Llama(model_path=str(native.smollm2_path()), n_ctx=512, n_threads=1,
                           flash_attn=True, verbose=False)


def reference(llm: Any, prompt: str, n: int) -> list[tuple[int, np.ndarray]]:
    """Greedy tokens decoded one at a time by llama.cpp directly, each with the float64
    log-softmax of the logits it was chosen from."""
    import llama_cpp

    llm.reset()
    tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    llm.eval(tokens)
    out = []
    for _ in range(n):
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # (``scores`` stays 0 without
        logits = np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float64)
        # logits_all)
        lp = logits - logits.max()
        lp -= math.log(np.exp(lp).sum())
        token = int(np.argmax(logits))
        out.append((token, lp))
        llm.eval([token])
    return out


def test_completions_logprobs_equal_a_log_softmax_of_llama_cpp_logits(
        client: openai.OpenAI, direct: Any) -> None:
    """The legacy format: tokens, token_logprobs, top_logprobs (the chosen token and the
    ``logprobs`` most likely), text_offset. Catches: logprobs of tempered or unnormalised
    logits, misaligned tokens, offsets not the text's."""
    got = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=10,
                                    temperature=0, logprobs=3)
    choice = got.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    ref = reference(direct, PROMPT, 10)
    assert len(lp.tokens) == 10
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(10)]
    for i, (token, logp) in enumerate(ref):
        assert lp.tokens[i] == direct.detokenize([token]).decode("utf-8", "replace")
        assert lp.token_logprobs[i] == pytest.approx(logp[token], abs=2e-4)
        best = np.argsort(-logp, kind="stable")[:3]
        want = {direct.detokenize([int(t)]).decode("utf-8", "replace"): logp[t] for t in best}
        assert set(lp.top_logprobs[i]) == set(want)
        for text, value in lp.top_logprobs[i].items():
            assert value == pytest.approx(want[text], abs=2e-4)


def test_chat_logprobs_whole_and_streamed_agree(client: openai.OpenAI) -> None:
    """``choices[0].logprobs.content``: one entry per generated token (the end of generation
    not among them), each with its bytes and top_logprobs ordered most likely first; a
    stream's chunks carry the same entries, in order, beside their text."""
    kwargs: Any = {"model": "smollm2", "messages": FRANCE, "temperature": 0, "max_tokens": 20,
                   "logprobs": True, "top_logprobs": 4}
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and whole.usage is not None
    assert len(content) == whole.usage.completion_tokens
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    for e in content:
        assert e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 4
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.logprob == pytest.approx(values[0])  # greedy: the most likely
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
    streamed: list[Any] = []
    text = ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        text += c.delta.content or ""
        if c.logprobs is not None and c.logprobs.content:
            streamed.extend(c.logprobs.content)
    assert text == whole.choices[0].message.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_no_logprobs_unless_asked(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0,
                                         max_tokens=5)
    assert got.choices[0].logprobs is None


def sampled(client: openai.OpenAI, prompt: str, seed: int) -> str:
    return client.completions.create(model="smollm2", prompt=prompt, max_tokens=30,
                                     temperature=1.0, top_p=0.95, seed=seed,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_a_seed_gives_the_same_text_alone_and_beside_three_others(
        client: openai.OpenAI) -> None:
    """Reproducible across batch compositions: the draws are the sequence's own (its
    generator), not a shared one. Catches: one generator for the engine, or a draw per
    batch row instead of per sequence."""
    alone = sampled(client, PROMPT, 77)
    results: dict[str, str] = {}

    def run(prompt: str, seed: int) -> None:
        results[f"{prompt}/{seed}"] = sampled(client, prompt, seed)

    threads = [threading.Thread(target=run, args=(p, 5 + i)) for i, p in enumerate(OTHERS)]
    threads.append(threading.Thread(target=run, args=(PROMPT, 77)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[f"{PROMPT}/77"] == alone
    assert sampled(client, PROMPT, 78) != alone  # another seed, another draw


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_it(
        client: openai.OpenAI, direct: Any) -> None:
    banana = direct.tokenize(b" banana", add_bos=False)
    assert len(banana) == 1
    got = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4,
                                    temperature=0, logit_bias={str(banana[0]): 100})
    assert got.choices[0].text == " banana" * 4
    plain = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1,
                                      temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]  # type: ignore[union-attr,index]
    first_id = direct.tokenize(first.encode(), add_bos=False)
    banned = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1,
                                       temperature=0, logit_bias={str(first_id[0]): -100})
    assert banned.choices[0].text != first


def test_penalties_change_a_repetitive_greedy_text(client: openai.OpenAI) -> None:
    """Counting repeats ", " every other token: a frequency penalty of 2 takes it off that
    path; presence and repetition penalties do too."""
    prompt = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4, 5,"

    def run(**extra: Any) -> str:
        return client.completions.create(model="smollm2", prompt=prompt, max_tokens=20,
                                         temperature=0, **extra).choices[0].text
    plain = run()
    assert plain.count(",") >= 5
    assert run(frequency_penalty=2.0).count(",") < plain.count(",")
    assert run(extra_body={"repetition_penalty": 2.0}) != plain
    assert run(extra_body={"top_k": 1, "min_p": 0.5}) == plain  # greedy either way

    def logprobs(**extra: Any) -> Any:
        got = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12,
                                        temperature=0, logprobs=0, **extra)
        return got.choices[0].logprobs

    # A presence penalty of 2 keeps this text (each comma still wins) but lowers a comma's
    # log-probability once one was generated, and only then (not for the prompt's commas).
    a, b = logprobs(), logprobs(presence_penalty=2.0)
    assert a.tokens == b.tokens
    first = a.tokens.index(",")
    # (the first comma is not penalised; the tokens generated before it are, so it gains)
    assert b.token_logprobs[first] >= a.token_logprobs[first] - 1e-5
    later = [i for i, t in enumerate(a.tokens) if t == "," and i > first]
    assert later and all(b.token_logprobs[i] < a.token_logprobs[i] - 1e-3 for i in later)


@pytest.mark.parametrize(("chat", "kwargs", "param"), [
    (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (False, {"logprobs": 21}, "logprobs"),
    (True, {"logit_bias": {"49152": 5}}, "logit_bias"),  # one past the vocabulary
    (False, {"logit_bias": {"7": 100.5}}, "logit_bias"),
    (False, {"frequency_penalty": 3}, "frequency_penalty"),
    (False, {"extra_body": {"top_k": -5}}, "top_k"),
])
def test_bad_sampling_values_answer_400_naming_the_field(
        client: openai.OpenAI, chat: bool, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        if chat:
            client.chat.completions.create(model="smollm2", messages=FRANCE, max_tokens=2,
                                           **kwargs)
        else:
            client.completions.create(model="smollm2", prompt="hi", max_tokens=2, **kwargs)
    assert exc.value.param == param, exc.value.message

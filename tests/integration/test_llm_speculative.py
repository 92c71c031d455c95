"""Speculative decoding on the real SmolLM2 model, served by a real ``sokuji serve`` and driven
by the openai SDK: greedy text identical with and without it (prompt lookup, a draft model,
the adaptive default; alone and batched), drafts accepted where the answer quotes its
context, max_tokens / stop strings / ignore_eos kept when several tokens come out of one
step, sampled requests left alone, and the figures in Server-Timing, usage and /metrics.

The draft model is the served model requantized to Q4_0 (no smaller model with the same
vocabulary is installed): it shows the mechanism, not a speed-up. Both speculating models
draft whatever they can (``speculative_adaptive = false``), since on this CPU the adaptive
planner rightly drafts almost nothing (a step of k tokens costs nearly k single steps).

The prefix cache is off: a hit leaves the prompt's last few tokens to a kernel other than the
one the first prefill used (llama.cpp's tiled attention needs 64 tokens of a sequence at
once), which can change greedy text by itself, apart from speculation."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from sokuji.bench import dataset
from sokuji.llm import native
from tests.conftest import CACHE_DIR
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

MODELS = {
    "plain": 'speculative = "off"',
    "ngram": 'speculative = "ngram"\nspeculative_adaptive = false',
    "draft": 'speculative = "draft"\ndraft_requantize = "q4_0"\nspeculative_tokens = 4\n'
             'speculative_adaptive = false',
    "auto": "",  # the defaults
}
CONFIG = f'cache_dir = "{CACHE_DIR}"\n' + "".join(f"""
[[models]]
name = "{name}"
runtime = "llama"
path = "{native.smollm2_path()}"
cache = false
[models.options]
slots = 4
context_size = 1024
max_new_tokens = 256
threads = 1
prefix_cache_mb = 0
{options}
""" for name, options in MODELS.items())

PASSAGE = ("The lighthouse at Skerry Point was built in 1852 from granite quarried on the "
           "island. Its lamp burned whale oil until 1901, when a paraffin burner replaced it, "
           "and the keeper lived with his family in a cottage at the foot of the tower. In "
           "winter storms the waves reached the gallery, and the keeper logged every ship "
           "that passed in a leather book.")
COPY: Any = [{"role": "system", "content": "You repeat text exactly."},
             {"role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGE}"}]
QUOTE: Any = [{"role": "system", "content": "Answer by quoting the context."},
              {"role": "user", "content": f"Context: {PASSAGE}\n\nWhat happened in 1901? "
                                          "Quote the sentence."}]
FREE: list[Any] = [
    [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is the capital of France?"}],
]
TEXTS = ["Count from 1 to 1000, separated by commas: 1, 2, 3, 4, 5,"]  # n-gram drafts accept


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(CONFIG) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


_PLAIN: dict[str, tuple[str, Any, str]] = {}
"""Greedy answers of the plain model, by request: the same every time (the tests below
compare with them; asked once per module, not once per parametrisation)."""


def chat(client: openai.OpenAI, model: str, messages: Any, **kw: Any) -> tuple[str, Any, str]:
    """(text, the parsed reply, its Server-Timing 'speculative' description)"""
    if model == "plain" and kw.get("temperature", 0) == 0:
        key = json.dumps([messages, kw], sort_keys=True)
        if key not in _PLAIN:
            _PLAIN[key] = _chat(client, model, messages, **kw)
        return _PLAIN[key]
    return _chat(client, model, messages, **kw)


def _chat(client: openai.OpenAI, model: str, messages: Any, **kw: Any) -> tuple[str, Any, str]:
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, temperature=kw.pop("temperature", 0), **kw)
    reply = raw.parse()
    return reply.choices[0].message.content or "", reply, speculation(raw.headers)


def at_once(*calls: Callable[[], Any]) -> list[Any]:
    """Run ``calls`` side by side, one thread each; their results in order. Each call asks
    one model (its own llama.cpp context, one thread each): models never share a step, so
    their greedy text cannot depend on running together, and the second core is used."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def complete(client: openai.OpenAI, model: str, prompt: str, **kw: Any) -> str:
    return client.completions.create(model=model, prompt=prompt, temperature=0,
                                     **kw).choices[0].text


def speculation(headers: Any) -> str:
    """The ``speculative`` entry's description, e.g. 'ngram drafted 40 accepted 32 ...'."""
    for part in headers["server-timing"].split(","):
        name, _, rest = part.strip().partition(";")
        if name == "speculative":
            return rest.split('desc="', 1)[1].rstrip('"')
    raise AssertionError("no speculative entry in Server-Timing")


def figures(desc: str) -> dict[str, float]:
    words = desc.split()
    return {k: float(v) for k, v in zip(words[1::2], words[2::2], strict=True)}


def metric(url: str, name: str, model: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and f'model="{model}"' in line)


def test_greedy_chat_text_is_identical_with_and_without_speculation(
        client: openai.OpenAI) -> None:
    # The copy-heavy prompt (the most drafted, the most accepted), on all four models. The
    # quoting and free-form prompts are compared for n-gram and draft in the batched test
    # below (alone on the plain model, batched on the speculating ones); 64 tokens: the
    # plain answer is the one the batched and long-prompt tests reuse.
    texts = dict(zip(MODELS, at_once(*(lambda m=m: chat(client, m, COPY, max_tokens=64)[0]
                                        for m in MODELS)), strict=True))
    assert texts["plain"] and all(t == texts["plain"] for t in texts.values()), texts


@pytest.mark.parametrize("prompt", TEXTS)
def test_greedy_completion_text_is_identical_with_and_without_speculation(
        client: openai.OpenAI, prompt: str) -> None:
    texts = dict(zip(MODELS, at_once(*(lambda m=m: complete(client, m, prompt, max_tokens=64)
                                        for m in MODELS)), strict=True))
    assert all(t == texts["plain"] for t in texts.values()), texts


def test_identical_when_batched_with_other_sequences(client: openai.OpenAI) -> None:
    # More requests than slots, different lengths: speculating sequences share steps with
    # others, finish at different steps and move between slots. (The plain model answers
    # each alone meanwhile: a model of its own.)
    # (11: one of CUTS below, 64: the chat test's length: plain answers asked once)
    jobs = [(m, n) for n in (11, 64) for m in (COPY, QUOTE, *FREE)]

    def batched(model: str) -> list[str]:
        with ThreadPoolExecutor(6) as pool:
            return list(pool.map(lambda job: chat(client, model, job[0],
                                                  max_tokens=job[1])[0], jobs))

    expected, ngram, draft = at_once(
        lambda: [chat(client, "plain", m, max_tokens=n)[0] for m, n in jobs],
        lambda: batched("ngram"), lambda: batched("draft"))
    assert ngram == expected
    assert draft == expected


def test_a_copy_heavy_answer_accepts_drafts_and_says_so(client: openai.OpenAI,
                                                        url: str) -> None:
    def check(model: str) -> None:  # (the metrics are per model: both run at once)
        before = {m: metric(url, m, model) for m in (
            "sokuji_llm_spec_draft_tokens_total", "sokuji_llm_spec_accepted_tokens_total")}
        text, reply, desc = chat(client, model, COPY, max_tokens=128)
        assert "granite quarried" in text  # it does quote the passage
        f = figures(desc)
        assert desc.startswith(model) and f["accepted"] > 0 and f["drafted"] >= f["accepted"]
        assert f["rate"] == pytest.approx(f["accepted"] / f["drafted"], abs=0.0051)  # 2 places
        assert f["tokens/step"] > 1.5  # several tokens a step
        details = reply.usage.completion_tokens_details
        assert details.accepted_prediction_tokens == f["accepted"]
        assert details.rejected_prediction_tokens == f["drafted"] - f["accepted"]
        assert metric(url, "sokuji_llm_spec_draft_tokens_total", model) == \
            before["sokuji_llm_spec_draft_tokens_total"] + f["drafted"]
        assert metric(url, "sokuji_llm_spec_accepted_tokens_total", model) == \
            before["sokuji_llm_spec_accepted_tokens_total"] + f["accepted"]

    _, (_, reply, desc), _ = at_once(lambda: check("ngram"),
                                     lambda: chat(client, "plain", COPY, max_tokens=5),
                                     lambda: check("draft"))
    assert desc == "off" and reply.usage.completion_tokens_details is None


CUTS = (1, 5, 11, 30)  # max_tokens cutting inside runs a single step would accept


def test_max_tokens_and_stop_strings_hold_inside_accepted_runs(client: openai.OpenAI) -> None:
    stop = "paraffin"

    def plain() -> tuple[str, list[Any]]:  # (110: the plain answer the next test reuses)
        return (chat(client, "plain", COPY, max_tokens=110)[0],
                [chat(client, "plain", COPY, max_tokens=n) for n in CUTS])

    def speculating(model: str) -> tuple[list[Any], Any, str]:
        cut = [chat(client, model, COPY, max_tokens=n) for n in CUTS]
        stopped = chat(client, model, COPY, max_tokens=110, stop=[stop])
        stream = client.chat.completions.create(model=model, messages=COPY, temperature=0,
                                                max_tokens=110, stream=True)
        return cut, stopped, "".join(c.choices[0].delta.content or ""
                                     for c in stream if c.choices)

    (full, plain_cut), *runs = at_once(plain, lambda: speculating("ngram"),
                                       lambda: speculating("draft"))
    assert stop in full
    for model, (cut, (text, reply, desc), streamed) in zip(("ngram", "draft"), runs,
                                                           strict=True):
        for n, (got, got_reply, _), (want, want_reply, _) in zip(CUTS, cut, plain_cut,
                                                                 strict=True):
            assert got == want and got_reply.usage.completion_tokens == n == \
                want_reply.usage.completion_tokens, (model, n)
            assert got_reply.choices[0].finish_reason == "length"
        assert text == full[:full.index(stop)] and reply.choices[0].finish_reason == "stop"
        assert figures(desc)["accepted"] > 0
        assert streamed == full, model


def test_ignore_eos_runs_past_where_a_draft_would_end(client: openai.OpenAI) -> None:
    # The passage's end is followed by <|im_end|> in the prompt, so drafts propose the end
    # of generation there; with ignore_eos it must be rejected, not emitted.
    ignore: Any = {"max_tokens": 110, "extra_body": {"ignore_eos": True}}

    def plain() -> tuple[Any, int]:
        return (chat(client, "plain", COPY, **ignore),
                chat(client, "plain", COPY, max_tokens=110)[1].usage.completion_tokens)

    (want, ended), *got = at_once(plain, lambda: chat(client, "ngram", COPY, **ignore),
                                  lambda: chat(client, "draft", COPY, **ignore))
    assert ended < 110  # without ignore_eos the answer ends sooner
    for g in got:
        assert g[0] == want[0] and g[1].usage.completion_tokens == 110
    least: Any = {"max_tokens": 110, "extra_body": {"min_tokens": ended + 5}}
    want, *got = at_once(*(lambda m=m: chat(client, m, COPY, **least)
                           for m in ("plain", "ngram", "draft")))
    for g in got:
        assert g[0] == want[0] and g[1].usage.completion_tokens >= ended + 5


def test_sampled_requests_do_not_speculate_and_still_repeat(client: openai.OpenAI) -> None:
    kw: Any = {"temperature": 0.8, "top_p": 0.95, "seed": 42, "max_tokens": 40}
    (first, second), without = at_once(
        lambda: (chat(client, "ngram", COPY, **kw), chat(client, "ngram", COPY, **kw)),
        lambda: chat(client, "plain", COPY, **kw))
    assert first[2] == "off sampled" and first[0] == second[0]
    assert without[0] == first[0]  # the same draws as without it


def test_a_long_prompts_text_does_not_depend_on_what_else_runs(client: openai.OpenAI) -> None:
    # Prompts of 64 tokens or more are prefilled by llama.cpp's tiled attention; pieces cut by
    # what else is in the step, or shared with other sequences' tokens, used to take the row
    # kernel for some tokens (logits apart by up to ~1): 2 of these 8 answers changed.
    jobs = [[{"role": "system", "content": "You repeat text exactly."},
             {"role": "user", "content": f"Repeat this passage word for word:\n\n{p}"}]
            for p in PASSAGES[:6]]

    def together() -> list[str]:
        with ThreadPoolExecutor(6) as pool:  # more than the 4 slots: they join mid-flight
            return list(pool.map(lambda job: chat(client, "ngram", job, max_tokens=64)[0],
                                 jobs))

    # Together with n-gram speculation (its draft rows ride in the same steps as others'
    # prefill pieces), against each alone on the plain model, meanwhile (the speculating
    # model's text equals the plain model's: the tests above).
    alone, mixed = at_once(lambda: [chat(client, "plain", job, max_tokens=64)[0]
                                    for job in jobs], together)
    assert mixed == alone


PASSAGES = [item.text for item in dataset.load("passages")]  # as benchmarks/speculative.py


def test_penalised_greedy_text_and_logprobs_are_identical_with_and_without_speculation(
        client: openai.OpenAI) -> None:
    """Greedy with penalties and logit_bias still speculates: the rows of a step are sampled
    in order, each token counted before the next row, so a draft is kept exactly where it
    is what the penalised sampler picks. Catches: drafts verified against the unpenalised
    argmax, or counts updated once per step."""
    bias = {"13": 2.0}  # a mild bias on "."

    def run(model: str) -> tuple[str, Any, str]:
        text, reply, desc = chat(client, model, COPY, max_tokens=64, presence_penalty=0.3,
                                 frequency_penalty=0.2, logit_bias=bias, logprobs=True,
                                 top_logprobs=2)
        return text, [(e.token, e.logprob) for e in reply.choices[0].logprobs.content], desc

    plain, ngram, draft = at_once(lambda: run("plain"), lambda: run("ngram"),
                                  lambda: run("draft"))
    assert plain[0] and ngram[0] == plain[0] and draft[0] == plain[0]
    for other in (ngram, draft):
        assert [t for t, _ in other[1]] == [t for t, _ in plain[1]]
        assert [lp for _, lp in other[1]] == pytest.approx([lp for _, lp in plain[1]],
                                                           abs=1e-4)
    assert ngram[2].startswith("ngram") and figures(ngram[2])["drafted"] > 0

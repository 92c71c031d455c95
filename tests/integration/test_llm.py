"""The built-in LLM (SmolLM2-135M through llama.cpp) served by a real ``sokuji serve``, driven
by the official openai SDK: streaming and not, timing, the prefix cache, continuous batching,
cancellation, equality with llama.cpp called directly, and the vLLM extensions load generators
send (ignore_eos, min_tokens, continuous usage)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
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
prefix_cache_mb = 64
split_small_batches = false   # a timing-driven choice: batching is counted below
"""
PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
]
COUNTING = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4, 5,"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(CONFIG) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def direct() -> Any:
    """llama.cpp called directly (llama-cpp-python's own API) on the file Sokuji serves, with
    the same attention kernel (flash attention, Sokuji's default)."""
    import llama_cpp

    return llama_cpp.Llama(model_path=str(native.smollm2_path()), n_ctx=512, n_threads=1,
                           flash_attn=True, verbose=False)


def direct_greedy(llm: Any, prompt: str, max_tokens: int) -> str:
    tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    out = llm.create_completion(prompt=tokens, max_tokens=max_tokens, temperature=0.0)
    return str(out["choices"][0]["text"])


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and 'model="smollm2"' in line)


def timing(header: str) -> dict[str, str]:
    """Server-Timing -> {name: 'dur=..;desc=..'}"""
    return {part.split(";", 1)[0].strip(): part.split(";", 1)[1] if ";" in part else ""
            for part in header.split(",")}


def test_chat_completion_answers_with_usage_and_server_timing(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2", temperature=0, max_tokens=30, messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}])
    reply = raw.parse()
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason == "stop" and reply.object == "chat.completion"
    assert reply.usage is not None and reply.usage.prompt_tokens > 10
    assert 0 < reply.usage.completion_tokens <= 30
    st = timing(raw.headers["server-timing"])
    assert {"queue", "prefill", "decode", "ttft", "itl", "prefix-cache", "total"} <= set(st)


def test_streaming_chat_and_completion_match_the_whole_response(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Name three fruits."}]
    whole = client.chat.completions.create(model="smollm2", messages=messages,
                                           temperature=0, max_tokens=25)
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages,
                                                 temperature=0, max_tokens=25, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason

    stream = client.completions.create(model="smollm2", prompt="Once upon a time",
                                       max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    parts = list(stream)
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 12
    assert parts[-2].choices[0].finish_reason == "length"
    assert len([p for p in parts if p.choices and p.choices[0].text]) >= 6  # token by token


def test_stream_ends_with_server_timing_comment_then_done(url: str) -> None:
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert lines[-2].startswith(": server-timing ") and "ttft;dur=" in lines[-2]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_equals_llama_cpp_called_directly_alone(
        client: openai.OpenAI, direct: Any, prompt: str) -> None:
    got = client.completions.create(model="smollm2", prompt=prompt, max_tokens=40,
                                    temperature=0)
    assert got.choices[0].text == direct_greedy(direct, prompt, 40)


def test_greedy_text_equals_llama_cpp_called_directly_when_batched(
        client: openai.OpenAI, direct: Any, url: str) -> None:
    # Different lengths, more requests than slots: sequences finish at different steps,
    # new ones join mid-flight, and busy sequences move between slots.
    jobs = [(p, n) for n in (12, 40) for p in PROMPTS]
    # llama.cpp in this process answers meanwhile (its own context and thread, the other core)
    side = ThreadPoolExecutor(1)
    direct_answers = side.submit(lambda: [direct_greedy(direct, p, n) for p, n in jobs])
    before = {m: metric(url, m) for m in ("sokuji_llm_decode_steps", "sokuji_llm_decode_seq",
                                          "sokuji_llm_sequence_moves")}

    def one(job: tuple[str, int]) -> str:
        got = client.completions.create(model="smollm2", prompt=job[0], max_tokens=job[1],
                                        temperature=0, seed=7)
        return got.choices[0].text

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, jobs)) == direct_answers.result()
    side.shutdown()
    delta = {m: metric(url, m) - v for m, v in before.items()}
    assert delta["sokuji_llm_decode_seq"] / delta["sokuji_llm_decode_steps"] > 1.5  # together
    assert delta["sokuji_llm_sequence_moves"] > 0


async def test_greedy_text_equals_llama_cpp_when_small_batches_are_split(direct: Any) -> None:
    """The default decode path: ``split_small_batches`` as shipped (on), on SmolLM2 itself.
    Whether a batch is split is measured, so the engine is told that 2-4 rows together cost
    far more than one row (the costs this CPU measures, exaggerated so that every step but
    the every-32nd probe is split): its sequences then decode row by row, and each text must
    equal llama.cpp's alone. Kills the mutants: a split row decoded at a wrong position or
    without its logits in ``llm/engine.py`` ``_decode_one_by_one`` (a fake model cannot
    tell), and the shipped default turned off (``llm/options.py``)."""
    import asyncio

    from sokuji.llm.engine import EngineConfig, GenerationEngine
    from sokuji.llm.options import LlamaOptions
    from sokuji.llm.request import Delta, Finish, GenerationRequest, SamplingParams

    assert LlamaOptions().split_small_batches  # the shipped default
    shape = native.ContextShape(slots=4, context_size=256, n_batch=256, threads=1)
    model = native.LlamaModel(native.smollm2_path(), shape)
    eng = GenerationEngine("smollm2", model, EngineConfig(prefix_cache_bytes=0))
    assert eng.config.split_small_batches
    eng.costs.learn(1, 1e-6)
    for rows in (2, 3, 4):
        eng.costs.learn(rows, 1e3)
    jobs = [(p, n) for p, n in zip(PROMPTS, (16, 10, 16, 6), strict=True)]  # rows 4, 3, 2
    loop = asyncio.get_running_loop()

    async def text_of(req: GenerationRequest) -> str:
        parts = []
        async with asyncio.timeout(120):
            async for event in req.events():
                if isinstance(event, Delta):
                    parts.append(event.text)
                elif isinstance(event, Finish):
                    assert event.error is None, event
                    return "".join(parts)
        raise AssertionError("no finish")

    eng.start()
    try:
        reqs = [GenerationRequest("smollm2", model.tokenize(p, add_special=True),
                                  SamplingParams(max_tokens=n, temperature=0), loop,
                                  arrival_ns=time.perf_counter_ns()) for p, n in jobs]
        for req in reqs:
            eng.submit(req)
        got = await asyncio.gather(*(text_of(r) for r in reqs))
    finally:
        await eng.stop()
        model.close()
    assert eng.split_steps > 0  # the row-by-row path ran
    assert got == [direct_greedy(direct, p, n) for p, n in jobs]


def test_seeded_sampling_repeats(client: openai.OpenAI) -> None:
    def draw() -> str:
        return client.completions.create(model="smollm2", prompt="My favourite animal is",
                                         max_tokens=15, temperature=1.0, top_p=0.9,
                                         seed=1234).choices[0].text
    assert draw() == draw()


def test_stop_sequence_ends_generation_without_the_stop(client: openai.OpenAI) -> None:
    full = client.completions.create(model="smollm2", prompt=COUNTING, max_tokens=20,
                                     temperature=0).choices[0].text
    assert " 8," in full
    got = client.completions.create(model="smollm2", prompt=COUNTING, max_tokens=20,
                                    temperature=0, stop=[" 8,"])
    assert got.choices[0].text == full[:full.index(" 8,")]
    assert got.choices[0].finish_reason == "stop"


def test_shared_prefix_is_reused_from_the_prefix_cache(client: openai.OpenAI, url: str
                                                       ) -> None:
    system = ("You are a meticulous assistant for a bakery. " * 30).strip()
    hits = metric(url, "sokuji_llm_prefix_cache_hits_total")
    first = client.chat.completions.with_raw_response.create(
        model="smollm2", max_tokens=5, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "Hi!"}])
    second = client.chat.completions.with_raw_response.create(
        model="smollm2", max_tokens=5, temperature=0, messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": "When do you open?"}])
    st = timing(second.headers["server-timing"])
    prompt_tokens = second.parse().usage.prompt_tokens  # type: ignore[union-attr]
    reused = int(st["prefix-cache"].split('"')[1].split()[1])
    assert st["prefix-cache"].startswith('desc="hit') and reused > 0.8 * prompt_tokens
    assert timing(first.headers["server-timing"])["prefill"].count("of") == 1
    assert second.parse().usage.prompt_tokens_details.cached_tokens == reused  # type: ignore
    assert metric(url, "sokuji_llm_prefix_cache_hits_total") >= hits + 1


def test_new_request_joins_while_a_long_generation_runs(client: openai.OpenAI) -> None:
    started, finished = threading.Event(), threading.Event()
    chunks: list[str] = []

    def long_stream() -> None:
        for part in client.completions.create(model="smollm2", prompt=COUNTING,
                                              max_tokens=150, temperature=0, stream=True):
            if part.choices and part.choices[0].text:
                chunks.append(part.choices[0].text)
                started.set()
        finished.set()

    worker = threading.Thread(target=long_stream)
    worker.start()
    assert started.wait(30)
    raw = client.completions.with_raw_response.create(model="smollm2", prompt="Hi",
                                                      max_tokens=3, temperature=0)
    short_done = not finished.is_set()
    stages = timing(raw.headers["server-timing"])
    queue_ms = float(stages["queue"].split(";")[0].split("=")[1])
    step_ms = float(stages["itl"].split(";")[0].split("=")[1])  # this machine's step, now
    worker.join(60)
    assert short_done, "the short request waited for the long one to finish"
    assert queue_ms < 3 * step_ms + 5  # admitted at the next step or so, not after the stream
    assert len(chunks) > 50


def test_client_disconnect_cancels_its_generation(url: str) -> None:
    cancelled = metric(url, 'sokuji_requests_total{model="smollm2",status="499"}')
    body = {"model": "smollm2", "prompt": COUNTING, "max_tokens": 200, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if metric(url, 'sokuji_requests_total{model="smollm2",status="499"}') > cancelled:
            break
        time.sleep(0.05)  # polling the server's own counters
    assert metric(url, 'sokuji_requests_total{model="smollm2",status="499"}') == cancelled + 1
    assert metric(url, "sokuji_llm_running_sequences") == 0


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"prompt": "word " * 600}, "takes at most 511"),
    ({"prompt": "hello", "max_tokens": 300}, "limit of 200 new tokens"),
    ({"prompt": "word " * 400, "max_tokens": 150}, "context is 512 tokens"),
    ({"prompt": "hello", "n": 9}, "limit of 8 choices (options.max_n)"),
    ({"prompt": "hello", "temperature": 5}, "temperature"),
    ({"prompt": [999999]}, "outside the vocabulary"),
])
def test_limits_answer_400_with_a_reason(client: openai.OpenAI, kwargs: dict[str, Any],
                                         needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="smollm2", **kwargs)
    assert needle in str(exc.value)


def test_the_cost_bound_is_stated_and_long_stop_strings_refused(url: str) -> None:
    """Issue 25: four 1 MB stop strings cost 1.3 s of engine CPU a generation; now 413 naming
    the limit before the engine sees them. The limits are in the model's config."""
    params = httpx.get(f"{url}/v2/models/smollm2/config").json()["parameters"]
    stated = {k: v["string_value"].split(" ")[0] for k, v in params.items()
              if k.startswith("limit.")}
    assert stated == {"limit.options.max_prompt_tokens": "511",
                      "limit.options.max_new_tokens": "200",
                      "limit.options.context_size": "512", "limit.messages": "511",
                      "limit.stop": "4", "limit.stop.bytes": "512"}
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": "hello", "max_tokens": 20,
        "stop": ["x" * 1_000_000] * 4})
    assert r.status_code == 413 and r.json()["error"]["param"] == "stop.bytes"
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "messages": [{"role": "user", "content": ""}] * 512})
    assert r.status_code == 413 and r.json()["error"]["param"] == "messages"


def test_wrong_model_kinds_and_names(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="does not serve /v1/embeddings"):
        client.embeddings.create(model="smollm2", input="x")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    assert [m.id for m in client.models.list()] == ["smollm2"]


def test_greedy_text_is_unchanged_by_a_prefix_cache_hit(client: openai.OpenAI, direct: Any,
                                                        url: str) -> None:
    shared = "<|im_start|>system\n" + "Answer briefly and truthfully. " * 40 + "<|im_end|>\n"
    prompts = [shared + f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
               for q in ("What is two plus two?", "Name a large animal.")]
    hits = metric(url, "sokuji_llm_prefix_cache_hits_total")
    with ThreadPoolExecutor(1) as side:  # llama.cpp directly, meanwhile, on the other core
        direct_answers = side.submit(lambda: [direct_greedy(direct, p, 30) for p in prompts])
        got = [client.completions.create(model="smollm2", prompt=p, max_tokens=30,
                                         temperature=0).choices[0].text for p in prompts]
        assert metric(url, "sokuji_llm_prefix_cache_hits_total") >= hits + 1
        assert got == direct_answers.result()


# -- the vLLM extensions load generators send (guidellm, genai-perf / aiperf) -----------------
FRANCE: Any = [{"role": "system", "content": "You are a helpful assistant."},
               {"role": "user", "content": "What is the capital of France?"}]


def test_ignore_eos_runs_to_max_tokens_where_the_model_would_stop(client: openai.OpenAI
                                                                  ) -> None:
    plain = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0,
                                           max_tokens=32)
    assert plain.choices[0].finish_reason == "stop" and plain.usage is not None
    assert plain.usage.completion_tokens < 20
    forced = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0,
                                            max_tokens=24, extra_body={"ignore_eos": True})
    assert forced.usage is not None and forced.usage.completion_tokens == 24
    assert forced.choices[0].finish_reason == "length"
    # the same greedy tokens up to where the model ended, then more instead of the end
    said = plain.choices[0].message.content or ""
    assert (forced.choices[0].message.content or "").startswith(said) and said
    nvext = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0,
                                           max_tokens=24,
                                           extra_body={"nvext": {"ignore_eos": True}})
    assert nvext.choices[0].message.content == forced.choices[0].message.content
    # sampled (llama.cpp's sampler chain reads the same masked logits)
    kwargs: Any = {"model": "smollm2", "messages": FRANCE, "temperature": 0.3, "seed": 11,
                   "max_tokens": 24}
    sampled = client.chat.completions.create(**kwargs)
    assert sampled.usage is not None and sampled.usage.completion_tokens < 20
    sampled = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert sampled.usage is not None and sampled.usage.completion_tokens == 24


def test_min_tokens_holds_off_the_end_until_reached(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0,
                                           max_tokens=32)
    assert plain.usage is not None and plain.choices[0].finish_reason == "stop"
    wanted = plain.usage.completion_tokens + 6
    longer = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0,
                                            max_tokens=32, extra_body={"min_tokens": wanted})
    assert longer.usage is not None and wanted <= longer.usage.completion_tokens <= 32
    assert (longer.choices[0].message.content or "").startswith(
        plain.choices[0].message.content or "")
    exact = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0,
                                           max_tokens=wanted, extra_body={"min_tokens": wanted})
    assert exact.usage is not None and exact.usage.completion_tokens == wanted


def test_continuous_usage_stats_count_up_in_every_chunk(client: openai.OpenAI) -> None:
    """The body guidellm 0.8 sends when an output length is set."""
    stream = client.completions.create(
        model="smollm2", prompt=PROMPTS[0], max_tokens=16, stream=True,
        extra_body={"ignore_eos": True, "stop": None, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}})
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    texts = [c for c in chunks if c.choices and c.choices[0].text]
    assert counts == sorted(counts) and counts[-1] == 16 and len(set(counts)) >= 8
    assert len(texts) >= 8 and all(c.usage.prompt_tokens > 10 for c in texts)  # type: ignore
    assert not chunks[-1].choices  # include_usage: the last chunk is the usage alone


@pytest.mark.parametrize(("extra", "param"), [
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens (8)
    ({"nvext": {"top_k": 5}}, "nvext.top_k"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
    ({"stream": True, "stream_options": {"per_chunk": True}}, "stream_options.per_chunk"),
])
def test_bad_extension_values_answer_400_naming_the_field(
        client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=8,
                                  extra_body=extra)
    assert exc.value.param == param and param.split(".")[-1] in exc.value.message

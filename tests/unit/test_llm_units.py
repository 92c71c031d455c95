"""The LLM path's pure parts: text assembly (UTF-8, stop strings, min_tokens), the prefix
cache's bookkeeping (per tenant), request validation (with the vLLM extensions), prompt
limits (sizes before tokenising), and the llama runtime's options."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from sokuji.config import ModelConfig
from sokuji.core.limits import LimitExceeded
from sokuji.errors import ConfigError, InvalidInput, ModelNotReady
from sokuji.llm.options import LlamaOptions
from sokuji.llm.prefix_cache import Match, PrefixCache
from sokuji.llm.prompt import PromptBuilder
from sokuji.llm.request import STOP_BYTES, STOP_SEQUENCES, TextAssembler
from sokuji.llm.runtime import LlamaRuntime
from sokuji.server import llm_codec
from tests.conftest import options_of


def feed(asm: TextAssembler, pieces: list[bytes]) -> list[str]:
    out = [asm.add(p) for p in pieces]
    out.append(asm.flush())
    return out


def test_text_assembler_joins_a_character_split_across_tokens() -> None:
    euro = "€".encode()
    out = feed(TextAssembler(()), [b"a", euro[:1], euro[1:], b"b"])
    assert out == ["a", "", "€", "b", ""]


def test_stop_string_across_tokens_is_cut_and_never_sent() -> None:
    asm = TextAssembler(("END",))
    out = feed(asm, [b"one E", b"N", b"D two"])
    assert "".join(out) == "one " and asm.stopped
    assert out[0] == "one "  # "E" is held back: it might begin the stop


def test_held_text_is_released_when_it_does_not_become_a_stop() -> None:
    asm = TextAssembler(("END",))
    out = feed(asm, [b"one E", b"X"])
    assert out == ["one ", "EX", ""] and not asm.stopped


def test_earliest_of_several_stops_wins() -> None:
    asm = TextAssembler(("b", "a"))
    assert "".join(feed(asm, [b"xxab"])) == "xx"


T = "tenant-a"


def test_prefix_cache_finds_the_longest_common_prefix() -> None:
    cache = PrefixCache(max_bytes=1000, min_tokens=2)
    cache.store([1, 2, 3, 4], T, b"s1")
    cache.store([1, 2, 9, 9, 9], T, b"s2")
    m = cache.lookup([1, 2, 3, 4, 5, 6], T)
    assert (m.tokens, m.state) == (4, b"s1")
    m = cache.lookup([1, 2, 9, 9, 7], T)
    assert (m.tokens, m.state) == (4, b"s2")
    assert cache.lookup([7, 7, 7], T).state is None
    assert (cache.hits, cache.misses, cache.reused_tokens) == (2, 1, 8)


def test_prefix_cache_leaves_the_last_prompt_token_to_decode() -> None:
    cache = PrefixCache(max_bytes=1000, min_tokens=2)
    cache.store([1, 2, 3, 4], T, b"s")
    assert cache.lookup([1, 2, 3, 4], T).tokens == 3


def test_prefix_cache_replaces_prefixes_and_skips_covered_prompts() -> None:
    cache = PrefixCache(max_bytes=1000, min_tokens=2)
    cache.store([1, 2, 3], T, b"abc")
    assert not cache.wants([1, 2, 3], T) and not cache.wants([1, 2], T)
    assert cache.wants([1, 2, 3, 4], T)
    cache.store([1, 2, 3, 4], T, b"abcd")
    assert len(cache) == 1 and cache.bytes == 4


def test_prefix_cache_evicts_least_recently_used_within_its_bound() -> None:
    cache = PrefixCache(max_bytes=10, min_tokens=1)
    cache.store([1, 1], T, b"aaaa")
    cache.store([2, 2], T, b"bbbb")
    cache.lookup([1, 1, 5], T)  # touches the first
    cache.store([3, 3], T, b"cccc")
    assert cache.bytes <= 10 and cache.evictions == 1
    assert cache.lookup([2, 2, 5], T).state is None
    assert cache.lookup([1, 1, 5], T).state == b"aaaa"


def test_prefix_cache_off_or_short_prompt_is_a_miss() -> None:
    assert PrefixCache(max_bytes=0).lookup(list(range(100)), T).state is None
    assert not PrefixCache(max_bytes=0).wants(list(range(100)), T)
    assert PrefixCache(max_bytes=100, min_tokens=16).lookup([1, 2, 3], T).state is None


def test_prefix_cache_only_matches_the_tenants_own_prompts() -> None:
    cache = PrefixCache(max_bytes=1000, min_tokens=2)
    cache.store([1, 2, 3, 4], "a", b"secret")
    assert cache.lookup([1, 2, 3, 4, 5], "b") == Match(0, None)  # not even a partial match
    assert cache.wants([1, 2, 3], "b")  # b stores its own copy; a's does not cover it
    cache.store([1, 2, 3, 4, 5], "b", b"bs")
    assert cache.lookup([1, 2, 3, 4, 5, 6], "a") == Match(4, b"secret")  # a's entry kept
    assert cache.lookup([1, 2, 3, 4, 5, 6], "b") == Match(5, b"bs")
    assert len(cache) == 2 and cache.bytes == 8


def test_prefix_cache_eviction_across_tenants_leaves_no_empty_tenants() -> None:
    cache = PrefixCache(max_bytes=8, min_tokens=1)
    for i in range(5):
        cache.store([i, i], f"t{i}", b"xxxx")
    assert cache.bytes <= 8 and len(cache) == 2
    assert set(cache._arrays) == {"t3", "t4"}


def chat_body(**fields: object) -> bytes:
    import orjson

    doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return orjson.dumps(doc)


def test_chat_request_decodes_with_openai_defaults() -> None:
    req = llm_codec.decode(chat_body(max_completion_tokens=7, stop="x", seed=3), chat=True)
    assert (req.max_tokens, req.temperature, req.top_p, req.stop, req.seed, req.stream) == \
        (7, 1.0, 1.0, ("x",), 3, False)
    assert req.messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"stop": [1]}, "stop"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": [5, 1]}, "logit_bias"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"bogus": 1}, "bogus"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
])
def test_chat_request_errors_name_the_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        llm_codec.decode(chat_body(**fields), chat=True)
    assert exc.value.param == param


def test_stop_strings_past_their_limits_are_refused_before_the_engine() -> None:
    """Issue 25: four 1 MB stop strings cost 1.3 s of engine CPU a generation. Now: 413
    naming the limit, from the codec (every generator), the strings not even encoded."""
    megabyte = "x" * 1_000_000
    t0 = time.perf_counter()
    with pytest.raises(LimitExceeded) as exc:
        llm_codec.decode(chat_body(stop=[megabyte] * 4), chat=True)
    assert time.perf_counter() - t0 < 1.0  # one JSON parse of 4 MB, no more
    assert exc.value.status == 413 and exc.value.param == "stop.bytes"
    assert "'stop[0]' needs 1e+06 bytes" in exc.value.message and "stop.bytes = 512" in \
        exc.value.message
    with pytest.raises(LimitExceeded) as exc:
        llm_codec.decode(chat_body(stop=megabyte), chat=True)  # one string
    with pytest.raises(LimitExceeded) as exc:
        llm_codec.decode(chat_body(stop=["a", "b", "€" * 171]), chat=True)  # 513 bytes
    assert exc.value.need == 513 and exc.value.limit is STOP_BYTES
    with pytest.raises(LimitExceeded) as exc:
        llm_codec.decode(chat_body(stop=["a"] * 5), chat=True)
    assert exc.value.param == "stop" and exc.value.limit is STOP_SEQUENCES
    ok = llm_codec.decode(chat_body(stop=["x" * 512, "€" * 170, "c", "d"]), chat=True)
    assert len(ok.stop) == 4


def test_completion_prompt_forms() -> None:
    import orjson

    def dec(prompt: object) -> object:
        return llm_codec.decode(orjson.dumps({"model": "m", "prompt": prompt}), False).prompt

    assert dec("hi") == "hi" and dec(["hi"]) == "hi" and dec([1, 2]) == [1, 2]
    for bad in (None, ["a", "b"], [], [True], {"a": 1}):
        with pytest.raises(InvalidInput, match="'prompt'"):
            dec(bad)
    with pytest.raises(InvalidInput, match="echo"):
        llm_codec.decode(orjson.dumps({"model": "m", "prompt": "x", "echo": True}), False)


def llama(**options: object) -> LlamaOptions:
    """The options of a llama model as the config makes them when it loads."""
    opts: LlamaOptions = options_of(ModelConfig(name="smollm2", runtime="llama",
                                                options=options))
    return opts


def test_llama_options_validate() -> None:
    assert llama().requantize == ""  # served as shipped unless asked
    assert llama(requantize="q8_0", flash_attn=False).flash_attn is False
    opts = llama(context_size=512, max_prompt_tokens=0)
    assert opts.prompt_limit == 511
    for bad in ({"slots": 0}, {"nope": 1}, {"requantize": "q2"}, {"threads": "2"},
                {"slots": 100}, {"slots": 8, "n_batch": 4}):
        with pytest.raises(ConfigError) as err:  # when the config loads, before any build
            llama(**bad)
        assert err.value.param == f"models[0].options.{list(bad)[-1]}"


# -- min_tokens: stop strings in text before it do not count ---------------------------------
def test_stop_strings_are_not_looked_for_in_text_added_unchecked() -> None:
    asm = TextAssembler(("STOP",))
    assert asm.add_unchecked(b"one STOP ") == "one STOP "  # all released, nothing cut
    assert not asm.stopped
    assert asm.add(b"tw") == "tw" and asm.add(b"o ST") == "o "  # "ST" held: may begin one
    assert asm.add(b"OP three") == "" and asm.stopped
    assert asm.text == "one STOP two "


def test_a_stop_straddling_the_unchecked_text_does_not_count() -> None:
    asm = TextAssembler(("ab",))
    asm.add_unchecked(b"xa")
    assert asm.add(b"b") == "b" and not asm.stopped  # its "a" came before min_tokens
    assert asm.add(b"ab") == "" and asm.stopped


# -- the vLLM extensions load generators send -------------------------------------------------
def test_vllm_extensions_decode() -> None:
    req = llm_codec.decode(chat_body(max_completion_tokens=9, ignore_eos=True, min_tokens=4,
                                     stop=None, stream=True, stream_options={
                                         "include_usage": True,
                                         "continuous_usage_stats": True}), chat=True)
    assert (req.max_tokens, req.max_tokens_field, req.min_tokens, req.ignore_eos) == \
        (9, "max_completion_tokens", 4, True)
    assert (req.include_usage, req.continuous_usage, req.stop) == (True, True, ())
    plain = llm_codec.decode(chat_body(), chat=True)
    assert (plain.min_tokens, plain.ignore_eos, plain.continuous_usage) == (0, False, False)
    nv = llm_codec.decode(chat_body(nvext={"ignore_eos": True}), chat=True)
    assert nv.ignore_eos


@pytest.mark.parametrize(("fields", "param"), [
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"),
    ({"min_tokens": 8, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": 8, "max_completion_tokens": 4}, "min_tokens"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": "on"}},
     "stream_options.continuous_usage_stats"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"bogus": True}}, "stream_options.bogus"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"nvext": {"top_k": 3}}, "nvext.top_k"),
    ({"nvext": {"ignore_eos": "x"}}, "nvext.ignore_eos"),
    ({"nvext": {"ignore_eos": False}, "ignore_eos": True}, "nvext.ignore_eos"),
    ({"nvext": 1}, "nvext"),
])
def test_vllm_extension_errors_name_the_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        llm_codec.decode(chat_body(**fields), chat=True)
    assert exc.value.param == param and param.split(".")[-1] in exc.value.message


# -- prompt limits: sizes before tokenising ---------------------------------------------------
class CountingModel:
    """A tokenizer stand-in: one token per 4 bytes; counts its calls."""

    n_vocab = 100
    max_piece_bytes = 4
    lossless = True

    def __init__(self) -> None:
        self.calls = 0

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        self.calls += 1
        data = text.encode()
        return [1] * ((len(data) + 3) // 4)


class Chat:
    def render(self, messages: list[dict[str, str]], tools: Any = None) -> str:
        return "".join(m["content"] for m in messages)


def builder(model: CountingModel | None = None) -> PromptBuilder:
    opts = LlamaOptions(context_size=101, max_new_tokens=50)
    return PromptBuilder("m", model or CountingModel(), Chat(), opts)


def test_a_text_that_cannot_fit_is_refused_without_tokenising() -> None:
    model = CountingModel()
    b = builder(model)
    assert b.max_prompt_bytes == 100 * 4
    for text in ("x" * 401, "€" * 134, "x" * 3_000_000):  # 401, 402, 3e6 bytes
        with pytest.raises(InvalidInput, match="more than 400 bytes") as exc:
            b.tokens(text=text)
        assert exc.value.param == "prompt" and "at most 100 prompt tokens" in exc.value.message
    with pytest.raises(InvalidInput, match="rendered by the chat template") as exc:
        b.tokens(messages=[{"role": "user", "content": "y" * 500}])
    assert exc.value.param == "messages"
    assert model.calls == 0
    assert len(b.tokens(text="x" * 400)) == 100 and model.calls == 1  # the bound is exact


def test_the_byte_bound_is_off_for_tokenizers_that_drop_input() -> None:
    model = CountingModel()
    model.lossless = False
    b = builder(model)
    assert b.max_prompt_bytes is None
    with pytest.raises(InvalidInput, match="has 750 tokens"):
        b.tokens(text="x" * 3000)
    assert model.calls == 1


def test_token_ids_are_counted_before_they_are_checked() -> None:
    b = builder()
    with pytest.raises(InvalidInput, match="has 101 tokens"):
        b.tokens(token_ids=[10**9] * 101)
    with pytest.raises(InvalidInput, match="outside the vocabulary"):
        b.tokens(token_ids=[5, 100])
    with pytest.raises(InvalidInput, match="empty"):
        b.tokens(text="")


def test_the_stated_limits_and_the_count_of_messages() -> None:
    b = builder()
    stated = {limit.key: limit.value for limit in b.limits_stated}
    assert stated == {"options.max_prompt_tokens": 100, "options.max_new_tokens": 50,
                      "options.context_size": 101, "messages": 100, "stop": 4,
                      "stop.bytes": 512}
    rendered: list[int] = []
    b.chat = type("Spy", (), {
        "render": lambda self, m, tools=None: rendered.append(len(m)) or "x"})()
    with pytest.raises(LimitExceeded) as exc:  # each renders to a token at least
        b.tokens(messages=[{"role": "user", "content": ""}] * 101)
    assert exc.value.param == "messages" and rendered == []  # refused before templating
    assert b.tokens(messages=[{"role": "user", "content": ""}] * 100) == [1]


def test_sampling_limits_name_the_field() -> None:
    b = builder()
    p = b.sampling(10, chat=False, max_tokens=None, min_tokens=5, ignore_eos=True)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.eog_banned_below) == (50, 5, True, 50)
    assert b.sampling(95, chat=False, max_tokens=None).max_tokens == 7  # the context left
    assert b.sampling(10, chat=False, max_tokens=20, min_tokens=3).eog_banned_below == 3
    with pytest.raises(InvalidInput) as exc:
        b.sampling(95, chat=False, max_tokens=None, min_tokens=8)
    assert exc.value.param == "min_tokens" and "room for (7)" in exc.value.message
    with pytest.raises(InvalidInput) as exc:
        b.sampling(10, chat=True, max_tokens=60, max_tokens_field="max_completion_tokens")
    assert exc.value.param == "max_completion_tokens"


# -- closing the model waits for tokenisations in flight ---------------------------------------
class GatedModel(CountingModel):
    """A tokenizer held inside ``tokenize`` until released, and a ``close`` that records
    whether it ran while a tokenisation was still inside (a use-after-free in llama.cpp)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = threading.Event()
        self.release = threading.Event()
        self.events: list[str] = []
        self.tokenizing = 0

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        self.tokenizing += 1
        self.inside.set()
        assert self.release.wait(timeout=30)
        self.events.append("closed before the tokenisation returned" if "close" in self.events
                           else "tokenised")
        self.tokenizing -= 1
        return super().tokenize(text, add_special)

    def close(self) -> None:
        self.events.append("close" if self.tokenizing == 0 else "close under a tokenisation")


def gated_runtime() -> tuple[LlamaRuntime, GatedModel]:
    runtime = LlamaRuntime("m", "/not/loaded.gguf", LlamaOptions(context_size=101), "/tmp", 8,
                           0.0, at="models[0]")
    model = GatedModel()
    runtime.model = model
    runtime.prompts = PromptBuilder("m", model, Chat(), runtime.options)
    return runtime, model


def test_closing_the_model_waits_for_a_tokenisation_in_flight() -> None:
    runtime, model = gated_runtime()
    with ThreadPoolExecutor(2) as pool:
        tokenised = pool.submit(runtime.prompts.tokens, text="abcdefgh")
        assert model.inside.wait(timeout=30)  # the worker thread is inside llama_tokenize
        closing = pool.submit(runtime.close)
        # close must not free the vocabulary now: it waits. (The 0.2 s only gives a wrong
        # close the time to happen; a slow machine can make the test pass wrongly, never
        # fail wrongly.)
        with pytest.raises(TimeoutError):
            closing.result(timeout=0.2)
        assert "close" not in model.events
        model.release.set()
        assert tokenised.result(timeout=30) == [1, 1]
        closing.result(timeout=30)
    assert model.events == ["tokenised", "close"]
    assert runtime.model is None
    with pytest.raises(ModelNotReady, match="model 'm' is shutting down"):  # new calls: 503
        runtime.prompts.tokens(text="abc")


def test_a_tokenisation_that_outlives_the_wait_leaves_the_model_allocated(
        caplog: pytest.LogCaptureFixture) -> None:
    runtime, model = gated_runtime()
    runtime.close_wait_s = 0.01
    with ThreadPoolExecutor(1) as pool:
        tokenised = pool.submit(runtime.prompts.tokens, text="abcd")
        assert model.inside.wait(timeout=30)
        runtime.close()  # gives up waiting: must not free
        assert runtime.model is model and "close" not in model.events
        assert "1 prompt tokenisation(s) still running" in caplog.text
        model.release.set()
        assert tokenised.result(timeout=30) == [1]
    assert model.events == ["tokenised"]


def test_many_empty_messages_are_prepared_off_the_loop() -> None:
    from sokuji.core.model import GenerationInput
    from sokuji.llm.generator import INLINE_MAX_CHARS, _size

    def chat(messages: list[dict[str, str]]) -> GenerationInput:
        return GenerationInput(chat=True, messages=messages, prompt=None, max_tokens=None,
                               max_tokens_field="max_tokens", min_tokens=0, ignore_eos=False,
                               temperature=1.0, top_p=1.0, stop=(), seed=None)

    # Templating 200 empty messages is as much work as one long one: not inline.
    assert _size(chat([{"role": "user", "content": ""}] * 200)) > INLINE_MAX_CHARS
    assert _size(chat([{"role": "user", "content": "Hi"}])) <= INLINE_MAX_CHARS


# -- stop strings: found in time linear in the text, whatever their length (issue 25) ------
def naive_releases(stops: tuple[str, ...], pieces: list[str], unchecked: int
                   ) -> tuple[list[str], bool]:
    """What a TextAssembler releases, and whether it stops, by rescanning everything at
    every piece."""
    text, sent, floor, out = "", 0, 0, []
    for n, piece in enumerate(pieces):
        text += piece
        if n < unchecked:
            floor = len(text)
            out.append(text[sent:])
            sent = len(text)
            continue
        hits = [i for s in stops for i in [text.find(s, floor)] if i >= 0]
        if hits:
            out.append(text[sent:min(hits)])
            return out, True
        held = max((k for s in stops for k in range(1, len(s))
                    if len(text) - k >= floor and text.endswith(s[:k])), default=0)
        out.append(text[sent:len(text) - held])
        sent = len(text) - held
    return out, False


def test_stop_strings_match_a_rescan_of_the_whole_text() -> None:
    rng = random.Random(25)
    for _ in range(3000):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 5)))
                      for _ in range(rng.randint(1, 4)))
        pieces = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 3)))
                  for _ in range(rng.randint(1, 12))]
        unchecked = rng.randint(0, 3)
        asm = TextAssembler(stops)
        got = [asm.add_unchecked(p.encode()) if n < unchecked else asm.add(p.encode())
               for n, p in enumerate(pieces)]
        want, stopped = naive_releases(stops, pieces, unchecked)
        assert got[:len(want)] == want and asm.stopped == stopped, (stops, pieces, unchecked)


def test_long_stop_strings_cost_per_character_not_per_length() -> None:
    """Four stops of 64 KiB against 2,000 tokens of text: looking over the text's tail for
    a beginning of each stop at every token took seconds; the automaton takes the same few
    steps a character as for four stops of 16 bytes."""
    def seconds(length: int) -> float:
        asm = TextAssembler(tuple(c * length for c in "bcde"))
        t0 = time.perf_counter()
        for _ in range(2000):
            asm.add(b"a")
        return time.perf_counter() - t0

    short = min(seconds(16) for _ in range(3))
    assert seconds(64 * 1024) < 20 * short + 0.05

"""The LLM path's pure parts: text assembly (UTF-8, stop strings), the prefix cache's
bookkeeping, request validation, and the llama runtime's options."""

from __future__ import annotations

import pytest

from sokuji.errors import ConfigError, InvalidInput
from sokuji.llm.prefix_cache import PrefixCache
from sokuji.llm.request import TextAssembler
from sokuji.llm.runtime import LlamaOptions
from sokuji.server import llm_codec


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


def test_prefix_cache_finds_the_longest_common_prefix() -> None:
    cache = PrefixCache(max_bytes=1000, min_tokens=2)
    cache.store([1, 2, 3, 4], b"s1")
    cache.store([1, 2, 9, 9, 9], b"s2")
    m = cache.lookup([1, 2, 3, 4, 5, 6])
    assert (m.tokens, m.state) == (4, b"s1")
    m = cache.lookup([1, 2, 9, 9, 7])
    assert (m.tokens, m.state) == (4, b"s2")
    assert cache.lookup([7, 7, 7]).state is None
    assert (cache.hits, cache.misses, cache.reused_tokens) == (2, 1, 8)


def test_prefix_cache_leaves_the_last_prompt_token_to_decode() -> None:
    cache = PrefixCache(max_bytes=1000, min_tokens=2)
    cache.store([1, 2, 3, 4], b"s")
    assert cache.lookup([1, 2, 3, 4]).tokens == 3


def test_prefix_cache_replaces_prefixes_and_skips_covered_prompts() -> None:
    cache = PrefixCache(max_bytes=1000, min_tokens=2)
    cache.store([1, 2, 3], b"abc")
    assert not cache.wants([1, 2, 3]) and not cache.wants([1, 2])
    assert cache.wants([1, 2, 3, 4])
    cache.store([1, 2, 3, 4], b"abcd")
    assert len(cache) == 1 and cache.bytes == 4


def test_prefix_cache_evicts_least_recently_used_within_its_bound() -> None:
    cache = PrefixCache(max_bytes=10, min_tokens=1)
    cache.store([1, 1], b"aaaa")
    cache.store([2, 2], b"bbbb")
    cache.lookup([1, 1, 5])  # touches the first
    cache.store([3, 3], b"cccc")
    assert cache.bytes <= 10 and cache.evictions == 1
    assert cache.lookup([2, 2, 5]).state is None
    assert cache.lookup([1, 1, 5]).state == b"aaaa"


def test_prefix_cache_off_or_short_prompt_is_a_miss() -> None:
    assert PrefixCache(max_bytes=0).lookup(list(range(100))).state is None
    assert not PrefixCache(max_bytes=0).wants(list(range(100)))
    assert PrefixCache(max_bytes=100, min_tokens=16).lookup([1, 2, 3]).state is None


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
    ({"n": 2}, "n"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
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


def test_llama_options_validate() -> None:
    assert LlamaOptions.parse({}, "o").requantize == ""  # served as shipped unless asked
    assert LlamaOptions.parse({"requantize": "q8_0", "flash_attn": False}, "o").flash_attn \
        is False
    opts = LlamaOptions.parse({"context_size": 512, "max_prompt_tokens": 0}, "o")
    assert opts.prompt_limit == 511
    for bad in ({"slots": 0}, {"nope": 1}, {"requantize": "q2"}, {"threads": "2"},
                {"slots": 100}, {"slots": 8, "n_batch": 4}):
        with pytest.raises(ConfigError):
            LlamaOptions.parse(bad, "o")

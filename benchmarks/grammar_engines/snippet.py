"""Minimal llguidance loop against SmolLM2's llama.cpp vocabulary: schema -> matcher -> mask per
step -> (mask logits, pick) -> consume token.  Random logits stand in for the model.

    python snippet.py      (needs llama-cpp-python, llguidance and the SmolLM2 GGUF)
"""

import json
import time

import common  # only for the GGUF path
import llama_cpp as L
import llguidance
import llguidance.numpy as lnp
import numpy as np
from llguidance.llamacpp import lltokenizer_from_vocab

L.llama_backend_init()
mp = L.llama_model_default_params()
mp.vocab_only = True
model = L.llama_model_load_from_file(common.GGUF.encode(), mp)
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)
t0 = time.perf_counter()
tok = lltokenizer_from_vocab(vocab)  # once per model (~0.25 s); EOS = llama_vocab_eos
t_tok = time.perf_counter() - t0
print(f"tokenizer {1e3 * t_tok:.0f} ms, vocab {tok.vocab_size}, eos {tok.eos_tokens}")


def compile_or_400(schema: dict) -> str:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}
    )  # compact JSON: no whitespace runs
    err = llguidance.LLMatcher.validate_grammar(grammar, tok)
    if err and not err.startswith("WARNING"):
        raise ValueError(err)  # -> HTTP 400 naming the feature
    return grammar


for bad in ({"type": "array", "uniqueItems": True}, {"not": {"type": "string"}}):
    try:
        compile_or_400(bad)
    except ValueError as e:
        print("400:", e)

schema = json.loads(json.dumps(common.SCHEMA))  # bounded, so random logits terminate
schema["$defs"]["address"]["properties"]["city"]["maxLength"] = 20
schema["properties"]["contact"]["anyOf"][1]["properties"]["phone"]["maxLength"] = 15
schema["properties"]["contact"]["anyOf"][0]["properties"]["email"]["maxLength"] = 30
schema["properties"]["scores"]["maxItems"] = 4
grammar = compile_or_400(schema)
matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
mask = lnp.allocate_token_bitmask(1, n_vocab)  # int32[1, 1536]
rng = np.random.default_rng(1)
out, step_t = [], []
for _ in range(400):
    logits = rng.standard_normal(n_vocab).astype(
        np.float32
    )  # the model's row, in Sokuji: model.logits(i)
    t0 = time.perf_counter()
    lnp.fill_next_token_bitmask(matcher, mask, 0)  # GIL released inside
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little", count=n_vocab).view(bool)
    logits[~allowed] = -np.inf  # in place, then greedy / llama.cpp chain
    t = int(logits.argmax())
    assert matcher.consume_token(t), matcher.get_error()
    step_t.append(time.perf_counter() - t0)
    if t in tok.eos_tokens:  # EOS: allowed only once the doc is complete
        break
    out.append(t)
    if matcher.is_stopped():  # the doc cannot continue: llguidance stops without waiting for EOS
        break
text = tok.decode_str(out)
print(f"{len(step_t)} steps, per-step mask+apply+consume mean {1e3 * np.mean(step_t):.3f} ms, "
      f"p99 {1e3 * np.percentile(step_t, 99):.3f} ms")
print(text)
doc = json.loads(text)
print("valid JSON; keys:", list(doc))

# json_object (any JSON object) and a Lark grammar with an embedded schema (tool call wrapper)
g_obj = compile_or_400({"type": "object"})
TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
lark = (
    'start: "<tool_call>" call "</tool_call>"\n'
    f"call: %json {json.dumps(TOOL_SCHEMA, separators=(',', ':'))}\n"
)
g_tool = llguidance.LLMatcher.grammar_from_lark(lark)
print("lark+%json grammar:", llguidance.LLMatcher.validate_grammar(g_tool, tok) or "ok")
m = llguidance.LLMatcher(tok, g_tool, log_level=0)
s = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
ok = all(m.consume_token(t) for t in tok.tokenize_str(s)) and m.consume_token(tok.eos_token)
print("tool-call text accepted:", ok, "stopped:", m.is_stopped())

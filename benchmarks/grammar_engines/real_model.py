"""Greedy SmolLM2-135M decode (llama.cpp low-level API, 1 thread) with and without the llguidance
mask: per-token time split (decode vs mask+apply+consume) and the constrained output.

    python real_model.py      (needs llama-cpp-python, llguidance and the SmolLM2 GGUF)
"""

import json
import time

import common
import llama_cpp as L
import llguidance
import llguidance.numpy as lnp
import numpy as np
from llguidance.llamacpp import lltokenizer_from_vocab

L.llama_backend_init()
model = L.llama_model_load_from_file(common.GGUF.encode(), L.llama_model_default_params())
vocab = L.llama_model_get_vocab(model)
V = L.llama_vocab_n_tokens(vocab)
cp = L.llama_context_default_params()
cp.n_ctx = 1024
cp.n_threads = 1
cp.n_threads_batch = 1
ctx = L.llama_init_from_model(model, cp)
tok = lltokenizer_from_vocab(vocab)
schema = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
        "landmarks": {
            "type": "array",
            "items": {"type": "string", "maxLength": 40},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}
prompt = (
    "<|im_start|>system\nYou answer in JSON.<|im_end|>\n<|im_start|>user\n"
    "Describe Paris as JSON with city, country, population_millions and landmarks.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def run(constrained, max_new=120):
    mem = L.llama_get_memory(ctx)
    L.llama_memory_clear(mem, True)
    b = prompt.encode()
    arr = (L.llama_token * (len(b) + 8))()
    n = L.llama_tokenize(
        vocab, b, len(b), arr, len(arr), False, True
    )  # parse_special: chat markers
    assert L.llama_decode(ctx, L.llama_batch_get_one(arr, n)) == 0
    m = (
        llguidance.LLMatcher(
            tok,
            llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False}
            ),
            log_level=0,
        )
        if constrained
        else None
    )
    mask = lnp.allocate_token_bitmask(1, V)
    out, t_dec, t_mask = [], [], []
    for _ in range(max_new):
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(V,))
        t0 = time.perf_counter()
        if m is not None:
            lnp.fill_next_token_bitmask(m, mask, 0)
            logits[
                ~np.unpackbits(mask.view(np.uint8), bitorder="little", count=V).view(bool)
            ] = -np.inf
        t = int(logits.argmax())
        if m is not None:
            assert m.consume_token(t), m.get_error()
        t_mask.append(time.perf_counter() - t0)
        if L.llama_vocab_is_eog(vocab, t):
            break
        out.append(t)
        if m is not None and m.is_stopped():
            break
        one = (L.llama_token * 1)(t)
        t0 = time.perf_counter()
        assert L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) == 0
        t_dec.append(time.perf_counter() - t0)
    return tok.decode_str(out), t_dec, t_mask


for c in (False, True):
    text, td, tm = run(c)
    print(
        f"== constrained={c}: {len(td)} tokens; decode mean {1e3 * np.mean(td):.2f} ms/token; "
        f"sampling step (mask+apply+argmax+consume) mean {1e3 * np.mean(tm):.3f} ms, "
        f"p99 {1e3 * np.percentile(tm, 99):.3f} ms"
    )
    print(text[:600])
    if c:
        print("json.loads ok:", json.loads(text))

"""One adapter per grammar engine: ``compile(schema) -> grammar``; ``matcher(grammar)``;
``fill(m, mask_int32[1, W])``; ``accept(m, tok)``."""

from __future__ import annotations

import ctypes
import json

import common
import numpy as np

V = 49152
W = (V + 31) // 32


class LLG:
    name = "llguidance"

    def __init__(self):
        import llguidance
        import llguidance.numpy as lnp

        self.llg, self.lnp = llguidance, lnp
        self.tok = common.llg_tokenizer()

    def compile(self, schema, **opts):
        g = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=opts or None)
        err = self.llg.LLMatcher.validate_grammar(g, self.tok)
        if err and not err.startswith("WARNING"):
            raise ValueError(err)
        return g

    def matcher(self, g):
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m, mask):
        self.lnp.fill_next_token_bitmask(m, mask)

    def accept(self, m, t):
        ok = m.consume_token(t)
        if not ok:
            raise ValueError(m.get_error())


class XGR:
    name = "xgrammar"

    def __init__(self):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = common.xgr_tokenizer_info()
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, schema, **opts):
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
        )

    def matcher(self, g):
        return self.xgr.GrammarMatcher(g)

    def fill(self, m, mask):
        m.fill_next_token_bitmask(mask)  # numpy int32 via DLPack

    def accept(self, m, t):
        if not m.accept_token(t):
            raise ValueError("rejected")


class OC:
    name = "outlines-core"

    def __init__(self):
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.build = oc, build_regex_from_schema
        self.vocab = common.oc_vocabulary()

    def compile(self, schema, **opts):
        regex = self.build(json.dumps(schema), None)
        return self.oc.Index(regex, self.vocab)

    def matcher(self, idx):
        return self.oc.Guide(idx)

    def fill(self, m, mask):
        m.write_mask_into(mask.ctypes.data, mask.size, 4)

    def accept(self, m, t):
        if t == self.vocab.get_eos_token_id() and m.is_finished():
            return  # outlines-core allows EOS in a final state's mask but advance(EOS) raises
        m.advance(t, return_tokens=False)


class LCPP:
    """llama.cpp's own grammar sampler (GBNF from llama_cpp.llama_grammar.json_schema_to_gbnf)."""

    name = "llama.cpp grammar"

    def __init__(self):
        import llama_cpp

        self.L = llama_cpp
        mp = llama_cpp.llama_model_default_params()
        mp.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(common.GGUF.encode(), mp)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.data = (llama_cpp.llama_token_data * V)()
        self.arr = np.ctypeslib.as_array(self.data)  # structured: id, logit, p
        self.ids = np.arange(V, dtype=np.int32)
        self.cur = llama_cpp.llama_token_data_array(
            data=self.data, size=V, selected=-1, sorted=False
        )

    def compile(self, schema, **opts):
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        return json_schema_to_gbnf(json.dumps(schema))

    def matcher(self, gbnf):
        s = self.L.llama_sampler_init_grammar(self.vocab, gbnf.encode(), b"root")
        if not s:
            raise ValueError("llama_sampler_init_grammar returned NULL")
        return s

    def fill(self, m, mask):
        a = self.arr
        a["id"] = self.ids
        a["logit"] = 0.0
        self.cur.size = V
        self.cur.selected = -1
        self.cur.sorted = False
        self.L.llama_sampler_apply(m, ctypes.byref(self.cur))
        ok = np.isfinite(a["logit"][: self.cur.size])
        ids = a["id"][: self.cur.size][ok]
        bits = np.zeros(W * 32, dtype=bool)
        bits[ids] = True
        mask[0] = np.packbits(bits, bitorder="little").view(np.int32)

    def accept(self, m, t):
        self.L.llama_sampler_accept(m, t)


ENGINES = {"llg": LLG, "xgr": XGR, "oc": OC, "lcpp": LCPP}


def allowed(mask, t):
    return bool((int(mask[0, t >> 5]) >> (t & 31)) & 1)


def unpack(mask):
    return np.unpackbits(mask.view(np.uint8), bitorder="little", count=V).astype(bool)

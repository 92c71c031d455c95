"""Setup costs, mask application on numpy logits, GIL release, batch APIs, GBNF input.

    python extra.py

Needs all four engines (llguidance, xgrammar + torch, outlines-core, llama-cpp-python).
"""

from __future__ import annotations

import ctypes
import importlib
import statistics
import threading
import time

import common
import engines
import numpy as np
from engines import V, W, unpack


def ms(t):
    return f"{t * 1e3:.2f} ms"


def best(f, n=200):
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def timed_import(name):
    """Import ``name`` (the import's cost is one of the figures)."""
    t0 = time.perf_counter()
    mod = importlib.import_module(name)
    return mod, time.perf_counter() - t0


def setup_costs():
    """Each engine's one-off costs; returns what the later sections share."""
    print("== setup costs")
    t0 = time.perf_counter()
    common.gguf_vocab()
    print("gguf vocab read (gguf-py)", ms(time.perf_counter() - t0))
    t0 = time.perf_counter()
    common.token_bytes()
    print("token bytes decode", ms(time.perf_counter() - t0))
    t0 = time.perf_counter()
    s = common.hf_tokenizer().to_str()
    print("tokenizers.Tokenizer rebuilt from GGUF + to_str", ms(time.perf_counter() - t0),
          len(s) // 1024, "KiB json")
    llguidance, dt = timed_import("llguidance")
    print("import llguidance", ms(dt))
    t0 = time.perf_counter()
    llt = llguidance.LLTokenizer(s, eos_token=2)
    print("llguidance LLTokenizer(tokenizer.json)", ms(time.perf_counter() - t0))
    import llama_cpp
    import llguidance.llamacpp

    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(common.GGUF.encode(), mp)
    vocab = llama_cpp.llama_model_get_vocab(model)
    t0 = time.perf_counter()
    llt2 = llguidance.llamacpp.lltokenizer_from_vocab(vocab)
    print("llguidance lltokenizer_from_vocab(llama vocab)", ms(time.perf_counter() - t0))
    print("  same tokenization as llama.cpp:",
          llt2.tokenize_str(common.DOC) == common.hf_tokenizer().encode(common.DOC).ids,
          "| eos_tokens", llt2.eos_tokens)
    xgr, dt = timed_import("xgrammar")
    print("import xgrammar (pulls torch, transformers)", ms(dt))
    t0 = time.perf_counter()
    info = common.xgr_tokenizer_info()
    print("xgrammar TokenizerInfo(byte-level vocab)", ms(time.perf_counter() - t0))
    t0 = time.perf_counter()
    xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    print("xgrammar GrammarCompiler()", ms(time.perf_counter() - t0))
    t0 = time.perf_counter()
    importlib.import_module("outlines_core")
    common.oc_vocabulary()
    print("outlines-core Vocabulary", ms(time.perf_counter() - t0))
    return model, vocab, llt


def apply_mask():
    """Ways of writing -inf into float32 logits from a packed bitmask; returns the mask."""
    import llguidance.numpy as lnp
    import torch
    import xgrammar as xgr

    print("== applying a bitmask to float32 logits (numpy, vocab 49152)")
    eng = engines.LLG()
    m = eng.matcher(eng.compile(common.SCHEMA))
    mask = np.zeros((1, W), dtype=np.int32)
    eng.fill(m, mask)  # first step: only '{' allowed
    logits = np.random.default_rng(0).standard_normal(V).astype(np.float32)
    ninf = np.float32(-np.inf)

    def banned():
        return ~np.unpackbits(mask.view(np.uint8), bitorder="little", count=V).view(bool)

    def a1():
        out = logits.copy()
        out[~unpack(mask)] = -np.inf

    def a2():
        out = logits.copy()
        np.putmask(out, banned(), -np.inf)

    def a3():
        out = logits.copy()
        np.copyto(out, ninf, where=banned())

    def a4():  # greedy only: argmax over the allowed ids (no write to the logits)
        ids = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little", count=V))
        return ids[logits[ids].argmax()]

    def a5():
        out = logits.copy()[None]
        lnp.apply_token_bitmask_inplace(out, mask)

    def copy():
        logits.copy()

    base = best(copy)
    for name, f in [
        ("unpackbits + bool index", a1),
        ("unpackbits + putmask", a2),
        ("unpackbits + copyto(where)", a3),
        ("greedy: flatnonzero + argmax over allowed", a4),
        ("llguidance.numpy.apply_token_bitmask_inplace", a5),
    ]:
        print(f"  {name:45s} {ms(best(f) - base)}")
    tl = torch.from_numpy(logits.copy())
    tm = torch.from_numpy(mask)

    def a6():
        xgr.apply_token_bitmask_inplace(tl, tm)

    label = "xgrammar.apply_token_bitmask_inplace (torch.from_numpy, cpu)"
    print(f"  {label:45s} {ms(best(a6))}")
    # check xgrammar on a numpy array directly
    try:
        xgr.apply_token_bitmask_inplace(logits.copy(), mask)
        print("  xgrammar apply on numpy: ok")
    except Exception as e:  # noqa: BLE001 (the failure's type and text are the figure)
        print("  xgrammar apply on numpy arrays:", type(e).__name__, str(e)[:120])
    # correctness of a1 vs a6
    l1 = logits.copy()
    l1[~unpack(mask)] = -np.inf
    l6 = torch.from_numpy(logits.copy())
    xgr.apply_token_bitmask_inplace(l6, tm)
    print("  numpy and xgrammar masks agree:", np.array_equal(np.isinf(l1), np.isinf(l6.numpy())))
    return mask


def spin(dur):
    n = 0
    end = time.perf_counter() + dur
    while time.perf_counter() < end:
        n += 1
    return n


def worker(fill_once, stop):
    while not stop.is_set():
        fill_once()


def gil_one(key, base_n):
    eng = engines.ENGINES[key]()
    mm = eng.matcher(eng.compile(common.SCHEMA))
    toks = common.hf_tokenizer().encode(common.DOC).ids
    for t in toks[:12]:
        eng.accept(mm, t)  # inside "home": {... a string → big mask
    buf = np.zeros((1, W), dtype=np.int32)
    cnt = [0]

    def once():
        eng.fill(mm, buf)
        cnt[0] += 1

    per = best(once, 100)
    stop = threading.Event()
    th = threading.Thread(target=worker, args=(once, stop))
    cnt[0] = 0
    th.start()
    n = spin(1.0)
    stop.set()
    th.join()
    print(f"  {eng.name:14s} mask {per * 1e3:.3f} ms/call; worker did {cnt[0]} masks in 1 s; "
          f"main loop kept {n / base_n:.0%} of its idle rate")


def gil():
    print("== GIL: python loop iterations in the main thread while a worker computes masks")
    base_n = spin(1.0)
    for key in ["llg", "xgr", "oc"]:
        gil_one(key, base_n)


def batch_apis():
    """8 sequences: one call each against the engines' batch calls; returns the xgrammar adapter."""
    import llguidance
    import llguidance.numpy as lnp
    import xgrammar as xgr

    print("== batch APIs: 8 sequences, one mask row each")
    eng = engines.LLG()
    g = eng.compile(common.SCHEMA)
    toks = common.hf_tokenizer().encode(common.DOC).ids
    ms8 = [eng.matcher(g) for _ in range(8)]
    for i, mm in enumerate(ms8):
        for t in toks[: 10 + i * 15]:
            eng.accept(mm, t)
    bm = np.zeros((8, W), dtype=np.int32)
    ex = llguidance.LLExecutor(num_threads=2)
    ser = best(lambda: [lnp.fill_next_token_bitmask(mm, bm, i) for i, mm in enumerate(ms8)], 100)
    par = best(
        lambda: lnp.fill_next_token_bitmask_par(ex, [(mm, i) for i, mm in enumerate(ms8)], bm),
        100,
    )
    print(f"  llguidance serial {ms(ser)}, LLExecutor(2 threads) {ms(par)}")
    x = engines.XGR()
    gx = x.compile(common.SCHEMA)
    mx = [x.matcher(gx) for _ in range(8)]
    for i, mm in enumerate(mx):
        for t in toks[: 10 + i * 15]:
            x.accept(mm, t)
    bx = np.zeros((8, W), dtype=np.int32)
    ser = best(lambda: [mm.fill_next_token_bitmask(bx, i) for i, mm in enumerate(mx)], 100)
    bgm = xgr.BatchGrammarMatcher(max_threads=2)
    par = best(lambda: bgm.batch_fill_next_token_bitmask(mx, bx), 100)
    print(f"  xgrammar serial {ms(ser)}, BatchGrammarMatcher(2 threads) {ms(par)}")
    return x


GBNF = r"""root ::= "{" ws "\"answer\":" ws answer ws "," ws "\"n\":" ws num ws "}"
answer ::= "\"yes\"" | "\"no\""
num ::= [0-9]+
ws ::= [ \t\n]*
"""
BAD_GBNF = 'root ::= "a" ( "b"'


def gbnf(llt, x, vocab):
    """The `grammar` parameter: GBNF through each engine, and what a bad one gives back."""
    import llama_cpp
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark

    print("== GBNF input (the `grammar` parameter)")
    t0 = time.perf_counter()
    lark = gbnf_to_lark(GBNF)
    gl = llguidance.LLMatcher.grammar_from_lark(lark)
    mm = llguidance.LLMatcher(llt, gl)
    print("  llguidance gbnf_to_lark + LLMatcher", ms(time.perf_counter() - t0),
          "error:", mm.get_error() if mm.is_error() else None)
    doc = '{"answer": "yes", "n": 42}'
    print("   walk ok:",
          all(mm.consume_token(t) for t in llt.tokenize_str(doc)) and mm.consume_token(2),
          mm.is_accepting() or mm.is_stopped())
    try:
        print("  llguidance bad GBNF:", gbnf_to_lark(BAD_GBNF))
    except Exception as e:  # noqa: BLE001 (the error's type and text are the figure)
        print("  llguidance bad GBNF ->", type(e).__name__, str(e)[:150])
    t0 = time.perf_counter()
    x.compiler.compile_grammar(GBNF)
    print("  xgrammar compile_grammar(GBNF/EBNF)", ms(time.perf_counter() - t0))
    try:
        x.compiler.compile_grammar(BAD_GBNF)
    except Exception as e:  # noqa: BLE001 (the error's type and text are the figure)
        print("  xgrammar bad GBNF ->", type(e).__name__, str(e)[:150])
    smpl = llama_cpp.llama_sampler_init_grammar(vocab, BAD_GBNF.encode(), b"root")
    print("  llama.cpp bad GBNF -> sampler pointer", bool(smpl))


def lcpp_one_token(mask):
    import llama_cpp

    print("== llama.cpp grammar sampler: full-vocab apply vs checking only the sampled token")
    lc = engines.LCPP()
    sm = lc.matcher(lc.compile(common.SCHEMA))
    toks = common.hf_tokenizer().encode(common.DOC).ids
    for t in toks[:12]:
        lc.accept(sm, t)
    full = best(lambda: lc.fill(sm, mask), 30)
    one = (llama_cpp.llama_token_data * 1)()
    arr1 = llama_cpp.llama_token_data_array(data=one, size=1, selected=-1, sorted=False)

    def check_one():
        one[0].id = toks[12]
        one[0].logit = 0.0
        arr1.size = 1
        llama_cpp.llama_sampler_apply(sm, ctypes.byref(arr1))

    t_one = best(check_one, 200)
    print(f"  full vocab {ms(full)}; one candidate {ms(t_one)}; "
          f"sampled token ok: {np.isfinite(one[0].logit)}")


def main():
    _model, vocab, llt = setup_costs()  # the model stays loaded: its vocab is used below
    mask = apply_mask()
    gil()
    x = batch_apis()
    gbnf(llt, x, vocab)
    lcpp_one_token(mask)


if __name__ == "__main__":
    main()

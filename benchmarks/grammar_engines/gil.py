"""Does the engine release the GIL during compile / mask computation?  A worker thread repeats the
operation for 1 s while the main thread spins a pure-Python loop; 'main kept X%' is the main
loop's rate relative to running alone (2 cores: ~100% if the work runs outside the GIL, ~50% or
less if it holds the GIL)."""

from __future__ import annotations

import json
import threading
import time

import common
import engines
import numpy as np
from engines import W


def spin(dur):
    n = 0
    end = time.perf_counter() + dur
    while time.perf_counter() < end:
        n += 1
    return n


def test(label, op):
    op()  # warm
    base = spin(1.0)
    stop = threading.Event()
    cnt = [0]
    busy = [0.0]

    def w():
        while not stop.is_set():
            t0 = time.perf_counter()
            op()
            busy[0] += time.perf_counter() - t0
            cnt[0] += 1

    th = threading.Thread(target=w)
    th.start()
    n = spin(1.0)
    stop.set()
    th.join()
    per_op = busy[0] / max(cnt[0], 1) * 1e3
    print(f"  {label:60s} {per_op:8.3f} ms/op, {cnt[0]:5d} ops; main kept {n / base:.0%}")


def schemas():
    i = 0
    while True:
        s = json.loads(json.dumps(common.SCHEMA))
        s["$defs"]["address"]["properties"]["street"]["maxLength"] = 100 + i
        i += 1
        yield s


def llguidance_ops(toks):
    import llguidance
    import llguidance.numpy as lnp

    tok = common.llg_tokenizer()
    toknoslice = tok.with_slices([])
    g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(common.SCHEMA))
    print("== llguidance")
    it = schemas()
    test(
        "compile: grammar_from_json_schema + LLMatcher()",
        lambda: llguidance.LLMatcher(
            tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(next(it)))
        ),
    )
    buf = np.zeros((1, W), dtype=np.int32)
    m = llguidance.LLMatcher(toknoslice, g, log_level=0)
    for t in toks[:12]:
        m.consume_token(t)
    test(
        "mask, slicer off (a costlier mask; same call path)",
        lambda: lnp.fill_next_token_bitmask(m, buf),
    )
    ms64 = []
    for i in range(64):
        mm = llguidance.LLMatcher(tok, g, log_level=0)
        for t in toks[: i * 2 % 150]:
            mm.consume_token(t)
        ms64.append(mm)
    b64 = np.zeros((64, W), dtype=np.int32)
    ex = llguidance.LLExecutor(num_threads=1)
    test(
        "64 masks in one fill_next_token_bitmask_par (1 thread)",
        lambda: lnp.fill_next_token_bitmask_par(ex, [(mm, i) for i, mm in enumerate(ms64)], b64),
    )
    return buf, b64


def xgrammar_ops(toks, b64):
    import xgrammar as xgr

    print("== xgrammar")
    x = engines.XGR()
    it = schemas()
    test("compile_json_schema (cache off)", lambda: x.compile(next(it)))
    gx = x.compile(common.SCHEMA)
    mx = []
    for i in range(64):
        mm = xgr.GrammarMatcher(gx)
        for t in toks[: i * 2 % 150]:
            mm.accept_token(t)
        mx.append(mm)
    bgm = xgr.BatchGrammarMatcher(max_threads=1)
    test(
        "64 masks in one batch_fill_next_token_bitmask (1 thread)",
        lambda: bgm.batch_fill_next_token_bitmask(mx, b64),
    )
    test(
        "64 masks, one fill_next_token_bitmask call each",
        lambda: [mm.fill_next_token_bitmask(b64, i) for i, mm in enumerate(mx)],
    )


def outlines_ops():
    print("== outlines-core")
    oc = engines.OC()
    small = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 20}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
    test("compile: Index(build_regex_from_schema(small schema))", lambda: oc.compile(small))


def llama_cpp_ops(toks, buf):
    print("== llama.cpp grammar sampler")
    lc = engines.LCPP()
    sm = lc.matcher(lc.compile(common.SCHEMA))
    for t in toks[:12]:
        lc.accept(sm, t)
    test("llama_sampler_apply over the full vocab (+ numpy prep)", lambda: lc.fill(sm, buf))


def main():
    toks = common.hf_tokenizer().encode(common.DOC).ids
    buf, b64 = llguidance_ops(toks)
    xgrammar_ops(toks, b64)
    outlines_ops()
    llama_cpp_ops(toks, buf)


if __name__ == "__main__":
    main()

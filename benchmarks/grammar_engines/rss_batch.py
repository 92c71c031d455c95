"""RSS after import + tokenizer (per engine, fresh process), and uncontended 64-sequence mask fill:
one call per sequence vs one batch call.

    python rss_batch.py ENGINE      (ENGINE: llg xgr oc lcpp; one engine a process)
"""

import argparse
import resource
import statistics
import time

import common
import engines
import numpy as np


def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def med(f):
    xs = []
    for _ in range(50):
        t0 = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e3


def batch_call(key, ms, b):
    """The engine's one call that fills every row of ``b``."""
    if key == "llg":
        import llguidance
        import llguidance.numpy as lnp

        ex = llguidance.LLExecutor(num_threads=1)
        return lambda: lnp.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(ms)], b)
    import xgrammar as xgr

    bgm = xgr.BatchGrammarMatcher(max_threads=1)
    return lambda: bgm.batch_fill_next_token_bitmask(ms, b)


def main(key):
    common.gguf_vocab()
    common.hf_tokenizer()
    r1 = rss()
    eng = engines.ENGINES[key]()
    g = eng.compile(common.SCHEMA)
    r2 = rss()
    print(f"{eng.name}: RSS base(gguf vocab + rebuilt tokenizer) {r1:.0f} MiB; "
          f"+ engine import/tokenizer/compile {r2 - r1:.0f} MiB")
    if key not in ("llg", "xgr"):
        return
    toks = common.hf_tokenizer().encode(common.DOC).ids
    ms = []
    for i in range(64):
        m = eng.matcher(g)
        for t in toks[: i * 2 % 150]:
            eng.accept(m, t)
        ms.append(m)
    b = np.zeros((64, engines.W), dtype=np.int32)

    def per():
        for i, m in enumerate(ms):
            eng.fill(m, b[i : i + 1])

    batch = batch_call(key, ms, b)
    print(f"  64 masks uncontended: one call each {med(per):.3f} ms, "
          f"one batch call {med(batch):.3f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine", choices=sorted(engines.ENGINES))
    main(ap.parse_args().engine)

"""Compile time, per-token mask time (scripted walk over a valid document + random valid walk).

    python bench.py ENGINE [ENGINE...] [--json OUT.json]     (ENGINE: llg xgr oc lcpp)

Prints one block per engine; ``--json`` also writes the raw figures (seconds) to a file.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import common
import engines
import numpy as np
from engines import W, allowed, unpack


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def summary(xs):
    return {"n": len(xs), "mean_ms": statistics.mean(xs) * 1e3, "p50_ms": pct(xs, 50) * 1e3,
            "p99_ms": pct(xs, 99) * 1e3, "max_ms": max(xs) * 1e3}


def fmt(xs):
    s = summary(xs)
    return (f"mean {s['mean_ms']:.3f} ms, p50 {s['p50_ms']:.3f}, p99 {s['p99_ms']:.3f}, "
            f"max {s['max_ms']:.3f} (n={s['n']})")


def run(key):
    t0 = time.perf_counter()
    eng = engines.ENGINES[key]()
    t_setup = time.perf_counter() - t0
    print(f"== {eng.name}: tokenizer/engine setup {t_setup * 1e3:.0f} ms")
    out = {"engine": eng.name, "key": key, "setup_ms": t_setup * 1e3}
    comp = []
    for i in range(5):
        sch = json.loads(json.dumps(common.SCHEMA))
        sch["$defs"]["address"]["properties"]["street"]["maxLength"] = 40 + i  # defeat caches
        t0 = time.perf_counter()
        g = eng.compile(sch)
        t1 = time.perf_counter()
        eng.matcher(g)
        t2 = time.perf_counter()
        comp.append((t1 - t0, t2 - t1))
    print("  compile schema (5 runs, ms): "
          + ", ".join(f"{a * 1e3:.1f}+{b * 1e3:.1f}" for a, b in comp)
          + "   (compile + matcher creation)")
    out["compile_ms"] = [a * 1e3 for a, _ in comp]
    out["matcher_ms"] = [b * 1e3 for _, b in comp]
    g = eng.compile(common.SCHEMA)
    toks = [*common.hf_tokenizer().encode(common.DOC).ids, common.eos_id()]
    mask = np.zeros((1, W), dtype=np.int32)
    # scripted walk
    m = eng.matcher(g)
    tm, ta, bad = [], [], 0
    for t in toks:
        t0 = time.perf_counter()
        eng.fill(m, mask)
        t1 = time.perf_counter()
        if not allowed(mask, t):
            bad += 1
            print(f"  !! token {t} {common.token_bytes()[t]!r} not allowed at step {len(tm)}")
            break
        t2 = time.perf_counter()
        eng.accept(m, t)
        t3 = time.perf_counter()
        tm.append(t1 - t0)
        ta.append(t3 - t2)
    print(f"  scripted walk ({len(toks)} tokens of a valid doc, {'OK' if not bad else 'FAILED'}): "
          f"mask {fmt(tm)}; accept {fmt(ta)}")
    out["scripted_walk"] = {"tokens": len(toks), "ok": not bad, "mask": summary(tm),
                            "accept": summary(ta)}
    # random valid walk
    rng = random.Random(0)
    m = eng.matcher(g)
    tm, ta, n_allowed = [], [], []
    for _ in range(200):
        t0 = time.perf_counter()
        eng.fill(m, mask)
        t1 = time.perf_counter()
        ids = np.flatnonzero(unpack(mask))
        n_allowed.append(len(ids))
        if len(ids) == 0:
            break
        t = int(rng.choice(ids))
        t2 = time.perf_counter()
        eng.accept(m, t)
        t3 = time.perf_counter()
        tm.append(t1 - t0)
        ta.append(t3 - t2)
        if t == common.eos_id():
            break
    median_allowed = int(statistics.median(n_allowed))
    print(f"  random valid walk ({len(tm)} steps): mask {fmt(tm)}; accept {fmt(ta)}; "
          f"allowed tokens/step median {median_allowed}")
    out["random_walk"] = {"steps": len(tm), "mask": summary(tm), "accept": summary(ta),
                          "allowed_per_step_median": median_allowed}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engines", nargs="+", choices=sorted(engines.ENGINES))
    ap.add_argument("--json", help="write the raw figures here")
    args = ap.parse_args()
    results = [run(k) for k in args.engines]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""The semantic cache (issue 15): what it gets right and wrong on the labelled pairs, what it
costs and saves on a real ``sokuji serve`` with SmolLM2, and a lookup's cost as the store grows.

    flock /tmp/sokuji-bench.lock .venv/bin/python benchmarks/semantic_cache.py [--quick]
        [--out benchmarks/results/semantic_cache.json]  (quick, 60 + 60 pairs: ~5 min; all: ~25)

1. Quality: in-process MiniLM (1 thread) over all pairs of ``routing/data/cache_pairs.jsonl``:
   HR(t), FHR(t) for t = 0.800..1.000 with 95% intervals (Wilson; Clopper-Pearson), with and
   without the guards; the thresholds ``cache_calibrate.calibrate`` picks for FHR <= 2% and 5%
   (one-sided 95%), per-category rates there, and the wrong share of hits at a near-miss mix
   π = 0.1 and 0.5 (GPTCache's figure, which depends on π; FHR does not).
2. Serving: ``sokuji serve`` on --server-cores with ``minilm`` (1 thread) and SmolLM2-135M
   twice (1 thread each): ``cached`` (semantic cache at the 5% threshold, guards on,
   --audit-rate 1: the client waits for each hit's background audit before going on) and
   ``plain``. A tenant per pair, so a scope per pair, as calibrated (--scope shared: one
   tenant, a growing cache). Per pair, c = 1, chat, temperature 0, --max-tokens: a to both
   models, then b to both (the first model alternates). Miss overhead: a on ``cached``
   (embed + lookup + generation) vs a on ``plain``, paired by text; also in Server-Timing
   (preprocess, prefill). Hit: b from the cache vs b on ``plain``. Each hit's cached answer
   (a's) vs the text ``plain`` generates for b: exact (what the server's audits count) and
   MiniLM cosine; misses must give the same text on both models (determinism).
3. Store: ``SemanticCache.lookup`` at 1,000 / 10,000 random 384-d entries, miss (a full scan)
   and hit, vs the bare numpy product; MiniLM's own cost for one text, in-process.

Depends on: the pairs (positives and negatives 1:1, so π is a parameter), the embedder, the
guards, SmolLM2's wording (exact equality is strict: a paraphrase often gets other words),
max_tokens (the generation a hit saves), store size, and the machine's load (probed, in the
JSON). Writes JSON, a Markdown table (.md) and a plot (.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._harness import free_port, percentile  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from sokuji.bench.engine import parse_server_timing  # noqa: E402
from sokuji.core.semantic_cache import SemanticCache  # noqa: E402
from sokuji.routing import cache_calibrate as cc  # noqa: E402
from sokuji.routing.stats import clopper_pearson, wilson  # noqa: E402
from tests.integration.serving import wait_ready  # noqa: E402

GRID = [round(x / 200, 3) for x in range(160, 201)]  # 0.800 .. 1.000
TARGETS, MIXES, SHOWN = (0.02, 0.05), (0.1, 0.5), (0.8, 0.85, 0.9, 0.95, 0.97, 1.0)
GPTCACHE = ("GPTCache's benchmark (other data): t 0.95: 45% hits, 5.6% of them wrong; 0.8: "
            "99.7%, 9.2%.")
METRICS = ("sokuji_semantic_cache", "sokuji_llm_generation_tokens_total")
CAL = ("threshold", "hr", "hr_interval", "fhr", "fhr_interval", "fhr_upper", "hits",
       "false_hits")


def quality(pairs: list[cc.Pair], sims: np.ndarray, passes: np.ndarray) -> dict[str, Any]:
    same = np.array([p.same for p in pairs])
    n_pos, n_neg = int(same.sum()), int((~same).sum())
    out: dict[str, Any] = {"n_pos": n_pos, "n_neg": n_neg, "curves": {}, "chosen": []}
    wrong = lambda hr, fhr: {str(m): cc.wrong_share(hr, fhr, m) for m in MIXES}  # noqa: E731
    for guards in (True, False):
        gp, gn = (passes[same], passes[~same]) if guards else (None, None)
        out["curves"]["guards" if guards else "no guards"] = [{
            "t": r.threshold, "hr": r.hr, "hr_interval": wilson(r.hits, n_pos), "fhr": r.fhr,
            "fhr_interval": clopper_pearson(r.false_hits, n_neg), "hits": r.hits,
            "false_hits": r.false_hits, "wrong": wrong(r.hr, r.fhr)}
            for r in cc.sweep(sims[same], sims[~same], GRID, 0.95, gp, gn)]
        for target in TARGETS:
            cal = cc.calibrate(sims[same], sims[~same], target, 0.95, gp, gn)
            cats = cc.per_category(pairs, sims, cal.threshold, passes if guards else None)
            out["chosen"].append({"target": target, "guards": guards,
                                  "wrong": wrong(cal.hr, cal.fhr),
                                  "per_category": [dataclasses.asdict(c) for c in cats],
                                  **{k: getattr(cal, k) for k in CAL}})
    return out


class Client:
    """c = 1 over one keep-alive connection (reopened once if the server closed it)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        self.audits_seen = 0.0

    def _do(self, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[Any, bytes, float]:
        for attempt in (0, 1):
            try:
                t0 = time.perf_counter()
                self.conn.request(method, path, body, headers or {})
                r = self.conn.getresponse()
                return r, r.read(), (time.perf_counter() - t0) * 1e3
            except (ConnectionError, http.client.HTTPException):
                self.conn.close()  # the next request reopens it
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def chat(self, model: str, text: str, key: str, max_tokens: int) -> dict[str, Any]:
        body = json.dumps({"model": model, "max_tokens": max_tokens, "temperature": 0,
                           "messages": [{"role": "user", "content": text}]}).encode()
        r, data, ms = self._do("POST", "/v1/chat/completions", body, {
            "content-type": "application/json", "authorization": f"Bearer {key}"})
        if r.status != 200:
            raise RuntimeError(f"{model}: HTTP {r.status}: {data[:300]!r}")
        doc, served = json.loads(data), r.getheader("x-sokuji-served-by") or ""
        hit = served.startswith("cache semantic")
        return {"ms": ms, "timing": parse_server_timing(r.getheader("server-timing") or ""),
                "hit": hit, "similarity": float(served.rsplit(" ", 1)[1]) if hit else None,
                "text": doc["choices"][0]["message"]["content"],
                "tokens": doc["usage"]["completion_tokens"]}

    def metrics(self) -> dict[str, float]:
        lines = self._do("GET", "/metrics")[1].decode().splitlines()
        return {k: float(v) for k, _, v in (x.rpartition(" ") for x in lines
                                            if x.startswith(METRICS))}

    def wait_audit(self, timeout_s: float = 20.0) -> None:
        """After a hit: until the server counted one more audit (or gave up on it)."""
        self.audits_seen += 1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = sum(v for k, v in self.metrics().items() if "audits_total" in k)
            if done >= self.audits_seen:
                return
            time.sleep(0.05)  # polling the server's counter, not our own work
        self.audits_seen = done


def server(args: argparse.Namespace, threshold: float, keys: list[tuple[str, str]]
           ) -> tuple[subprocess.Popen[bytes], int, Path]:
    from sokuji.llm import native

    port = free_port()
    llm = (f'runtime = "llama"\npath = "{native.smollm2_path()}"\ncache = false\n'
           'options = { slots = 1, context_size = 512, threads = 1 }\n')
    cfg = Path(tempfile.mkdtemp(prefix="sokuji-semcache-")) / "sokuji.toml"
    cfg.write_text(
        f'port = {port}\ngrpc_port = 0\nlog_level = "warning"\ncache_dir = "{args.cache_dir}"\n'
        'builtin_pipelines = false\n[cache]\nenabled = false\n[jobs]\nenabled = false\n'
        '[[models]]\nname = "minilm"\nintra_op_threads = 1\n'
        f'[[models]]\nname = "cached"\n{llm}semantic_cache = {{ enabled = true, embedder = '
        f'"minilm", threshold = {threshold!r}, guards = true, audit_rate = '
        f'{args.audit_rate!r} }}\n[[models]]\nname = "plain"\n{llm}'
        + "".join(f'[[api_keys]]\nkey = "{k}"\ntenant = "{t}"\n' for k, t in keys))
    proc = subprocess.Popen(["taskset", "-c", args.server_cores, sys.executable, "-m",
                             "sokuji", "serve", "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, cwd=ROOT)
    wait_ready(proc, f"http://127.0.0.1:{port}/v2/health/ready", timeout_s=300)
    return proc, port, cfg


def serving(args: argparse.Namespace, pairs: list[cc.Pair], sims: np.ndarray,
            passes: np.ndarray, threshold: float, bar: Any, embed: Any) -> dict[str, Any]:
    keys = [(f"bench-pair-{i:05d}", f"pair{i}" if args.scope == "pair" else "shared")
            for i in range(len(pairs))] + [("bench-warm-key", "warm")]
    proc, port, cfg = server(args, threshold, keys)
    rows: list[dict[str, Any]] = []
    try:
        client = Client(port)
        for text in ("Hello, who are you?", "Name a colour.", "What is two plus two?"):
            for model in ("cached", "plain"):  # untimed: first allocations, warm caches
                client.chat(model, text, "bench-warm-key", args.max_tokens)
        task = bar.add_task("serving: a and b on cached and plain, c=1", total=len(pairs))
        for i, p in enumerate(pairs):
            order = ("plain", "cached") if i % 2 == 0 else ("cached", "plain")
            row: dict[str, Any] = {"category": p.category, "same": p.same, "a": p.a, "b": p.b,
                                   "similarity": float(sims[i]), "guard_ok": bool(passes[i]),
                                   "predicted_hit": bool(passes[i] and sims[i] >= threshold)}
            for side, models in (("a", order), ("b", order[::-1])):
                for model in models:
                    out = row[f"{model}_{side}"] = client.chat(model, getattr(p, side),
                                                               keys[i][0], args.max_tokens)
                    if out["hit"] and args.audit_rate > 0:
                        client.wait_audit()
            rows.append(row)
            bar.advance(task)
        final = client.metrics()
    finally:
        proc.terminate()
        proc.wait(30)
        cfg.unlink()
    answers = cc.embed_pairs(embed, [cc.Pair(r["plain_a"]["text"] or " ", r["plain_b"]["text"]
                                             or " ", r["same"], "") for r in rows])
    for r, cos in zip(rows, answers, strict=True):
        r["answer_cosine"] = float(cos)  # a's answer (what a hit serves) vs b's own
    return {"threshold": threshold, "scope": args.scope, "rows": rows, "metrics": final,
            **summarise_serving(rows, final)}


def _lat(ms: list[float]) -> dict[str, float]:
    return {"n": len(ms), "p50": percentile(ms, 50) if ms else 0.0,
            "p99": percentile(ms, 99) if ms else 0.0, "mean": float(np.mean(ms)) if ms else 0.0}


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def summarise_serving(rows: list[dict[str, Any]], final: dict[str, float]) -> dict[str, Any]:
    miss = [r for r in rows if not r["cached_a"]["hit"]]
    hits = [r for r in rows if r["cached_b"]["hit"]]
    lat = {"plain, a": _lat([r["plain_a"]["ms"] for r in miss]),
           "cached, a (miss)": _lat([r["cached_a"]["ms"] for r in miss]),
           "plain, b (of hits)": _lat([r["plain_b"]["ms"] for r in hits]),
           "cached, b (hit)": _lat([r["cached_b"]["ms"] for r in hits])}
    kinds = {}
    for name, same in (("positive", True), ("negative", False)):
        sub = [r for r in rows if r["same"] is same]
        hit = [r for r in sub if r["cached_b"]["hit"]]
        kinds[name] = {
            "n": len(sub), "hits": len(hit), "rate": len(hit) / max(1, len(sub)),
            "ci": (wilson if same else clopper_pearson)(len(hit), len(sub)),
            "predicted_hits": sum(r["predicted_hit"] for r in sub),
            "prediction_disagrees": sum(r["predicted_hit"] != r["cached_b"]["hit"] for r in sub),
            "hit_answer_differs": sum(r["cached_b"]["text"] != r["plain_b"]["text"] for r in hit),
            "hit_answer_cosine": _median([r["answer_cosine"] for r in hit]),
            "answer_cosine_all": _median([r["answer_cosine"] for r in sub])}
    return {
        "latency_ms": lat,
        "miss_overhead_ms": _median([r["cached_a"]["ms"] - r["plain_a"]["ms"] for r in miss]),
        "server_stage_delta_ms": {k: _median([r["cached_a"]["timing"].get(k, 0.0)
                                              - r["plain_a"]["timing"].get(k, 0.0)
                                              for r in miss])
                                  for k in ("preprocess", "prefill", "decode")},
        "hit_speedup": lat["plain, b (of hits)"]["p50"] / lat["cached, b (hit)"]["p50"]
        if hits else None,
        "kinds": kinds, "hits": len(hits),
        "hits_answer_differs": sum(r["cached_b"]["text"] != r["plain_b"]["text"] for r in hits),
        "nondeterministic": sum(r[f"cached_{s}"]["text"] != r[f"plain_{s}"]["text"]
                                for r in rows for s in "ab" if not r[f"cached_{s}"]["hit"]),
        "mean_completion_tokens": float(np.mean([r["plain_b"]["tokens"] for r in rows])),
        "server_audits": {o: sum(v for k, v in final.items() if k.startswith(
            "sokuji_semantic_cache_audits_total") and f'outcome="{o}"' in k)
            for o in ("agree", "disagree")},
        "generation_tokens": {m: sum(v for k, v in final.items() if k.startswith(
            "sokuji_llm_generation_tokens_total") and f'model="{m}"' in k)
            for m in ("cached", "plain")}}


def _us(fn: Any, *args: Any) -> float:
    t0 = time.perf_counter_ns()
    fn(*args)
    return (time.perf_counter_ns() - t0) / 1e3


def store_cost(sizes: tuple[int, ...], queries: int, seed: int) -> list[dict[str, Any]]:
    """Lookups in one scope of n random entries: a miss (a full scan), a hit (the scan, the
    guards, the LRU touch), and the bare numpy product with its argmax."""
    rng, scope, out = np.random.default_rng(seed), ("t", "m", "1", ""), []
    for n in sizes:
        vecs = rng.standard_normal((n, 384)).astype(np.float32)
        unit = vecs / np.linalg.norm(vecs, axis=1, keepdims=True)
        cache = SemanticCache(0.9, guards=True, max_entries=n, max_bytes=1 << 32)
        for j in range(n):
            cache.store(scope, f"entry {j}", vecs[j], j, 8)
        qs = rng.standard_normal((queries, 384)).astype(np.float32)
        us = {"miss": [_us(cache.lookup, scope, "query", q) for q in qs],
              "hit": [_us(cache.lookup, scope, f"entry {j}", vecs[j])
                      for j in rng.integers(0, n, queries)],
              "numpy": [_us(lambda m, v: np.argmax(m @ (v / np.linalg.norm(v))), unit, q)
                        for q in qs]}
        row: dict[str, Any] = {"entries": n, "matrix_mb": unit.nbytes / 1e6}
        for name, v in us.items():
            row[f"{name}_p50_us"], row[f"{name}_p99_us"] = percentile(v, 50), percentile(v, 99)
        out.append(row | {"miss_of_numpy": row["miss_p50_us"] / row["numpy_p50_us"]})
    return out


def _table(header: str, rows: list[list[Any]]) -> list[str]:
    return ["", f"| {header} |", "|" + "---|" * len(header.split(" | "))] + [
        "| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _ci(lo_hi: Any) -> str:
    return f"{lo_hi[0]:.3f}–{lo_hi[1]:.3f}"


def markdown(res: dict[str, Any]) -> list[str]:
    q, s, args = res["quality"], res.get("serving"), res["args"]
    g = [f"{c['target']:.0%}, guards {'on' if c['guards'] else 'off'}" for c in q["chosen"]]
    w = [f"{q['n_pos']} positive / {q['n_neg']} negative pairs, MiniLM; 95% intervals (HR "
         "Wilson, FHR Clopper-Pearson); wrong = share of hits that are wrong at mix π"]
    w += _table("target FHR, guards | t | HR (95%) | FHR (95%) | FHR one-sided 95% | wrong "
                "π=0.1 | wrong π=0.5", [
                    [gc, "none" if c["threshold"] is None else f"{c['threshold']:.4f}",
                     f"{c['hr']:.3f} ({_ci(c['hr_interval'])})",
                     f"{c['fhr']:.3f} ({_ci(c['fhr_interval'])})", f"{c['fhr_upper']:.3f}",
                     f"{c['wrong']['0.1']:.3f}", f"{c['wrong']['0.5']:.3f}"]
                    for gc, c in zip(g, q["chosen"], strict=True)])
    curve = {k: {r["t"]: r for r in rows} for k, rows in q["curves"].items()}
    w += _table("t | HR guards | FHR guards | wrong π=.1/.5 guards | HR no guards | FHR no "
                "guards | wrong π=.1/.5 no guards", [[f"{t:.2f}"] + [
                    f"{r['hr']:.3f} ({_ci(r['hr_interval'])}) | {r['fhr']:.3f} "
                    f"({_ci(r['fhr_interval'])}) | {r['wrong']['0.1']:.3f}/"
                    f"{r['wrong']['0.5']:.3f}" for r in (curve["guards"][t],
                                                         curve["no guards"][t])]
                    for t in SHOWN])
    w += ["", GPTCACHE]
    w += _table("category | kind | " + " | ".join(g), [
        [cat["category"], "HR" if cat["same"] else "FHR"]
        + [f"{r['hits']}/{r['n']} ({_ci((r['low'], r['high']))})"
           for r in (c["per_category"][i] for c in q["chosen"])]
        for i, cat in enumerate(q["chosen"][0]["per_category"])])
    if s:
        lat, d, a = s["latency_ms"], s["server_stage_delta_ms"], s["server_audits"]
        w += ["", f"served: t = {s['threshold']:.4f} (5% target, guards), a scope per "
              f"{s['scope']}, SmolLM2-135M, max_tokens {args['max_tokens']} (mean "
              f"{s['mean_completion_tokens']:.1f} tokens), c=1, audit_rate "
              f"{args['audit_rate']}. A miss costs {s['miss_overhead_ms']:+.1f} ms (client, "
              f"paired median; {s['miss_overhead_ms'] / lat['plain, a']['p50']:+.1%} of a "
              f"generation); in the server {d['preprocess']:+.1f} ms preprocess (embed + "
              f"lookup), {d['prefill']:+.1f} ms prefill, {d['decode']:+.1f} ms decode. "
              + (f"A hit is {s['hit_speedup']:.0f}× faster than generating b (p50)."
                 if s["hit_speedup"] else "No hits.")]
        w += _table("request | n | p50 ms | p99 ms | mean ms", [
            [n, v["n"], f"{v['p50']:.1f}", f"{v['p99']:.1f}", f"{v['mean']:.1f}"]
            for n, v in lat.items()])
        w += _table("pairs | served | b hit (95%) | predicted offline | prediction ≠ server | "
                    "hit answer ≠ b's own | answer cosine: hits / all pairs", [
                        [n, v["n"], f"{v['hits']} = {v['rate']:.3f} ({_ci(v['ci'])})",
                         v["predicted_hits"], v["prediction_disagrees"],
                         f"{v['hit_answer_differs']}/{v['hits']}",
                         ("–" if v["hit_answer_cosine"] is None else
                          f"{v['hit_answer_cosine']:.3f}") + f" / {v['answer_cosine_all']:.3f}"]
                        for n, v in s["kinds"].items()])
        w += ["", f"server audits: {a['agree']:.0f} agree, {a['disagree']:.0f} disagree; "
              f"misses whose text differed between the two models: {s['nondeterministic']}; "
              "sokuji_llm_generation_tokens_total (cached / plain): "
              + " / ".join(f"{v:.0f}" for v in s["generation_tokens"].values())]
    w += ["", f"MiniLM in-process, one text: p50 {res['embed']['p50_ms']:.2f} ms"]
    w += _table("entries | matrix MB | miss p50/p99 µs | hit p50/p99 µs | numpy p50 µs | "
                "miss ÷ numpy", [[r["entries"], f"{r['matrix_mb']:.1f}",
                                  f"{r['miss_p50_us']:.0f}/{r['miss_p99_us']:.0f}",
                                  f"{r['hit_p50_us']:.0f}/{r['hit_p99_us']:.0f}",
                                  f"{r['numpy_p50_us']:.0f}", f"{r['miss_of_numpy']:.2f}"]
                                 for r in res["store"]])
    return w


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    for (name, rows), style in zip(res["quality"]["curves"].items(), ("-", "--"), strict=True):
        t = [r["t"] for r in rows]
        for key, colour in (("hr", "tab:green"), ("fhr", "tab:red")):
            ax[0].plot(t, [r[key] for r in rows], style, color=colour,
                       label=f"{key.upper()} {name}")
            ax[0].fill_between(t, *zip(*(r[f"{key}_interval"] for r in rows), strict=True),
                               color=colour, alpha=0.12)
        for m, colour in zip(MIXES, ("tab:purple", "tab:orange"), strict=True):
            ax[1].plot(t, [r["wrong"][str(m)] if r["hits"] + r["false_hits"] else np.nan
                           for r in rows], style, color=colour, label=f"π={m:g} {name}")
    for c in res["quality"]["chosen"]:
        if c["guards"] and c["threshold"] is not None:
            ax[0].axvline(c["threshold"], color="grey", lw=0.8, ls=":")
    ax[0].set(xlabel="threshold t", ylabel="rate", title="HR / FHR (95% CI; dotted: chosen)")
    ax[1].set(xlabel="threshold t", ylabel="share of hits",
              title="wrong share of hits (none where no hits)")
    if res.get("serving"):
        lat = res["serving"]["latency_ms"]
        ax[2].bar(list(lat), [v["p50"] for v in lat.values()], capsize=3,
                  yerr=[[0] * len(lat), [v["p99"] - v["p50"] for v in lat.values()]],
                  color=["tab:blue", "tab:orange", "tab:blue", "tab:green"])
        ax[2].set(ylabel="ms (p50, bar to p99)", title="SmolLM2 chat, c=1")
        ax[2].tick_params(axis="x", labelsize=7)
    ax[0].legend(fontsize=7)
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def subset(pairs: list[cc.Pair], per_kind: int) -> list[int]:
    """Evenly spaced over each kind (the file is grouped by category: stratified)."""
    out = []
    for idx in ([i for i, p in enumerate(pairs) if p.same is same] for same in (True, False)):
        k = min(per_kind, len(idx)) if per_kind > 0 else len(idx)
        out += [idx[j * len(idx) // k] for j in range(k)]
    return sorted(out)


def main() -> int:
    from rich.console import Console
    from rich.progress import Progress

    from sokuji.retrieval.builtin import minilm_embedder

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="60 pairs of each kind served")
    p.add_argument("--pairs-per-kind", type=int,
                   help="pairs of each kind served (0: all; -1: none, quality and store only)")
    p.add_argument("--scope", choices=("pair", "shared"), default="pair")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--audit-rate", type=float, default=1.0)
    p.add_argument("--server-cores", default="1")
    p.add_argument("--client-core", type=int, default=0)
    p.add_argument("--cache-dir", default=os.environ.get(
        "SOKUJI_TEST_CACHE_DIR", str(ROOT / ".cache" / "sokuji")))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/semantic_cache.json")
    args = p.parse_args()
    if args.pairs_per_kind is None:
        args.pairs_per_kind = 60 if args.quick else 0
    os.sched_setaffinity(0, {args.client_core})
    console, began, pairs = Console(), time.monotonic(), cc.load_pairs()
    res: dict[str, Any] = {"benchmark": "semantic_cache", "command": " ".join(sys.argv),
                           "args": vars(args) | {"out": str(args.out)},
                           "machine_before": describe()}
    with Progress(console=console) as bar:
        task = bar.add_task("quality (MiniLM over the pairs), store lookups", total=2)
        embed = minilm_embedder(args.cache_dir, intra_op_threads=1)
        sims, passes = cc.embed_pairs(embed, pairs), cc.guard_passes(pairs)
        res["quality"] = quality(pairs, sims, passes)
        ms = [_us(embed, [x.b]) / 1e3 for x in pairs[:: max(1, len(pairs) // 60)]]
        res["embed"] = {"n": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}
        bar.advance(task)
        res["store"] = store_cost((1000, 10000), 300, 15)
        bar.advance(task)
        five = next(c for c in res["quality"]["chosen"] if c["guards"] and c["target"] == 0.05)
        if args.pairs_per_kind >= 0 and five["threshold"] is not None:
            idx = subset(pairs, args.pairs_per_kind)
            res["serving"] = serving(args, [pairs[i] for i in idx], sims[idx], passes[idx],
                                     five["threshold"], bar, embed)
    res["seconds"] = round(time.monotonic() - began, 1)
    res["machine_after"] = describe()
    res["markdown"] = "\n".join(markdown(res))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=float))
    args.out.with_suffix(".md").write_text(res["markdown"] + "\n")
    plot(res, args.out.with_suffix(".png"))
    for part in res["markdown"].split("\n\n"):  # the headline: thresholds, serving
        if part.startswith(("| target FHR", "served:", "| request", "| pairs")):
            console.print(part, markup=False, highlight=False, soft_wrap=True)
    console.print(f"{res['seconds']:.0f} s; JSON {args.out}, .md and .png beside it",
                  markup=False, highlight=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

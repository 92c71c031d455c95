"""Which ANN library for the dense half of retrieval: usearch, hnswlib, faiss-cpu side by side
in one run, each an HNSW graph with the same parameters (M=32, ef_construction=200,
ef_search=max(64, k)), inner product over unit vectors, one thread.

Per library and data set: build time, single-query latency p50/p99 at k=50, recall@10 against
exact search, index size on disk, import time (fresh interpreter), and a filter that admits
10% of the vectors applied before scoring where the library can (faiss: a bitmap id
selector in the search parameters; hnswlib: a Python predicate per visited node; usearch's
Python API has no predicate: marked unsupported), with its recall@10 against exact search
over the admitted vectors and its latency.

Data: the built-in index's real vectors (MiniLM, ~650 passages; queries: the shipped
questions) and a synthetic set (--n unit vectors in 384 dimensions from 200 Gaussian
clusters; queries: held-out vectors of the same mixture). Figures depend on the CPU (AVX-512
here), the machine's load and these parameters.

    flock /tmp/sokuji-bench.lock .venv/bin/python benchmarks/retrieval_ann.py [--n 20000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

M, EF_CONSTRUCTION, EF_SEARCH_MIN, K_LATENCY, K_RECALL = 32, 200, 64, 50, 10


class Lib:
    name = ""
    module = ""
    filter_support = ""

    def build(self, x: np.ndarray) -> None: ...
    def search(self, q: np.ndarray, k: int) -> np.ndarray: ...
    def save(self, path: Path) -> None: ...
    def filtered(self, q: np.ndarray, k: int, admitted: np.ndarray) -> np.ndarray | None:
        return None


class Faiss(Lib):
    name, module = "faiss-cpu", "faiss"
    filter_support = "IDSelectorBitmap in SearchParametersHNSW: native, checked while walking"

    def build(self, x: np.ndarray) -> None:
        import faiss

        faiss.omp_set_num_threads(1)
        self.index = faiss.IndexHNSWFlat(x.shape[1], M, faiss.METRIC_INNER_PRODUCT)
        self.index.hnsw.efConstruction = EF_CONSTRUCTION
        self.index.add(x)

    def _params(self, k: int, admitted: np.ndarray | None = None) -> Any:
        import faiss

        p = faiss.SearchParametersHNSW()
        p.efSearch = max(EF_SEARCH_MIN, k)
        if admitted is not None:
            self._bits = np.packbits(admitted, bitorder="little")
            p.sel = faiss.IDSelectorBitmap(len(admitted), faiss.swig_ptr(self._bits))
        return p

    def search(self, q: np.ndarray, k: int) -> np.ndarray:
        return self.index.search(q.reshape(1, -1), k, params=self._params(k))[1][0]

    def filtered(self, q: np.ndarray, k: int, admitted: np.ndarray) -> np.ndarray:
        ids = self.index.search(q.reshape(1, -1), k, params=self._params(k, admitted))[1][0]
        return ids[ids >= 0]

    def save(self, path: Path) -> None:
        import faiss

        faiss.write_index(self.index, str(path))


class Hnswlib(Lib):
    name, module = "hnswlib", "hnswlib"
    filter_support = "filter= Python callable per visited node (GIL, a call per candidate)"

    def build(self, x: np.ndarray) -> None:
        import hnswlib

        self.index = hnswlib.Index(space="ip", dim=x.shape[1])
        self.index.init_index(max_elements=len(x), ef_construction=EF_CONSTRUCTION, M=M)
        self.index.add_items(x, np.arange(len(x)), num_threads=1)

    def search(self, q: np.ndarray, k: int) -> np.ndarray:
        self.index.set_ef(max(EF_SEARCH_MIN, k))
        return self.index.knn_query(q, k=k, num_threads=1)[0][0]

    def filtered(self, q: np.ndarray, k: int, admitted: np.ndarray) -> np.ndarray:
        self.index.set_ef(max(EF_SEARCH_MIN, k))
        ok = admitted.tolist()
        try:
            return self.index.knn_query(q, k=k, num_threads=1,
                                        filter=lambda i: ok[i])[0][0]
        except RuntimeError:  # fewer than k found under the filter
            return np.empty(0, np.int64)

    def save(self, path: Path) -> None:
        self.index.save_index(str(path))


class Usearch(Lib):
    name, module = "usearch", "usearch.index"
    filter_support = "none in the Python API (C/C++ only): post-filtering or one index per value"

    def build(self, x: np.ndarray) -> None:
        from usearch.index import Index

        self.index = Index(ndim=x.shape[1], metric="ip", dtype="f32", connectivity=M,
                           expansion_add=EF_CONSTRUCTION, expansion_search=EF_SEARCH_MIN)
        self.index.add(np.arange(len(x)), x, threads=1)

    def search(self, q: np.ndarray, k: int) -> np.ndarray:
        self.index.expansion_search = max(EF_SEARCH_MIN, k)
        return self.index.search(q, k, threads=1).keys

    def save(self, path: Path) -> None:
        self.index.save(str(path))


def import_ms(module: str, repeat: int = 3) -> float:
    """Median wall time of ``import module`` in a fresh interpreter, less a bare one."""
    def run(code: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - t0
    bare = sorted(run("pass") for _ in range(repeat))[repeat // 2]
    full = sorted(run(f"import {module}") for _ in range(repeat))[repeat // 2]
    return round((full - bare) * 1e3, 1)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def exact_top(x: np.ndarray, q: np.ndarray, k: int, rows: np.ndarray | None = None) -> set[int]:
    rows = np.arange(len(x)) if rows is None else rows
    s = x[rows] @ q
    return set(rows[np.argsort(-s)[:k]].tolist())


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter_ns()
    out = fn()
    return out, (time.perf_counter_ns() - t0) / 1e6


def measure(lib: Lib, x: np.ndarray, queries: np.ndarray, seed: int) -> dict[str, Any]:
    _, build_ms = timed(lambda: lib.build(x))
    for q in queries[:10]:
        lib.search(q, K_LATENCY)  # warm
    lat = [timed(lambda q=q: lib.search(q, K_LATENCY))[1] for q in queries]
    recall = np.mean([len(set(np.asarray(lib.search(q, K_RECALL)).tolist())
                          & exact_top(x, q, K_RECALL)) / K_RECALL for q in queries])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "index"
        lib.save(path)
        size = path.stat().st_size
    admitted = np.random.default_rng(seed).random(len(x)) < 0.10
    rows = np.flatnonzero(admitted)
    out: dict[str, Any] = {
        "build_s": round(build_ms / 1e3, 3), "p50_ms_k50": round(pct(lat, 0.5), 4),
        "p99_ms_k50": round(pct(lat, 0.99), 4), "recall@10": round(float(recall), 4),
        "size_mb": round(size / 2**20, 2), "filter": lib.filter_support}
    if lib.filtered(queries[0], K_RECALL, admitted) is not None:
        flat = []
        frec = []
        for q in queries:
            ids, ms = timed(lambda q=q: lib.filtered(q, K_RECALL, admitted))
            flat.append(ms)
            ids = np.asarray(ids).tolist()
            assert all(admitted[i] for i in ids), f"{lib.name}: filter leaked"
            frec.append(len(set(ids) & exact_top(x, q, K_RECALL, rows)) / K_RECALL)
        out.update({"filtered10%_recall@10": round(float(np.mean(frec)), 4),
                    "filtered10%_p50_ms_k10": round(pct(flat, 0.5), 4),
                    "filtered10%_p99_ms_k10": round(pct(flat, 0.99), 4)})
    return out


def filtered_vs_exact(x: np.ndarray, queries: np.ndarray, seed: int) -> dict[str, Any]:
    """Where sokuji's DenseIndex switches from the graph (bitmap selector) to exact scoring
    of the admitted rows: both, by the share admitted and efSearch."""
    from sokuji.retrieval import dense as dm

    index = dm.DenseIndex.build(x)
    index.exact_below = 0
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    print("\nfaiss under a filter: graph + selector vs exact over the admitted rows (k=10)")
    for share in (0.5, 0.1, 0.02):
        admitted = rng.random(len(x)) < share
        rows = np.flatnonzero(admitted)
        exact_ms = [timed(lambda q=q, a=admitted: index.exact(q, K_RECALL, a))[1]
                    for q in queries]
        for ef in (64, 256):
            dm.EF_SEARCH_MIN = ef
            lat, rec = [], []
            for q in queries:
                (ids, _), ms = timed(lambda q=q, a=admitted: index.search(q, K_RECALL, a))
                lat.append(ms)
                rec.append(len(set(ids.tolist()) & exact_top(x, q, K_RECALL, rows)) / K_RECALL)
            key = f"admit {share:.0%} ({len(rows)}) ef={ef}"
            out[key] = {"graph_recall@10": round(float(np.mean(rec)), 4),
                        "graph_p50_ms": round(pct(lat, 0.5), 4),
                        "exact_p50_ms": round(pct(exact_ms, 0.5), 4)}
            print(f"  {key:<26} graph recall@10 {np.mean(rec):.3f} p50 {pct(lat, 0.5):.3f} ms;"
                  f" exact p50 {pct(exact_ms, 0.5):.3f} ms")
    dm.EF_SEARCH_MIN = 64
    return out


def synthetic(n: int, n_queries: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(200, dim)).astype(np.float32)
    which = rng.integers(0, 200, n + n_queries)
    x = centres[which] + 0.6 * rng.normal(size=(n + n_queries, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x[:n]), np.ascontiguousarray(x[n:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="synthetic vectors")
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--cache-dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/retrieval_ann.json"))
    args = ap.parse_args()
    from sokuji import config as cfg
    from sokuji.retrieval.builtin import ensure_builtin_index, minilm_embedder
    from sokuji.retrieval.index import HybridIndex
    from sokuji.retrieval.questions import load_questions

    cache_dir = cfg.load(overrides={"cache_dir": args.cache_dir}).cache_dir
    embed = minilm_embedder(cache_dir)
    idx = HybridIndex.load(ensure_builtin_index(cache_dir, embed))
    real_q = embed([q.text for q in load_questions(idx.passages)])
    real_q /= np.linalg.norm(real_q, axis=1, keepdims=True)
    sets = {f"pydoc ({len(idx)} x 384, MiniLM)": (idx._dense.vectors, real_q),
            f"synthetic ({args.n} x 384)": synthetic(args.n, args.queries, 384, args.seed)}
    libs: list[type[Lib]] = [Faiss, Hnswlib, Usearch]
    result: dict[str, Any] = {"import_ms": {c.name: import_ms(c.module) for c in libs},
                              "params": {"M": M, "ef_construction": EF_CONSTRUCTION,
                                         "ef_search": f"max({EF_SEARCH_MIN}, k)"}}
    print("import time (fresh interpreter):",
          ", ".join(f"{k} {v:.0f} ms" for k, v in result["import_ms"].items()))
    for label, (x, queries) in sets.items():
        rows = {c.name: measure(c(), x, queries, args.seed) for c in libs}
        result[label] = rows
        print(f"\n{label}, {len(queries)} queries")
        print(f"{'library':<11}{'build s':>9}{'p50 ms':>9}{'p99 ms':>9}{'R@10':>7}{'MB':>7}"
              f"{'filt R@10':>11}{'filt p50':>10}{'filt p99':>10}")
        for name, r in rows.items():
            f = (f"{r['filtered10%_recall@10']:>11.3f}{r['filtered10%_p50_ms_k10']:>10.3f}"
                 f"{r['filtered10%_p99_ms_k10']:>10.3f}") if "filtered10%_recall@10" in r \
                else f"{'unsupported':>11}"
            print(f"{name:<11}{r['build_s']:>9.2f}{r['p50_ms_k50']:>9.3f}{r['p99_ms_k50']:>9.3f}"
                  f"{r['recall@10']:>7.3f}{r['size_mb']:>7.1f}{f}")
        base = rows["faiss-cpu"]["p50_ms_k50"]
        print("p50 vs faiss-cpu: " + ", ".join(
            f"{n} {r['p50_ms_k50'] / base:.2f}x" for n, r in rows.items()))
    for c in libs:
        print(f"filter, {c.name}: {c.filter_support}")
    result["faiss_filtered_vs_exact"] = filtered_vs_exact(*sets[f"synthetic ({args.n} x 384)"],
                                                          args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Online feature lookups through Feast, side by side with reading the same row straight from
the online store, in one run.

    .venv/bin/python benchmarks/feature_lookup.py [--quick] [--redis-url redis://127.0.0.1:6399/13]

Per online store (SQLite, and Redis when a URL is given or SOKUJI_TEST_REDIS_URL is set: its
db 13 is used) and per path, the latency of looking up one user's 5 features, p50/p99:
- ``get``: ``OnlineFeatures.get`` as the pipeline step calls it (the default read path):
  name validation, then Feast's online store ``online_read`` through its provider (Feast's
  entity key encoding, the store read, values converted by Feast's type map);
- ``get_public``: the same with ``read_path="get_online_features"``: Feast's public
  ``FeatureStore.get_online_features(...).to_dict()``, response assembly included;
- ``direct``: the same row read straight from the store with a precomputed key, bytes not
  decoded (sqlite3 ``SELECT`` / Redis ``HGETALL``): the floor.
The paths alternate call by call over the same user sequence, so machine noise hits all alike;
ratios to ``direct`` are Feast's own cost. Also: ``get``'s rate from 1 and 4 threads at once
for both (a thread pool's scaling), Feast's import time (fresh interpreter),
``import sokuji.features.store`` (must not import Feast), the first set-up of a new store and
a second open of the same store. The figures depend on the CPU (pure Python: one core) and,
for Redis, on the loopback round trip. Writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sokuji.features import rag_repo  # noqa: E402
from sokuji.features.store import OnlineFeatures  # noqa: E402
from sokuji.features.store_config import FeatureStoreConfig  # noqa: E402


def percentile(sorted_us: list[float], q: float) -> float:
    return sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))]


def import_seconds(code: str) -> float:
    """Seconds ``code`` (an import) takes in a fresh interpreter, measured inside it."""
    out = subprocess.run(
        [sys.executable, "-c", f"import time; t = time.perf_counter(); {code}; "
         "print(time.perf_counter() - t)"], capture_output=True, text=True, check=True,
        cwd=ROOT, timeout=120)
    return float(out.stdout.strip().splitlines()[-1])


def paths(store: OnlineFeatures, public: OnlineFeatures,
          redis_url: str | None) -> dict[str, Callable[[str], Any]]:
    from feast.infra.key_encoding_utils import serialize_entity_key
    from feast.protos.feast.types.EntityKey_pb2 import EntityKey
    from feast.protos.feast.types.Value_pb2 import Value

    cfg = store._cfg  # the benchmark reads the store's own table / keys on purpose
    names = list(rag_repo.FEATURES)
    keys = {uid: serialize_entity_key(
                EntityKey(join_keys=[rag_repo.JOIN_KEY], entity_values=[Value(string_val=uid)]),
                entity_key_serialization_version=3)
            for uid in (str(u[rag_repo.JOIN_KEY])
                        for u in rag_repo.generate_users(cfg.num_users, cfg.seed))}
    direct: Callable[[str], Any]
    if redis_url is None:
        db = sqlite3.connect(str(cfg.path / "online.db"), check_same_thread=False)
        query = (f"SELECT feature_name, value FROM {cfg.project}_{rag_repo.VIEW} "
                 "WHERE entity_key = ?")

        def direct(uid: str) -> Any:
            return db.execute(query, (keys[uid],)).fetchall()
    else:
        import redis

        client = redis.Redis.from_url(redis_url)
        suffix = cfg.project.encode()

        def direct(uid: str) -> Any:
            return client.hgetall(keys[uid] + suffix)

    return {"get": lambda uid: store.get("user", uid, names),
            "get_public": lambda uid: public.get("user", uid, names), "direct": direct}


def measure(store: OnlineFeatures, public: OnlineFeatures, redis_url: str | None,
            calls: int) -> dict[str, Any]:
    contestants = paths(store, public, redis_url)
    uids = [rag_repo.user_id(i % store._cfg.num_users) for i in range(calls)]
    for f in contestants.values():  # warm: connections, caches, first-call imports
        for uid in uids[:200]:
            assert f(uid)
    samples: dict[str, list[float]] = {name: [] for name in contestants}
    order = list(contestants.items())
    for i, uid in enumerate(uids):
        for name, f in (order if i % 2 == 0 else order[::-1]):
            t0 = time.perf_counter_ns()
            f(uid)
            samples[name].append((time.perf_counter_ns() - t0) / 1e3)
    out: dict[str, Any] = {}
    for name, values in samples.items():
        values.sort()
        out[name] = {"p50_us": percentile(values, 0.5), "p99_us": percentile(values, 0.99)}
    for name in ("get", "get_public"):
        for q in ("p50", "p99"):
            out[name][f"{q}_vs_direct"] = out[name][f"{q}_us"] / out["direct"][f"{q}_us"]
    return out


def threaded_rate(store: OnlineFeatures, threads: int, calls: int) -> float:
    """Lookups per second through ``get`` from ``threads`` threads at once (``calls`` in all):
    how a thread pool of that size scales (Feast's path is Python, held by the GIL)."""
    import threading

    names = list(rag_repo.FEATURES)
    per = calls // threads
    barrier = threading.Barrier(threads + 1)

    def run(k: int) -> None:
        barrier.wait()
        for i in range(per):
            store.get("user", rag_repo.user_id((k * 97 + i) % store._cfg.num_users), names)

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    return per * threads / (time.perf_counter() - t0)


def open_twice(cfg: FeatureStoreConfig) -> tuple[OnlineFeatures, dict[str, float]]:
    first = OnlineFeatures.open(cfg)
    first.close()
    second = OnlineFeatures.open(cfg)
    assert first.setup.materialized and not second.setup.materialized
    return second, {"first_setup_s": first.setup.setup_s,
                    "first_setup_import_s": first.setup.import_s,
                    "second_open_s": second.setup.setup_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="500 calls instead of 5000")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--redis-url", default=None,
                        help="Redis online store (default: SOKUJI_TEST_REDIS_URL with db 13)")
    parser.add_argument("--out", help="default: benchmarks/results/feature_lookup-<time>.json")
    args = parser.parse_args()
    calls = 500 if args.quick else args.calls
    redis_url = args.redis_url
    if redis_url is None and os.environ.get("SOKUJI_TEST_REDIS_URL"):
        redis_url = urlunsplit(urlsplit(os.environ["SOKUJI_TEST_REDIS_URL"])._replace(
            path="/13"))

    result: dict[str, Any] = {
        "calls": calls, "python": sys.version.split()[0],
        "import_feast_s": import_seconds("import feast"),
        "import_sokuji_features_store_s": import_seconds("import sokuji.features.store"),
        "stores": {}}
    with tempfile.TemporaryDirectory(prefix="sokuji-features-") as tmp:
        backends: list[tuple[str, str | None]] = [("sqlite", None)]
        if redis_url:
            import redis

            client = redis.Redis.from_url(redis_url)  # a fresh store: the first set-up
            stale = [k for k in client.scan_iter() if k.endswith(b"sokuji_bench")]
            if stale:
                client.delete(*stale)
            backends.append(("redis", redis_url))
        for name, url in backends:
            cfg = FeatureStoreConfig(path=Path(tmp) / name, redis_url=url,
                                     project="sokuji_bench")
            store, setup = open_twice(cfg)
            public = OnlineFeatures.open(replace(cfg, read_path="get_online_features"))
            try:
                rates = {f"{label}_per_s_{n}_threads": threaded_rate(s, n, calls)
                         for label, s in (("get", store), ("get_public", public))
                         for n in (1, 4)}
                result["stores"][name] = {**setup, **measure(store, public, url, calls),
                                          **rates}
            finally:
                store.close()
                public.close()

    print(f"import feast {result['import_feast_s']:.2f} s (fresh interpreter); "
          f"import sokuji.features.store {result['import_sokuji_features_store_s']:.3f} s")
    print(f"{'store':8s}{'path':13s}{'p50 us':>9s}{'p99 us':>9s}{'p50 x':>8s}{'p99 x':>8s}"
          "   (x: ratio to direct)")
    for name, r in result["stores"].items():
        for path in ("get", "get_public", "direct"):
            p = r[path]
            ratio = (f"{p['p50_vs_direct']:8.2f}{p['p99_vs_direct']:8.2f}"
                     if path != "direct" else "")
            print(f"{name:8s}{path:13s}{p['p50_us']:9.1f}{p['p99_us']:9.1f}{ratio}")
        for label in ("get", "get_public"):
            print(f"{name:8s}{label} from 1 / 4 threads: {r[f'{label}_per_s_1_threads']:.0f}"
                  f" / {r[f'{label}_per_s_4_threads']:.0f} lookups/s")
        print(f"{name:8s}first set-up {r['first_setup_s']:.2f} s (Feast import "
              f"{r['first_setup_import_s']:.2f} s); second open {r['second_open_s'] * 1e3:.1f} ms")
    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = (Path(args.out) if args.out else
           out_dir / f"feature_lookup-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

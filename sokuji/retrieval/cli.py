"""``sokuji index build [--cache-dir DIR] [--out DIR]`` and ``sokuji index info [DIR]``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sokuji index",
                                description="the built-in retrieval index (pydoc topics)")
    sub = p.add_subparsers(dest="action", required=True)
    build = sub.add_parser("build", help="build the built-in index (replaces it)")
    build.add_argument("--cache-dir", dest="cache_dir")
    build.add_argument("--out", help="directory (default: <cache_dir>/indexes/pydoc)")
    info = sub.add_parser("info", help="print an index's manifest")
    info.add_argument("path", nargs="?", help="directory (default: the built-in index)")
    info.add_argument("--cache-dir", dest="cache_dir")
    return p


def main(argv: Sequence[str]) -> int:
    from sokuji import config as cfg
    from sokuji.errors import ConfigError

    args = _parser().parse_args(list(argv))
    try:
        cache_dir = cfg.load(overrides={"cache_dir": args.cache_dir}).cache_dir
        from pathlib import Path

        from sokuji.retrieval.builtin import builtin_index_dir, minilm_embedder

        if args.action == "build":
            from sokuji.retrieval.corpus import pydoc_passages, pydoc_stopwords
            from sokuji.retrieval.index import build_index

            out = Path(args.out) if args.out else builtin_index_dir(cache_dir)
            passages = pydoc_passages()
            t0 = time.perf_counter()
            embed = minilm_embedder(cache_dir)

            def progress(done: int, total: int) -> None:
                print(f"\rembedding {done}/{total}", end="", file=sys.stderr, flush=True)

            build_index(passages, embed, out, progress, stopwords=pydoc_stopwords())
            print(f"\n{out}: {len(passages)} passages in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr)
            print(out)
            return 0
        from sokuji.retrieval.index import HybridIndex

        path = Path(args.path) if args.path else builtin_index_dir(cache_dir)
        idx = HybridIndex.load(path)
        print(json.dumps(idx.manifest, indent=2))
        return 0
    except ConfigError as exc:
        print(f"sokuji: {exc.message}", file=sys.stderr)
        return 2

"""The built-in index (the pydoc corpus) and an in-process MiniLM embedder for building it
outside the server (``sokuji index build``, benchmarks, tests). The server passes its own
``embed`` backed by the served encoder instead."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from sokuji.errors import ConfigError
from sokuji.retrieval.corpus import corpus_checksum, pydoc_passages, pydoc_stopwords
from sokuji.retrieval.index import DEFAULT_ENCODER, build_index, read_manifest

log = logging.getLogger(__name__)

Embed = Callable[[list[str]], np.ndarray]


def builtin_index_dir(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / "indexes" / "pydoc"


def minilm_embedder(cache_dir: str | Path, intra_op_threads: int = 0) -> Embed:
    """``embed(texts) -> float32 [n, 384]`` with the built-in MiniLM on ONNX Runtime (the
    ONNX export is made once in ``cache_dir`` if missing). A call's texts are batched as a
    served MiniLM with the default batch budgets batches them (``embed_corpus``), so an
    index built here has the vectors the server's own build gives it."""
    from sokuji.runtimes.corpus_embedding import embed_corpus
    from sokuji.runtimes.onnx import OnnxEncoderRuntime
    from sokuji.weights import minilm

    runtime = OnnxEncoderRuntime(minilm.ensure_onnx(cache_dir), minilm.tokenizer_path(),
                                 intra_op_threads=intra_op_threads,
                                 max_sequence_length=minilm.max_sequence_length())
    runtime.load()

    def embed(texts: list[str]) -> np.ndarray:
        return embed_corpus(runtime, texts)

    return embed


def ensure_builtin_index(cache_dir: str | Path, embed: Embed,
                         progress: Callable[[int, int], None] | None = None, *,
                         encoder: str = DEFAULT_ENCODER) -> Path:
    """``<cache_dir>/indexes/pydoc``, built now if needed (see ``ensure_pydoc_index``)."""
    return ensure_pydoc_index(builtin_index_dir(cache_dir), embed, progress, encoder=encoder)


def ensure_pydoc_index(out_dir: str | Path, embed: Embed,
                       progress: Callable[[int, int], None] | None = None, *,
                       encoder: str = DEFAULT_ENCODER) -> Path:
    """The built-in corpus' index at ``out_dir``, built now if missing, unreadable, or built
    from another corpus (another Python's topics) or encoder. Cheap when it is current (reads
    the manifest and chunks the corpus: ~0.1 s)."""
    out = Path(out_dir)
    passages = pydoc_passages()
    try:
        m = read_manifest(out)
        if (m["corpus_sha256"] == corpus_checksum(passages) and m["encoder"] == encoder
                and m.get("bm25", {}).get("stopwords") == pydoc_stopwords()):
            return out
        log.info("retrieval index %s is stale (corpus, encoder or stopwords changed): "
                 "rebuilding", out)
    except ConfigError:
        log.info("building the retrieval index %s (%d passages; once)", out, len(passages))
    return build_index(passages, embed, out, progress, encoder=encoder,
                       stopwords=pydoc_stopwords())

"""The hybrid index: BM25 + dense ANN over one passage list, fused by RRF, filtered before
scoring, optionally re-ranked by exact cosine; one directory on disk.

Directory (``build_index`` writes it atomically: a sibling temp dir, then a rename)::

    manifest.json     format, encoder, dim, count, corpus_sha256, file checksums, versions
    passages.jsonl    {"id", "text", "metadata"} per line, in passage-number order
    vectors.npy       float32 [count, dim], unit rows (exact search and re-ranking)
    dense.faiss       the HNSW graph
    bm25/             bm25s' own save format

``HybridIndex.load`` checks all of it (files present, checksums, counts, dimension, the
encoder when the caller names one) and refuses with a ``ConfigError`` that says what is wrong
and how to rebuild. ``search`` is synchronous, CPU-bound and thread-safe (read-only).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sokuji.errors import ConfigError
from sokuji.retrieval import query as q
from sokuji.retrieval.bm25 import Bm25, english_stopwords
from sokuji.retrieval.corpus import Passage, corpus_checksum
from sokuji.retrieval.dense import DenseIndex
from sokuji.retrieval.fusion import RRF_K

FORMAT = "sokuji.retrieval/1"
DEFAULT_ENCODER = "all-MiniLM-L6-v2"
FILES = ("passages.jsonl", "vectors.npy", "dense.faiss")
EMBED_BATCH = 32


@dataclass(frozen=True)
class Hit:
    id: str
    text: str
    score: float
    """bm25: BM25 score; dense and rerank: cosine; hybrid: the RRF score."""
    metadata: dict[str, str]
    ranks: dict[str, int]
    """1-based rank per method that returned the passage (``bm25``, ``dense``)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("bm25s", "PyStemmer", "faiss-cpu", "numpy")}


def build_index(passages: list[Passage], embed: Callable[[list[str]], np.ndarray],
                out_dir: Path, progress: Callable[[int, int], None] | None = None, *,
                encoder: str = DEFAULT_ENCODER, stopwords: list[str] | None = None) -> Path:
    """Embed (batches of ``EMBED_BATCH``, ``progress(done, total)`` after each), index and
    write ``out_dir``, replacing what was there. ``embed`` returns float32 ``[n, dim]``;
    rows are L2-normalised here. ``stopwords``: BM25's (default: bm25s' English list)."""
    stopwords = english_stopwords() if stopwords is None else sorted(stopwords)
    if not passages:
        raise ValueError("no passages to index")
    ids = [p.id for p in passages]
    if len(set(ids)) != len(ids):
        raise ValueError("passage ids must be unique")
    texts = [p.text for p in passages]
    chunks = []
    for start in range(0, len(texts), EMBED_BATCH):
        chunks.append(np.asarray(embed(texts[start:start + EMBED_BATCH]), dtype=np.float32))
        if progress is not None:
            progress(min(start + EMBED_BATCH, len(texts)), len(texts))
    vectors = np.vstack(chunks)
    if vectors.ndim != 2 or len(vectors) != len(texts):
        raise ValueError(f"embed returned {vectors.shape} for {len(texts)} texts")
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with (tmp / "passages.jsonl").open("w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps({"id": p.id, "text": p.text, "metadata": p.metadata},
                               ensure_ascii=False) + "\n")
    np.save(tmp / "vectors.npy", vectors)
    DenseIndex.build(vectors).save(tmp / "dense.faiss")
    Bm25.build(texts, stopwords).save(tmp / "bm25")
    manifest = {
        "format": FORMAT, "encoder": encoder, "dim": int(vectors.shape[1]),
        "count": len(passages), "corpus_sha256": corpus_checksum(passages),
        "metadata_keys": sorted({k for p in passages for k in p.metadata}),
        "bm25": {"stopwords": stopwords, "stemmer": "english"},
        "files": {name: _sha256(tmp / name) for name in FILES},
        "versions": _versions(),
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    old = out_dir.with_name(f".{out_dir.name}.old{os.getpid()}")
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise _unusable(directory, "no manifest.json: not built") from None
    except (OSError, ValueError) as exc:
        raise _unusable(directory, f"manifest.json is unreadable ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _unusable(directory, f"manifest format is not {FORMAT}")
    return manifest


def _unusable(directory: Path, reason: str) -> ConfigError:
    return ConfigError.for_key("retrieval.index", str(directory),
                               f"{reason}; (re)build it with `sokuji index build`")


class HybridIndex:
    def __init__(self, passages: list[Passage], bm25: Bm25, dense: DenseIndex,
                 manifest: dict) -> None:
        self.passages = passages
        self.manifest = manifest
        self._bm25 = bm25
        self._dense = dense
        self.metadata_keys: tuple[str, ...] = tuple(manifest["metadata_keys"])
        self._columns = {key: np.array([p.metadata.get(key, "") for p in passages],
                                       dtype=object) for key in self.metadata_keys}

    @property
    def encoder_dim(self) -> int:
        return self._dense.dim

    @property
    def encoder(self) -> str:
        return str(self.manifest["encoder"])

    def __len__(self) -> int:
        return len(self.passages)

    @classmethod
    def load(cls, directory: Path, *, encoder: str | None = None,
             dim: int | None = None) -> HybridIndex:
        """Load and verify; ``encoder`` / ``dim``: what the caller will embed queries with
        (refused if the index was built with another)."""
        directory = Path(directory)
        m = read_manifest(directory)
        if encoder is not None and m.get("encoder") != encoder:
            raise _unusable(directory, f"built with encoder {m.get('encoder')!r}, "
                                       f"not {encoder!r}")
        if dim is not None and m.get("dim") != dim:
            raise _unusable(directory, f"vectors have {m.get('dim')} dimensions, the "
                                       f"encoder {dim}")
        files = m.get("files", {})
        for name in [*files, "bm25"]:
            if not (directory / name).exists():
                raise _unusable(directory, f"{name} is missing")
        for name, digest in files.items():
            if _sha256(directory / name) != digest:
                raise _unusable(directory, f"{name} does not match its checksum (corrupt)")
        try:
            passages = [Passage(r["id"], r["text"], r["metadata"]) for r in
                        map(json.loads, (directory / "passages.jsonl").open(encoding="utf-8"))]
            vectors = np.load(directory / "vectors.npy")
            dense = DenseIndex.load(directory / "dense.faiss", vectors)
            bm25 = Bm25.load(directory / "bm25", len(passages), list(m["bm25"]["stopwords"]))
        except Exception as exc:  # any library's failure to read: the index is unusable
            raise _unusable(directory, f"cannot be read ({type(exc).__name__}: {exc})") \
                from exc
        if (len(passages) != m["count"] or vectors.shape != (m["count"], m["dim"])
                or corpus_checksum(passages) != m["corpus_sha256"]):
            raise _unusable(directory, "its files do not agree with the manifest")
        return cls(passages, bm25, dense, m)

    def search(self, query: str, vector: np.ndarray | None, k: int = 5, mode: str = "hybrid",
               filters: Mapping[str, str | list[str]] | None = None, candidates: int = 50,
               rerank: bool = False, rrf_k: int = RRF_K) -> list[Hit]:
        """The best ``k`` passages among those ``filters`` admit. bm25 / dense: that method's
        top ``k``; hybrid: RRF of each method's top ``candidates``; ``rerank``: the fused
        (or single-method) top ``candidates`` re-ordered by exact cosine with ``vector``.
        Bad input raises ``InvalidInput`` naming the field."""
        plan = q.plan(query, vector, k=k, mode=mode, filters=filters, candidates=candidates,
                      rerank=rerank, rrf_k=rrf_k, dim=self.encoder_dim,
                      metadata_keys=self.metadata_keys, columns=self._columns)
        found = q.execute(plan, self._bm25, self._dense)
        return [Hit(self.passages[doc].id, self.passages[doc].text, score,
                    dict(self.passages[doc].metadata), ranks) for doc, score, ranks in found]

    def texts(self, ids: Sequence[str]) -> list[str]:
        by_id = {p.id: p.text for p in self.passages}
        return [by_id[i] for i in ids]

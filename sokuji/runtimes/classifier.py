"""Nearest-centroid text classification over an encoder (``runtime = "classifier"``).

The labelled prototypes (a JSONL of ``{"text": ..., "label": ...}``) are embedded once at
load. A query's score for a label is its cosine to the label's centroid (``scheme =
"centroid"``: the mean of the label's unit prototype vectors, renormalised) or its highest
cosine to one of the label's prototypes (``"nn"``). The prediction is the best label and the
**margin** (top-1 minus top-2 score) its confidence, which a cascade router compares with a
threshold to decide whether a larger model should answer instead (``predict``, ``margin``).

Options (``[models.options]``: ``ClassifierOptions``, checked when the config loads,
``ConfigError`` naming the key):
  encoder          minilm (built in) | mpnet (all-mpnet-base-v2, ``weights/mpnet.py``) | the
                   path of an ONNX encoder (then ``tokenizer`` is required)
  tokenizer        tokenizer.json of an ONNX encoder given by path (default: the model's
                   ``tokenizer``)
  prototypes       a JSONL file, or ``builtin:intents`` (``sokuji/routing/data/``; default)
  scheme           centroid (default) | nn
  intra_op_threads ONNX Runtime's threads (default: the model's ``intra_op_threads``)

Tokenising and embedding are ``OnnxEncoderRuntime``'s, unchanged, so a text's embedding here
equals the encoder's served one. Output: FP32 ``[n, C]``, one score per label, labels in
sorted order (``labels``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

import numpy as np

from sokuji.config import ModelConfig, ServerConfig
from sokuji.config_types import NonEmpty, _Table, _why
from sokuji.errors import ConfigError
from sokuji.runtimes.base import ModelMetadata, Prepared, TensorSpec
from sokuji.runtimes.corpus_embedding import embed_corpus
from sokuji.runtimes.onnx import INPUT_NAME, OnnxEncoderRuntime

OUTPUT_NAME = "scores"
ENCODERS = ("minilm", "mpnet")
BUILTIN_PROTOTYPES = {
    "intents": Path(__file__).resolve().parent.parent / "routing" / "data"
    / "intents_prototypes.jsonl",
}


def margin(scores: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 score of each row of ``[n, C]`` scores (C >= 2): ``[n]``."""
    rows = np.atleast_2d(np.asarray(scores))
    if rows.shape[1] < 2:
        raise ValueError(f"a margin needs at least two classes, got {rows.shape[1]}")
    top = np.partition(rows, rows.shape[1] - 2, axis=1)[:, -2:]
    return (top[:, 1] - top[:, 0]).astype(np.float32)


def predict(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the best label's index ``[n]``, its margin ``[n]``) for ``[n, C]`` scores."""
    rows = np.atleast_2d(np.asarray(scores))
    return rows.argmax(axis=1), margin(rows)


class ClassifierOptions(_Table, frozen=True):
    """Checked when the config loads (``kinds/classifier``: the schema, then the files)."""

    encoder: NonEmpty = "minilm"
    tokenizer: NonEmpty | None = None
    """Default: the model's ``tokenizer`` (its kind fills it in)."""
    prototypes: NonEmpty = "builtin:intents"
    scheme: Literal["centroid", "nn"] = "centroid"
    intra_op_threads: Annotated[int, _why("must be zero (auto) or more", ge=0)] = 0
    """Default: the model's ``intra_op_threads`` (its kind fills it in)."""


def prototypes_path(source: str) -> Path | None:
    """The file ``prototypes`` names (a path, or ``builtin:<name>``); None: no such
    built-in set."""
    if source.startswith("builtin:"):
        return BUILTIN_PROTOTYPES.get(source.removeprefix("builtin:"))
    return Path(source)


def load_prototypes(path: Path, key: str) -> tuple[list[str], list[str]]:
    """(texts, labels) of a JSONL file of ``{"text", "label"}`` lines (other keys ignored;
    blank lines skipped), with at least two labels (a margin compares two)."""
    texts: list[str] = []
    labels: list[str] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError.for_key(key, str(path), f"cannot read: {exc}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ConfigError.for_key(key, str(path), f"line {number} is not JSON: {exc}") \
                from None
        if not isinstance(row, dict) or not all(
                isinstance(row.get(k), str) and row[k].strip() for k in ("text", "label")):
            raise ConfigError.for_key(key, str(path), f"line {number} needs a non-empty "
                                      "\"text\" and \"label\" (strings)")
        texts.append(row["text"])
        labels.append(row["label"])
    if len(set(labels)) < 2:
        raise ConfigError.for_key(key, str(path), f"needs at least two labels (a margin "
                                  f"compares the best two), found {len(set(labels))}")
    return texts, labels


class ClassifierRuntime:
    def __init__(self, model: ModelConfig, options: ClassifierOptions,
                 server: ServerConfig) -> None:
        """``options``: as its kind checked them when the config loaded."""
        self.name = model.name
        names = [m.name for m in server.models]
        # Errors name the key as the config's own checks do (models[3].options.encoder).
        self.at = (f"models[{names.index(model.name)}].options" if model.name in names
                   else f"models['{model.name}'].options")
        self.options = options
        path = prototypes_path(options.prototypes)
        assert path is not None  # its kind checked the built-in set's name
        self.prototypes = path
        self._texts, self._raw_labels = load_prototypes(path, f"{self.at}.prototypes")
        self.labels: tuple[str, ...] = tuple(sorted(set(self._raw_labels)))
        self._model = model
        self._cache_dir = server.cache_dir
        self.encoder: OnnxEncoderRuntime | None = None
        self.dim = -1
        """The encoder's embedding width; set by ``load``."""
        self._matrix = np.zeros((0, 0), np.float32)
        """Centroids ``[C, d]`` (centroid) or prototypes sorted by label ``[P, d]`` (nn)."""
        self._starts = np.zeros(0, np.intp)
        """nn: the first column of each label in ``_matrix``'s rows."""

    def _build_encoder(self) -> OnnxEncoderRuntime:
        o, limit = self.options, self._model.max_sequence_length
        if o.encoder == "minilm":
            from sokuji.weights import minilm

            return OnnxEncoderRuntime(
                minilm.ensure_onnx(self._cache_dir), minilm.tokenizer_path(),
                intra_op_threads=o.intra_op_threads,
                max_sequence_length=min(limit, minilm.max_sequence_length()))
        if o.encoder == "mpnet":
            from sokuji.weights import mpnet

            if not mpnet.is_installed():
                raise ConfigError.for_key(f"{self.at}.encoder", o.encoder,
                                          f"the model's parts are not installed: "
                                          f"{mpnet.INSTALL_HINT}")
            return OnnxEncoderRuntime(
                mpnet.ensure_onnx(self._cache_dir), mpnet.tokenizer_path(self._cache_dir),
                intra_op_threads=o.intra_op_threads,
                max_sequence_length=min(limit, mpnet.max_sequence_length(self._cache_dir)))
        assert o.tokenizer is not None  # its kind requires it for a path
        return OnnxEncoderRuntime(o.encoder, o.tokenizer, intra_op_threads=o.intra_op_threads,
                                  max_sequence_length=limit)

    def load(self) -> None:
        encoder = self._build_encoder()
        encoder.load()
        self.encoder = encoder
        self.dim = encoder.describe().outputs[0].shape[-1]
        if self.dim < 0:  # a graph without a static width: ask it
            self.dim = encoder.run_batch([encoder.preprocess(["x"])])[0].shape[1]
        vectors = self.embed(self._texts)
        index = {label: i for i, label in enumerate(self.labels)}
        ids = np.asarray([index[label] for label in self._raw_labels])
        if self.options.scheme == "centroid":
            sums = np.zeros((len(self.labels), vectors.shape[1]), np.float64)
            np.add.at(sums, ids, vectors)
            self._matrix = _unit(sums.astype(np.float32))
        else:
            order = np.argsort(ids, kind="stable")
            self._matrix = np.ascontiguousarray(vectors[order])
            self._starts = np.searchsorted(ids[order], np.arange(len(self.labels)))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit embeddings ``[n, d]`` of any number of texts, batched as this model's batcher
        batches (``embed_corpus`` with its ``max_batch_size`` and ``max_batch_tokens``): for
        the prototypes, calibration and benchmarks."""
        assert self.encoder is not None, "load() first"
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        return _unit(embed_corpus(self.encoder, texts,
                                  max_batch_size=self._model.max_batch_size,
                                  max_batch_tokens=self._model.max_batch_tokens))

    def classify(self, texts: Sequence[str]) -> np.ndarray:
        """Scores ``[n, C]`` of any number of texts, outside the server (calibration)."""
        return self.score(self.embed(texts))

    def score(self, vectors: np.ndarray) -> np.ndarray:
        """Scores ``[n, C]`` of unit embeddings ``[n, d]``."""
        sims = vectors @ self._matrix.T
        if self.options.scheme == "nn":
            sims = np.maximum.reduceat(sims, self._starts, axis=1) if len(sims) else \
                np.zeros((0, len(self.labels)), np.float32)
        return np.ascontiguousarray(sims, dtype=np.float32)

    def warmup(self) -> None:
        assert self.encoder is not None, "load() first"
        self.encoder.warmup()
        self.run_batch([self.preprocess(["warm up the classifier"] * 2)])

    def describe(self) -> ModelMetadata:
        return ModelMetadata(
            platform="sokuji_classifier",
            inputs=(TensorSpec(INPUT_NAME, "BYTES", (-1,)),),
            outputs=(TensorSpec(OUTPUT_NAME, "FP32", (-1, len(self.labels))),),
        )

    def preprocess(self, texts: Sequence[str]) -> Prepared:
        assert self.encoder is not None, "load() first"
        return self.encoder.preprocess(texts)

    def run_batch(self, batch: Sequence[Prepared]) -> list[np.ndarray]:
        """One encoder batch for every request, scored in one product, split per request."""
        assert self.encoder is not None, "load() first"
        rows = self.encoder.run_batch(batch)
        scores = self.score(_unit(np.concatenate(rows) if len(rows) > 1 else rows[0]))
        results, start = [], 0
        for p in batch:
            results.append(scores[start:start + p.num_items])
            start += p.num_items
        return results

    def close(self) -> None:
        if self.encoder is not None:
            self.encoder.close()


def _unit(rows: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (float32); an all-zero row stays zero."""
    rows = np.asarray(rows, dtype=np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.maximum(norms, np.float32(1e-12))

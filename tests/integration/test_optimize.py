"""``sokuji optimize`` on the real MiniLM, then the server serving its variants."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from sokuji.optimize import pipeline
from sokuji.weights import minilm, variant_index
from tests.conftest import CACHE_DIR
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def optimized(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any],
                                                                            int]]:
    """A copy of the exported MiniLM, optimized into its own repository (never the shared
    cache: other tests' servers must keep serving fp32)."""
    root = tmp_path_factory.mktemp("repo")
    model = root / "model.onnx"
    shutil.copy(minilm.ensure_onnx(CACHE_DIR), model)
    shutil.copy(minilm.tokenizer_path(), root / "tokenizer.json")
    proc = subprocess.run(
        [sys.executable, "-m", "sokuji", "optimize", str(model), "--variants",
         "int8,int8-mixed", "--force", "int8", "--threads", "2", "--out", str(root / "out.json"),
         "--html", str(root / "report.html")], capture_output=True, text=True, timeout=300)
    yield model, json.loads((root / "out.json").read_text()), proc.returncode


def test_every_variant_is_measured_judged_and_recorded(optimized: tuple[Path, Any, int]
                                                       ) -> None:
    model, index, rc = optimized
    assert set(index["variants"]) == {"fp32", "int8", "int8-mixed"}
    for name, v in index["variants"].items():
        path = model.parent / v["file"]
        assert path.is_file() and pipeline.sha256(path) == v["sha256"]
        f = v["figures"]
        assert f["p50_ms_batch1"] > 0 and f["best_items_per_s"] > 0 and f["peak_rss_mb"] > 50
        assert set(f["throughput_items_per_s"]) == {"1", "8", "32"}
        assert 0.5 < v["quality"]["mean_cosine"] <= 1.0 + 1e-6
        assert v["passed"] == (v["quality"]["mean_cosine"] >= 0.99
                               and v["quality"]["recall_at_10"] >= 0.95)
        if name != "fp32":
            manifest = json.loads((path.parent / "manifest.json").read_text())
            assert manifest["recipe"]["per_channel"] is True
    fp32 = index["variants"]["fp32"]
    assert fp32["quality"] == {"mean_cosine": pytest.approx(1.0, abs=1e-5),
                               "min_cosine": pytest.approx(1.0, abs=1e-5), "recall_at_10": 1.0}
    assert index["variants"]["int8"]["bytes"] < 0.75 * fp32["bytes"]
    passing = [n for n, v in index["variants"].items() if v["passed"]]
    best = max(passing, key=lambda n: index["variants"][n]["figures"]["best_items_per_s"])
    assert index["recommended"] == best
    assert rc == (0 if index["any_optimized_passed"] else 1)
    assert json.loads((model.with_suffix(".variants") / "index.json").read_text()) == index
    assert "data:image/png;base64," in (model.parent / "report.html").read_text()


def test_a_strict_gate_fails_everything_and_exits_nonzero(optimized: tuple[Path, Any, int],
                                                         tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    shutil.copy(optimized[0], model)
    proc = subprocess.run([sys.executable, "-m", "sokuji", "optimize", str(model),
                           "--tokenizer", str(optimized[0].parent / "tokenizer.json"),
                           "--variants", "int8", "--min-cosine", "0.99999", "--threads", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "no optimized variant passed" in proc.stderr
    index = variant_index.read_index(model)
    assert index is not None and index["recommended"] == "fp32"


@pytest.fixture(scope="module")
def served(optimized: tuple[Path, Any, int]) -> Iterator[str]:
    model, _, _ = optimized
    with sokuji_server(f"""
[[models]]
name = "enc"
path = "{model}"
tokenizer = "{model.parent / 'tokenizer.json'}"
variant = "auto"
cache = false
""") as url:
        yield url


def test_auto_serves_the_recommended_variant_and_versions_address_the_others(
        served: str, optimized: tuple[Path, Any, int]) -> None:
    import tritonclient.http as httpclient

    _, index, _ = optimized
    client = httpclient.InferenceServerClient(url=served.removeprefix("http://"))
    texts = np.array(["the invoice was paid late", "a train was delayed"], dtype=np.object_)

    def embed(version: str = "") -> tuple[np.ndarray, dict[str, Any]]:
        inp = httpclient.InferInput("text", [2], "BYTES")
        inp.set_data_from_numpy(texts)
        res = client.infer("enc", [inp], model_version=version)
        return res.as_numpy("embedding"), res.get_response()

    default, _ = embed()
    fp32, meta = embed("fp32")
    int8, meta8 = embed("int8")  # failed the gate, but forced: servable
    assert meta["model_version"] == "fp32" and meta8["model_version"] == "int8"
    same = {"fp32": fp32, "int8": int8}.get(index["recommended"])
    if same is not None:
        np.testing.assert_allclose(default, same, atol=1e-6)
    cos = np.sum(fp32 * int8, axis=1)
    assert np.all(cos > 0.95) and not np.allclose(fp32, int8, atol=1e-6)
    r = httpx.post(f"{served}/v2/models/enc/versions/nope/infer",
                   json={"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                     "data": ["x"]}]})
    assert r.status_code == 404 and "int8" in r.json()["error"]


def test_the_variant_shows_in_responses_and_metrics(served: str,
                                                    optimized: tuple[Path, Any, int]) -> None:
    recommended = optimized[1]["recommended"]
    r = httpx.post(f"{served}/v1/embeddings", json={"model": "enc", "input": "hello"})
    assert r.status_code == 200 and r.headers["x-sokuji-variant"] == recommended
    assert 'infer;dur=' in r.headers["server-timing"]
    assert f'desc="{recommended}"' in r.headers["server-timing"]
    httpx.post(f"{served}/v2/models/enc/versions/int8/infer",
               json={"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                 "data": ["x"]}]}).raise_for_status()
    text = httpx.get(f"{served}/metrics").text
    assert f'sokuji_model_variant{{model="enc",variant="{recommended}"}} 1.0' in text
    assert 'sokuji_requests_total{model="enc@int8",status="200"}' in text


def test_a_variant_that_failed_the_gate_is_refused_at_startup(
        optimized: tuple[Path, Any, int], tmp_path: Path) -> None:
    model, index, _ = optimized
    failing = [n for n, v in index["variants"].items() if not v["passed"] and not v["forced"]]
    config = tmp_path / "c.toml"
    name = failing[0] if failing else "int8-static"  # (never built here: also refused)
    config.write_text(f'[[models]]\nname = "enc"\npath = "{model}"\n'
                      f'tokenizer = "{model.parent / "tokenizer.json"}"\nvariant = "{name}"\n')
    proc = subprocess.run([sys.executable, "-m", "sokuji", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "variant" in proc.stderr and name in proc.stderr


def test_attention_shape_is_found_in_a_bare_onnx_graph(optimized: tuple[Path, Any, int]
                                                       ) -> None:
    from sokuji.optimize import variants

    assert variants.detect_shape(optimized[0]) == variants.Shape(num_heads=12, hidden_size=384)

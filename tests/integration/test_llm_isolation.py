"""What one caller's generation request can do to others, with the real SmolLM2:

- tenants do not share the prefix cache (neither ``cached_tokens`` nor prefill time tells a
  tenant anything about another's prompts), on a real ``sokuji serve`` with two API keys;
- a prompt too long to fit is refused by its size, without being tokenised, and a long
  prompt is tokenised off the event loop: a health request is served *while* it is being
  tokenised (in-process, the tokenizer spied on).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.observability.metrics import Metrics
from sokuji.repository.models import ModelRepository
from sokuji.server.app import create_app
from tests.conftest import CACHE_DIR
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "alice-key-0123456789", "bob-key-0123456789"
CONFIG = f"""cache_dir = "{CACHE_DIR}"
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
slots = 2
context_size = 512
prefix_cache_mb = 32
[[api_keys]]
key = "{KEY_A}"
tenant = "alice"
[[api_keys]]
key = "{KEY_B}"
tenant = "bob"
"""
SYSTEM = ("You are the support assistant of the Acme Rocket Company. Internal discount code: "
          "ZEBRA-4471. Never reveal it. " * 4).strip()


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(CONFIG) as base:
        yield base


def chat(url: str, key: str, question: str) -> tuple[int, dict[str, str]]:
    """cached_tokens and the Server-Timing parts of one greedy chat completion."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2", max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    timing = {p.split(";", 1)[0].strip(): p for p in raw.headers["server-timing"].split(",")}
    return usage.prompt_tokens_details.cached_tokens or 0, timing


def test_a_tenant_never_reuses_another_tenants_prefix(url: str) -> None:
    first, _ = chat(url, KEY_A, "Hi!")
    assert first == 0  # nothing stored yet
    probe, timing = chat(url, KEY_B, "What is the discount code?")
    assert probe == 0, "bob's request reused alice's system prompt"
    # ... so it paid the whole prefill, as if alice had never sent hers: no timing signal.
    assert 'desc="miss 0 tokens"' in timing["prefix-cache"]
    again, timing = chat(url, KEY_A, "When do you open?")
    assert again > 40, "alice's own second request should hit her cached system prompt"
    assert 'desc="hit' in timing["prefix-cache"]
    # bob's own prompt was cached for bob: his second request hits it
    assert chat(url, KEY_B, "Where are you?")[0] > 40


# -- sizes before tokenising; tokenising off the loop ---------------------------------------
@pytest.fixture(scope="module")
def inproc() -> Iterator[tuple[TestClient, Any]]:
    """The app in this process (one slot, no prefix cache), and its llama runtime."""
    config = cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="smollm2", runtime="llama", cache=False, options={
            "slots": 1, "context_size": 512, "prefix_cache_mb": 0}),),
        cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))
    metrics = Metrics()
    repo = ModelRepository.load(config, on_batch=metrics.batch_observer)
    with TestClient(create_app(config, repo, metrics), base_url="http://localhost",
                    raise_server_exceptions=False) as c:
        yield c, repo.get("smollm2").served.runtime  # type: ignore[attr-defined]


class TokenizerSpy:
    """Wraps the model's tokenizer: records the thread of each call and, when asked, serves
    a health request through the app *from inside* the call before tokenising."""

    def __init__(self, client: TestClient, runtime: Any, probe: bool) -> None:
        self.client, self.model, self.probe = client, runtime.model, probe
        self.real = runtime.model.tokenize
        self.threads: list[int] = []
        self.probe_status: int | str | None = None

    def __call__(self, text: str, add_special: bool) -> list[int]:
        self.threads.append(threading.get_ident())
        if self.probe:
            # On the event loop's thread this cannot complete (the loop is busy right here);
            # the portal refuses such a call, which the test sees as a failed probe.
            try:
                self.probe_status = self.client.get("/v2/health/live").status_code
            except RuntimeError as exc:  # anyio: "cannot be called from the event loop"
                self.probe_status = f"refused: {exc}"
        return list(self.real(text, add_special))

    def __enter__(self) -> TokenizerSpy:
        self.model.tokenize = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.tokenize = self.real


def loop_thread(client: TestClient) -> int:
    ident: list[int] = []
    client.portal.call(lambda: ident.append(threading.get_ident()))  # type: ignore[union-attr]
    return ident[0]


def test_a_long_prompt_is_tokenised_while_the_loop_serves_others(
        inproc: tuple[TestClient, Any]) -> None:
    client, runtime = inproc
    loop = loop_thread(client)
    words = "tell me more " * 1500  # ~19 KiB: within the byte bound, too many tokens
    with TokenizerSpy(client, runtime, probe=True) as spy:
        r = client.post("/v1/completions", json={"model": "smollm2", "prompt": words,
                                                 "max_tokens": 2})
    assert r.status_code == 400 and "tokens; model 'smollm2' takes at most 511" in r.text
    assert spy.threads and loop not in spy.threads
    assert spy.probe_status == 200, spy.probe_status  # served during the tokenisation

    with TokenizerSpy(client, runtime, probe=False) as spy:  # a short one: inline
        r = client.post("/v1/completions", json={"model": "smollm2", "prompt": "Hi",
                                                 "max_tokens": 2})
    assert r.status_code == 200 and spy.threads == [loop]


@pytest.mark.parametrize("chat", [False, True])
def test_a_prompt_too_long_to_fit_is_refused_without_tokenising(
        inproc: tuple[TestClient, Any], chat: bool) -> None:
    client, runtime = inproc
    huge = "x" * (3 * 1024 * 1024)
    body: dict[str, Any] = {"model": "smollm2", "max_tokens": 2}
    if chat:
        body["messages"] = [{"role": "user", "content": huge}]
    else:
        body["prompt"] = huge
    bound = 511 * runtime.model.max_piece_bytes
    with TokenizerSpy(client, runtime, probe=False) as spy:
        r = client.post(f"/v1/{'chat/' if chat else ''}completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == ("messages" if chat else "prompt")
    assert f"more than {bound} bytes" in error["message"]
    assert "at most 511 prompt tokens" in error["message"]
    assert spy.threads == []  # never tokenised


def test_refusing_a_huge_prompt_costs_about_as_much_as_reading_it(url: str) -> None:
    """Over real HTTP: the 3 MiB refusal takes no longer than a few reads of a 3 MiB body
    that is refused for another reason (an unknown field), measured in the same test."""
    huge = "x" * (3 * 1024 * 1024)
    headers = {"Authorization": f"Bearer {KEY_A}"}

    def post(extra: dict[str, Any]) -> tuple[float, httpx.Response]:
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                       json={"model": "smollm2", "prompt": huge, **extra})
        return time.perf_counter() - t0, r

    baseline = min(post({"bogus": 1})[0] for _ in range(3))
    took, r = min((post({}) for _ in range(3)), key=lambda x: x[0])
    assert r.status_code == 400 and "at most 511 prompt tokens" in r.text
    assert took < 3 * baseline + 0.05  # tokenising 3 MiB would add ~0.7 s

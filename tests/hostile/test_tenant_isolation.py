"""Tenant isolation where it can leak: one test, parametrised over every cache and
pass-through of the suite's server, sends the same input as tenant ``t1`` and then as
``t2`` and ``t1:corp`` (whose name starts like ``t1``'s keys would if they were joined
strings). Each probe must be a miss, by the hit marker that cache shows its caller, and be
answered with its own answer; its repeat then hits its own entry (the probe measures
something).

The caches: the exact response cache of every cached kind (``declared.DECLARED``: a kind an
open issue adds is declared there, so it is probed here too), the encoder's through
``/v1/embeddings``, the semantic cache, the LLM prefix cache, the upstream's own cache
behind a pass-through with a key per tenant, and a pipeline whose step answers with the
caller's tenant (the one answer that tells a shared entry from an own one: the others are
deterministic, so only the marker can).

Kills the mutants (each applied by hand, seen failing): ``cache_key`` given one tenant for
everyone in ``server/inference.py`` ``_cached`` (every ``exact-*`` case, ``encoder``,
``pipeline-own-answer``), or only for kind pipeline / vad / ocr; the semantic scope without
the tenant (``routing/semantic.py``); the prefix cache's lookup under one tenant
(``llm/engine.py``); the upstream sent one key for every tenant (``routing/upstream.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import requests

from tests.hostile import declared
from tests.hostile.conftest import UPSTREAM_ADMIN_KEY, Server, post

pytestmark = pytest.mark.integration

OTHERS = ("t2", "t1:corp")
"""The tenants that probe ``t1``'s entries (they send nothing anywhere else)."""
FRESH = {"cache-control": "no-cache"}
"""Past the exact response cache, to the cache behind it."""


def cache_desc(response: requests.Response) -> str:
    """The ``desc`` of the response's ``cache`` stage ('hit', 'miss', 'semantic 0/1 hit'...)."""
    for part in response.headers.get("server-timing", "").split(","):
        name, _, rest = part.strip().partition(";")
        if name == "cache":
            return rest.partition('desc="')[2].rstrip('"')
    return ""


def exact_marker(r: requests.Response) -> str:
    desc = cache_desc(r)  # (a classifier's semantic cache answers 'semantic 0/1 ...': none)
    return "miss" if desc.startswith("semantic 0/") else desc


def semantic_marker(r: requests.Response) -> str:
    desc = cache_desc(r)
    return "hit" if desc.startswith("semantic 1/1 hit") else \
        "miss" if desc.startswith("semantic 0/1") else desc


def prefix_marker(r: requests.Response) -> str:
    usage = r.json()["usage"]
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return "hit" if cached > 0 else "miss"


def upstream_hits(server: Server) -> float:
    """The upstream server's own response-cache hits so far (its metrics, as its admin).
    Our cache is skipped (``no-cache``); the upstream's is what a tenant could read through
    the pass-through (its total time comes back in Server-Timing with a key per tenant)."""
    r = requests.get(f"{server.upstream}/metrics", timeout=10,
                     headers={"Authorization": f"Bearer {UPSTREAM_ADMIN_KEY}"})
    assert r.status_code == 200, r.text
    return sum(float(line.split()[-1]) for line in r.text.splitlines()
               if line.startswith("sokuji_cache_requests") and 'model="enc"' in line
               and 'result="hit"' in line)


def v2_outputs(r: requests.Response) -> Any:
    return [(o["name"], o["data"]) for o in r.json()["outputs"]]


def embeddings(r: requests.Response) -> Any:
    return [d["embedding"] for d in r.json()["data"]]


def chat_text(r: requests.Response) -> Any:
    return r.json()["choices"][0]["message"]["content"]


@dataclass(frozen=True)
class Case:
    request: declared.Request
    marker: Callable[[requests.Response], str] | None
    """'hit' or 'miss' as the response shows it (None: ``hits`` counts them)."""
    answer: Callable[[requests.Response], Any] = v2_outputs
    headers: tuple[tuple[str, str], ...] = ()
    first: declared.Request | None = None
    """What ``t1`` sends first, if not ``request`` itself (the semantic cache's original of
    the paraphrase probed)."""
    own: Callable[[str], Any] | None = None
    """The answer each tenant must get, where it differs by tenant (else: ``t1``'s)."""
    not_t1s: bool = False
    """``t1``'s answer is what its cache held for another input (a semantic hit): a probe
    computing its own must answer otherwise."""
    hits: Callable[[Server], float] | None = None
    """Where the hits are counted when the response does not show them."""


SYSTEM = ("You are the support assistant of the Acme Rocket Company. Internal discount code: "
          "ZEBRA-4471. Never reveal it. " * 3).strip()
WHOAMI = "which tenant is asking?"


def _cases() -> list[Any]:
    cases = [pytest.param(Case(request, exact_marker), id=f"exact-{d.runtime}")
             for d in declared.DECLARED.values()
             if d.cached and (request := d.by_route(declared.V2_JSON)) is not None]
    cases += [
        pytest.param(Case(declared.embeddings("minilm", ["an encoder's text of t1's"]),
                          exact_marker, embeddings), id="encoder"),
        pytest.param(Case(
            declared.v2_texts("intent", ["please tell me my current account balance now"]),
            semantic_marker, headers=tuple(FRESH.items()),
            first=declared.v2_texts("intent", ["please tell me my current account balance"]),
            not_t1s=True), id="semantic"),
        pytest.param(Case(declared.Request(declared.OPENAI, "/v1/chat/completions",
                                           orjson.dumps({
            "model": "smollm2", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "What is the code?"}]})),
            prefix_marker, chat_text), id="prefix"),
        pytest.param(Case(
            declared.v2_texts("far", ["a text only t1 embedded through the upstream"]),
            None, headers=tuple(FRESH.items()), hits=upstream_hits),
            id="upstream-pass-through"),
        pytest.param(Case(declared.v2_texts("whoami", [WHOAMI], name="question"), exact_marker,
                          own=lambda tenant: [("echo", [f"{WHOAMI} (answered for {tenant})"])]),
                     id="pipeline-own-answer"),
    ]
    return cases


@pytest.mark.parametrize("case", _cases())
def test_a_second_tenant_sending_the_same_input_misses_and_gets_its_own_answer(
        server: Server, case: Case) -> None:
    headers = dict(case.headers)

    def send(request: declared.Request, tenant: str) -> tuple[requests.Response, str]:
        before = case.hits(server) if case.hits is not None else 0.0
        r = post(server, request, tenant, **headers)
        assert r.status_code == 200, (tenant, r.text)
        if case.marker is not None:
            return r, case.marker(r)
        assert case.hits is not None
        return r, "hit" if case.hits(server) > before else "miss"

    send(case.first or case.request, "t1")
    own, marker = send(case.request, "t1")
    assert marker == "hit", own.headers.get("server-timing")  # the cache is on
    for tenant in OTHERS:
        probe, marker = send(case.request, tenant)
        assert marker == "miss", (tenant, probe.headers.get("server-timing"), probe.text[:300])
        if case.not_t1s:
            assert case.answer(probe) != case.answer(own), tenant
            want = case.answer(probe)
        else:
            want = case.own(tenant) if case.own is not None else case.answer(own)
            assert case.answer(probe) == want, tenant
        again, marker = send(case.request, tenant)  # its own entry: the probe saw a cache
        assert marker == "hit", (tenant, again.headers.get("server-timing"))
        assert case.answer(again) == want, tenant

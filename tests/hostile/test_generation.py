"""A generation's cost as the client sets it: stop strings bounded, and a pipeline step's
``max_tokens`` a ceiling the client cannot raise."""

from __future__ import annotations

import orjson
import pytest
import requests

from tests.hostile import declared
from tests.hostile.conftest import Server, auth, post

pytestmark = pytest.mark.integration

STOPS = "issue 25: LLM stop/limits"


def test_stop_strings_past_their_bound_are_refused_naming_stop(server: Server) -> None:
    request = declared.chat("smollm2", "Say hi.", stop=["x" * 50_000] * 4)
    r = post(server, request)
    assert r.status_code in (400, 413), r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "stop" or "stop" in error["message"], error


def test_a_pipeline_steps_max_tokens_is_a_ceiling(server: Server) -> None:
    request = declared.Request(declared.OPENAI, "/v1/chat/completions", orjson.dumps({
        "model": "qa", "messages": [{"role": "user", "content": "Count to twenty."}],
        "max_tokens": 16, "temperature": 0}))
    r = post(server, request)
    if r.status_code == 400:  # refused, naming the step's ceiling: also a ceiling
        assert "max_tokens" in str(r.json()["error"])
        return
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 4, r.json()["usage"]


def test_a_generation_is_answered_after_the_hostile_ones(server: Server) -> None:
    r = requests.post(server.url + "/v1/chat/completions", timeout=60,
                      data=declared.chat("smollm2", "Say hi.").body,
                      headers={**declared.JSON, **auth("ops")})
    assert r.status_code == 200, r.text

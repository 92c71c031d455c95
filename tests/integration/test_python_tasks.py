"""Python classes that declare an OpenAI task, served by a real ``sokuji serve`` and driven
by the official ``openai`` client: an embeddings class (hashed character trigrams, numpy) on
``/v1/embeddings`` and V2 alike, and rules-based chat classes on ``/v1/chat/completions`` and
``/v1/completions``, whole and streamed word by word; a class that breaks its task's contract
gets a 502 naming the model, or stops start-up."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from sokuji import config as cfg
from sokuji.errors import ConfigError
from tests.conftest import client_for
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration
DATA = "tests/data/pymodels"


def _model(name: str, entry: str, **options: object) -> str:
    extra = "".join(f"{k} = {v!r}\n" for k, v in options.items())
    return f"""[[models]]
name = "{name}"
runtime = "python"
max_batch_size = 8
[models.options]
entry = "{DATA}/{entry}"
{extra}"""


CONFIG = "builtin_pipelines = false\n[cache]\nenabled = true\n" + "".join((
    _model("hash", "task_embed.py:HashingEmbedder", dims=48),
    _model("reverse", "task_chat.py:Reverser"),
    _model("echo", "task_chat.py:Echo"),
    _model("wide", "task_bad.py:WrongWidth"),
    _model("raises", "task_bad.py:Raises"),
    _model("not-text", "task_bad.py:NotText"),
    _model("overclaims", "task_bad.py:Overclaims")))


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(CONFIG) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# -- embeddings -------------------------------------------------------------------------------
def test_embeddings_through_the_openai_client(client: openai.OpenAI) -> None:
    texts = ["the quick brown fox", "the quick brown foxes", "a slow green turtle"]
    r = client.embeddings.create(model="hash", input=texts)
    rows = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert rows.shape == (3, 48) and [d.index for d in r.data] == [0, 1, 2]
    assert np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
    assert rows[0] @ rows[1] > rows[0] @ rows[2]  # similar texts, closer vectors
    assert r.usage.prompt_tokens == 12  # the class's own count (words)
    one = client.embeddings.create(model="hash", input="a slow green turtle",
                                   encoding_format="float", dimensions=48)
    assert np.allclose(one.data[0].embedding, rows[2], atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="gives 48"):
        client.embeddings.create(model="hash", input="x", dimensions=12)


def test_the_same_class_on_v2_and_its_metadata(url: str, client: openai.OpenAI) -> None:
    meta = httpx.get(f"{url}/v2/models/hash").json()
    assert meta["inputs"][0]["name"] == "input"
    assert meta["outputs"][0] == {"name": "embedding", "datatype": "FP32", "shape": [-1, 48]}
    r = httpx.post(f"{url}/v2/models/hash/infer", json={"inputs": [
        {"name": "input", "datatype": "BYTES", "shape": [2], "data": ["a b", "c d e"]}]})
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert out["embedding"]["shape"] == [2, 48] and out["prompt_tokens"]["data"] == [5]
    via_openai = client.embeddings.create(model="hash", input=["a b", "c d e"],
                                          encoding_format="float")
    assert np.allclose(np.reshape(out["embedding"]["data"], (2, 48)),
                       [d.embedding for d in via_openai.data], atol=1e-6)


def test_a_deterministic_class_is_answered_from_the_cache(url: str) -> None:
    body = {"model": "hash", "input": ["cache me, twice"]}
    first = httpx.post(f"{url}/v1/embeddings", json=body)
    second = httpx.post(f"{url}/v1/embeddings", json=body)
    assert 'desc="miss"' in first.headers["server-timing"]
    assert 'desc="hit"' in second.headers["server-timing"]
    assert first.json()["data"] == second.json()["data"]


def test_rows_of_another_width_are_a_502_naming_the_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as err:
        client.embeddings.create(model="wide", input="x")
    assert err.value.status_code == 502 and "model 'wide'" in str(err.value)
    assert "[1, 8]" in str(err.value)


# -- chat ---------------------------------------------------------------------------------------
def test_chat_whole_through_the_openai_client(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="reverse", messages=_user("one two three"))
    assert r.choices[0].message.content == "three two one"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 3 and r.usage.prompt_tokens == 0  # no tokenizer
    r = client.chat.completions.create(model="echo", messages=_user("a b c d e"),
                                       max_tokens=2)
    assert r.choices[0].message.content == "a b" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 2)  # the class's


def test_chat_streams_word_by_word(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="reverse", messages=_user("alpha beta gamma delta"), stream=True,
        stream_options={"include_usage": True})
    deltas, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert deltas == ["delta", " gamma", " beta", " alpha"]  # one step, one delta
    assert reasons == ["stop"] and usage is not None and usage.completion_tokens == 4


def test_max_tokens_cuts_a_stream_and_bounds_the_request(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="reverse", messages=_user("1 2 3 4 5 6"),
                                            max_tokens=2, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "6 5" and chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="limit of 64 new tokens"):
        client.chat.completions.create(model="reverse", messages=_user("x"), max_tokens=65)


def test_text_completions_and_stop(client: openai.OpenAI) -> None:
    r = client.completions.create(model="reverse", prompt="red green blue", stop=["red"])
    assert r.choices[0].text == "blue green"


def test_a_class_that_raises_or_breaks_its_steps_is_a_502(client: openai.OpenAI,
                                                          url: str) -> None:
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="raises", messages=_user("x"))
    assert err.value.status_code == 502 and "predict raised RuntimeError" in str(err.value)
    assert "rules engine broke" not in str(err.value)  # its text goes to the log only
    with pytest.raises(openai.InternalServerError, match="not a str"):
        client.chat.completions.create(model="not-text", messages=_user("x"))
    with pytest.raises(openai.InternalServerError, match="reported 4 completion tokens"):
        client.chat.completions.create(model="overclaims", messages=_user("x"), max_tokens=3)
    # Streamed: the status is sent with the first delta; the failure ends the stream.
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={
            "model": "not-text", "messages": _user("x"), "stream": True}) as r:
        body = r.read().decode()
    assert r.status_code == 200 and '"content":"fine"' in body
    assert "event: error" in body and "not a str" in body


def test_a_task_class_is_refused_at_the_wrong_routes(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="does not serve /v1/embeddings"):
        client.embeddings.create(model="reverse", input="x")
    with pytest.raises(openai.BadRequestError, match="does not serve /v1/chat/completions"):
        client.chat.completions.create(model="hash", messages=_user("x"))


# -- start-up -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("entry", "why"), [
    ("task_bad.py:Streams", "must return its rows, not yield them"),
    ("task_bad.py:NoRows", "measuring it failed"),
])
def test_an_embeddings_class_that_cannot_serve_stops_start_up(entry: str, why: str) -> None:
    m = cfg.ModelConfig(name="bad", runtime="python", options={"entry": f"{DATA}/{entry}"})
    with pytest.raises(ConfigError, match=why):  # (at the config's check, or at build)
        config = cfg.validate(cfg.ServerConfig(models=(m,), builtin_pipelines=False))
        with client_for(config):
            pass

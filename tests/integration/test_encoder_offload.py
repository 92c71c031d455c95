"""A long embedding request, with the real MiniLM in-process, the tokenizer spied on:

- it is tokenised off the event loop: a health probe is served *while* it is being
  tokenised; a short one is tokenised inline, on the loop;
- however long its text, the tokenizer reads at most a bounded prefix of it: a 4 MB text is
  cut (200), or refused with 400 naming the limit when the cut cannot be kept (whitespace).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

pytestmark = pytest.mark.integration


class TokenizerSpy:
    """Wraps the runtime's tokenizer: records the thread and the longest text of each call,
    and, when asked, serves a health request through the app *from inside* the call."""

    def __init__(self, client: TestClient, probe: bool) -> None:
        self.client, self.probe = client, probe
        self.runtime = client.app.inference.repo.get("minilm").served.runtime  # type: ignore[attr-defined]
        self.real = self.runtime._tokenizer
        self.calls: list[tuple[int, int]] = []
        self.probe_status: int | str | None = None

    def _seen(self, texts: Sequence[str]) -> None:
        self.calls.append((threading.get_ident(), max(map(len, texts))))
        if self.probe and self.probe_status is None:
            # On the event loop's thread this cannot complete (the loop is busy right here);
            # the portal refuses such a call, which the test sees as a failed probe.
            try:
                self.probe_status = self.client.get("/v2/health/live").status_code
            except RuntimeError as exc:  # anyio: "cannot be called from the event loop"
                self.probe_status = f"refused: {exc}"

    def encode(self, text: str) -> Any:
        self._seen([text])
        return self.real.encode(text)

    def encode_batch(self, texts: list[str]) -> Any:
        self._seen(texts)
        return self.real.encode_batch(texts)

    def __enter__(self) -> TokenizerSpy:
        self.runtime._tokenizer = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.runtime._tokenizer = self.real


def loop_thread(client: TestClient) -> int:
    ident: list[int] = []
    client.portal.call(lambda: ident.append(threading.get_ident()))  # type: ignore[union-attr]
    return ident[0]


def embed(client: TestClient, texts: str | list[str]) -> Any:
    return client.post("/v1/embeddings", json={"model": "minilm", "input": texts})


def test_a_long_text_is_tokenised_while_the_loop_serves_others(minilm: TestClient) -> None:
    loop = loop_thread(minilm)
    text = f"{uuid.uuid4()} " + "tell me more about the weather today " * 110_000  # 4 MB
    with TokenizerSpy(minilm, probe=True) as spy:
        r = embed(minilm, text)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 256
    assert spy.calls and all(thread != loop for thread, _ in spy.calls)
    assert spy.probe_status == 200, spy.probe_status  # served during the tokenisation
    assert max(n for _, n in spy.calls) <= spy.runtime.cut_chars  # never the whole 4 MB

    # several texts that are long only together go off the loop too (V2 this time)
    texts = [f"{uuid.uuid4()} " + "x y " * 700 for _ in range(2)]  # 2 x ~2.8 K characters
    with TokenizerSpy(minilm, probe=True) as spy:
        r = minilm.post("/v2/models/minilm/infer", json={"inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [2], "data": texts}]})
    assert r.status_code == 200, r.text
    assert spy.calls and all(thread != loop for thread, _ in spy.calls)
    assert spy.probe_status == 200, spy.probe_status

    with TokenizerSpy(minilm, probe=False) as spy:  # a short one: inline, on the loop
        r = embed(minilm, f"hello {uuid.uuid4()}")
    assert r.status_code == 200 and [t for t, _ in spy.calls] == [loop]


def test_a_huge_text_that_cannot_be_cut_is_refused_after_reading_only_its_prefix(
        minilm: TestClient) -> None:
    runtime = minilm.app.inference.repo.get("minilm").served.runtime  # type: ignore[attr-defined]
    huge = " " * 4_000_000 + f"hello {uuid.uuid4()}"  # whitespace: no token in the cut
    with TokenizerSpy(minilm, probe=False) as spy:
        r = embed(minilm, ["fine", huge])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input" and error["code"] == "invalid_input"
    assert error["message"].startswith("text 1 of the request is 4000042 characters long")
    assert f"send at most {runtime.max_text_chars} characters" in error["message"]
    assert max(n for _, n in spy.calls) == runtime.cut_chars  # the cut only, not 4 MB


def test_a_sparse_text_within_the_bound_is_read_whole(minilm: TestClient) -> None:
    """Whitespace the cut would lose is read whole up to the bound: same embedding as
    the words alone (BERT drops whitespace)."""
    words = f"hello world {uuid.uuid4().hex[:6]}"
    r = embed(minilm, [words, " " * 6000 + words])
    assert r.status_code == 200, r.text
    a, b = (np.asarray(d["embedding"]) for d in r.json()["data"])
    np.testing.assert_allclose(a, b, atol=1e-6)

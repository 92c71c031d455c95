"""Inputs the schema fuzzer (tests/integration/test_schema_fuzz.py) and a review of the codecs
turned up: each once answered 500 or was silently taken as something else; each must now get a
400 (or the documented status) whose reason names the field."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

INFER = "/v2/models/synth/infer"


def v2_body(**extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                       "data": ["a"]}]}
    doc.update(extra)
    return doc


def with_input(**fields: Any) -> dict[str, Any]:
    doc = v2_body()
    doc["inputs"][0].update(fields)
    return doc


@pytest.mark.parametrize(("body", "names"), [
    # an unhashable output name was a 500 (TypeError in a set lookup)
    (v2_body(outputs=[{"name": ["length"]}]), "outputs[0]"),
    (v2_body(outputs=[{"name": {"a": 1}}]), "outputs[0]"),
    (v2_body(outputs=["length"]), "outputs[0]"),
    # non-boolean binary flags were read as truthy/falsy instead of refused
    (v2_body(outputs=[{"name": "length", "parameters": {"binary_data": "no"}}]), "binary_data"),
    (v2_body(outputs=[{"name": "length", "parameters": []}]), "parameters"),
    (v2_body(parameters={"binary_data_output": "yes"}), "binary_data_output"),
    # tensor parameters that are not an object were ignored
    (with_input(parameters=[]), "parameters"),
    (with_input(parameters=0), "parameters"),
    (with_input(parameters={"binary_data_size": True}), "binary_data_size"),
])
def test_v2_refuses_malformed_fields_by_name(synth: TestClient, body: dict[str, Any],
                                             names: str) -> None:
    r = synth.post(INFER, json=body)
    assert r.status_code == 400, r.text
    assert names in r.json()["error"]


def test_v2_null_parameters_mean_none(synth: TestClient) -> None:
    r = synth.post(INFER, json=v2_body(parameters=None, outputs=[
        {"name": "length", "parameters": None}]))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("field", "value"), [("user", 5), ("user", ["a"]),
                                              ("dimensions", 0), ("dimensions", -3)])
def test_embeddings_refuse_wrong_types_by_name(synth: TestClient, field: str,
                                               value: Any) -> None:
    r = synth.post("/v1/embeddings", json={"model": "synth", "input": "a", field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_empty_content_encoding_is_identity(synth: TestClient) -> None:
    r = synth.post(INFER, json=v2_body(), headers={"content-encoding": ""})
    assert r.status_code == 200, r.text
    r = synth.post(INFER, json=v2_body(), headers={"content-encoding": "gzip"})
    assert r.status_code == 415 and "Content-Encoding" in r.json()["error"]


def test_negative_content_length_is_refused(synth: TestClient) -> None:
    # Real servers (h11, httptools) refuse it before the app; a Sokuji app behind another
    # ASGI server must not take it as "no limit".
    r = synth.post(INFER, content=b"{}", headers={"content-length": "-1",
                                                  "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "Content-Length" in r.json()["error"]


def test_errors_name_a_huge_value_without_echoing_it(synth: TestClient) -> None:
    huge = "x" * 30_000  # under the synthetic config's 64 KiB body limit
    for body in (with_input(datatype=huge), with_input(name=huge), v2_body(id=[huge]),
                 v2_body(outputs=[{"name": huge}])):
        r = synth.post(INFER, json=body)
        assert r.status_code == 400, r.text
        assert "chars)" in r.json()["error"] and len(r.content) < 500
    r = synth.post("/v1/embeddings", json={"model": "synth", "input": "a",
                                           "encoding_format": huge})
    assert r.status_code == 400 and len(r.content) < 500

"""Triton generate bodies as completion requests (``server/generate_codec.py``)."""

from __future__ import annotations

import orjson
import pytest

from sokuji.errors import BadRequest, InvalidInput
from sokuji.server import generate_codec, llm_codec


def test_fields_map_onto_the_completion_request() -> None:
    req = generate_codec.decode(orjson.dumps({
        "text_input": "Hello", "parameters": {"max_tokens": 5, "temperature": 0.5,
                                              "top_p": 0.9, "top_k": 7, "seed": 3,
                                              "stop": ["\n"]}}), "m", False)
    assert (req.prompt, req.model, req.max_tokens, req.temperature, req.top_p, req.top_k,
            req.seed, req.stop, req.stream, req.chat) == \
        ("Hello", "m", 5, 0.5, 0.9, 7, 3, ("\n",), False, False)


@pytest.mark.parametrize(("route", "body", "streams"), [
    (False, None, False), (False, False, False), (False, True, True),
    (True, None, True), (True, False, True), (True, True, True)])
def test_the_route_streams_and_the_body_may_ask_to(route: bool, body: bool | None,
                                                   streams: bool) -> None:
    doc = {"text_input": "a"} if body is None else {"text_input": "a", "stream": body}
    assert generate_codec.decode_dict(doc, "m", route).stream is streams


def test_text_input_may_be_a_list_of_one_string() -> None:
    """As genai-perf sends it (a BYTES tensor of shape [1])."""
    assert generate_codec.decode_dict({"text_input": ["Hi"]}, "m", False) == \
        generate_codec.decode_dict({"text_input": "Hi"}, "m", False)


def test_top_level_parameters_equal_nested_ones() -> None:
    nested = generate_codec.decode_dict({"text_input": "a", "parameters": {"max_tokens": 4}},
                                        "m", True)
    top = generate_codec.decode_dict({"text_input": "a", "max_tokens": 4}, "m", True)
    same = generate_codec.decode_dict({"text_input": "a", "max_tokens": 4,
                                       "parameters": {"max_tokens": 4}}, "m", True)
    assert nested == top == same and top.stream and top.max_tokens == 4


def test_same_as_completions_decoder() -> None:
    doc = {"max_tokens": 3, "temperature": 0.0, "stop": "x"}
    ours = generate_codec.decode_dict({"text_input": "p", **doc}, "m", False)
    theirs = llm_codec.decode(orjson.dumps({"model": "m", "prompt": "p", **doc}), False)
    assert ours == theirs


@pytest.mark.parametrize(("doc", "param"), [
    ({}, "text_input"),
    ({"text_input": ["a", "b"]}, "text_input"),
    ({"text_input": []}, "text_input"),
    ({"text_input": [3]}, "text_input"),
    ({"text_input": "a", "parameters": "x"}, "parameters"),
    ({"text_input": "a", "parameters": {"nope": 1}}, "parameters.nope"),
    ({"text_input": "a", "nope": 1}, "nope"),
    ({"text_input": "a", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "a", "max_tokens": True}, "max_tokens"),
    ({"text_input": "a", "top_p": 0}, "top_p"),
    ({"text_input": "a", "stop": [1]}, "stop"),
    ({"text_input": "a", "stream": 1}, "stream"),
    ({"text_input": "a", "seed": 1, "parameters": {"seed": 2}}, "seed"),
])
def test_bad_fields_are_named(doc: dict, param: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        generate_codec.decode_dict(doc, "m", False)
    assert caught.value.param == param


def test_body_must_be_an_object() -> None:
    with pytest.raises(InvalidInput):
        generate_codec.decode(b"[1]", "m", False)
    with pytest.raises(BadRequest):
        generate_codec.decode(b"{", "m", False)

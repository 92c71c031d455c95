"""Structured outputs, tools and ``n`` through a real ``sokuji serve`` of SmolLM2-135M, with
the clients applications are written in: the openai SDK (``response_format`` json_schema /
json_object, ``chat.completions.parse`` with a pydantic model, tools whole and streamed as
the SDK assembles them), instructor, LangChain's ``with_structured_output`` and
``bind_tools``; llama-server's ``grammar`` (GBNF) and ``json_schema`` fields; the 400s for
what cannot be enforced. The 135M model's content may be silly: what is tested is that every
answer is structurally valid (``jsonschema``), every time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.conftest import CACHE_DIR
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

CONFIG = f"""cache_dir = "{CACHE_DIR}"
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
slots = 4
context_size = 1024
max_new_tokens = 256
max_n = 4
"""
ASK: Any = [{"role": "user", "content": "Describe a person called Ada, as JSON."}]

# Every schema bounds what it lets a model repeat (string lengths, array sizes, number
# ranges): an unbounded one lets a 135M model write "1111..." until max_tokens.
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {"type": "object", "additionalProperties": False,
               "required": ["name", "address"],
               "properties": {"name": {"type": "string", "maxLength": 24},
                              "address": {"type": "object", "additionalProperties": False,
                                          "required": ["city", "zip"],
                                          "properties": {
                                              "city": {"type": "string", "maxLength": 24},
                                              "zip": {"type": "string",
                                                      "pattern": "^[0-9]{5}$"}}}}},
    "array-bounds": {"type": "object", "additionalProperties": False, "required": ["tags"],
                     "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                             "items": {"type": "string", "maxLength": 12}}}},
    "enum-anyof": {"type": "object", "additionalProperties": False,
                   "required": ["color", "contact"],
                   "properties": {
                       "color": {"enum": ["red", "green", "blue"]},
                       "contact": {"anyOf": [
                           {"type": "object", "additionalProperties": False,
                            "required": ["email"],
                            "properties": {"email": {"type": "string", "format": "email",
                                                     "maxLength": 40}}},
                           {"type": "object", "additionalProperties": False,
                            "required": ["phone"],
                            "properties": {"phone": {"type": "string",
                                                     "pattern": "^[0-9]{3}-[0-9]{4}$"}}}]}}},
    "formats-ref": {"type": "object", "additionalProperties": False,
                    "required": ["id", "born", "friend"],
                    "$defs": {"person": {"type": "object", "additionalProperties": False,
                                         "required": ["name"],
                                         "properties": {"name": {"type": "string",
                                                                 "maxLength": 16}}}},
                    "properties": {"id": {"type": "string", "format": "uuid"},
                                   "born": {"type": "string", "format": "date"},
                                   "friend": {"$ref": "#/$defs/person"}}},
    "numbers": {"type": "object", "additionalProperties": False,
                "required": ["age", "score", "ok"],
                "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                               "score": {"type": "number", "minimum": 0, "maximum": 10,
                                         "multipleOf": 0.5},
                               "ok": {"type": "boolean"}}},
}
TOOLS: Any = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                       "properties": {"city": {"type": "string", "maxLength": 24},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two small numbers.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
]
WEATHER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with sokuji_server(CONFIG) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def schema_format(name: str, schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_answer_validates_against_its_schema(client: openai.OpenAI, name: str) -> None:
    """Greedy and seeded-sampled, whole and streamed: each answer ends by itself ("stop")
    and is a document of the schema. Catches: the mask not applied on some row (a
    speculative draft's, a sampled one), an answer let end before the document does."""
    schema = SCHEMAS[name]
    answers = []
    for kw in ({"temperature": 0}, {"temperature": 0.9, "seed": 7}):
        r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=200,
                                           response_format=schema_format(name, schema), **kw)
        answers.append((r.choices[0].finish_reason, r.choices[0].message.content))
    stream = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=200,
                                            response_format=schema_format(name, schema),
                                            temperature=0.9, seed=11, stream=True)
    parts, reason = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    answers.append((reason, "".join(parts)))
    for reason, text in answers:
        assert reason == "stop", (reason, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_and_completions_take_a_schema_too(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=120,
                                       response_format={"type": "json_object"}, temperature=0)
    if r.choices[0].finish_reason == "stop":  # (an unbounded object may run to max_tokens)
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    else:
        assert (r.choices[0].message.content or "").startswith("{")
    schema = SCHEMAS["numbers"]
    r2 = client.completions.create(model="smollm2", prompt="A person, as JSON:", max_tokens=80,
                                   temperature=0, extra_body={"response_format":
                                                              schema_format("n", schema)})
    jsonschema.validate(json.loads(r2.choices[0].text), schema)


def test_llama_servers_grammar_and_json_schema_fields(client: openai.OpenAI) -> None:
    r = client.completions.create(model="smollm2", prompt="Two digits:", max_tokens=20,
                                  extra_body={"grammar": 'root ::= "[" [0-9] "," [0-9] "]"'})
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop" and len(json.loads(text)) == 2, text
    schema = SCHEMAS["array-bounds"]
    r2 = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=80,
                                        temperature=0, extra_body={"json_schema": schema})
    jsonschema.validate(json.loads(r2.choices[0].message.content or ""), schema)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)
    mood: Literal["happy", "sad"]


def test_the_openai_sdks_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(model="smollm2", messages=ASK, response_format=Person,
                                      max_tokens=120, temperature=0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person) and 0 <= parsed.age <= 120


def test_instructor_gets_its_model(base: str) -> None:
    import instructor

    client = instructor.from_openai(openai.OpenAI(base_url=f"{base}/v1", api_key="unused",
                                                  max_retries=0),
                                    mode=instructor.Mode.JSON_SCHEMA)
    person = client.chat.completions.create(model="smollm2", messages=ASK,
                                            response_model=Person, max_tokens=120,
                                            temperature=0, max_retries=0)
    assert isinstance(person, Person)


def test_langchain_structured_output_and_bound_tools(base: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="smollm2", base_url=f"{base}/v1", api_key="unused",  # type: ignore[arg-type]
                     temperature=0, max_tokens=120, max_retries=0)
    person = llm.with_structured_output(Person, method="json_schema").invoke(ASK[0]["content"])
    assert isinstance(person, Person)

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        WEATHER[0]["content"])
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    assert isinstance(reply.tool_calls[0]["args"]["city"], str)


def _validate_calls(calls: Any, names: set[str]) -> None:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_are_valid_whole_and_streamed(client: openai.OpenAI,
                                                         choice: str) -> None:
    tool_choice: Any = "required" if choice == "required" else {
        "type": "function", "function": {"name": "add"}}
    names = {"get_weather", "add"} if choice == "required" else {"add"}
    r = client.chat.completions.create(model="smollm2", messages=WEATHER, tools=TOOLS,
                                       tool_choice=tool_choice, parallel_tool_calls=False,
                                       max_tokens=80, temperature=0)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(message.tool_calls or []) == 1
    _validate_calls(message.tool_calls, names)
    with client.chat.completions.stream(model="smollm2", messages=WEATHER, tools=TOOLS,
                                        tool_choice=tool_choice, parallel_tool_calls=False,
                                        max_tokens=80, temperature=0.8, seed=3) as stream:
        final = stream.get_final_completion()  # assembled by the SDK from the deltas
    assert final.choices[0].finish_reason == "tool_calls"
    _validate_calls(final.choices[0].message.tool_calls, names)


def test_tool_choice_none_never_calls_and_a_tool_result_continues_the_chat(
        client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=WEATHER, tools=TOOLS,
                                       tool_choice="none", max_tokens=40, temperature=0)
    assert not r.choices[0].message.tool_calls and "<tool_call>" not in (
        r.choices[0].message.content or "")
    call_id = "call_abc"
    history: Any = [*WEATHER,
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
                    {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"}]
    r2 = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS,
                                        max_tokens=40, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    if r2.choices[0].message.tool_calls:
        _validate_calls(r2.choices[0].message.tool_calls, {"get_weather", "add"})


def test_n_choices_share_the_prompt_and_each_is_its_own(client: openai.OpenAI) -> None:
    """One prefill (the others' prompt tokens are reused: ``cached_tokens``), each choice
    drawn with its own seed (seed + i): the same request repeats choice for choice; usage
    counts every choice's tokens and the prompt once."""
    kw: Any = {"model": "smollm2", "messages": ASK, "n": 3, "max_tokens": 24,
               "temperature": 0.9, "seed": 5, "logprobs": True}
    first, again = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # each choice its own draw
    usage = first.usage
    single = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1)
    assert usage is not None and single.usage is not None
    assert usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once
    assert usage.completion_tokens == sum(len(c.logprobs.content or [])
                                          for c in first.choices if c.logprobs)
    streamed: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index].append(c.delta.content or "")
    assert ["".join(streamed[i]) for i in range(3)] == texts
    schema = SCHEMAS["numbers"]
    r = client.chat.completions.create(model="smollm2", messages=ASK, n=2, max_tokens=80,
                                       temperature=0.9, seed=9,
                                       response_format=schema_format("n", schema))
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content or ""), schema)


@pytest.mark.parametrize(("body", "param", "status"), [
    ({"response_format": schema_format("u", {"type": "array", "uniqueItems": True})},
     "response_format", 400),
    ({"response_format": schema_format("f", {"type": "string", "format": "credit-card"})},
     "response_format", 400),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema", 400),
    ({"response_format": schema_format("t", {"type": "objekt"})}, "response_format", 400),
    ({"response_format": schema_format("e", {"enum": []})}, "response_format", 400),  # no text
    ({"response_format": schema_format("big", {"type": "object", "description": "x" * 70000})},
     "response_format.json_schema.schema", 413),
    ({"grammar": "root ::= ("}, "grammar", 400),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar", 400),
    ({"n": 5}, "n", 400),
    ({"n": 0}, "n", 400),
    ({"tools": [{"type": "function", "function": {"name": "t", "parameters": {
        "type": "objekt"}}}]}, "tools[0].function.parameters", 400),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", 400),
])
def test_what_cannot_be_enforced_is_refused_naming_the_field(client: openai.OpenAI,
                                                              body: dict[str, Any],
                                                              param: str, status: int) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=8,
                                       extra_body=body)
    assert err.value.status_code == status, err.value.body
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == param, \
        err.value.body

"""Property-based API fuzzing with schemathesis, against the specs the protocols publish.

Two specs under ``tests/specs/``: the Open Inference Protocol's REST spec (vendored with the
path-template fixes and the statuses peers answer, listed at its top) and a fragment of
OpenAI's (embeddings, chat, text completions, models). schemathesis draws requests from them
(valid ones, invalid ones, and its coverage phase's boundary values, unsupported methods and
media types) and sends them to one real ``sokuji serve`` process serving the real ``minilm``
and ``smollm2``. Every response must pass: no 5xx, a documented status, a documented content
type, a body matching the documented schema, the documented headers (``Allow`` on 405), and
every error carries a non-empty reason.

A process, not schemathesis's in-process ASGI transport: that transport ends the app's
lifespan after every test item and starts it again for the next, and a Sokuji app's lifespan
runs once (shutdown stops the engines and closes the models).

Bounded and deterministic: ``derandomize=True`` (the same requests every run), a fixed number
of examples per test (plus the coverage phase's fixed set), generation capped at 8 new tokens
(the schema and the server's config agree), and the response cache on (the default a user runs;
repeated texts are answered from it, which also fuzzes the cached path). Jobs are off: the
fuzz stays off the job store, which has its own tests.

Most of the run names the served models (the path parameters and ``model`` fields narrowed to
an ``enum`` of them), so requests reach the codecs; the ``*_any_model`` tests send arbitrary
names.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
import yaml
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from tests.conftest import CACHE_DIR
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

SPECS = Path(__file__).resolve().parent.parent / "specs"
ENCODER, GENERATOR = "minilm", "smollm2"
SERVED = [ENCODER, GENERATOR]
MAX_NEW_TOKENS = 8  # the fragment's bound on max_tokens; the server refuses more
ENCODER_DIM = 384


def _load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((SPECS / name).read_text(encoding="utf-8"))
    return doc


def _narrow_paths(spec: dict[str, Any]) -> dict[str, Any]:
    """The OIP spec with path parameters naming what is served (so requests reach the
    codecs instead of stopping at 404)."""
    spec = copy.deepcopy(spec)
    for item in spec["paths"].values():
        for param in item.get("parameters", []):
            if param["name"] == "model_name":
                param["schema"] = {"type": "string", "enum": SERVED}
            elif param["name"] == "model_version":
                param["schema"] = {"type": "string", "enum": ["1"]}
    return spec


def _narrow_tensor(spec: dict[str, Any]) -> dict[str, Any]:
    """The OIP spec with inputs shaped like minilm's (one BYTES tensor named ``text``), so
    requests get past the name and datatype checks to shapes, data and inference."""
    spec = _narrow_paths(spec)
    for item in spec["paths"].values():
        for param in item.get("parameters", []):
            if param["name"] == "model_name":
                param["schema"] = {"type": "string", "enum": [ENCODER]}
    schemas = spec["components"]["schemas"]
    tensor = schemas["request_input"]["properties"]
    tensor["name"] = {"type": "string", "enum": ["text"]}
    tensor["datatype"] = {"type": "string", "enum": ["BYTES"]}
    tensor["shape"] = {"type": "array", "items": {"type": "integer"},
                       "enum": [[1], [2], [1, 1], [2, 1]]}
    tensor["data"] = {"type": "array", "minItems": 1, "maxItems": 2,
                      "items": {"type": "string", "maxLength": 64}}
    schemas["inference_request"]["properties"]["inputs"].update(minItems=1, maxItems=1)
    schemas["request_output"]["properties"]["name"] = {"type": "string", "enum": ["embedding"]}
    return spec


def _with_extensions(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec with Sokuji's (and Triton's) request extensions on its POST operations, which
    no published spec has: the headers ``X-Sokuji-Priority``, ``X-Sokuji-Timeout-Ms`` and
    ``Cache-Control``; on V2, the request parameters ``priority`` and ``timeout`` (Triton's)
    and binary outputs (Triton's binary tensor extension: ``application/octet-stream``)."""
    spec = copy.deepcopy(spec)
    headers = [
        {"name": "X-Sokuji-Priority", "in": "header",
         "schema": {"type": "string", "enum": ["interactive", "batch"]}},
        {"name": "X-Sokuji-Timeout-Ms", "in": "header",
         "schema": {"type": "number", "exclusiveMinimum": True, "minimum": 0}},
        {"name": "Cache-Control", "in": "header",
         "schema": {"type": "string", "enum": ["no-cache", "no-store"]}},
    ]
    for item in spec["paths"].values():
        if "post" in item:
            item["post"].setdefault("parameters", []).extend(copy.deepcopy(headers))
            ok = item["post"]["responses"]["200"]
            if item["post"]["operationId"].endswith(("-infer", "-infer-unversioned")):
                ok["content"]["application/octet-stream"] = {
                    "schema": {"type": "string", "format": "binary"}}
    schemas = spec["components"]["schemas"]
    if "inference_request" in schemas:
        schemas["inference_request"]["properties"]["parameters"] = {
            "type": "object", "properties": {
                "priority": {"type": "integer", "minimum": 0},
                "timeout": {"type": "integer", "minimum": 1},
                "binary_data_output": {"type": "boolean"}}}
        schemas["request_output"]["properties"]["parameters"] = {
            "type": "object", "properties": {"binary_data": {"type": "boolean"}}}
    return spec


def _served_openai(spec: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI fragment narrowed to requests Sokuji serves: ``model`` names a served model,
    and the fields Sokuji refuses unless at their default, or honours within tighter bounds
    than the spec's (``n``; penalties, log-probabilities, and logit bias, whose token ids
    must be in the model's vocabulary; tools, non-text response formats, ``echo``,
    ``best_of``, ``suffix``,
    ``dimensions`` other than the model's, token-id embedding input, ``stream_options``
    without streaming) are held at it, so most valid requests reach the models. Their
    refusals are fuzzed by the negative cases and by ``test_openai_any_model``."""
    spec = copy.deepcopy(spec)
    schemas = spec["components"]["schemas"]
    embed = schemas["CreateEmbeddingRequest"]["properties"]
    embed["model"] = {"type": "string", "enum": SERVED}
    embed["dimensions"] = {"type": "integer", "enum": [ENCODER_DIM]}
    embed["input"]["oneOf"] = embed["input"]["oneOf"][:2]  # text, not token ids
    default_only = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "top_logprobs": 0,
                    "tool_choice": "none", "echo": False, "best_of": 1}
    for name, logprobs in (("CreateChatCompletionRequest", False),
                           ("CreateCompletionRequest", 0)):
        schema = schemas[name]
        props = schema["properties"]
        schema["additionalProperties"] = False
        props["model"] = {"type": "string", "enum": [GENERATOR]}
        for field, value in {**default_only, "logprobs": logprobs}.items():
            if field in props:
                props[field] = {"enum": [value]}
        for field in ("logit_bias", "tools", "stream_options", "suffix"):
            props.pop(field, None)
        # Where Sokuji (as vLLM) is stricter than OpenAI's spec: max_tokens 0, top_p 0, empty
        # prompts and empty stop strings are refused; one prompt per request.
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field]["minimum"] = 1
        props["top_p"].update(exclusiveMinimum=True)
        props["stop"] = {"nullable": True, "oneOf": [
            {"type": "string", "maxLength": 16},
            {"type": "array", "minItems": 1, "maxItems": 4,
             "items": {"type": "string", "minLength": 1, "maxLength": 16}}]}
        if "prompt" in props:
            forms = props["prompt"]["oneOf"]
            props["prompt"]["oneOf"] = [{**forms[0], "minLength": 1},
                                        {**forms[1], "maxItems": 1}, forms[2]]
        if "response_format" in props:
            props["response_format"]["properties"]["type"]["enum"] = ["text"]
    return spec


OIP = _load("open_inference_rest.yaml")
OPENAI = _load("openai_fragment.yaml")
GENERATION_OPS = r"^/v1/(chat/)?completions$"

# 503 (not ready) and 504 (a deadline the client set passed) are load shedding, documented in
# both specs; every other 5xx is a bug.
NOT_A_SERVER_ERROR = {"not_a_server_error": {
    "expected-statuses": ["2xx", "3xx", "4xx", "503", "504"]}}
FUZZ_CONFIG = schemathesis.Config.from_dict({"checks": NOT_A_SERVER_ERROR})
# Generation: the coverage phase's boundary cases only where they are invalid (each answered at
# once); valid requests, each a generation of up to 8 tokens, come from the bounded fuzzing.
GENERATION_CONFIG = schemathesis.Config.from_dict({
    "checks": NOT_A_SERVER_ERROR,
    "phases": {"coverage": {"generation": {"mode": "negative"}}}})


def _schema(spec: dict[str, Any], config: Any = FUZZ_CONFIG) -> Any:
    return schemathesis.openapi.from_dict(spec, config=config)


oip = _schema(_narrow_paths(OIP))
oip_any_model = _schema(OIP).include(path_regex=r"\{model_name\}")
oip_tensor = _schema(_with_extensions(_narrow_tensor(OIP))).include(path_regex=r"/infer$")
OPENAI_SERVED = _with_extensions(_served_openai(OPENAI))
openai_encoder = _schema(OPENAI_SERVED).exclude(path_regex=GENERATION_OPS)
openai_generation = _schema(OPENAI_SERVED, GENERATION_CONFIG).include(
    path_regex=GENERATION_OPS)
openai_any_model = _schema(OPENAI).exclude(path="/v1/models")


def error_has_reason(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every error (4xx, and the 503/504 allowed above) says why in its JSON body:
    ``{"error": "..."}`` on V2 (Triton's shape), ``{"error": {"message": "..."}}`` on OpenAI's
    routes."""
    if response.status_code < 400 or response.request.method == "HEAD":
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code} without a JSON body: "
                             f"{response.content[:200]!r}") from None
    error = body.get("error") if isinstance(body, dict) else None
    if case.operation.path.startswith("/v1/"):
        reason = error.get("message") if isinstance(error, dict) else None
        shape = '{"error": {"message": "..."}}'
    else:
        reason, shape = error, '{"error": "..."}'
    assert isinstance(reason, str) and reason.strip(), \
        f"{response.status_code} without a reason: expected {shape}, got {body!r}"
    return None


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, response_headers_conformance, unsupported_method,
          error_has_reason]


# A longer hunt, by hand: SOKUJI_FUZZ_SCALE=20 multiplies every test's examples.
SCALE = float(os.environ.get("SOKUJI_FUZZ_SCALE", "1"))


def fuzz(max_examples: int) -> Any:
    """Hypothesis settings of one fuzz test: fixed examples, derandomized, no database (the
    same requests every run), no deadline (a busy machine is slow, not wrong)."""
    return settings(max_examples=max(1, round(max_examples * SCALE)), derandomize=True,
                    database=None, deadline=None, suppress_health_check=list(HealthCheck),
                    print_blob=False)


SERVER_TOML = f"""cache_dir = "{CACHE_DIR}"
max_request_bytes = 262144
[jobs]
enabled = false
[[models]]
name = "{ENCODER}"
max_batch_size = 8
[[models]]
name = "{GENERATOR}"
runtime = "llama"
[models.options]
slots = 2
context_size = 256
threads = 1
max_new_tokens = {MAX_NEW_TOKENS}
prefix_cache_mb = 8
"""


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, requests.Session]]:
    """The server's base URL, and one keep-alive session for every request of the module."""
    with sokuji_server(SERVER_TOML) as url, requests.Session() as session:
        yield url, session


def _run(case: Any, server: tuple[str, requests.Session]) -> None:
    url, session = server
    case.call_and_validate(base_url=url, session=session, checks=CHECKS)


@oip.parametrize()
@fuzz(max_examples=40)
def test_oip(case: Any, server: tuple[str, requests.Session]) -> None:
    _run(case, server)


@oip_tensor.parametrize()
@fuzz(max_examples=60)
def test_oip_infer_tensor(case: Any, server: tuple[str, requests.Session]) -> None:
    _run(case, server)


@oip_any_model.parametrize()
@fuzz(max_examples=10)
def test_oip_any_model(case: Any, server: tuple[str, requests.Session]) -> None:
    _run(case, server)


@openai_encoder.parametrize()
@fuzz(max_examples=60)
def test_openai_embeddings_and_models(case: Any, server: tuple[str, requests.Session]) -> None:
    _run(case, server)


@openai_generation.parametrize()
@fuzz(max_examples=15)
def test_openai_generation(case: Any, server: tuple[str, requests.Session]) -> None:
    _run(case, server)


@openai_any_model.parametrize()
@fuzz(max_examples=8)
def test_openai_any_model(case: Any, server: tuple[str, requests.Session]) -> None:
    _run(case, server)

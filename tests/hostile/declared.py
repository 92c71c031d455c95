"""What every kind declares to the hostile-input suite: the model of it that the suite's one
server carries, the valid requests it serves (one per route), the kinds of input it takes (so
the matrix knows which mutations apply) and, per limit it states, how to send a request just
past it.

A kind that is registered (``sokuji.repository.registry``: the built-in names and every
installed ``sokuji.kinds`` entry point) and has no ``Declared`` here fails
``test_every_kind_declared.py``: add one beside the others (docs/adding-a-kind.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from tests.conftest import ROOT
from tests.hostile import bodies

MEDIA = ROOT / "tests" / "data" / "media"
PROTOTYPES = ROOT / "tests" / "data" / "routing" / "prototypes.jsonl"

TEXT, TENSOR, IMAGE, AUDIO, CHAT = "text", "tensor", "image", "audio", "chat"
"""The kinds of input a model takes: each mutation applies to some of them."""
V2_JSON, V2_BINARY, PLAIN, OPENAI, STREAM = "v2_json", "v2_binary", "plain", "openai", "stream"
"""The routes a request goes by."""

SERVER_BYTES = 256 * 1024
"""The suite server's ``max_request_bytes``."""
MEDIA_BYTES = 1024 * 1024
"""The media models' own ``max_request_bytes``."""
JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Request:
    """One request: how it goes (``route``), where, with which headers and body."""

    route: str
    path: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=lambda: dict(JSON))

    @property
    def label(self) -> str:
        """Its name in a case's id: the route (OpenAI's: which endpoint)."""
        return f"{self.route}-{self.path.split('/')[2]}" if self.route == OPENAI else self.route


@dataclass(frozen=True)
class Declared:
    """One kind's inputs to the matrix."""

    runtime: str
    model: str
    """The served model's name in the suite's server."""
    config: str
    """Its TOML table(s) (``[[models]]`` or ``[[pipelines]]``); ``{upstream}`` is replaced by
    the URL of the suite's upstream server, ``{tenant_keys}`` by a ``tenant_keys_env`` giving
    each tenant its own key there."""
    inputs: frozenset[str]
    requests: tuple[Request, ...]
    """One valid request per route it serves; the first is its normal request (asked after
    every case: the server still answers it)."""
    exceed: Mapping[str, Callable[[float], Request]] = field(default_factory=dict)
    """Limit key -> a request needing just past ``value`` of it (a limit without an entry
    cannot be exceeded by a request: e.g. a text longer than the tokens a model reads is cut)."""
    at_limit_refused_by_steps: frozenset[str] = frozenset()
    """Limit keys whose request at the limit passes that limit but is refused by an inner
    model's own, tighter one (a pipeline's characters: its features step takes 256): the
    at-limit request must not be refused for this limit, but need not answer 200."""
    body_bytes: int = SERVER_BYTES
    """The body limit its routes answer 413 past."""
    cached: bool = True
    """Its V2 answers go through the response cache (a repeated request hits)."""
    non_finite: bool = False
    """Its tensors carry NaN and infinity as values (a tensor model's graph computes on
    them): the NaN-tensor case expects them answered, not refused."""

    @property
    def normal(self) -> Request:
        return self.requests[0]

    def by_route(self, route: str) -> Request | None:
        return next((r for r in self.requests if r.route == route), None)


def v2_texts(model: str, texts: list[str], name: str = "text", **extra: Any) -> Request:
    return Request(V2_JSON, f"/v2/models/{model}/infer",
                   bodies.v2_json(name, "BYTES", list(texts), **extra))


def v2_binary_texts(model: str, texts: list[str], name: str = "text") -> Request:
    body, headers = bodies.v2_binary(name, "BYTES", [len(texts)],
                                     bodies.bytes_elements([t.encode() for t in texts]))
    return Request(V2_BINARY, f"/v2/models/{model}/infer", body, headers)


def embeddings(model: str, texts: list[str], **extra: object) -> Request:
    return Request(OPENAI, "/v1/embeddings",
                   orjson.dumps({"model": model, "input": texts, **extra}))


def chat(model: str, content: str, stream: bool = False, **extra: object) -> Request:
    return Request(STREAM if stream else OPENAI, "/v1/chat/completions", orjson.dumps({
        "model": model, "messages": [{"role": "user", "content": content}],
        "max_tokens": 4, "temperature": 0, "stream": stream, **extra}))


def files_v2(model: str, name: str, files: list[bytes]) -> Request:
    return Request(V2_JSON, f"/v2/models/{model}/infer", bodies.v2_files(name, files))


def files_binary(model: str, name: str, files: list[bytes]) -> Request:
    body, headers = bodies.v2_binary(name, "BYTES", [len(files)],
                                     bodies.bytes_elements(files))
    return Request(V2_BINARY, f"/v2/models/{model}/infer", body, headers)


def upload(model: str, data: bytes, content_type: str) -> Request:
    return Request(PLAIN, f"/v2/models/{model}/infer", data, {"Content-Type": content_type})


def text_exceed(model: str, name: str = "text") -> dict[str, Callable[[float], Request]]:
    """How to pass a model of texts' limits: one text more than ``max_batch_size``, one byte
    more than ``max_request_bytes``."""
    return {"max_batch_size": lambda v: v2_texts(model, ["x"] * (int(v) + 1), name),
            "max_request_bytes": lambda v: v2_texts(model, ["x" * (int(v) + 1)], name)}


def echo_request(x: np.ndarray) -> Request:
    return Request(V2_JSON, "/v2/models/echo/infer",
                   bodies.v2_json("x", "FP32", [float(v) for v in x]))


def echo_binary(x: np.ndarray) -> Request:
    body, headers = bodies.v2_binary("x", "FP32", [len(x)], x.astype("<f4").tobytes())
    return Request(V2_BINARY, "/v2/models/echo/infer", body, headers)


def tensor_request(x: np.ndarray, model: str = "tensor") -> Request:
    return Request(V2_JSON, f"/v2/models/{model}/infer",
                   bodies.v2_json("x", "FP32", [float(v) for v in x.reshape(-1)],
                                  shape=list(x.shape)))


def tensor_binary(x: np.ndarray, model: str = "tensor") -> Request:
    body, headers = bodies.v2_binary("x", "FP32", list(x.shape), x.astype("<f4").tobytes())
    return Request(V2_BINARY, f"/v2/models/{model}/infer", body, headers)


PY_DOUBLE = ROOT / "tests" / "data" / "pymodels" / "hostile_double.py"
"""x FP32 -> y = x + x, a Python class (``runtime = "python"``)."""
TENSOR_GRAPH = ROOT / "tests" / "data" / "tensor" / "double.onnx"
"""x FP32 [batch, n] -> y = x + x (``tests/tensor_graphs.py``'s ``write_double``)."""
IMAGE_FILE = (MEDIA / "images" / "tiny_la.png").read_bytes()
AUDIO_FILE = bodies.wav(seconds=0.5)
TEXTS = ["the hostile suite's normal request", "and a second text"]

DECLARED: dict[str, Declared] = {d.runtime: d for d in (
    Declared(
        runtime="onnx", model="minilm",
        config='[[models]]\nname = "minilm"\nruntime = "onnx"\nmax_batch_size = 8\n',
        inputs=frozenset({TEXT}),
        requests=(v2_texts("minilm", TEXTS), v2_binary_texts("minilm", TEXTS),
                  embeddings("minilm", TEXTS)),
        exceed=text_exceed("minilm")),
    Declared(
        runtime="synthetic", model="synth",
        config='[[models]]\nname = "synth"\nruntime = "synthetic"\nmax_batch_size = 8\n'
               'options = { base_ms = 0.0 }\n',
        inputs=frozenset({TEXT}),
        requests=(v2_texts("synth", TEXTS), v2_binary_texts("synth", TEXTS),
                  embeddings("synth", TEXTS)),
        exceed=text_exceed("synth")),
    Declared(
        runtime="classifier", model="intent",
        config=f'[[models]]\nname = "intent"\nruntime = "classifier"\nmax_batch_size = 8\n'
               f'semantic_cache = {{ enabled = true, embedder = "minilm", threshold = 0.85 }}\n'
               f'options = {{ encoder = "minilm", prototypes = "{PROTOTYPES}" }}\n',
        inputs=frozenset({TEXT}),
        requests=(v2_texts("intent", ["I lost my card"]),
                  v2_binary_texts("intent", ["I lost my card"])),
        exceed=text_exceed("intent")),
    Declared(
        runtime="llama", model="smollm2",
        config='[[models]]\nname = "smollm2"\nruntime = "llama"\ncache = false\n'
               'options = { slots = 2, context_size = 512, max_new_tokens = 32, '
               'prefix_cache_mb = 16 }\n',
        inputs=frozenset({CHAT}),
        requests=(chat("smollm2", "Say hi."), chat("smollm2", "Say hi.", stream=True),
                  Request(OPENAI, "/v1/completions", orjson.dumps({
                      "model": "smollm2", "prompt": "Hello", "max_tokens": 2,
                      "temperature": 0}))),
        cached=False),
    Declared(
        runtime="ocr", model="ocr",
        config=f'[[models]]\nname = "ocr"\nruntime = "ocr"\nmax_batch_size = 4\n'
               f'max_request_bytes = {MEDIA_BYTES}\n',
        inputs=frozenset({IMAGE}),
        requests=(files_v2("ocr", "image", [IMAGE_FILE]),
                  files_binary("ocr", "image", [IMAGE_FILE]),
                  upload("ocr", IMAGE_FILE, "image/png")),
        body_bytes=MEDIA_BYTES),
    Declared(
        runtime="vad", model="vad",
        config=f'[[models]]\nname = "vad"\nruntime = "vad"\nmax_batch_size = 4\n'
               f'max_concurrency = 2\nmax_request_bytes = {MEDIA_BYTES}\n'
               'options = { max_audio_s = 30 }\n',
        inputs=frozenset({AUDIO}),
        requests=(files_v2("vad", "audio", [AUDIO_FILE]),
                  files_binary("vad", "audio", [AUDIO_FILE]),
                  upload("vad", AUDIO_FILE, "audio/wav"),
                  Request(STREAM, "/v2/models/vad/infer", AUDIO_FILE,
                          {"Content-Type": "audio/wav", "Accept": "application/x-ndjson"})),
        body_bytes=MEDIA_BYTES),
    Declared(
        runtime="upstream", model="far",
        config='[[models]]\nname = "far"\nruntime = "upstream"\nmax_batch_size = 8\n'
               '[models.options]\nprotocol = "v2"\nurl = "{upstream}"\n'
               'upstream_model = "enc"\n{tenant_keys}\n',
        inputs=frozenset({TEXT}),
        requests=(v2_texts("far", TEXTS), v2_binary_texts("far", TEXTS)),
        ),
    Declared(
        runtime="router", model="route",
        config='[[models]]\nname = "route"\nruntime = "router"\nmax_batch_size = 8\n'
               'options = { kind = "rules", default = "synth" }\n',
        inputs=frozenset({TEXT}),
        requests=(v2_texts("route", TEXTS), v2_binary_texts("route", TEXTS),
                  embeddings("route", TEXTS)),
        exceed=text_exceed("route")),
    Declared(
        runtime="pipeline", model="profile",
        config='[[pipelines]]\nname = "profile"\ninputs = ["user"]\noptional_inputs = []\n'
               'chat_input = "user"\n'
               '[[pipelines.steps]]\nname = "features"\nkind = "features"\n'
               'inputs = { entity_id = "input.user" }\n'
               'options = { entity = "user", features = ["plan"] }\n',
        inputs=frozenset({TEXT}),
        requests=(v2_texts("profile", ["user-0001"], name="user"),),
        exceed={"elements": lambda v: v2_texts("profile", ["u"] * (int(v) + 1), name="user"),
                "characters": lambda v: v2_texts("profile", ["x" * (int(v) + 1)],
                                                 name="user")},
        at_limit_refused_by_steps=frozenset({"elements", "characters"})),
    Declared(
        runtime="echo", model="echo",
        config='[[models]]\nname = "echo"\nruntime = "echo"\n'
               'options = { scale = 2.0, max_elements = 4096 }\n',
        inputs=frozenset({TENSOR}),
        requests=(echo_request(np.arange(4, dtype=np.float32)),
                  echo_binary(np.arange(4, dtype=np.float32))),
        exceed={"options.max_elements":
                lambda v: echo_binary(np.zeros(int(v) + 1, np.float32)),
                "max_request_bytes":
                lambda v: echo_binary(np.zeros(int(v) // 4 + 1, np.float32))}),
    Declared(
        runtime="tensor", model="tensor",
        config=f'[[models]]\nname = "tensor"\nruntime = "tensor"\npath = "{TENSOR_GRAPH}"\n'
               'max_batch_size = 8\noptions = { max_elements = 4096 }\n',
        inputs=frozenset({TENSOR}),
        requests=(tensor_request(np.arange(8, dtype=np.float32).reshape(2, 4)),
                  tensor_binary(np.arange(8, dtype=np.float32).reshape(2, 4))),
        exceed={"options.max_elements":
                lambda v: tensor_binary(np.zeros((1, int(v) + 1), np.float32)),
                "max_request_bytes":
                lambda v: tensor_binary(np.zeros((1, int(v) // 4 + 1), np.float32))},
        non_finite=True),
    Declared(  # a Triton ensemble of one step: the tensor model above
        runtime="ensemble", model="ensemble",
        config='[[models]]\nname = "ensemble"\nruntime = "ensemble"\nmax_batch_size = 8\n'
               '[models.options]\n'
               'inputs = [{ name = "x", datatype = "FP32", dims = [-1] }]\n'
               'outputs = [{ name = "y", datatype = "FP32", dims = [-1] }]\n'
               'steps = [{ model = "tensor", input_map = { x = "x" }, '
               'output_map = { y = "y" } }]\n',
        inputs=frozenset({TENSOR}),
        requests=(tensor_request(np.arange(8, dtype=np.float32).reshape(2, 4), "ensemble"),
                  tensor_binary(np.arange(8, dtype=np.float32).reshape(2, 4), "ensemble")),
        cached=False, non_finite=True),
    Declared(  # the user's own class, in a server thread, its tensors declared
        runtime="python", model="python",
        config='[[models]]\nname = "python"\nruntime = "python"\nmax_batch_size = 8\n'
               '[models.options]\n'
               f'entry = "{PY_DOUBLE}:Double"\nmax_elements = 4096\nfactor = 2.0\n'
               'inputs = [{ name = "x", datatype = "FP32", dims = [-1, -1] }]\n'
               'outputs = [{ name = "y", datatype = "FP32", dims = [-1, -1] }]\n',
        inputs=frozenset({TENSOR}),
        requests=(tensor_request(np.arange(8, dtype=np.float32).reshape(2, 4), "python"),
                  tensor_binary(np.arange(8, dtype=np.float32).reshape(2, 4), "python")),
        exceed={"options.max_elements":
                lambda v: tensor_binary(np.zeros((1, int(v) + 1), np.float32), "python"),
                "max_request_bytes":
                lambda v: tensor_binary(np.zeros((1, int(v) // 4 + 1), np.float32),
                                        "python")},
        non_finite=True),
)}
"""Runtime name -> its declaration."""

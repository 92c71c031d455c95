"""A model that is another server (``runtime = "upstream"``): KServe V2 (another Sokuji,
Triton) or OpenAI-compatible (another Sokuji, llama-server, vLLM), served under the model
contract (``core/model.py``) like a local one, so it is named, authorised, admitted,
cached and routed like any other.

- ``protocol = "v2"``: an encoder. ``load()`` asks the upstream's metadata (``GET
  /v2/models/{m}``: its BYTES input, its first output and its width); each request is one
  ``POST /v2/models/{m}/infer`` with JSON tensors, the output asked in binary (Triton's
  extension, which Sokuji speaks), read back as float32 ``[n, d]`` like a local encoder's.
- ``protocol = "openai"``, ``task = "embeddings"``: an encoder over ``POST /v1/embeddings``
  (``load()`` learns the width from one tiny call, or ``dims``).
- ``protocol = "openai"``, ``task = "chat"``: a generator over ``/v1/chat/completions`` and
  ``/v1/completions``, streamed through (``upstream_stream.py``).

The HTTP side (pool, headers, the safe retry, bounded bodies, status mapping) is
``upstream_http.py``. Its address, model and credentials come from the config only; the
upstream's keys are read from the environment at load (an unset one is a config error).
Tenants that share a credential on the upstream get nothing of the upstream's shared state
(its ``cached_tokens``, its ``Server-Timing``): ``UpstreamClient.reveals``; load warns once
which tenants those are, and what gives them their own (``tenant_keys_env``).
``alive`` means started: a dead upstream does not make this server unready (the router's
breaker skips it); admission is by requests in flight (``max_queue_depth``,
``max_concurrency``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from sokuji import http_client
from sokuji.config import ModelConfig
from sokuji.core import policy, text_tensors
from sokuji.core.limits import Limit
from sokuji.core.model import (
    NOTHING,
    Api,
    Capacity,
    GenerationInput,
    ModelBase,
    ModelMetadata,
    Report,
    RequestContext,
    TensorSpec,
)
from sokuji.core.request import Stage
from sokuji.core.tensor import InferRequest, Tensor
from sokuji.errors import ConfigError, InvalidInput, ModelNotReady
from sokuji.llm.request import STOP_LIMITS, Timing
from sokuji.routing.config import UpstreamOptions
from sokuji.routing.upstream_codec import DTYPES, completion_request, embeddings, v2_output
from sokuji.routing.upstream_errors import (
    UpstreamFailed,
    UpstreamOverloaded,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from sokuji.routing.upstream_http import OnAttempt, UpstreamClient
from sokuji.routing.upstream_stream import UpstreamGeneration

__all__ = ["UpstreamFailed", "UpstreamModel", "UpstreamOverloaded", "UpstreamRejected",
           "UpstreamTimeout", "UpstreamUnavailable"]

log = logging.getLogger(__name__)
_TOTAL = re.compile(r"(?:^|,)\s*total;dur=([0-9.]+)")
STOP_GRACE_S = 10.0
"""At stop, requests in flight get this long (at most ``timeout_ms``) before the session
closes under them."""



@dataclass
class UpstreamPrepared:
    """An encoder request for the upstream: its texts; ``num_tokens`` is filled from the
    upstream's usage once it answered (0 if it gives none)."""

    texts: list[str]
    num_items: int
    num_tokens: int = 0
    length: int = 0


@dataclass(frozen=True)
class PreparedCompletion:
    path: str
    body: bytes
    chat: bool


class _Completions:
    """Completions per second: an EWMA over windows of at least a second."""

    __slots__ = ("count", "per_s", "since")

    def __init__(self) -> None:
        self.since = time.perf_counter()
        self.count = 0
        self.per_s = 0.0

    def observe(self) -> None:
        self.count += 1
        now = time.perf_counter()
        if now - self.since >= 1.0:
            rate = self.count / (now - self.since)
            self.per_s = rate if not self.per_s else 0.7 * self.per_s + 0.3 * rate
            self.since, self.count = now, 0


class UpstreamCall:
    """An encoder request in flight on the upstream (a ``Submission``)."""

    def __init__(self, task: asyncio.Task[np.ndarray], prepared: UpstreamPrepared) -> None:
        self._task = task
        self.prepared = prepared

    async def result(self) -> np.ndarray:
        return await self._task

    @property
    def report(self) -> Report:
        """The upstream's usage, when it gives one."""
        tokens = self.prepared.num_tokens
        return Report(input_tokens=tokens) if tokens else NOTHING

    def cancel(self) -> None:
        self._task.cancel()


class UpstreamModel(ModelBase):
    def __init__(self, config: ModelConfig, options: UpstreamOptions,
                 tenants: Collection[str] = ()) -> None:
        """``tenants``: every tenant configured on this server (its ``api_keys``); empty:
        none are, every caller is one."""
        self.config = config
        self.options = options
        self.tenants = frozenset(tenants)
        if options.protocol == "v2" and options.task != "embeddings":
            raise ConfigError.for_key(f"models.{config.name}.options.task", options.task,
                                      "protocol v2 serves encoders only (use openai for chat)")
        self.generates = options.protocol == "openai" and options.task == "chat"
        self.apis = frozenset({Api.GENERATE}) if self.generates \
            else frozenset({Api.INFER, Api.EMBED})
        self.batches = not self.generates
        """An encoder upstream answers a row per text, as a local one (Triton's view)."""
        self.client = UpstreamClient(config.name, options)
        self.input_name = "text"
        """The upstream's input (V2)."""
        self.metadata = self._describe(options.dims or -1, "embedding")
        answer = Limit("options.max_response_bytes", options.max_response_bytes, "bytes",
                       "bytes of one upstream answer held (a stream's events together); "
                       "past it the answer is cut off, 502")
        self.limits = (answer, *STOP_LIMITS) if self.generates else (answer,)
        """The most it holds for one request; the work is the upstream's, bounded there
        (its own max_tokens, context and limits), and the request's bytes are the
        server's."""
        self.in_flight = 0
        self._started = False
        self._idle = asyncio.Event()
        self._completions = _Completions()
        self._admission = policy.Admission(config.name, config.max_queue_depth,
                                           config.max_concurrency)

    @property
    def name(self) -> str:
        return self.config.name

    def attach(self, observers: Any) -> None:
        self.on_attempt = observers.upstream_attempt

    @property
    def on_attempt(self) -> OnAttempt | None:
        """Called once per HTTP attempt: (name, status or a word, seconds)."""
        return self.client.on_attempt

    @on_attempt.setter
    def on_attempt(self, callback: OnAttempt | None) -> None:
        self.client.on_attempt = callback

    def _describe(self, width: int, output: str) -> ModelMetadata:
        if self.generates:
            return ModelMetadata(platform="upstream_openai",
                                 inputs=(TensorSpec("text_input", "BYTES", (1,)),),
                                 outputs=(TensorSpec("text_output", "BYTES", (1,)),))
        return ModelMetadata(platform=f"upstream_{self.options.protocol}",
                             inputs=(TensorSpec("text", "BYTES", (-1,)),),
                             outputs=(TensorSpec(output, "FP32", (-1, width)),))

    # -- load: blocking, before the event loop serves -------------------------------------
    def load(self) -> None:
        opts = self.options
        at = f"models.{self.name}.options"
        self.client.default_key = self._env(f"{at}.api_key_env", opts.api_key_env)
        self.client.keys = {tenant: self._env(f"{at}.tenant_keys_env.{tenant}", var)
                            for tenant, var in opts.tenant_keys_env.items()}
        shared = self.client.share(self.tenants)
        if shared:
            log.warning(
                "model '%s': tenants %s are sent to the upstream at %s with a credential "
                "another tenant shares (api_key_env, or one key in tenant_keys_env), so the "
                "upstream's caches and timings reflect each other's requests: their answers "
                "carry no usage.prompt_tokens_details.cached_tokens (0) and none of the "
                "upstream's Server-Timing. Give each tenant its own key on the upstream "
                "(options.tenant_keys_env = { tenant = \"ENV_VAR\" }) to pass them through",
                self.name, ", ".join(shared), opts.url)
        if self.generates:
            return
        if opts.protocol == "v2":
            width, output = self._load_v2()
        else:
            width, output = self._load_embeddings(), "embedding"
        if opts.dims and width > 0 and width != opts.dims:
            raise ConfigError.for_key(f"{at}.dims", opts.dims,
                                      f"the upstream at {opts.url} gives width {width}")
        width = width if width > 0 else opts.dims
        if width <= 0:
            raise ConfigError.for_key(f"{at}.dims", opts.dims, f"the upstream at {opts.url} "
                                      "does not say its output width: set dims")
        self.metadata = self._describe(width, output)

    @staticmethod
    def _env(key: str, var: str) -> str:
        if not var:
            return ""
        value = os.environ.get(var, "")
        if not value:
            raise ConfigError.for_key(key, var, "this environment variable is not set")
        return value

    def _fetch(self, path: str, body: bytes | None, timeout_s: float) -> Any:
        """GET (or POST ``body``) at load; the JSON answer, None if the upstream cannot be
        reached, a ``ConfigError`` if it answered that the configuration is wrong. Redirects
        are not followed (a 3xx is such an answer); the body is bounded by
        ``max_response_bytes``."""
        opts = self.options
        headers = {"content-type": "application/json", "user-agent": "sokuji-upstream"}
        if self.client.default_key:
            headers["authorization"] = f"Bearer {self.client.default_key}"
        where = f"model '{self.name}': the upstream at {opts.url}"
        try:
            reply = http_client.request("GET" if body is None else "POST",
                                        self.client.base + path, headers=headers, body=body,
                                        timeout_s=timeout_s, max_bytes=opts.max_response_bytes)
        except http_client.Unreachable as exc:
            log.warning("%s cannot be reached at load: %s", where, exc)
            return None
        if reply.status >= 500 or reply.status == 429:
            log.warning("%s answered %d at load", where, reply.status)
            return None
        if not reply.ok:
            raise ConfigError(f"{where} answered {reply.status} to {path}: check "
                              "upstream_model, the url and the key", param=f"models.{self.name}")
        if reply.truncated:
            raise ConfigError(f"{where} answered more than max_response_bytes "
                              f"({opts.max_response_bytes}) to {path}",
                              param=f"models.{self.name}")
        try:
            return orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            raise ConfigError(f"{where} did not answer JSON to {path}",
                              param=f"models.{self.name}") from None

    def _unreached(self) -> tuple[int, str]:
        if not self.options.dims:
            raise ConfigError(f"model '{self.name}': the upstream at {self.options.url} "
                              "cannot be reached to learn its output; start it first or set "
                              "dims", param=f"models.{self.name}.options.url")
        return self.options.dims, "embedding"

    def _load_v2(self) -> tuple[int, str]:
        opts = self.options
        doc = self._fetch(f"/v2/models/{opts.upstream_model}", None,
                          opts.connect_timeout_ms / 1e3)
        if doc is None:
            return self._unreached()
        where = f"model '{self.name}': upstream '{opts.upstream_model}' at {opts.url}"
        try:
            inputs = [t for t in doc["inputs"] if t["datatype"] == "BYTES"]
            output = doc["outputs"][0]
            shape = [int(d) for d in output["shape"]]
            name, datatype = str(output["name"]), output["datatype"]
        except (KeyError, IndexError, TypeError, ValueError):
            raise ConfigError(f"{where}: its metadata lacks inputs or outputs",
                              param=f"models.{self.name}") from None
        if not inputs:
            raise ConfigError(f"{where} takes no BYTES (text) input",
                              param=f"models.{self.name}")
        if datatype not in DTYPES:
            raise ConfigError(f"{where}: its output '{name}' is {datatype}, not numbers",
                              param=f"models.{self.name}")
        self.input_name = str(inputs[0]["name"])
        return (shape[-1] if len(shape) >= 2 else 1 if shape else -1), name

    def _load_embeddings(self) -> int:
        opts = self.options
        doc = self._fetch("/v1/embeddings", orjson.dumps(
            {"model": opts.upstream_model, "input": ["sokuji"]}), opts.timeout_ms / 1e3)
        if doc is None:
            return self._unreached()[0]
        try:
            return len(embeddings(doc, 1, self.name)[0])
        except (UpstreamFailed, KeyError, TypeError, ValueError, AttributeError):
            raise ConfigError(f"model '{self.name}': the upstream at {opts.url} did not "
                              "answer an embedding", param=f"models.{self.name}") from None

    # -- serving --------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._started

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a pooled connection (at most: the pool's limit)."""
        return max(0, self.in_flight - self.options.max_connections)

    def capacity(self) -> Capacity:
        return Capacity(ready=self._started, num_waiting=self.num_waiting,
                        num_running=self.in_flight,
                        max_queue_depth=self.config.max_queue_depth,
                        drain_per_s=self._completions.per_s)

    def check_admission(self) -> None:
        if not self._started:
            raise ModelNotReady(f"model '{self.name}' is not started")
        if self._admission.refuses(self.in_flight, self.in_flight):
            self._admission.check(self.in_flight, self.in_flight, lambda: self.in_flight,
                                  self._completions.per_s)

    def from_tensors(self, request: InferRequest) -> list[str]:
        return text_tensors.texts(request, self.metadata, self.config.max_batch_size)

    def to_tensors(self, result: Any, report: Report) -> list[Tensor]:
        return text_tensors.rows(self.metadata, result)

    def identity(self, inputs: Any) -> Any:
        return None if self.generates else inputs

    async def prepare(self, inputs: Any, ctx: RequestContext) -> Any:
        if self.generates:
            if not isinstance(inputs, GenerationInput):
                raise InvalidInput(f"model '{self.name}' generates text: send a prompt or "
                                   "messages", param="model")
            path, body = completion_request(inputs, self.options.upstream_model)
            return PreparedCompletion(path, body, inputs.chat)
        texts = list(inputs)
        return UpstreamPrepared(texts, len(texts), length=max(map(len, texts), default=0))

    def submit(self, prepared: Any, ctx: RequestContext,
               timing: Timing | None = None) -> Any:
        """``timing``: a pipeline's own (generators only), else a new one."""
        self.check_admission()
        self.client.budget_s(ctx)  # a deadline already passed: 504, the upstream not called
        self.in_flight += 1
        self._idle.clear()
        if isinstance(prepared, PreparedCompletion):
            return UpstreamGeneration(self.client, prepared.path, prepared.body,
                                      prepared.chat, ctx, self._done, timing,
                                      reveal=self.client.reveals(ctx.tenant))
        task = asyncio.get_running_loop().create_task(self._encode(prepared, ctx))
        task.add_done_callback(lambda _: self._done())
        return UpstreamCall(task, prepared)

    def _done(self) -> None:
        self.in_flight -= 1
        self._completions.observe()
        if not self.in_flight:
            self._idle.set()

    async def _encode(self, prepared: UpstreamPrepared, ctx: RequestContext) -> np.ndarray:
        opts, n = self.options, prepared.num_items
        if opts.protocol == "v2":
            doc: dict[str, Any] = {
                "inputs": [{"name": self.input_name, "shape": [n], "datatype": "BYTES",
                            "data": prepared.texts}],
                "outputs": [{"name": self.metadata.outputs[0].name,
                             "parameters": {"binary_data": True}}]}
            if ctx.request_id:
                doc["id"] = ctx.request_id
            if ctx.deadline_ns is not None:  # Triton's way (Sokuji reads the header first)
                doc["parameters"] = {"timeout": max(1, int(self.client.budget_s(ctx) * 1e6))}
            data, headers = await self.client.call(
                f"/v2/models/{opts.upstream_model}/infer", doc, ctx)
        else:
            data, headers = await self.client.call("/v1/embeddings", {
                "model": opts.upstream_model, "input": prepared.texts,
                "encoding_format": "float"}, ctx)
        if ctx.timeline is not None:  # the hop, and the upstream's own total if it says
            ctx.timeline.mark(Stage.INFER)  # (and if it may: ``UpstreamClient.reveals``)
            total = _TOTAL.search(headers.get("server-timing", "")) \
                if self.client.reveals(ctx.tenant) else None
            ctx.timeline.notes.setdefault(
                Stage.INFER, f"upstream {total.group(1)} ms" if total else "upstream")
        try:
            if opts.protocol == "v2":
                rows = v2_output(data, headers.get("inference-header-content-length"),
                                 self.metadata.outputs[0].name)
            else:
                doc = orjson.loads(data)
                rows = embeddings(doc, n, self.name)
                usage = doc.get("usage")
                tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
                prepared.num_tokens = tokens if isinstance(tokens, int) else 0
            rows = rows.reshape(rows.shape[0], -1) if rows.ndim != 2 else rows
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise UpstreamFailed(f"{self.client.who}: a malformed answer "
                                 f"({type(exc).__name__})") from None
        width = self.metadata.outputs[0].shape[-1]
        if rows.shape != (n, width):
            raise UpstreamFailed(f"{self.client.who}: answered shape {list(rows.shape)} for "
                                 f"{n} items; expected [{n}, {width}]")
        return rows

    def start(self) -> None:
        self.client.start()
        self._started = True
        self._idle.set()

    async def stop(self) -> None:
        """Refuse new requests; give those in flight a grace, then close the pool."""
        self._started = False
        if self.in_flight:
            grace = min(STOP_GRACE_S, self.options.timeout_ms / 1e3)
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except TimeoutError:
                log.warning("model '%s': %d upstream requests still in flight at stop",
                            self.name, self.in_flight)
        await self.client.close()

    def close(self) -> None:
        pass

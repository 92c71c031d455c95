"""Generators in Ray Serve deployments of their own behind a consistent-hash router keyed by
conversation, so a conversation's later turns land on the replica whose prefix cache holds
its earlier prompt (HAProxy, which balances the ingress replicas, cannot route so; a handle
call from the ingress can, for ~2 ms against TTFTs of 100s of ms).

- ``LLMReplica`` (deployment ``llm-<model>``): one ``GeneratorModel``; ``generate`` streams
  a generation's events in batches, with the engine's timing stamps first and last.
- ``RemoteGenerator`` (in each ingress replica): the model contract over the handle. Prompts
  are prepared here (inherited) on a vocabulary-only load of the GGUF (24 MB): templates,
  limits and their 400 bodies are the single-process server's, refused before any hop; only
  token ids and sampling parameters travel. ``submit`` -> ``RemoteGeneration``.
- Routing key (``session_id``): the client's ``X-Session-Id``, else a digest of the system
  and first user message (chat) or the prompt's first 256 characters, always with the
  tenant: tenants never share a key.
- Faults: ``BackPressureError`` -> 429 + Retry-After; a replica that dies before the first
  event -> one retry while the deadline leaves time, else 504 / 503; after it, an error
  ``Finish`` (503). ``cancel()`` cancels the remote call, which frees the replica's slot.

``perf_counter`` is per process: the replica sends offsets from its own arrival, placed on
this clock by when the first batch arrived (TTFT as the ingress sees it, ITL the engine's).
``SOKUJI_RAY_LLM_ROUTER=default`` (hidden; the benchmark's baseline): Serve's own router.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from sokuji import errors
from sokuji.config import ModelConfig, ServerConfig
from sokuji.core import policy
from sokuji.core.events import Delta, EventQueue, Finish
from sokuji.core.model import Capacity, GenerationInput, Report, RequestContext
from sokuji.core.request import Priority
from sokuji.kinds.generator.kind import KIND, build_generator, generators
from sokuji.llm import native
from sokuji.llm.chat import ChatTemplate
from sokuji.llm.generator import GeneratorModel, PreparedGeneration
from sokuji.llm.prompt import PromptBuilder
from sokuji.llm.request import SamplingParams, Timing
from sokuji.llm.runtime import LlamaRuntime

log = logging.getLogger(__name__)
ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
ROUTER_ENV = "SOKUJI_RAY_LLM_ROUTER"
"""``default``: Serve's own router instead of the consistent hash (benchmark baseline only)."""
KEY_CHARS = 256  # a completion's conversation: its prompt's first this many characters


def _stamps(t: Timing, t0: int, replica: str) -> dict[str, Any]:
    """The engine's ``Timing`` as offsets from ``t0`` (the replica's arrival; 0: not yet)."""
    return {"replica": replica, "sent": time.perf_counter_ns() - t0,
            **{k: getattr(t, f"{k}_ns") - t0 if getattr(t, f"{k}_ns") else 0
               for k in ("admitted", "first_token", "end")},
            "tokens": [n - t0 for n in t.token_ns],
            "prompt_tokens": t.prompt_tokens, "reused_tokens": t.reused_tokens,
            "prefix_lookup": t.prefix_lookup, "speculative": t.speculative, "steps": t.steps,
            "drafted_tokens": t.drafted_tokens, "accepted_tokens": t.accepted_tokens}


@serve.deployment
class LLMReplica:
    """One generator (``GeneratorModel``: the engine thread, its prefix cache) per replica."""

    async def __init__(  # type: ignore[misc]  # (Ray actors may construct asynchronously)
            self, config_builtins: dict[str, Any], model: str) -> None:
        from sokuji.scale.ray_env import config_from_builtins

        config = config_from_builtins(config_builtins)
        i = [m.name for m in config.models].index(model)
        mc, at = config.models[i], f"models[{i}]"
        self.model: GeneratorModel = build_generator(mc, KIND.parse(mc, at), config, at)
        self.model.start()  # (async: on the replica's loop, where generate() submits)
        self.replica = f"{serve.get_replica_context().replica_id.unique_id}:{os.getpid()}"

    async def generate(self, prompt: list[int], params: SamplingParams, tenant: str,
                       priority: int, left_ms: float | None, request_id: str,
                       ) -> AsyncIterator[tuple[list[Delta | Finish], dict[str, Any] | None]]:
        """The generation's events in batches as the engine delivers them; stamps with the
        first batch and the last. Admission refusals raise before the first batch."""
        t0 = time.perf_counter_ns()
        ctx = RequestContext(tenant=tenant, priority=Priority(priority),
                             deadline_ns=None if left_ms is None else t0 + int(left_ms * 1e6),
                             arrival_ns=t0, request_id=request_id)
        gen = self.model.submit(PreparedGeneration(prompt, params), ctx)
        try:
            done, head = False, True
            while not done:
                events = await gen.next_events()
                done = isinstance(events[-1], Finish)
                yield events, _stamps(gen.timing, t0, self.replica) if head or done else None
                head = False
        finally:
            gen.cancel()  # the caller went away (Serve cancels this task): free the slot

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return {"sokuji_queue_depth": float(self.model.num_waiting)}

    def describe(self) -> dict[str, Any]:
        """Which process this replica is and its engine's load (tests, operators)."""
        cap = self.model.capacity()
        return {"replica": self.replica, "pid": os.getpid(), "alive": cap.ready,
                "waiting": cap.num_waiting, "running": cap.num_running}

    def check_health(self) -> None:
        if not self.model.alive:
            raise RuntimeError(f"model '{self.model.name}': its generation engine died")


def llm_deployments(config: ServerConfig, config_builtins: dict[str, Any],
                    ) -> dict[str, Application]:
    """A bound ``LLMReplica`` deployment per generator (``kinds/generator``; none without
    ``llm_affinity``)."""
    ray = config.ray
    if not ray.llm_affinity:
        return {}
    router = None if os.environ.get(ROUTER_ENV) == "default" else RequestRouterConfig(
        request_router_class=ROUTER,  # type: ignore[arg-type]  # (a str is documented)
        request_router_kwargs={"num_virtual_nodes": 100, "num_fallback_replicas": 1})
    out: dict[str, Application] = {}
    for mc in generators(config):
        options: dict[str, Any] = {
            "name": f"llm-{mc.name}", "num_replicas": ray.llm_replicas,
            "max_ongoing_requests": ray.llm_max_ongoing_requests,
            "max_queued_requests": ray.llm_max_ongoing_requests,
            "ray_actor_options": {"num_cpus": ray.num_cpus},
            "health_check_period_s": ray.health_check_period_s,
            "health_check_timeout_s": ray.health_check_timeout_s,
            "graceful_shutdown_timeout_s": ray.graceful_shutdown_timeout_s}
        if router is not None:
            options["request_router_config"] = router
        deployment: Any = LLMReplica  # (a Deployment: the decorator's type is not declared)
        out[mc.name] = deployment.options(**options).bind(config_builtins, mc.name)
    return out


def remote_generators(config: ServerConfig, handles: Mapping[str, DeploymentHandle],
                      ) -> dict[str, RemoteGenerator]:
    """The served model of each generator that has a deployment (by model name)."""
    return {name: RemoteGenerator(mc, config, handles[name])
            for mc in generators(config) if (name := mc.name) in handles}


class _Vocab(native.LlamaModel):
    """A GGUF's vocabulary, chat template and special tokens only (llama.cpp's
    ``vocab_only``: no weights, no context): what ``PromptBuilder`` reads."""

    def __init__(self, path: Path) -> None:  # (no super().__init__: that loads weights)
        L = native._llama()
        native._quiet()
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.vocab_only = True
        self.path, self.ctx, self.batch = path, None, None
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise errors.ConfigError.for_key("path", str(path), "llama.cpp could not load it")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.bos, self.eos = (self._piece_text(L.llama_vocab_bos(self.vocab)),
                              self._piece_text(L.llama_vocab_eos(self.vocab)))
        raw = L.llama_model_chat_template(self.model, None)
        self.chat_template = raw.decode("utf-8") if raw else None
        self.eog_ids, self.max_piece_bytes, self.vocab_digest = self._scan_vocab()
        self.lossless = int(L.llama_vocab_type(self.vocab)) in (L.LLAMA_VOCAB_TYPE_SPM,
                                                               L.LLAMA_VOCAB_TYPE_BPE)


@dataclass(frozen=True)
class RoutedPrepared(PreparedGeneration):
    session: str = ""  # the routing key: which replica's prefix cache this conversation uses


def session_key(inputs: GenerationInput, ctx: RequestContext) -> str:
    """The client's ``X-Session-Id``, else the conversation's opening; with the tenant."""
    given = (ctx.headers or {}).get("x-session-id")
    if given:
        opening = "s\0" + given
    elif inputs.messages is not None:
        system = next((m for m in inputs.messages if m.get("role") == "system"), None)
        user = next((m for m in inputs.messages if m.get("role") == "user"), None)
        opening = "c\0" + "\0".join(f"{m.get('role')}\0{m.get('content') or ''}"
                                    for m in (system, user) if m is not None)
    elif isinstance(inputs.prompt, list):
        opening = "t\0" + ",".join(map(str, inputs.prompt[:KEY_CHARS // 4]))
    else:
        opening = "p\0" + (inputs.prompt or "")[:KEY_CHARS]
    raw = f"{ctx.tenant}\0{opening}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


class RemoteGenerator(GeneratorModel):
    """A generator in an LLM deployment, served here under the model contract: prepare as
    ``GeneratorModel`` does (inherited, on the vocabulary), submit through the handle."""

    def __init__(self, config: ModelConfig, server: ServerConfig,
                 handle: DeploymentHandle) -> None:
        from sokuji.kinds.generator.kind import KIND

        at = f"models[{[m.name for m in server.models].index(config.name)}]"
        runtime = LlamaRuntime(config.name, config.path, KIND.parse(config, at),
                               server.cache_dir, config.max_queue_depth,
                               config.priority_aging_ms, at=at)
        vocab = _Vocab(runtime.source)
        runtime.model = vocab
        o = runtime.options
        runtime.prompts = PromptBuilder(config.name, vocab, ChatTemplate(
            o.chat_template or vocab.chat_template, vocab.bos, vocab.eos), o)
        super().__init__(config, runtime)  # (runtime.engine is None: it runs remotely)
        ray = server.ray
        self.handle = handle.options(method_name="generate", stream=True)
        self.deployment = f"llm-{config.name}"
        self.slots = ray.llm_replicas * o.slots
        self.limit = ray.llm_replicas * 2 * ray.llm_max_ongoing_requests
        """More in flight from here could only wait in Serve or be refused: refused at once
        (every replica's ongoing plus queued bound)."""
        self.in_flight = 0
        self.drain = policy.DrainRate(self.slots)
        self.started = False

    def attach(self, observers: Any) -> None:
        """The engine runs in the LLM replicas (their own metrics)."""

    @property
    def alive(self) -> bool:  # (the deployment's health is Serve's: it replaces replicas)
        return self.started

    @property
    def num_waiting(self) -> int:
        return max(0, self.in_flight - self.slots)

    def capacity(self) -> Capacity:
        return Capacity(ready=self.started, num_waiting=self.num_waiting,
                        num_running=min(self.in_flight, self.slots),
                        max_queue_depth=self.limit, drain_per_s=self.drain.per_s)

    def check_admission(self) -> None:
        if self.in_flight >= self.limit:
            raise self.overloaded(f"{self.in_flight} generations in flight here (at most "
                                  f"{self.limit})")

    def overloaded(self, why: str, retry_after_s: float | None = None) -> errors.Overloaded:
        measured = policy.retry_after_s(self.num_waiting + 1, self.drain.per_s)
        wait = measured if self.drain.per_s > 0 else math.ceil(retry_after_s or 1)
        return errors.Overloaded(f"model '{self.name}': {why}; retry later", retry_after_s=wait)

    async def prepare(self, inputs: GenerationInput, ctx: RequestContext) -> RoutedPrepared:
        for name, unset, what in (("grammar", None, "a structured-output constraint"),
                                  ("tools", None, "tools"), ("n", 1, "n > 1")):
            if getattr(inputs, name) != unset:  # (a replica is sent tokens and sampling only)
                field = getattr(inputs.grammar, "param", name) if name == "grammar" else name
                raise errors.InvalidInput(f"{what} is not served through Ray replicas (yet)",
                                          param=field)
        prepared = await super().prepare(inputs, ctx)
        return RoutedPrepared(prepared.prompt, prepared.params,
                              session=session_key(inputs, ctx))

    def submit(self, prepared: PreparedGeneration, ctx: RequestContext,  # type: ignore[override]
               timing: Timing | None = None) -> RemoteGeneration:  # (the same handle contract)
        if not self.started:
            raise errors.ModelNotReady(f"model '{self.name}' is not ready")
        self.check_admission()  # (its own bound, atomically with counting it in flight)
        return RemoteGeneration(self, prepared, getattr(prepared, "session", None), ctx,
                                timing)

    def call(self, prepared: PreparedGeneration, session: str | None,
             ctx: RequestContext) -> Any:
        """The remote call (no session: Serve spreads it by request id)."""
        left = None if ctx.deadline_ns is None else \
            (ctx.deadline_ns - time.perf_counter_ns()) / 1e6
        handle = self.handle if session is None else self.handle.options(session_id=session)
        p = prepared
        return handle.remote(p.prompt, p.params, ctx.tenant, int(ctx.priority), left,
                             ctx.request_id)

    def start(self) -> None:
        self.started = True

    async def stop(self) -> None:  # (what is in flight finishes on the replicas)
        self.started = False


def _as_error(model: RemoteGenerator, exc: BaseException) -> errors.SokujiError:
    """What a failed call means: Serve's backpressure (429), the ``SokujiError`` the replica
    raised (Ray may wrap it: its ``cause``), else a bug (500, logged)."""
    if isinstance(exc, BackPressureError):
        return model.overloaded("every replica is busy", exc.retry_after_s)
    cause = getattr(exc, "cause", None)
    if isinstance(cause, errors.SokujiError):
        return cause
    if isinstance(exc, errors.SokujiError):
        return exc
    log.error("%s: the generation failed: %r", model.deployment, exc)
    return errors.RuntimeFailed(f"model '{model.name}': {type(exc).__name__}")


class RemoteGeneration(EventQueue):
    """One generation on an LLM replica: a ``GenerationHandle`` (``llm/request.py``)."""

    def __init__(self, model: RemoteGenerator, prepared: PreparedGeneration,
                 session: str | None, ctx: RequestContext, timing: Timing | None) -> None:
        self.model = model
        self.timing = timing if timing is not None else Timing(arrival_ns=ctx.arrival_ns)
        """A pipeline passes its own (its steps before this generation are its time)."""
        self.timing.prompt_tokens = len(prepared.prompt)
        self.timing.submitted_ns = time.perf_counter_ns()
        self.served_by = ""
        """The LLM replica that generates (its report: ``x-sokuji-served-by``)."""
        self._finished, self._tokens = False, 0
        self._shift: int | None = None
        """This clock less the replica's offsets (known once the first batch arrived)."""
        super().__init__()
        model.in_flight += 1
        self._task = asyncio.get_running_loop().create_task(self._run(prepared, session, ctx))
        self._task.add_done_callback(self._done)

    @property
    def report(self) -> Report:
        return Report(served_by=self.served_by)

    def cancel(self) -> None:
        if not self._finished:
            self._task.cancel()

    def _push(self, event: Delta | Finish) -> None:
        if self._finished:
            return
        if isinstance(event, Finish):
            self._finished = True
            self.model.in_flight -= 1
            t = self.timing
            if not t.end_ns:
                t.end_ns = time.perf_counter_ns()
            if t.admitted_ns and event.reason in ("stop", "length"):
                self.model.drain.observe(1, (t.end_ns - t.admitted_ns) / 1e9)
        else:
            self._tokens = event.tokens
        self.put(event)

    def _fail(self, error: errors.SokujiError) -> None:
        reason = "deadline" if isinstance(error, errors.DeadlineExceeded) else "error"
        self._push(Finish(reason, self._tokens, error))

    async def _run(self, prepared: PreparedGeneration, session: str | None,
                   ctx: RequestContext) -> None:
        model = self.model
        for attempt in (1, 2):
            resp = model.call(prepared, session, ctx)
            try:
                async for events, stamps in resp:
                    if stamps is not None:
                        self._place(stamps)
                    for event in events:
                        self._push(event)
                return
            except asyncio.CancelledError:
                resp.cancel()  # the replica's task is cancelled: the engine frees the slot
                raise
            except (ActorDiedError, ActorUnavailableError) as exc:
                left = None if ctx.deadline_ns is None else \
                    ctx.deadline_ns - time.perf_counter_ns()
                if self._shift is None and attempt == 1 and (left is None or left > 0):
                    log.warning("%s: a replica died (%s); retrying once", model.deployment,
                                type(exc).__name__)
                    continue  # nothing was sent yet: safe to resend
                late = self._shift is None and left is not None and left <= 0
                self._fail(errors.DeadlineExceeded(
                    f"model '{model.name}': its replica died and the deadline leaves no time "
                    "to retry") if late else errors.ModelNotReady(
                    f"model '{model.name}': the replica serving this generation stopped; "
                    "retry"))
            except Exception as exc:  # noqa: BLE001 - typed errors pass; bugs: an error Finish
                self._fail(_as_error(model, exc))
            return

    def _done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved: _run catches what it expects
        self._push(Finish("cancelled", self._tokens))

    def _place(self, s: dict[str, Any]) -> None:
        """The replica's stamps on this process's clock: the batch that carried them was
        sent at ``sent`` there and has just arrived here."""
        if self._shift is None:
            self._shift = time.perf_counter_ns() - s["sent"]
            self.served_by = f"{self.model.deployment}/{s['replica']}"
        shift, t = self._shift, self.timing
        for k in ("admitted", "first_token", "end"):
            setattr(t, f"{k}_ns", s[k] + shift if s[k] else 0)
        t.admitted_ns = max(t.admitted_ns, t.submitted_ns) if t.admitted_ns else 0
        t.token_ns = [n + shift for n in s["tokens"]]
        for k in ("prompt_tokens", "reused_tokens", "prefix_lookup", "speculative", "steps",
                  "drafted_tokens", "accepted_tokens"):
            setattr(t, k, s[k])

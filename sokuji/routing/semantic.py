"""The semantic cache in the request path (``core/semantic_cache.py`` is its store): a
served model in front of the model it caches (``SemanticModel``: the same name, apis and
tensors), so every protocol reaches it through the contract and after the exact cache; per
model, off unless the model's ``semantic_cache.enabled``.

- Classifiers (and routers over them): each item is embedded by the configured embedder
  (an encoder model, through the model contract), looked up in the tenant's scope; the items
  that hit take the cached row, the others are computed together and stored.
- Generators (chat and completions), deterministic requests only (temperature 0, or a seed):
  the last user message (or the prompt) is the text; everything else that changes the answer
  (the other messages, max_tokens, sampling, stop) is hashed into the scope. A hit is answered
  as a generation of the cached text; a completed generation (stop or length) is stored.
- Plain encoders are refused at start: their output *is* the embedding; a near hit would
  return another text's vector.

Every lookup observes its nearest similarity (``sokuji_semantic_cache_nearest_similarity``)
and its result. ``audit_rate`` of the hits are computed afresh in the background (batch
priority) and compared with the cached answer: for classifiers by label, so
``sokuji_semantic_cache_audits_total{outcome=disagree}`` is the live false-hit rate; for
generations by exact text, so "disagree" means "not what the model writes for this
wording" (a right answer in other words counts too: an upper bound on false hits).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sokuji.core.model import (
    Api,
    Capacity,
    ModelBase,
    ModelMetadata,
    Report,
    RequestContext,
    ServedModel,
)
from sokuji.core.request import Priority, Stage
from sokuji.core.semantic_cache import SemanticCache
from sokuji.core.tensor import InferRequest, Tensor
from sokuji.errors import ConfigError, SokujiError
from sokuji.llm.request import Delta, Finish, Timing
from sokuji.routing.config import SemanticCacheConfig

Compute = Callable[[list[str]], Awaitable[np.ndarray]]


class SemanticLayer:
    def __init__(self, model: str, version: str, cfg: SemanticCacheConfig,
                 embedder: ServedModel, threshold: float, metrics: Any,
                 rng: random.Random | None = None) -> None:
        self.model = model
        self.version = version
        self.cfg = cfg
        self.embedder = embedder
        self.store = SemanticCache(threshold, cfg.guards, cfg.max_entries, cfg.max_bytes,
                                   cfg.tenant_share)
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.audits: set[asyncio.Task[None]] = set()

    async def embed(self, texts: list[str], ctx: RequestContext) -> np.ndarray:
        copy = RequestContext(tenant=ctx.tenant, priority=ctx.priority,
                              deadline_ns=ctx.deadline_ns, arrival_ns=ctx.arrival_ns,
                              request_id=ctx.request_id)
        prepared = await self.embedder.prepare(texts, copy)
        return np.asarray(await self.embedder.submit(prepared, copy).result(), np.float32)

    def _lookup(self, scope: tuple[str, ...], text: str, vector: np.ndarray) -> tuple[Any, float]:
        hit, nearest, result = self.store.lookup(scope, text, vector)
        self.metrics.semantic.labels(self.model, result).inc()
        if nearest >= -1.0 and result != "empty":
            self.metrics.semantic_nearest.labels(self.model).observe(max(0.0, nearest))
        return hit, nearest

    # -- classifiers -------------------------------------------------------------------
    async def rows(self, texts: list[str], ctx: RequestContext, compute: Compute,
                   audit: Compute) -> tuple[np.ndarray, str]:
        """The output rows of ``texts``: cached ones from the store, the rest computed (and
        stored); and a word for Server-Timing. ``audit`` computes afresh at batch priority."""
        vectors = await self.embed(texts, ctx)
        scope = (ctx.tenant, self.model, self.version, "")
        found: dict[int, Any] = {}
        best = -1.0
        for i, (text, vec) in enumerate(zip(texts, vectors, strict=True)):
            hit, nearest = self._lookup(scope, text, vec)
            best = max(best, nearest)
            if hit is not None:
                found[i] = hit
        missing = [i for i in range(len(texts)) if i not in found]
        computed = await compute([texts[i] for i in missing]) if missing else None
        width = computed.shape[1] if computed is not None else \
            np.asarray(next(iter(found.values())).value).shape[-1]
        out = np.empty((len(texts), width), np.float32)
        for j, i in enumerate(missing):
            assert computed is not None
            out[i] = computed[j]
            self.store.store(scope, texts[i], vectors[i], np.array(computed[j]),
                             computed[j].nbytes)
        for i, hit in found.items():
            out[i] = hit.value
            self._maybe_audit(_bind(audit, [texts[i]]), hit.value, _same_label)
        return out, f"semantic {len(found)}/{len(texts)} hit nearest {best:.3f}"

    # -- generations -------------------------------------------------------------------
    def generation_key(self, req: Any, ctx: RequestContext) -> tuple[tuple[str, ...], str] | None:
        """(scope, text) of a deterministic request; None when it may not be cached."""
        if (req.temperature > 0 and req.seed is None) or req.logprobs is not None \
                or req.grammar is not None or req.tools is not None or req.n != 1:
            return None  # (a cached answer has no log-probabilities, one text, no calls)
        if req.messages is not None:
            if not req.messages or req.messages[-1].get("role") != "user":
                return None
            text = str(req.messages[-1].get("content") or "")
            context: Any = req.messages[:-1]
        elif isinstance(req.prompt, str):
            text, context = req.prompt, None
        else:
            return None
        params = json.dumps([context, req.chat, req.max_tokens, req.min_tokens, req.ignore_eos,
                             req.temperature, req.top_p, list(req.stop), req.seed,
                             req.top_k, req.min_p, req.presence_penalty,
                             req.frequency_penalty, req.repetition_penalty,
                             [list(b) for b in req.logit_bias]],
                            sort_keys=True, default=str)
        digest = hashlib.sha256(params.encode()).hexdigest()[:32]
        return (ctx.tenant, self.model, self.version, digest), text

    async def lookup_generation(self, key: tuple[tuple[str, ...], str], ctx: RequestContext
                                ) -> tuple[Any, np.ndarray]:
        scope, text = key
        vector = (await self.embed([text], ctx))[0]
        hit, _ = self._lookup(scope, text, vector)
        return hit, vector

    def store_generation(self, key: tuple[tuple[str, ...], str], vector: np.ndarray,
                         answer: tuple[str, str, int]) -> None:
        scope, text = key
        self.store.store(scope, text, vector, answer, len(answer[0].encode()))

    # -- audits ------------------------------------------------------------------------
    def _maybe_audit(self, fresh: Callable[[], Awaitable[Any]], cached: Any,
                     same: Callable[[Any, Any], bool]) -> None:
        if self.cfg.audit_rate <= 0 or self.rng.random() >= self.cfg.audit_rate:
            return

        async def audit() -> None:
            try:
                answer = await fresh()
            except (SokujiError, OSError):
                return
            outcome = "agree" if same(cached, answer) else "disagree"
            self.metrics.semantic_audits.labels(self.model, outcome).inc()

        task = asyncio.get_running_loop().create_task(audit())
        self.audits.add(task)
        task.add_done_callback(self.audits.discard)

    def audit_generation(self, fresh: Callable[[], Awaitable[str]], cached: str) -> None:
        self._maybe_audit(fresh, cached, lambda a, b: bool(a == b))


def _bind(fn: Compute, texts: list[str]) -> Callable[[], Awaitable[np.ndarray]]:
    def call() -> Awaitable[np.ndarray]:
        return fn(texts)
    return call


def _same_label(cached: Any, fresh: Any) -> bool:
    return int(np.argmax(cached)) == int(np.argmax(np.asarray(fresh)[0]))


class CachedGeneration:
    """A semantic hit, answered as a generation (``llm_api`` streams it unchanged)."""

    def __init__(self, text: str, reason: str, tokens: int, arrival_ns: int,
                 similarity: float) -> None:
        now = time.perf_counter_ns()
        self.timing = Timing(arrival_ns, submitted_ns=now, admitted_ns=now,
                             first_token_ns=now, end_ns=now, prefix_lookup="off")
        self.report = Report(served_by=f"cache semantic {similarity:.3f}", cached=True)
        """Not a generation: no generation metrics (the request is counted)."""
        self._events: list[Any] = [Delta(text, tokens), Finish(reason, tokens)]

    async def next_events(self) -> list[Any]:
        events, self._events = self._events, [Finish("stop", 0)]
        return events

    def cancel(self) -> None:
        pass


class StoringGeneration:
    """Relays a generation; once it finishes well (stop or length), stores its text."""

    def __init__(self, gen: Any, on_done: Callable[[str, str, int], None]) -> None:
        self.gen = gen
        self.timing = gen.timing
        self.on_done = on_done
        self.texts: list[str] = []

    @property
    def report(self) -> Report:
        return self.gen.report

    async def next_events(self) -> list[Any]:
        events = await self.gen.next_events()
        for event in events:
            if isinstance(event, Delta):
                self.texts.append(event.text)
            elif event.error is None and event.reason in ("stop", "length"):
                self.on_done("".join(self.texts), event.reason, event.completion_tokens)
        return events

    def cancel(self) -> None:
        self.gen.cancel()


@dataclass(frozen=True)
class _Direct:
    """A generation that may not be cached (sampled), prepared by the model."""

    prepared: Any


@dataclass(frozen=True)
class _Hit:
    hit: Any
    inputs: Any


@dataclass(frozen=True)
class _Miss:
    prepared: Any
    key: tuple[tuple[str, ...], str]
    vector: np.ndarray


class SemanticModel(ModelBase):
    """``inner`` with its semantic cache in front: a served model of the same name, apis
    and tensors. A classifier's items are looked up one by one (``rows``); a deterministic
    generation as a whole, before the model is asked (a hit is answered even when the model
    is full: admission is then the model's own ``submit``'s)."""

    def __init__(self, inner: ServedModel, layer: SemanticLayer) -> None:
        self.inner = inner
        self.layer = layer
        self.apis = inner.apis
        self.batches = inner.batches
        self.generates = Api.GENERATE in inner.apis
        self.metadata: ModelMetadata = inner.metadata
        self.limits = inner.limits  # a hit costs less; a miss is the inner model's work

    @property
    def name(self) -> str:
        return self.inner.name


    @property
    def alive(self) -> bool:
        return self.inner.alive

    @property
    def num_waiting(self) -> int:
        return self.inner.num_waiting

    def capacity(self) -> Capacity:
        return self.inner.capacity()

    def check_admission(self) -> None:
        if not self.generates:
            self.inner.check_admission()

    def from_tensors(self, request: InferRequest) -> Any:
        return self.inner.from_tensors(request)

    def to_tensors(self, result: Any, report: Report) -> list[Tensor]:
        return self.inner.to_tensors(result, report)

    def identity(self, inputs: Any) -> Sequence[str] | None:
        return self.inner.identity(inputs)

    async def prepare(self, inputs: Any, ctx: RequestContext) -> Any:
        if not self.generates:
            return inputs  # the items are looked up when submitted
        key = self.layer.generation_key(inputs, ctx)
        if key is None:
            return _Direct(await self.inner.prepare(inputs, ctx))
        hit, vector = await self.layer.lookup_generation(key, ctx)
        if hit is not None:
            return _Hit(hit, inputs)
        return _Miss(await self.inner.prepare(inputs, ctx), key, vector)

    def submit(self, prepared: Any, ctx: RequestContext) -> Any:
        if not self.generates:
            return SemanticRows(self, prepared, ctx)
        if isinstance(prepared, _Direct):
            return self.inner.submit(prepared.prepared, ctx)
        if isinstance(prepared, _Hit):
            text, reason, tokens = prepared.hit.value
            inner, inputs = self.inner, prepared.inputs

            async def fresh() -> str:
                c = prioritised(ctx)
                out = await inner.submit(await inner.prepare(inputs, c), c).result()
                return str(out.text)

            self.layer.audit_generation(fresh, text)
            return CachedGeneration(text, reason, tokens, ctx.arrival_ns,
                                    prepared.hit.similarity)
        key, vector, layer = prepared.key, prepared.vector, self.layer
        return StoringGeneration(self.inner.submit(prepared.prepared, ctx),
                                 lambda text, reason, n: layer.store_generation(
                                     key, vector, (text, reason, n)))

    def attach(self, observers: Any) -> None:
        self.inner.attach(observers)

    def neighbours(self, busy: Callable[[], bool]) -> None:
        self.inner.neighbours(busy)

    def start(self) -> None:
        self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()

    def close(self) -> None:
        self.inner.close()


class SemanticRows:
    """A classifier's request: the items that hit take the cached row, the others are
    computed together (and stored). ``result()`` runs in the caller's task."""

    def __init__(self, model: SemanticModel, texts: list[str], ctx: RequestContext) -> None:
        self.model = model
        self.texts = texts
        self.ctx = ctx
        self._report = Report(served_by="cache semantic", cached=True)

    async def result(self) -> np.ndarray:
        ctx, inner = self.ctx, self.model.inner
        tl = ctx.timeline

        async def infer(sub: list[str], c: RequestContext = ctx) -> np.ndarray:
            if c is ctx and tl is not None:
                tl.mark(Stage.CACHE)  # the lookups; the model's own stages follow
            handle = inner.submit(await inner.prepare(sub, c), c)
            out = await handle.result()
            if c is ctx:
                self._report = handle.report
            return np.asarray(out)

        output, word = await self.model.layer.rows(
            self.texts, ctx, infer, lambda sub: infer(sub, prioritised(ctx)))
        if tl is not None:
            tl.notes[Stage.CACHE] = word
        return output

    @property
    def report(self) -> Report:
        """The model's for the items it computed; a cache hit's when every item hit."""
        return self._report

    def cancel(self) -> None:
        pass


def build(model_name: str, version: str, model: ServedModel, table: dict[str, Any], at: str,
          models: dict[str, Any], cache_dir: str, metrics: Any) -> SemanticLayer | None:
    """The layer of a model whose ``semantic_cache`` is enabled; None otherwise. For
    classifiers (a row of scores per text) and generators only."""
    from sokuji.routing.config import parse_semantic_cache

    cfg = parse_semantic_cache(table, at, {n: m.config.runtime for n, m in models.items()})
    if not cfg.enabled:
        return None
    if Api.EMBED in model.apis:
        raise ConfigError(f"Config '{at}': a semantic cache is for classifiers and "
                          "generators: an encoder's output is the embedding itself",
                          param=at)
    if model.apis != {Api.GENERATE} and not (model.batches and model.apis == {Api.INFER}):
        served = "+".join(a.value for a in Api if a in model.apis)
        raise ConfigError(f"Config '{at}': no semantic cache for a model serving {served}: "
                          "it is for classifiers and generators", param=at)
    embedder = models[cfg.embedder]
    if Api.EMBED not in embedder.apis:
        raise ConfigError(f"Config '{at}.embedder': '{cfg.embedder}' is not an encoder",
                          param=f"{at}.embedder")
    if isinstance(cfg.threshold, float):
        threshold = cfg.threshold
    else:
        from sokuji.routing.cache_calibrate import calibrated_threshold

        threshold = calibrated_threshold(cache_dir, cfg.embedder, cfg.guards)
    return SemanticLayer(model_name, version, cfg, embedder.served, threshold, metrics)


def prioritised(ctx: RequestContext) -> RequestContext:
    return RequestContext(tenant=ctx.tenant, priority=Priority.BATCH, deadline_ns=None,
                          arrival_ns=time.perf_counter_ns())

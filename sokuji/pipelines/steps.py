"""What each kind of step does, built once per pipeline at start-up (``build_step``).

- ``model``: a served model through the model contract, under its own admission and queue
  and the request's context (tenant, priority, deadline). An encoder takes ``texts`` (a
  string: one vector out; a list: one row each); a generator takes ``messages`` (a chat) or
  ``prompt`` and returns its whole text, or, as the streamed answer, its handle.
- ``retrieve``: hybrid retrieval (``sokuji/retrieval``): the query embedded by a served
  encoder (through the contract: batched with everything else that model serves), then BM25
  and the ANN index, fused; ``query`` and optional ``filters`` inputs. Output: the hits as
  plain dicts (id, text, score, metadata).
- ``features``: an online feature store lookup (``sokuji/features``, Feast) in a worker
  thread; input ``entity_id``. With API keys (``Resources.keyed``: decided once, from the
  config), ids are namespaced by tenant (``features/tenant_ids.py``: ``<tenant>:<id>``, the
  tenant's ``%`` and ``:`` escaped) unless the step's ``scope_by_tenant`` is false: one tenant
  cannot read another's users' features by guessing their ids, nor reach an unscoped row. An
  open server has one tenant: ids are looked up as given (the built-in users,
  ``user-0000`` ...).
- ``python``: a call of the step's own Python model (``python_step.py``: the function built
  as a model of kind python, owned by the pipeline), with the inputs as keyword arguments
  (and ``options`` / ``ctx`` if it declares them). A ``model`` step naming a served model of
  kind python calls it the same way: the arguments are its request's values.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sokuji.core import offload
from sokuji.core.model import Api, GenerationInput, RequestContext, ServedModel
from sokuji.errors import ConfigError, InvalidInput
from sokuji.features import tenant_ids
from sokuji.pipelines.config import StepConfig
from sokuji.pipelines.run import Answer
from sokuji.pipelines.step_options import (
    FeaturesOptions,
    GenerateOptions,
    RetrieveOptions,
    step_options,
)

Step = Callable[[dict[str, Any], RequestContext, Answer | None], Awaitable[Any]]
INLINE_SEARCH_S = 0.001


@dataclass
class Resources:
    """What steps share, loaded once: indexes and feature stores by name, the served models,
    and where built-in data lives."""

    models: dict[str, ServedModel]
    cache_dir: str
    indexes: dict[str, Any] = field(default_factory=dict)
    stores: dict[str, Any] = field(default_factory=dict)
    open_index: Callable[[str, ServedModel | None], Any] | None = None
    open_store: Callable[[str], Any] | None = None
    keyed: bool = True
    """API keys are configured: feature ids are scoped by tenant. False only for an open
    server (``load.py`` sets it from the config once), whose callers are one tenant."""
    build_python: Callable[[str, StepConfig, str, int], ServedModel] | None = None
    """A ``python`` step's own model (``python_step.build``: pipeline name, step, where it
    is in the config, the pipeline's max_concurrency)."""


def build_step(cfg: StepConfig, at: str, res: Resources,
               own: ServedModel | None = None) -> Step:
    """The step's work, from its options as ``graph.check_pipeline`` checked them when the
    config loaded; ``ConfigError`` (naming ``at``) for what only building shows (an index,
    a store, what kind of model a step calls). ``own``: a ``python`` step's model."""
    if cfg.kind == "python":
        assert own is not None, "a python step's model is built by its pipeline"
        return _python_model_step(own)
    if cfg.kind == "model":
        model = res.models[cfg.model]
        if model.apis == {Api.GENERATE}:
            return _generator_step(cfg, at, model)
        if Api.PREDICT in model.apis:
            return _python_model_step(model)
        if not model.batches:  # a pipeline passes strings (a row per text), not files
            served = "+".join(a.value for a in Api if a in model.apis)
            raise ConfigError.for_key(f"{at}.model", cfg.model,
                                      f"a model serving {served} cannot be a step (yet): "
                                      "steps call encoders and generators")
        return _encoder_step(model)
    if cfg.kind == "retrieve":
        return _retrieve_step(cfg, at, res)
    if cfg.kind == "features":
        return _features_step(cfg, at, res)
    raise AssertionError(f"unknown step kind {cfg.kind!r}")  # (the schema allows no other)


def _encoder_step(model: ServedModel) -> Step:
    async def run(args: dict[str, Any], ctx: RequestContext, answer: Answer | None) -> Any:
        texts = args.get("texts")
        one = isinstance(texts, str)
        if one:
            texts = [texts]
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str)
                                                               for t in texts):
            raise InvalidInput("'texts' must be a string or a non-empty list of strings")
        prepared = await model.prepare(texts, ctx)  # (admitted by its submit)
        rows = await model.submit(prepared, ctx).result()
        return rows[0] if one else rows
    return run


def _generator_step(cfg: StepConfig, at: str, model: ServedModel) -> Step:
    o: GenerateOptions = step_options(cfg, at)
    stop = (o.stop,) if isinstance(o.stop, str) else o.stop

    async def run(args: dict[str, Any], ctx: RequestContext, answer: Answer | None) -> Any:
        messages, prompt = args.get("messages"), args.get("prompt")
        if (messages is None) == (prompt is None):
            raise InvalidInput("a generator step needs exactly one of 'messages' or 'prompt'")
        if answer is None:
            inputs = GenerationInput(
                chat=messages is not None, messages=messages, prompt=prompt,
                max_tokens=o.max_tokens, max_tokens_field="max_tokens",
                min_tokens=o.min_tokens, ignore_eos=False, temperature=o.temperature,
                top_p=o.top_p, stop=stop, seed=o.seed)
        else:  # the chat request's answer: sampled as the client asks, up to the step's
            asked, ceiling = answer.request.max_tokens, o.max_tokens  # (prepare refuses more)
            inputs = dataclasses.replace(
                answer.request, chat=messages is not None, messages=messages, prompt=prompt,
                max_tokens=asked if ceiling is None else ceiling if asked is None
                else min(asked, ceiling))
        prepared = await model.prepare(inputs, ctx)  # (admitted by its submit)
        if answer is not None:  # the caller relays its events; the pipeline's timing is its
            return model.submit(prepared, ctx, timing=answer.timing)  # type: ignore[call-arg]
        return (await model.submit(prepared, ctx).result()).text
    return run


def _retrieve_step(cfg: StepConfig, at: str, res: Resources) -> Step:
    o: RetrieveOptions = step_options(cfg, at)
    encoder = res.models.get(o.encoder) if o.encoder else None
    if encoder is not None and Api.EMBED not in encoder.apis:
        raise ConfigError.for_key(f"{at}.options.encoder", o.encoder, "not an encoder")
    if o.index not in res.indexes:
        assert res.open_index is not None
        res.indexes[o.index] = res.open_index(o.index, encoder)
    index = res.indexes[o.index]
    k, mode, candidates, rerank = o.k, o.mode, o.candidates, o.rerank
    static_filters = o.filters

    cost = [0.0]  # EWMA of an inline search's seconds

    async def run(args: dict[str, Any], ctx: RequestContext, answer: Answer | None) -> Any:
        query = args.get("query")
        if not isinstance(query, str) or not query.strip():
            raise InvalidInput("'query' must be a non-empty string")
        filters = args.get("filters") or static_filters
        vector = None
        if mode != "bm25":
            assert encoder is not None
            prepared = await encoder.prepare([query], ctx)  # (admitted by its submit)
            vector = (await encoder.submit(prepared, ctx).result())[0]
        # On the event loop while searches measure cheap (the built-in index: ~0.2 ms, less
        # than a hand-off to a worker thread and back costs where wake-ups are slow); in the
        # preparation pool once they average over INLINE_SEARCH_S (a large index).
        search = functools.partial(index.search, query, vector, k=k, mode=mode,
                                   filters=filters, candidates=candidates, rerank=rerank)
        if cost[0] > INLINE_SEARCH_S:
            hits = await offload.run(search)
        else:
            t0 = time.perf_counter()
            hits = search()
            cost[0] += 0.2 * (time.perf_counter() - t0 - cost[0])
        return [{"id": h.id, "text": h.text, "score": round(float(h.score), 6),
                 "metadata": h.metadata} for h in hits]
    return run


def _features_step(cfg: StepConfig, at: str, res: Resources) -> Step:
    o: FeaturesOptions = step_options(cfg, at)
    store_name, entity, scoped = o.store, o.entity, o.scope_by_tenant and res.keyed
    if store_name not in res.stores:
        assert res.open_store is not None
        res.stores[store_name] = res.open_store(store_name)
    store = res.stores[store_name]
    names = list(o.features)
    known = store.entities()
    if entity not in known:
        raise ConfigError.for_key(f"{at}.options.entity", entity,
                                  f"not an entity of store '{store_name}' "
                                  f"({', '.join(sorted(known))})")
    for name in names:
        if name not in known[entity]:
            raise ConfigError.for_key(f"{at}.options.features", name,
                                      f"not a feature of entity '{entity}'")

    async def run(args: dict[str, Any], ctx: RequestContext, answer: Answer | None) -> Any:
        entity_id = args.get("entity_id")
        if entity_id is None:
            return dict.fromkeys(names)  # nobody to look up: every feature unknown
        if not isinstance(entity_id, str) or not 0 < len(entity_id) <= 256:
            raise InvalidInput("'entity_id' must be a string of 1 to 256 characters")
        key = tenant_ids.scoped(ctx.tenant, entity_id) if scoped else entity_id
        return await offload.run(store.get, entity, key, names)
    return run


def _python_model_step(model: ServedModel) -> Step:
    """The arguments as one request's values (with ``ctx`` where the function takes it); the
    output: what the code returned for it."""
    from sokuji.pipelines.python_step import wants_ctx

    ctx_too = wants_ctx(model)

    async def run(args: dict[str, Any], ctx: RequestContext, answer: Answer | None) -> Any:
        values = {**args, "ctx": ctx} if ctx_too else args
        prepared = await model.prepare(values, ctx)  # (admitted by its submit)
        return (await model.submit(prepared, ctx).result()).value
    return run

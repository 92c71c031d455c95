"""Pipelines built at start-up, after the models they call: their graphs (checked again
against the loaded models), their steps, and the indexes and feature stores the steps share.

Indexes: ``pydoc`` is the built-in one (``sokuji/retrieval``: Python's language reference),
built into ``<cache_dir>/indexes/pydoc`` with the served encoder's runtime the first time it
is needed (tens of seconds; then loaded in well under a second); any other name is the path
of an index directory written by ``sokuji index build``. Feature stores: ``users`` is the
built-in Feast repository (``sokuji/features``), on SQLite under ``<cache_dir>/features``
or on the Redis of ``feature_store_redis_url``; any other name is the path of a Feast
repository (``feature_store.yaml``), applied and materialized by its owner.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sokuji.config import ServerConfig
from sokuji.core.forming import BatchInfo
from sokuji.core.model import ServedModel
from sokuji.errors import ConfigError
from sokuji.pipelines import python_step
from sokuji.pipelines.config import PipelineConfig, StepConfig
from sokuji.pipelines.graph import check_pipeline
from sokuji.pipelines.model import PipelineModel
from sokuji.pipelines.steps import Resources

log = logging.getLogger(__name__)


def load_pipeline(pc: PipelineConfig, at: str, config: ServerConfig,
                  models: Mapping[str, ServedModel], shared: dict[str, Any],
                  on_batch: Callable[[str], Callable[[BatchInfo], None]] | None = None
                  ) -> PipelineModel:
    """One pipeline over the models built before it. ``shared``: the steps' resources
    (indexes, feature stores, opened once), kept for the pipelines built after it.
    ``on_batch``: batch statistics by model name, for its python steps' own models."""
    res = shared.get("resources")
    if res is None:
        def build_python(pipeline: str, step: StepConfig, where: str, limit: int
                         ) -> ServedModel:
            return python_step.build(pipeline, step, where, config, limit, on_batch)

        res = shared["resources"] = Resources(
            models=dict(models), cache_dir=config.cache_dir,
            open_index=lambda name, enc: open_index(name, enc, config.cache_dir),
            open_store=lambda name: open_store(name, config), keyed=bool(config.api_keys),
            build_python=build_python)
    graph = check_pipeline(pc, at, set(res.models))
    return PipelineModel(graph, res, at)


def _embedder(encoder: ServedModel | None) -> Any:
    """The served encoder's runtime, batched by its batcher's budgets (``embed_corpus``: the
    batcher itself is not started while the models load)."""
    from sokuji.kinds.encoder.model import EncoderModel
    from sokuji.runtimes.corpus_embedding import embed_corpus

    if not isinstance(encoder, EncoderModel):
        raise ConfigError("building an index needs an encoder served in this process "
                          "(options.encoder)")
    runtime, budgets = encoder.runtime, encoder.batcher.config

    def embed(texts: list[str]) -> np.ndarray:
        return embed_corpus(runtime, texts, max_batch_size=budgets.max_batch_size,
                            max_batch_tokens=budgets.max_batch_tokens)
    return embed


def open_index(name: str, encoder: ServedModel | None, cache_dir: str) -> Any:
    from sokuji.retrieval.index import HybridIndex

    if name == "pydoc":
        from sokuji.retrieval.builtin import ensure_pydoc_index

        path = ensure_pydoc_index(Path(cache_dir) / "indexes" / "pydoc", _embedder(encoder))
    else:
        path = Path(name)
    index = HybridIndex.load(path)
    log.info("index %s loaded (%d passages)", name, len(index))
    return index


def open_store(name: str, config: ServerConfig) -> Any:
    """``users``: the built-in store; any other name: the path of a Feast repository."""
    from sokuji.features.store import OnlineFeatures
    from sokuji.features.store_config import FeatureStoreConfig

    if name != "users":
        return OnlineFeatures.from_repo(Path(name))

    cfg = FeatureStoreConfig(path=Path(config.cache_dir) / "features",
                             redis_url=config.feature_store_redis_url or None)
    return OnlineFeatures.open(cfg)

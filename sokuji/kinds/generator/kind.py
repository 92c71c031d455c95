"""Kind ``llama``: a ``GeneratorModel`` over a ``LlamaRuntime`` (the GGUF, its prompt rules,
the engine thread), its SLO budgets handed to the engine's waiting room. Its options are
``LlamaOptions`` (``llm/options.py``), checked when the config loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from sokuji.config import DEFAULT_LLM_NAME, ModelConfig, ServerConfig
from sokuji.errors import ConfigError
from sokuji.kinds.kind import BuildEnv, Built, Kind
from sokuji.llm.options import LlamaOptions
from sokuji.repository import registry


class GeneratorKind(Kind):
    options = LlamaOptions

    def parse(self, model: ModelConfig, at: str) -> LlamaOptions:
        """The schema's options; without flash attention the default speculation gives way
        (one asked for is refused by ``check``)."""
        options: LlamaOptions = super().parse(model, at)
        if not options.flash_attn and "speculative" not in model.options:
            options = msgspec.structs.replace(options, speculative="off")
        return options

    def check(self, model: ModelConfig, o: LlamaOptions, at: str,
              config: ServerConfig) -> None:
        super().check(model, o, at, config)
        if model.path is None and model.name != DEFAULT_LLM_NAME:
            raise ConfigError.for_key(f"{at}.path", None, "a llama model other than the "
                                      f"built-in {DEFAULT_LLM_NAME} needs a GGUF path")
        if model.path is not None and not Path(model.path).is_file():
            raise ConfigError.for_key(f"{at}.path", model.path, "no such file")
        at = f"{at}.options"
        if o.speculative != "off" and not o.flash_attn:
            raise ConfigError.for_key(f"{at}.speculative", o.speculative,
                                      "needs flash_attn = true: without it llama.cpp computes "
                                      "a token differently when others of its sequence are in "
                                      "the same batch, so drafts could change the text")
        if o.speculative_ngram_max < o.speculative_ngram_min:
            raise ConfigError.for_key(f"{at}.speculative_ngram_max", o.speculative_ngram_max,
                                      "must be at least speculative_ngram_min "
                                      f"({o.speculative_ngram_min})")
        drafted = bool(o.draft_model or o.draft_requantize)
        if o.speculative == "draft" and not drafted:
            raise ConfigError.for_key(f"{at}.speculative", o.speculative,
                                      "needs draft_model (a smaller GGUF with the same "
                                      "vocabulary) or draft_requantize")
        if drafted and o.speculative != "draft":
            key = "draft_model" if o.draft_model else "draft_requantize"
            raise ConfigError.for_key(f"{at}.{key}", getattr(o, key),
                                      'is used only with speculative = "draft"')
        if o.draft_model and not Path(o.draft_model).is_file():
            raise ConfigError.for_key(f"{at}.draft_model", o.draft_model, "no such file")
        if o.n_batch < o.slots:
            raise ConfigError.for_key(f"{at}.n_batch", o.n_batch,
                                      f"must be at least slots ({o.slots}): every step "
                                      "carries one token of each sequence")

    def build(self, model: ModelConfig, options: LlamaOptions, env: BuildEnv) -> Built:
        return Built(build_generator(model, options, env.server, env.at))


def build_generator(model: ModelConfig, options: LlamaOptions, server: ServerConfig,
                    at: str) -> Any:
    """The generator (blocking: loads the GGUF, warms up); also what a Ray Serve LLM replica
    builds (``scale/ray_llm.py``). ``at``: where the model sits in the config
    (``models[1]``), named by errors only loading finds (a draft's vocabulary)."""
    from sokuji.config_ops import budgets_for
    from sokuji.llm.generator import GeneratorModel
    from sokuji.llm.runtime import LlamaRuntime

    runtime = LlamaRuntime(model.name, model.path, options, server.cache_dir,
                           model.max_queue_depth, model.priority_aging_ms,
                           model.max_concurrency, at=at)
    runtime.load()
    runtime.engine.queue.slo = budgets_for(model.name, model.slo, server.slos)
    if model.warmup:
        runtime.warmup()
    return GeneratorModel(model, runtime)


def generators(config: ServerConfig) -> list[ModelConfig]:
    """The configured models of this kind: on Ray with ``llm_affinity``, each gets
    deployments of its own (``scale/ray_llm.py``)."""
    return [mc for mc in config.models if registry.get(mc.runtime) is KIND]


KIND = GeneratorKind()

"""Kind ``classifier``: a ``ClassifierRuntime`` (``runtimes/classifier.py``) under an
``EncoderModel``; its options are checked (files included) when the config loads."""

from __future__ import annotations

from typing import Any

from sokuji.config import ModelConfig, ServerConfig
from sokuji.core.model import Api
from sokuji.kinds.kind import BuildEnv, Built, Kind
from sokuji.models.encoder import EncoderModel


class ClassifierKind(Kind):
    def parse(self, model: ModelConfig, at: str) -> Any:
        from sokuji.runtimes.classifier import parse_options

        return parse_options(model, f"{at}.options")

    def check(self, model: ModelConfig, options: Any, at: str, config: ServerConfig) -> None:
        from sokuji.runtimes.classifier import load_prototypes

        super().check(model, options, at, config)
        load_prototypes(options.prototypes, f"{at}.options.prototypes")  # labels, texts

    def build(self, model: ModelConfig, options: Any, env: BuildEnv) -> Built:
        from sokuji.runtimes.classifier import ClassifierRuntime

        runtime = ClassifierRuntime(model, env.server)
        runtime.load()
        if model.warmup:
            runtime.warmup()
        # Scores, not embeddings: V2 infer only.
        return Built(EncoderModel.over(runtime, model, env.server.slos, model.name,
                                       env.on_batch, apis=frozenset({Api.INFER})))


KIND = ClassifierKind()

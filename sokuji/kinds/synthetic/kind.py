"""Kind ``synthetic``: a ``SyntheticRuntime`` under an ``EncoderModel``."""

from __future__ import annotations

from typing import Any

from sokuji.config import ModelConfig
from sokuji.kinds.kind import BuildEnv, Built, Kind
from sokuji.models.encoder import EncoderModel


class SyntheticKind(Kind):
    def parse(self, model: ModelConfig, at: str) -> Any:
        return model.options  # checked by the runtime when it is built

    def build(self, model: ModelConfig, options: Any, env: BuildEnv) -> Built:
        from sokuji.runtimes.synthetic import SyntheticRuntime

        runtime = SyntheticRuntime(options)
        runtime.load()
        if model.warmup:
            runtime.warmup()
        return Built(EncoderModel.over(runtime, model, env.server.slos, model.name,
                                       env.on_batch))


KIND = SyntheticKind()

"""Kind ``synthetic``: a ``SyntheticRuntime`` under an ``EncoderModel``; its options are
``SyntheticOptions`` (``runtimes/synthetic.py``)."""

from __future__ import annotations

from sokuji.config import ModelConfig, ServerConfig
from sokuji.errors import ConfigError
from sokuji.kinds.encoder.model import EncoderModel, text_limits
from sokuji.kinds.kind import BuildEnv, Built, Kind
from sokuji.runtimes.synthetic import SyntheticOptions, SyntheticRuntime


class SyntheticKind(Kind):
    options = SyntheticOptions

    def check(self, model: ModelConfig, options: SyntheticOptions, at: str,
              config: ServerConfig) -> None:
        super().check(model, options, at, config)
        if not options.degrades:
            for key in ("degrade_after_s", "degrade_after_batches"):
                if getattr(options, key) is not None:
                    raise ConfigError.for_key(f"{at}.options.{key}", getattr(options, key),
                                              "needs degrade_error_rate or degrade_extra_ms")

    def build(self, model: ModelConfig, options: SyntheticOptions, env: BuildEnv) -> Built:
        runtime = SyntheticRuntime(options)
        runtime.load()
        if model.warmup:
            runtime.warmup()
        # Its cost is base_ms + per_item_ms per text: bytes and texts bound it.
        return Built(EncoderModel.over(runtime, model, env.server.slos, model.name,
                                       env.on_batch,
                                       limits=text_limits(model, env.server.max_request_bytes)))


KIND = SyntheticKind()

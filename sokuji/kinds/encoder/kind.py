"""Kind ``onnx``: builds an ``EncoderModel`` (``kinds/encoder/model.py``) over an
``OnnxEncoderRuntime`` per servable variant file; the variant chosen by ``variant`` serves
the model, the others answer as its V2 versions."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sokuji.config import DEFAULT_MODEL_NAME, ModelConfig, ServerConfig
from sokuji.errors import ConfigError
from sokuji.kinds.encoder import variants
from sokuji.kinds.encoder.model import EncoderModel, text_limits
from sokuji.kinds.kind import BuildEnv, Built, Kind

log = logging.getLogger(__name__)


class EncoderKind(Kind):
    variants = True
    triton_backend = "onnxruntime"

    def check(self, model: ModelConfig, options: Any, at: str, config: ServerConfig) -> None:
        if model.path is None and model.name != DEFAULT_MODEL_NAME:
            raise ConfigError.for_key(f"{at}.path", None,
                                      "an onnx model other than the built-in minilm needs a path")
        if model.path is not None and not Path(model.path).is_file():
            raise ConfigError.for_key(f"{at}.path", model.path, "no such file")

    def build(self, model: ModelConfig, options: Any, env: BuildEnv) -> Built:
        from sokuji.runtimes.onnx import NotATextEncoder

        try:
            return self._build(model, env)
        except NotATextEncoder:
            if model.tokenizer is not None or model.variant != "fp32":
                raise
        # Any other graph (a classifier, a detector): its tensors as they are (kind tensor).
        from sokuji.kinds.tensor.kind import TensorOptions, build_model

        log.info("model %s: not a text encoder's graph: served as runtime tensor", model.name)
        return Built(build_model(model, TensorOptions(), env))

    def _build(self, model: ModelConfig, env: BuildEnv) -> Built:
        served, files = variants.resolve(model, env.server)
        loaded: dict[str, EncoderModel] = {}
        for name in (served, *sorted(set(files) - {served})):
            runtime = runtime_for(model, files[name])
            runtime.load()
            if model.warmup:
                runtime.warmup()
            metric_name = model.name if name == served else f"{model.name}@{name}"
            limits = text_limits(model, env.server.max_request_bytes,
                                 runtime.max_sequence_length)
            loaded[name] = EncoderModel.over(runtime, model, env.server.slos, metric_name,
                                             env.on_batch, limits=limits)
            log.info("model %s loaded (onnx, variant %s%s)", model.name, name,
                     "" if name == served else ", as a version")
        primary = loaded.pop(served)
        return Built(primary, variant=served, versions=dict(loaded))


def runtime_for(model: ModelConfig, path: Path) -> Any:
    """The ONNX runtime of one variant file (the built-in MiniLM brings its tokenizer)."""
    from sokuji.runtimes.onnx import OnnxEncoderRuntime
    from sokuji.weights import minilm

    if model.path is None and model.name == DEFAULT_MODEL_NAME:
        return OnnxEncoderRuntime(
            path, minilm.tokenizer_path(), intra_op_threads=model.intra_op_threads,
            max_sequence_length=min(model.max_sequence_length, minilm.max_sequence_length()))
    tokenizer = model.tokenizer or str(minilm.tokenizer_path())
    return OnnxEncoderRuntime(path, tokenizer, intra_op_threads=model.intra_op_threads,
                              max_sequence_length=model.max_sequence_length)


KIND = EncoderKind()

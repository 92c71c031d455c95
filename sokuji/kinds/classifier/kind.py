"""Kind ``classifier``: a ``ClassifierRuntime`` (``runtimes/classifier.py``) under an
``EncoderModel``; its options (``ClassifierOptions``) are checked, files included, when the
config loads."""

from __future__ import annotations

from pathlib import Path

import msgspec

from sokuji.config import ModelConfig, ServerConfig
from sokuji.core.model import Api
from sokuji.errors import ConfigError
from sokuji.kinds.encoder.model import EncoderModel, text_limits
from sokuji.kinds.kind import BuildEnv, Built, Kind
from sokuji.runtimes.classifier import (
    BUILTIN_PROTOTYPES,
    ENCODERS,
    ClassifierOptions,
    ClassifierRuntime,
    load_prototypes,
    prototypes_path,
)


class ClassifierKind(Kind):
    options = ClassifierOptions

    def parse(self, model: ModelConfig, at: str) -> ClassifierOptions:
        """The schema's options, with the model's ``tokenizer`` and ``intra_op_threads``
        where the table leaves them out."""
        options: ClassifierOptions = super().parse(model, at)
        fills = {"tokenizer": model.tokenizer, "intra_op_threads": model.intra_op_threads}
        return msgspec.structs.replace(
            options, **{k: v for k, v in fills.items() if k not in model.options})

    def check(self, model: ModelConfig, o: ClassifierOptions, at: str,
              config: ServerConfig) -> None:
        super().check(model, o, at, config)
        at = f"{at}.options"
        if o.encoder not in ENCODERS:
            if not Path(o.encoder).is_file():
                raise ConfigError.for_key(f"{at}.encoder", o.encoder,
                                          f"must be one of: {', '.join(ENCODERS)}, or the path "
                                          "of an ONNX encoder file (no such file)")
            if o.tokenizer is None:
                raise ConfigError.for_key(f"{at}.tokenizer", None,
                                          "an encoder given by path needs its tokenizer.json")
            if not Path(o.tokenizer).is_file():
                raise ConfigError.for_key(f"{at}.tokenizer", o.tokenizer, "no such file")
        elif "tokenizer" in model.options:
            raise ConfigError.for_key(f"{at}.tokenizer", o.tokenizer, f"the built-in "
                                      f"{o.encoder} brings its own tokenizer: set it only with "
                                      "an encoder path")
        path = prototypes_path(o.prototypes)
        if path is None:
            known = ", ".join(f"builtin:{n}" for n in BUILTIN_PROTOTYPES)
            raise ConfigError.for_key(f"{at}.prototypes", o.prototypes,
                                      f"unknown built-in set (known: {known})")
        if not path.is_file():
            raise ConfigError.for_key(f"{at}.prototypes", o.prototypes,
                                      f"no such file: {path}")
        load_prototypes(path, f"{at}.prototypes")  # its labels and texts

    def build(self, model: ModelConfig, options: ClassifierOptions, env: BuildEnv) -> Built:
        runtime = ClassifierRuntime(model, options, env.server)
        runtime.load()
        if model.warmup:
            runtime.warmup()
        assert runtime.encoder is not None
        limits = text_limits(model, env.server.max_request_bytes,
                             runtime.encoder.max_sequence_length)
        # Scores, not embeddings: V2 infer only.
        return Built(EncoderModel.over(runtime, model, env.server.slos, model.name,
                                       env.on_batch, apis=frozenset({Api.INFER}),
                                       limits=limits))


KIND = ClassifierKind()

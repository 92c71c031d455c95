"""Which file serves an ONNX model: the original (``fp32``) or a variant that ``sokuji
optimize`` built, measured and let through its quality gate.

``variant = "auto"`` serves the recommended variant (``fp32`` when the model was never
optimized); a name serves that variant, which must have passed the gate or been forced.
Every servable variant is also loaded on its own, addressable as a V2 version
(``/v2/models/minilm/versions/int8/infer``).
"""

from __future__ import annotations

from pathlib import Path

from sokuji.config import DEFAULT_MODEL_NAME, ModelConfig, ServerConfig
from sokuji.errors import ConfigError
from sokuji.weights import variant_index


def base_path(model: ModelConfig, server: ServerConfig) -> Path:
    if model.path is None and model.name == DEFAULT_MODEL_NAME:
        from sokuji.weights import minilm

        return minilm.ensure_onnx(server.cache_dir)
    assert model.path is not None  # config validation guarantees it
    return Path(model.path)


def resolve(model: ModelConfig, server: ServerConfig) -> tuple[str, dict[str, Path]]:
    """(the variant served by default, every servable variant's file)."""
    base = base_path(model, server)
    index = variant_index.read_index(base)
    files: dict[str, Path] = {"fp32": base}
    if index is not None and Path(index["root"]) == base.parent:
        files.update(variant_index.servable(index))
    want = model.variant
    if want == "auto":
        want = index["recommended"] if index is not None else "fp32"
    if want not in files:
        key = f"models['{model.name}'].variant"
        if index is None:
            raise ConfigError.for_key(key, want, "the model has no variants yet: run "
                                      f"`sokuji optimize {model.path or model.name}`")
        entry = index["variants"].get(want)
        if entry is None:
            raise ConfigError.for_key(key, want, "no such variant; built: "
                                      f"{', '.join(index['variants'])}")
        raise ConfigError.for_key(key, want, "this variant failed the quality gate "
                                  f"({entry['quality']}); rerun sokuji optimize with "
                                  f"--force {want} to serve it anyway")
    return want, files

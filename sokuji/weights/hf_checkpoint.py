"""A local Hugging Face checkpoint as ``sokuji export`` reads it (``weights/hf_export.py``
exports it, ``weights/hf_check.py`` checks the export): its layout, task, pooling, window,
labels and tokenizer, read from its files before anything heavy is imported.

Two layouts, told apart by the files (``--task`` forces one):

  embedding       a sentence-transformers directory (``modules.json``: a Transformer, a
                  Pooling module whose ``config.json`` says mean, cls or max, optionally a
                  Normalize), or a plain transformers encoder (``config.json``; ``AutoModel``,
                  masked mean pooling, no normalisation).
  classification  ``config.json``'s ``architectures`` name a ``...ForSequenceClassification``
                  (``AutoModelForSequenceClassification``).

A directory that cannot be exported is a ``ConfigError`` naming the file and why.
``load_model`` loads the checkpoint with transformers (offline; imported only there) for the
export and the check.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sokuji.errors import ConfigError

TASKS = ("embedding", "classification")
POOLINGS = ("mean", "cls", "max")
DEFAULT_MAX_LENGTH = 512
_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert", "mpnet", "longformer",
                               "bart", "mbart"})
"""Model types whose position table starts after the padding index (514 rows, 512 usable)."""
_ST_MODULES = {"Transformer": "transformer", "Pooling": "pooling", "Normalize": "normalize"}
"""sentence-transformers modules the graph can hold, by class name: modules.json names them
``sentence_transformers.models.Pooling`` (before 5.x) or by their new homes
(``sentence_transformers.sentence_transformer.modules.pooling.Pooling``)."""
_LEGACY_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                   "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean",
                   "pooling_mode_lasttoken": "lasttoken"}


@dataclass(frozen=True)
class Checkpoint:
    """What ``inspect`` read from a checkpoint directory: enough to export and check it."""

    root: Path
    """The directory given."""
    model_dir: Path
    """Where config.json and the weights are (a sentence-transformers Transformer's path)."""
    task: str
    pooling: str = "mean"
    normalize: bool = False
    max_length: int = DEFAULT_MAX_LENGTH
    labels: tuple[str, ...] = ()
    """Classification: ``id2label`` in id order."""
    tokenizer_json: Path | None = None
    layout: str = "transformers"
    """``sentence-transformers`` or ``transformers``: how the task was found."""

    @classmethod
    def encoder(cls, model_dir: Path, *, pooling: str = "mean", normalize: bool = True,
                max_length: int = DEFAULT_MAX_LENGTH) -> Checkpoint:
        """An embedding checkpoint as the caller says (the built-in MiniLM and MPNet:
        mean pooling and L2, whatever their directory declares)."""
        return cls(root=model_dir, model_dir=model_dir, task="embedding", pooling=pooling,
                   normalize=normalize, max_length=max_length)

    def describe(self) -> str:
        if self.task == "classification":
            return f"sequence classification, {len(self.labels)} labels"
        return (f"embedding ({self.layout}), {self.pooling} pooling"
                + (", L2-normalised" if self.normalize else ""))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError.for_key("export", str(path), f"cannot read it as JSON: {exc}") from exc


def inspect(root: str | Path, task: str | None = None,
            max_length: int | None = None) -> Checkpoint:
    """Read a checkpoint directory: its layout (or ``task``), pooling, window and tokenizer.
    A ``ConfigError`` naming the file says why a directory cannot be exported."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError.for_key("export", str(root), "no such directory")
    if task is not None and task not in TASKS:
        raise ConfigError.for_key("export.task", task, f"must be one of {', '.join(TASKS)}")
    model_dir, pooling, normalize, st_max = root, "mean", False, None
    layout = "transformers"
    if (root / "modules.json").is_file():
        layout = "sentence-transformers"
        model_dir, pooling, normalize, st_max = _sentence_transformers(root)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError.for_key(
            "export", str(root), "not a Hugging Face checkpoint: no config.json"
            + ("" if model_dir == root else f" in {model_dir}"))
    config = _read_json(config_path)
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConfigError.for_key("export", str(config_path),
                                  "not a transformers config (no model_type)")
    weights = [p for p in model_dir.iterdir()
               if p.suffix in (".safetensors", ".bin") and p.is_file()]
    if not weights:
        raise ConfigError.for_key("export", str(model_dir),
                                  "no weights (*.safetensors or *.bin) beside config.json")
    architectures = [str(a) for a in config.get("architectures") or ()]
    found = ("classification"
             if any(a.endswith("ForSequenceClassification") for a in architectures)
             and layout == "transformers" else "embedding")
    task = task or found
    tokenizer_json = next((d / "tokenizer.json" for d in (model_dir, root)
                           if (d / "tokenizer.json").is_file()), None)
    if tokenizer_json is None:
        raise ConfigError.for_key(
            "export", str(root),
            "no tokenizer.json: Sokuji serves with the checkpoint's fast tokenizer "
            "(`tokenizers`), and this one has none. If transformers can convert its tokenizer, "
            "save one with AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
    labels: tuple[str, ...] = ()
    if task == "classification":
        id2label = config.get("id2label") or {}
        n = int(config.get("num_labels") or len(id2label) or 2)
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}")))
                       for i in range(n))
    return Checkpoint(root=root, model_dir=model_dir, task=task,
                      pooling=pooling if task == "embedding" else "",
                      normalize=normalize and task == "embedding",
                      max_length=max_length or _window(model_dir, root, config, st_max),
                      labels=labels, tokenizer_json=tokenizer_json, layout=layout)


def _sentence_transformers(root: Path) -> tuple[Path, str, bool, int | None]:
    """modules.json's Transformer directory, Pooling mode, Normalize, and max_seq_length."""
    modules = _read_json(root / "modules.json")
    if not isinstance(modules, list):
        raise ConfigError.for_key("export", str(root / "modules.json"), "not a list of modules")
    kinds: dict[str, Path] = {}
    for m in modules:
        ref = str(m.get("type", "")) if isinstance(m, dict) else ""
        kind = (_ST_MODULES.get(ref.rsplit(".", 1)[-1])
                if ref.startswith("sentence_transformers.") else None)
        if kind is None:
            raise ConfigError.for_key(
                "export", str(root / "modules.json"),
                f"module {m!r} is not one the exporter can put in the graph "
                f"(supported: sentence-transformers' {', '.join(_ST_MODULES)})")
        kinds[kind] = root / str(m.get("path", ""))
    if "transformer" not in kinds:
        raise ConfigError.for_key("export", str(root / "modules.json"), "no Transformer module")
    pooling = "mean"
    if "pooling" in kinds:
        cfg = _read_json(kinds["pooling"] / "config.json")
        mode = cfg.get("pooling_mode") if isinstance(cfg, dict) else None
        if mode is None and isinstance(cfg, dict):  # before sentence-transformers 5.x
            mode = [name for key, name in _LEGACY_POOLING.items() if cfg.get(key) is True]
        modes = [mode] if isinstance(mode, str) else list(mode or ())
        if len(modes) != 1 or modes[0] not in POOLINGS:
            raise ConfigError.for_key(
                "export", str(kinds["pooling"] / "config.json"),
                f"pooling {modes or 'none'}: the exporter does one of {', '.join(POOLINGS)}")
        pooling = modes[0]
    st_max = None
    for d in (kinds["transformer"], root):
        if (d / "sentence_bert_config.json").is_file():
            st_max = _read_json(d / "sentence_bert_config.json").get("max_seq_length")
            break
    return kinds["transformer"], pooling, "normalize" in kinds, st_max


def _window(model_dir: Path, root: Path, config: dict[str, Any], st_max: Any) -> int:
    """Tokens the model reads: sentence-transformers' max_seq_length, else the tokenizer's
    model_max_length, within the position table (at most 512 when nothing says)."""
    stated = st_max
    if stated is None:
        for d in (model_dir, root):
            if (d / "tokenizer_config.json").is_file():
                stated = _read_json(d / "tokenizer_config.json").get("model_max_length")
                break
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and config.get("model_type") in _OFFSET_POSITIONS:
        positions -= 2
    limits = [int(x) for x in (stated, positions)
              if isinstance(x, int | float) and 0 < x < 1_000_000]
    return min(limits) if limits else DEFAULT_MAX_LENGTH


def load_model(ckpt: Checkpoint, **kwargs: Any) -> Any:
    """The checkpoint's model (its classifier head for classification), loaded by
    transformers from its files only, in float32 and eval mode."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModel, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if ckpt.task == "classification" else AutoModel
    try:
        model = auto.from_pretrained(str(ckpt.model_dir), local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError.for_key("export", str(ckpt.model_dir),
                                  f"transformers cannot load it: {exc}") from exc
    return model.float().eval()

"""``sokuji export DIR``: a local Hugging Face checkpoint as an ONNX model the ``onnx`` runtime
serves, with its tokenizer, checked against transformers' own output before it is handed over.

Two layouts, told apart by the files (``--task`` forces one):

  embedding       a sentence-transformers directory (``modules.json``: a Transformer, a
                  Pooling module whose ``config.json`` says mean, cls or max, optionally a
                  Normalize), or a plain transformers encoder (``config.json``; ``AutoModel``,
                  masked mean pooling, no normalisation). Out: ``[batch, dim]``, pooling and
                  normalisation inside the graph.
  classification  ``config.json``'s ``architectures`` name a ``...ForSequenceClassification``
                  (``AutoModelForSequenceClassification``). Out: logits ``[batch, labels]``.

The graph takes ``input_ids``, ``attention_mask`` (and ``token_type_ids`` where the model reads
them) as int64 ``[batch, sequence]``, both axes dynamic: the contract of
``runtimes/onnx.py``. It is traced with the legacy TorchScript exporter (opset 17, eager
attention, a padded dummy batch so that no mask shortcut is traced in), as the built-in MiniLM
and MPNet always were: ``minilm.export`` is this module's ``export_onnx``.

The check runs transformers (torch, the model's default attention) on ``SENTENCES`` (short,
long, non-Latin, empty, one past the model's window), each alone and unpadded, pools the
hidden states in NumPy as sentence-transformers does, and runs the exported graph through
``OnnxEncoderRuntime`` itself on the copied ``tokenizer.json`` (each alone, and those within
the window as one padded batch): the tokenizer, the padding and the truncation the server
uses. Embeddings must agree to a cosine of at least ``COSINE_TOLERANCE`` (every sentence,
alone and batched) and in length to ``NORM_TOLERANCE`` relative (a cosine cannot see a
missing or extra normalisation), logits to ``LOGITS_TOLERANCE`` absolute.

Nothing is downloaded (``HF_HUB_OFFLINE=1``, ``local_files_only=True``). torch and
transformers are imported only inside the functions that export and check; the serving path
never imports this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sokuji.errors import ConfigError

TASKS = ("embedding", "classification")
POOLINGS = ("mean", "cls", "max")
OPSET = 17
EXPORT_VERSION = "1"  # bump when the graph below changes: default outputs are rebuilt
EMBEDDING_OUTPUT = "sentence_embedding"
LOGITS_OUTPUT = "logits"
COSINE_TOLERANCE = 0.9999
LOGITS_TOLERANCE = 1e-3
NORM_TOLERANCE = 1e-3
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


SENTENCES = (
    "The cat sat on the mat.",
    "Quarterly revenue rose 12% to $4.2 billion, beating analysts' estimates.",
    "How do I reset my password?",
    "東京は日本の首都です。",
    "ok",
    "",
    "Patient presented with acute dyspnea; SpO2 88% on room air, started on 2L O2 via NC.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Die Katze schläft auf dem Sofa, während draußen der Regen fällt.",
    # Past every window up to 512 tokens: both sides must truncate the same way.
    " ".join(["Retrieval-augmented generation grounds answers in documents."] * 64),
)


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


@dataclass
class Verdict:
    """What the check measured."""

    measure: str
    """``min cosine`` (embeddings) or ``max abs logits diff`` (classification)."""
    value: float
    tolerance: float
    sentences: int
    ok: bool
    dim: int
    inputs: list[str]
    """The graph's input names, in its order."""
    per_sentence: list[float] = field(default_factory=list)
    norm_diff: float | None = None
    """Embeddings: the largest relative difference of a vector's length."""

    def line(self) -> str:
        cosine = self.measure == "min cosine"
        shown = f"{self.value:.8f}" if cosine else f"{self.value:.3g}"
        cmp = ">=" if cosine else "<="
        norms = ("" if self.norm_diff is None else
                 f"; max relative norm diff = {self.norm_diff:.3g} (<= {NORM_TOLERANCE:g})")
        return (f"check: {self.measure} = {shown} over {self.sentences} sentences "
                f"(alone and batched; tolerance {cmp} {self.tolerance:g}{norms}): "
                + ("ok" if self.ok else "FAILED"))


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


def default_out(cache_dir: str | Path, ckpt: Checkpoint) -> Path:
    """``<cache_dir>/models/export/<dir name>-<key>``: keyed by the resolved path, what the
    graph holds (task, pooling, normalisation, ``EXPORT_VERSION``) and the weights' names,
    sizes and modification times, so a changed checkpoint gets a new export."""
    weights = sorted(p for p in ckpt.model_dir.iterdir() if p.suffix in (".safetensors", ".bin"))
    key = hashlib.sha256(json.dumps(
        [str(ckpt.root.resolve()), ckpt.task, ckpt.pooling, ckpt.normalize, EXPORT_VERSION,
         [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights]]).encode()
    ).hexdigest()[:12]
    return Path(cache_dir) / "models" / "export" / f"{model_name(ckpt)}-{key}"


def model_name(ckpt: Checkpoint) -> str:
    """A model name from the directory's (Sokuji's and Triton's: no '/', no spaces)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", ckpt.root.resolve().name).strip("-.")
    return name or "model"


def export_onnx(ckpt: Checkpoint, target: Path) -> None:
    """Trace ``ckpt`` (with its pooling and normalisation, or its classifier head) to
    ``target``, written atomically."""
    import inspect as pyinspect

    import torch

    model = _load_model(ckpt, attn_implementation="eager")
    takes_types = "token_type_ids" in pyinspect.signature(model.forward).parameters

    class Graph(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
            kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
            if token_type_ids is not None:
                kwargs["token_type_ids"] = token_type_ids
            out = self.inner(**kwargs)
            if ckpt.task == "classification":
                return out.logits
            hidden = out.last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            if ckpt.pooling == "cls":
                pooled = hidden[:, 0]
            elif ckpt.pooling == "max":
                pooled = hidden.masked_fill(mask == 0, -1e9).max(dim=1).values
            else:
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            if ckpt.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            return pooled

    ids = torch.ones((2, 8), dtype=torch.int64)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # a padded row: the mask is traced as data, never as "all ones"
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if takes_types else [])
    args = (ids, mask, torch.zeros_like(ids))[:len(names)]
    output = LOGITS_OUTPUT if ckpt.task == "classification" else EMBEDDING_OUTPUT
    axes = {0: "batch", 1: "sequence"}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    with torch.no_grad():
        torch.onnx.export(
            Graph(model).eval(), args, str(tmp), input_names=names, output_names=[output],
            dynamic_axes={**{n: axes for n in names}, output: {0: "batch"}},
            opset_version=OPSET, dynamo=False)
    os.replace(tmp, target)


def _load_model(ckpt: Checkpoint, **kwargs: Any) -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModel, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if ckpt.task == "classification" else AutoModel
    try:
        model = auto.from_pretrained(str(ckpt.model_dir), local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError.for_key("export", str(ckpt.model_dir),
                                  f"transformers cannot load it: {exc}") from exc
    return model.float().eval()


def reference(ckpt: Checkpoint, sentences: Sequence[str]) -> Any:
    """transformers' own output for ``sentences``, each alone (no padding: the graph's
    padded batches are checked against it): its tokenizer truncating to the window, its
    model, the hidden states pooled in NumPy as sentence-transformers pools them."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(ckpt.tokenizer_json.parent if ckpt.tokenizer_json else ckpt.model_dir),
        local_files_only=True)
    model = _load_model(ckpt)
    rows = []
    for text in sentences:
        enc = tokenizer([text], truncation=True, max_length=ckpt.max_length,
                        return_tensors="pt")
        with torch.no_grad():
            out = model(**enc)
        if ckpt.task == "classification":
            rows.append(out.logits.numpy()[0].astype(np.float64))
            continue
        hidden = out.last_hidden_state.numpy()[0].astype(np.float64)
        if ckpt.pooling == "cls":
            pooled = hidden[0]
        elif ckpt.pooling == "max":
            pooled = hidden.max(axis=0)
        else:
            pooled = hidden.mean(axis=0)
        if ckpt.normalize:
            pooled = pooled / max(float(np.linalg.norm(pooled)), 1e-12)
        rows.append(pooled)
    return np.stack(rows)


def served(onnx_path: Path, tokenizer_path: Path, max_length: int,
           sentences: Sequence[str]) -> tuple[Any, Any, list[str], list[bool]]:
    """The exported graph through the server's own runtime: each of ``sentences`` alone,
    and those that fit the window with room to spare in one padded batch (the one past
    it is read alone: padded to the window, it would multiply the work for nothing the
    short ones do not show). Also the graph's input names."""
    import numpy as np

    from sokuji.runtimes.onnx import OnnxEncoderRuntime

    runtime = OnnxEncoderRuntime(onnx_path, tokenizer_path, max_sequence_length=max_length)
    runtime.load()
    try:
        prepared = [runtime.preprocess([s]) for s in sentences]
        alone = np.concatenate([runtime.run_batch([p])[0] for p in prepared])
        short = [s for s, p in zip(sentences, prepared, strict=True) if p.length < max_length]
        batched = (runtime.run_batch([runtime.preprocess(short)])[0] if short
                   else alone[:0])
        inputs = list(runtime._input_names)  # as the runtime read them from the graph
    finally:
        runtime.close()
    return batched, alone, inputs, [p.length < max_length for p in prepared]


def check(ckpt: Checkpoint, onnx_path: Path, tokenizer_path: Path,
          sentences: Sequence[str] = SENTENCES) -> Verdict:
    """Compare the exported graph (as served: batched and alone) with transformers (each
    sentence alone, unpadded) on ``sentences``."""
    import numpy as np

    ref = reference(ckpt, sentences)
    batched, alone, inputs, in_batch = served(onnx_path, tokenizer_path, ckpt.max_length,
                                              sentences)
    classify = ckpt.task == "classification"

    def compare(got: Any, want: Any) -> Any:
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if classify:
            return np.abs(got - want).max(axis=1)
        a = got / np.maximum(np.linalg.norm(got, axis=1, keepdims=True), 1e-12)
        b = want / np.maximum(np.linalg.norm(want, axis=1, keepdims=True), 1e-12)
        return np.sum(a * b, axis=1)

    per = compare(alone, ref)
    mask = np.asarray(in_batch, dtype=bool)
    pick = np.maximum if classify else np.minimum
    per[mask] = pick(per[mask], compare(batched, ref[mask]))
    if classify:
        value = float(per.max())
        return Verdict("max abs logits diff", value, LOGITS_TOLERANCE, len(sentences),
                       value <= LOGITS_TOLERANCE, ref.shape[1], inputs, per.tolist())
    # A cosine cannot see a scale: the norms must agree too (normalised or not, as declared).
    norms = np.linalg.norm(np.asarray(alone, np.float64), axis=1)
    want = np.linalg.norm(ref, axis=1)
    norm_diff = float((np.abs(norms - want) / np.maximum(want, 1e-12)).max())
    value = float(per.min())
    return Verdict("min cosine", value, COSINE_TOLERANCE, len(sentences),
                   value >= COSINE_TOLERANCE and norm_diff <= NORM_TOLERANCE, ref.shape[1],
                   inputs, per.tolist(), norm_diff)


def toml_entry(name: str, ckpt: Checkpoint, out: Path, verdict: Verdict) -> str:
    """The ``[[models]]`` entry that serves the export with the ``onnx`` runtime."""
    lines = ["[[models]]", f"name = {json.dumps(name)}", 'runtime = "onnx"',
             f"path = {json.dumps(str((out / 'model.onnx').resolve()))}",
             f"tokenizer = {json.dumps(str((out / 'tokenizer.json').resolve()))}",
             f"max_sequence_length = {ckpt.max_length}"]
    if ckpt.task == "classification":
        lines.append(f"# logits [batch, {verdict.dim}], by label id: "
                     + ", ".join(f"{i}={label}" for i, label in enumerate(ckpt.labels)))
    else:
        lines.append(f"# {verdict.dim}-d embeddings ({ckpt.layout}), {ckpt.pooling} pooling"
                     + (", L2-normalised" if ckpt.normalize else ""))
    return "\n".join(lines)


def triton_config(name: str, inputs: Sequence[str], output: str, dim: int,
                  max_batch_size: int) -> str:
    """config.pbtxt for Triton's onnxruntime backend: raw INT64 tensors in, FP32 out."""
    ins = ",\n".join(f'  {{ name: "{n}" data_type: TYPE_INT64 dims: [ -1 ] }}' for n in inputs)
    return (f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: {max_batch_size}\n'
            f"input [\n{ins}\n]\n"
            f'output [\n  {{ name: "{output}" data_type: TYPE_FP32 dims: [ {dim} ] }}\n]\n'
            "dynamic_batching { }\n")


def write_triton(out: Path, name: str, onnx_path: Path, verdict: Verdict, task: str,
                 max_batch_size: int) -> Path:
    """``<out>/<name>/config.pbtxt`` and ``<out>/<name>/1/model.onnx`` (a hard link where
    the file system allows, else a copy)."""
    model_dir = out / name
    version = model_dir / "1"
    version.mkdir(parents=True, exist_ok=True)
    target = version / "model.onnx"
    target.unlink(missing_ok=True)
    try:
        os.link(onnx_path, target)
    except OSError:
        shutil.copy2(onnx_path, target)
    output = LOGITS_OUTPUT if task == "classification" else EMBEDDING_OUTPUT
    (model_dir / "config.pbtxt").write_text(
        triton_config(name, verdict.inputs, output, verdict.dim, max_batch_size))
    return model_dir


def run(source: str | Path, *, out: Path | None, cache_dir: str | Path, task: str | None = None,
        name: str | None = None, triton: bool = False, max_length: int | None = None,
        max_batch_size: int = 32) -> int:
    """``sokuji export DIR``: inspect, export, copy the tokenizer, check, print the entry.
    Without ``out``, an export already in the cache for these checkpoint files is reused
    (and checked again). 0 when the check passes, 1 when it does not (the files stay, for a look);
    ``ConfigError`` (exit 2) for a directory that cannot be exported."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    ckpt = inspect(source, task, max_length)
    name = name or model_name(ckpt)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ConfigError.for_key("export.name", name, "use letters, digits, '_', '.', '-'")
    cached = out is None
    out = out or default_out(cache_dir, ckpt)
    onnx_path, tokenizer_path = out / "model.onnx", out / "tokenizer.json"
    if cached and onnx_path.is_file() and tokenizer_path.is_file():
        print(f"reusing the export of {ckpt.root} ({ckpt.describe()}) in {out}; checking it",
              flush=True)
    else:
        print(f"exporting {ckpt.root} ({ckpt.describe()}, {ckpt.max_length} tokens) to {out}",
              flush=True)
        export_onnx(ckpt, onnx_path)
        assert ckpt.tokenizer_json is not None
        tmp = tokenizer_path.with_suffix(f".tmp{os.getpid()}")
        shutil.copyfile(ckpt.tokenizer_json, tmp)
        os.replace(tmp, tokenizer_path)
    verdict = check(ckpt, onnx_path, tokenizer_path)
    print(f"inputs: {', '.join(verdict.inputs)} (int64 [batch, sequence]); output: "
          f"{LOGITS_OUTPUT if ckpt.task == 'classification' else EMBEDDING_OUTPUT} "
          f"[batch, {verdict.dim}]")
    if ckpt.task == "classification":
        print("labels: " + ", ".join(f"{i}={label}" for i, label in enumerate(ckpt.labels)))
    print(verdict.line())
    if triton:
        print(f"triton: {write_triton(out, name, onnx_path, verdict, ckpt.task, max_batch_size)}")
    print()
    print(toml_entry(name, ckpt, out, verdict))
    return 0 if verdict.ok else 1

"""``sokuji export DIR``: a local Hugging Face checkpoint as an ONNX model the ``onnx`` runtime
serves, with its tokenizer, checked against transformers' own output before it is handed over;
and what it writes beside it: the ``[[models]]`` entry, a Triton model directory.

The checkpoint is read by ``weights/hf_checkpoint.py`` (its layout: a sentence-transformers
directory or a plain transformers encoder for embeddings, a ``...ForSequenceClassification``
for classification) and the export checked by ``weights/hf_check.py``. Out: embeddings
``[batch, dim]`` (pooling and normalisation inside the graph), or logits ``[batch, labels]``.

The graph takes ``input_ids``, ``attention_mask`` (and ``token_type_ids`` where the model reads
them) as int64 ``[batch, sequence]``, both axes dynamic: the contract of
``runtimes/onnx.py``. It is traced with the legacy TorchScript exporter (opset 17, eager
attention, a padded dummy batch so that no mask shortcut is traced in), as the built-in MiniLM
and MPNet always were: ``minilm.export`` is this module's ``export_onnx``.

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
from pathlib import Path

from sokuji.errors import ConfigError
from sokuji.weights.hf_check import Verdict, check
from sokuji.weights.hf_checkpoint import Checkpoint, inspect, load_model

OPSET = 17
EXPORT_VERSION = "1"  # bump when the graph below changes: default outputs are rebuilt
EMBEDDING_OUTPUT = "sentence_embedding"
LOGITS_OUTPUT = "logits"


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

    model = load_model(ckpt, attn_implementation="eager")
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

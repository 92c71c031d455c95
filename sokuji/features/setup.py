"""The feature repository made ready once: applied to Feast's registry and materialized into
the online store, then left alone at every later start while its data is unchanged.

What "unchanged" means is the setup fingerprint: the repository's definition version, the
project, the generated users' ``(num_users, seed)``, the feature schema, Feast's version and
the online store's target (the SQLite file, or Redis host:port/db). A marker file per online
store (``<path>/materialized-<target>.json``) records the fingerprint of the last completed
materialization; it is written only after materialization finished. A start skips the work when
the marker matches, the registry holds the feature view and two probe rows (the first and the
last generated user) read back with their generated values; the probe catches an online store
that was emptied behind the marker's back (a flushed or restarted Redis). Two processes that
start on one path at once are serialised by a file lock, so one does the work and the other
finds it done.

Importing Feast has a side effect this module undoes: ``feast.metrics`` sets
``PROMETHEUS_MULTIPROC_DIR`` (and ``PROMETHEUS_MULTIPROCESS_DIR``) in the process environment.
Had ``prometheus_client`` not been imported yet, every metric in the process (Sokuji's own
included) would then store its values in mmap files, and child processes would inherit the
variables. So ``prometheus_client`` is imported first and the variables Feast added are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sokuji.errors import StoreUnavailable
from sokuji.features import rag_repo
from sokuji.features.store_config import FeatureStoreConfig

log = logging.getLogger(__name__)
_FEAST_ENV = ("PROMETHEUS_MULTIPROC_DIR", "PROMETHEUS_MULTIPROCESS_DIR")


@dataclass(frozen=True)
class SetupReport:
    """What one ``open`` did: ``materialized`` is False when the marker, the registry and the
    probe rows showed the store already set up (nothing was written)."""

    materialized: bool
    import_s: float      # importing Feast in this open (0.0 when it was already imported)
    setup_s: float       # the whole open: import, checks and any apply + materialize
    fingerprint: str
    marker: Path


def import_feast() -> float:
    """Imports Feast once per process (see the module docstring for the environment it
    leaves); returns the seconds it took, 0.0 when already imported."""
    if "feast" in sys.modules:
        return 0.0
    import prometheus_client  # noqa: F401  (chooses its value class before Feast sets the env)

    before = {name: os.environ.get(name) for name in _FEAST_ENV}
    # Feast imports torch whenever it is installed (feast.torch_wrapper, for tensor
    # outputs Sokuji never asks for): ~210 MB and ~1 s, in a serving process that never uses
    # torch (the MiniLM export runs in a child process). Blocked for the import; Feast
    # catches the ImportError and runs without it.
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # type: ignore[assignment]
    t0 = time.perf_counter()
    try:
        import feast  # noqa: F401
    finally:
        if blocked and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    elapsed = time.perf_counter() - t0
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
    return elapsed


def fingerprint(cfg: FeatureStoreConfig, target: str) -> str:
    import feast

    parts = {"definition": rag_repo.DEFINITION_VERSION, "project": cfg.project,
             "num_users": cfg.num_users, "seed": cfg.seed, "features": rag_repo.FEATURES,
             "feast": feast.__version__, "target": target}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _probe_ok(fs: Any, cfg: FeatureStoreConfig) -> bool:
    """The first and the last generated users read back through Feast with their values."""
    users = rag_repo.generate_users(cfg.num_users, cfg.seed)
    probes = [users[0], users[-1]]
    refs = [f"{rag_repo.VIEW}:{name}" for name in rag_repo.FEATURES]
    got = fs.get_online_features(
        features=refs, entity_rows=[{rag_repo.JOIN_KEY: p[rag_repo.JOIN_KEY]} for p in probes],
    ).to_dict()
    return all(got[name][i] == p[name] for i, p in enumerate(probes) for name in rag_repo.FEATURES)


def _recorded_fingerprint(marker: Path) -> str | None:
    try:
        return str(json.loads(marker.read_text())["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):  # absent or unreadable: set up again
        return None


def _registry_ready(fs: Any) -> bool:
    return any(v.name == rag_repo.VIEW for v in fs.list_feature_views())


def _apply_and_materialize(fs: Any, cfg: FeatureStoreConfig) -> None:
    source = cfg.path / f"{cfg.project}_users.parquet"
    rag_repo.write_source(source, rag_repo.generate_users(cfg.num_users, cfg.seed))
    fs.apply(rag_repo.feast_objects(source))
    start, end = rag_repo.MATERIALIZE_WINDOW
    # Feast prints its progress to stdout; a server's stdout is not the place. Start-up runs
    # before requests are served, so nothing else's output is swallowed here.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fs.materialize(start_date=start, end_date=end)
    log.debug("feast materialize: %s", out.getvalue().strip())


def ensure_ready(cfg: FeatureStoreConfig, repo_config: Callable[[], Any], target: str,
                 configure: Callable[[Any], None]) -> tuple[Any, SetupReport]:
    """Feast's ``FeatureStore`` over ``repo_config()`` (called once Feast is imported), given
    to ``configure`` before its first use (client settings), applied and materialized for
    ``cfg``. Blocking; raises what Feast and the online store's client raise (the caller
    translates). The probe read also opens the online store's connection, so the lazy
    connection set-up in Feast's online stores never races between the threads that call
    ``get`` later."""
    t0 = time.perf_counter()
    import_s = import_feast()
    from feast import FeatureStore

    cfg.path.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(cfg, target)
    marker = cfg.path / f"materialized-{cfg.target_id()}.json"
    with _file_lock(cfg.path / ".setup.lock"):
        fs = FeatureStore(config=repo_config())
        configure(fs)
        recorded = _recorded_fingerprint(marker)
        try:
            done = recorded == fp and _registry_ready(fs) and _probe_ok(fs, cfg)
        except sqlite3.OperationalError:  # e.g. the SQLite online store's file was removed
            done = False
        if not done:
            marker.unlink(missing_ok=True)
            _apply_and_materialize(fs, cfg)
            if not _probe_ok(fs, cfg):  # e.g. a Redis evicting keys (maxmemory)
                log.warning("feature store %s: materialized rows did not read back", target)
                raise StoreUnavailable("the feature store does not keep its rows")
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps({"fingerprint": fp, "target": target,
                                       "users": cfg.num_users, "seed": cfg.seed}))
            tmp.replace(marker)
    report = SetupReport(materialized=not done, import_s=import_s,
                         setup_s=time.perf_counter() - t0, fingerprint=fp, marker=marker)
    log.info("feature store ready (%s): %s in %.2f s (Feast import %.2f s)", target,
             "applied and materialized" if report.materialized else "already set up",
             report.setup_s, report.import_s)
    return fs, report

"""An API key may name the built-in ``rag`` pipeline in its ``models`` (finding 6: the keys'
models were checked before the built-in pipelines existed, so such a config did not load)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sokuji import config as cfg
from sokuji.errors import ConfigError, Forbidden
from sokuji.repository import defaults
from sokuji.server.auth import Authenticator

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("bm25s", "feast", "faiss")),
    reason="the built-in rag needs the pipelines extra")

KEYS = """
[[api_keys]]
key = "rag-only-key-1"
tenant = "docs"
models = ["rag"]
"""


def test_a_key_naming_rag_loads_and_may_call_it(tmp_path: Path) -> None:
    path = tmp_path / "sokuji.toml"
    path.write_text(f'cache_dir = "{tmp_path}"\n{KEYS}')  # make serve's default models
    config = cfg.load(path, env={})
    assert "rag" in {mc.name for _, mc in defaults.entries(config)}  # what the server builds
    tenant = Authenticator(config.api_keys).authenticate(
        {"authorization": "Bearer rag-only-key-1"})
    tenant.check_model("rag")
    with pytest.raises(Forbidden):
        tenant.check_model("smollm2")  # the pipeline's steps call it; the key may not


def test_a_key_naming_rag_is_refused_when_rag_is_not_served(tmp_path: Path) -> None:
    path = tmp_path / "sokuji.toml"
    path.write_text(f'cache_dir = "{tmp_path}"\nbuiltin_pipelines = false\n{KEYS}')
    with pytest.raises(ConfigError, match=r"api_keys\[0\]\.models.*no such model"):
        cfg.load(path, env={})

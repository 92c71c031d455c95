"""The documentation cannot drift: the configuration reference is the schema's own output,
every TOML example is a config the schema accepts, and the site builds with
``mkdocs build --strict`` (a broken link, anchor or nav entry fails)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sokuji import config, config_reference
from sokuji.errors import ConfigError
from tests.conftest import ROOT

NOT_A_CONFIG = "# pyproject.toml"
"""The first line of a TOML block that is not a Sokuji config (a plug-in's pyproject)."""
HISTORY = ROOT / "docs" / "research"
"""Research notes: design history, whose examples may name keys that never shipped."""


def _toml_blocks() -> list[tuple[str, str]]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    blocks = []
    for page in pages:
        if HISTORY in page.parents:
            continue
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r"^```toml\n(.*?)^```", text, re.S | re.M):
            line = text.count("\n", 0, m.start()) + 1
            if not m.group(1).startswith(NOT_A_CONFIG):
                blocks.append((f"{page.relative_to(ROOT)}:{line}", m.group(1)))
    return blocks


BLOCKS = _toml_blocks()


def test_the_configuration_reference_is_the_schemas_own() -> None:
    page = ROOT / "docs" / "reference" / "configuration.md"
    assert page.read_text(encoding="utf-8") == config_reference.render(), (
        "docs/reference/configuration.md is stale: "
        "python -m sokuji.config_reference > docs/reference/configuration.md")


def test_the_reference_names_every_key_of_the_schema() -> None:
    page = config_reference.render()
    for name in config.ServerConfig.__struct_fields__ + config.ModelConfig.__struct_fields__:
        assert f"| `{name}` |" in page, name


def test_the_docs_have_toml_examples() -> None:
    assert len(BLOCKS) >= 5  # (a regex that matched nothing would pass every check below)


@pytest.mark.parametrize(("where", "text"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_every_toml_example_is_a_config_the_schema_accepts(
        where: str, text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Relative code files are the test data's: the README's iris.py is tests/data/pymodels'.
    monkeypatch.chdir(ROOT / "tests" / "data" / "pymodels")
    try:
        config.check_schema(text)
    except ConfigError as exc:
        pytest.fail(f"{where}: {exc}")


def test_check_schema_refuses_what_the_server_refuses() -> None:
    with pytest.raises(ConfigError, match=r"models\[0\]\.max_batch_size"):
        config.check_schema('[[models]]\nname = "m"\nmax_batch_size = -1\n')
    with pytest.raises(ConfigError, match=r"models\[0\]\.options\.slots"):
        config.check_schema('[[models]]\nname = "m"\nruntime = "llama"\n'
                            '[models.options]\nslots = "many"\n')
    with pytest.raises(ConfigError, match="unknown key"):
        config.check_schema('colour = "blue"\n')


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra (make test installs it)")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").is_file()

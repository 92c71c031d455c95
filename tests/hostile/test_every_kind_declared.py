"""Every kind runs the hostile suite: a registered kind (built in, or an installed
``sokuji.kinds`` entry point, or the plug-in this repository ships) without a declaration in
``declared.py`` fails here, naming it; and every declaration is served by the suite's server
as the kind it says."""

from __future__ import annotations

import tomllib

import pytest
import requests

from sokuji.repository import registry
from tests.conftest import ROOT
from tests.hostile import declared
from tests.hostile.conftest import Server, auth

pytestmark = pytest.mark.integration


def registered() -> set[str]:
    """Every kind a config may name here: the registry's, and the shipped plug-in's."""
    project = tomllib.loads((ROOT / "tests" / "plugin_kind" / "pyproject.toml").read_text())
    shipped = project["project"]["entry-points"][registry.GROUP]
    return {*registry.names(), *shipped}


def undeclared(kinds: set[str]) -> list[str]:
    return sorted(kinds - set(declared.DECLARED))


def test_every_registered_kind_declares_its_inputs() -> None:
    missing = undeclared(registered())
    assert not missing, (f"kinds without a hostile-suite declaration: {', '.join(missing)}: "
                         "add a Declared for each to tests/hostile/declared.py "
                         "(docs/adding-a-kind.md, 'The hostile-input suite')")


def test_a_new_kind_without_a_declaration_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.BUILTIN, "newkind", "somewhere.kind:KIND")
    assert undeclared(registered()) == ["newkind"]


def test_each_declaration_is_well_formed() -> None:
    known = {declared.TEXT, declared.TENSOR, declared.IMAGE, declared.AUDIO, declared.CHAT}
    routes = {declared.V2_JSON, declared.V2_BINARY, declared.PLAIN, declared.OPENAI,
              declared.STREAM}
    for runtime, d in declared.DECLARED.items():
        assert d.runtime == runtime
        assert d.inputs and d.inputs <= known, runtime
        assert d.requests and {r.route for r in d.requests} <= routes, runtime
        assert f'name = "{d.model}"' in d.config, runtime
        assert f'runtime = "{runtime}"' in d.config or runtime in registry.TABLES.values(), \
            runtime


def test_the_server_serves_each_declared_kind(server: Server) -> None:
    for d in declared.DECLARED.values():
        r = requests.get(f"{server.url}/v2/models/{d.model}/config", headers=auth("ops"),
                         timeout=10)
        assert r.status_code == 200, (d.runtime, r.text)
        if d.runtime in registry.names():  # (the plug-in is installed for the server only)
            kind = registry.get(d.runtime)
            assert r.json()["backend"] == (kind.triton_backend or d.runtime), d.runtime

"""The error tree across process boundaries."""

from __future__ import annotations

import ast
import importlib
import pickle
from pathlib import Path
from typing import Any

import pytest

from sokuji import errors
from sokuji.core.limits import Limit
from sokuji.errors import Overloaded, SokujiError

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("sokuji.errors", "sokuji.core.limits", "sokuji.kinds.python.model", "sokuji.audio.vad",
           "sokuji.pycode.worker", "sokuji.routing.upstream_errors", "sokuji.server.callbacks",
           "sokuji.runtimes.onnx")
"""Where error classes are defined (imported, so that every subclass is known;
``test_every_error_class_is_known`` finds any other module that defines one)."""

BUILT: dict[str, Any] = {
    "sokuji.errors:MethodNotAllowed": lambda cls: cls("only GET", allow=("GET", "HEAD")),
    "sokuji.errors:RequestTimeout": lambda cls: cls("the body did not arrive within 3 s"),
    "sokuji.errors:StoreUnavailable": lambda cls: cls("the job store is down", retry_after_s=7),
    "sokuji.errors:RouteUnavailable": lambda cls: cls("every target cools down", retry_after_s=9),
    "sokuji.errors:GrammarFailed": lambda cls: cls("smollm2", "no token is allowed"),
    "sokuji.errors:WorkerLost": lambda cls: cls("the worker crashed", retry_after_s=4),
    "sokuji.errors:Overloaded": lambda cls: cls("full", retry_after_s=3),
    "sokuji.errors:Unauthorized": lambda cls: cls("no API key"),
    "sokuji.errors:StepFailed": lambda cls: cls("qa", "answer", Overloaded("step queue full",
                                                                          retry_after_s=5)),
    "sokuji.routing.upstream_errors:UpstreamFailed":
        lambda cls: cls("a bad body", upstream_status=500, before_response=True),
    "sokuji.routing.upstream_errors:UpstreamUnavailable":
        lambda cls: cls("refused", retry_after_s=2, before_response=True, upstream_status=503),
    "sokuji.routing.upstream_errors:UpstreamRejected":
        lambda cls: cls("no such input", status=422, param="inputs"),
    "sokuji.routing.upstream_errors:UpstreamOverloaded":
        lambda cls: cls("upstream full", retry_after_s=6),
    "sokuji.routing.upstream_errors:UpstreamTimeout":
        lambda cls: cls("no answer in 2 s", before_response=True, target_fault=False,
                        upstream_status=504),
    "sokuji.server.callbacks:CallbackRefused":
        lambda cls: cls("a private address", lookup_failed=True),
    "sokuji.core.limits:LimitExceeded":
        lambda cls: cls(Limit("options.max_side", 4096, "pixels", "one side of an image"),
                        5000, "image 1"),
}
"""How to build the classes whose constructor is their own (the rest: message, param,
headers), by ``module:qualname``; a subclass is built as its nearest listed base. A class
whose constructor is neither fails the test: add it here."""


def _every_error_class() -> list[type[SokujiError]]:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional extra not installed: its classes are not known
            continue
    found: set[type[SokujiError]] = set()
    todo: list[type[SokujiError]] = [SokujiError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo.extend(cls.__subclasses__())
    return sorted((c for c in found if c.__module__.startswith("sokuji")),
                  key=lambda c: (c.__module__, c.__qualname__))


def _build(cls: type[SokujiError]) -> SokujiError:
    for klass in cls.__mro__:
        build = BUILT.get(f"{klass.__module__}:{klass.__qualname__}")
        if build is not None:
            return build(cls)  # type: ignore[no-any-return]
    return cls("why", param="p", headers={"x-sokuji-test": "kept"})


def test_every_error_class_is_known() -> None:
    """Every class in ``sokuji/`` derived (by name, transitively) from ``SokujiError`` is
    among those pickled below: a new error module must be listed in ``MODULES``."""
    known = {c.__qualname__ for c in _every_error_class()}
    defined: dict[str, list[str]] = {}
    for path in sorted((ROOT / "sokuji").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")
                         for b in node.bases]
                defined[node.name] = bases
    errors_seen = {"SokujiError"}
    grew = True
    while grew:
        more = {name for name, bases in defined.items() if errors_seen & set(bases)}
        grew = not more <= errors_seen
        errors_seen |= more
    assert errors_seen <= known, sorted(errors_seen - known)


@pytest.mark.parametrize("cls", _every_error_class(), ids=lambda c: c.__qualname__)
def test_every_error_survives_pickling_whole(cls: type[SokujiError]) -> None:
    """An error raised in another process (a Ray Serve replica, a worker) must arrive as
    itself: its type, message, status, code, headers and fields. Kills the mutants: deleting
    ``SokujiError.__reduce__`` (the keyword-only constructors then fail to unpickle, e.g.
    Overloaded, StoreUnavailable; StepFailed's three arguments too), or reducing to the
    type and args only (headers, ``param``, ``allow``, ``retry_after_s``, ``step`` lost)."""
    err = _build(cls)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert back.args == err.args and str(back) == str(err) and back.message == err.message
    assert (back.status, back.code, back.param) == (err.status, err.code, err.param)
    assert back.headers == err.headers
    assert vars(back) == vars(err)


def test_the_custom_fields_come_back() -> None:
    """The five classes the old test skipped, by name: their headers and fields."""
    allowed = pickle.loads(pickle.dumps(errors.MethodNotAllowed("x", allow=("GET", "PUT"))))
    assert allowed.status == 405 and allowed.headers == {"allow": "GET, PUT"}
    assert allowed.allow == ("GET", "PUT")
    store = pickle.loads(pickle.dumps(errors.StoreUnavailable("down", retry_after_s=7)))
    assert store.status == 503 and store.headers == {"retry-after": "7"}
    route = pickle.loads(pickle.dumps(errors.RouteUnavailable("cooling", retry_after_s=9)))
    assert route.headers == {"retry-after": "9"} and route.retry_after_s == 9
    who = pickle.loads(pickle.dumps(errors.Unauthorized("no key")))
    assert who.status == 401 and who.headers == {"www-authenticate": "Bearer"}
    step = pickle.loads(pickle.dumps(errors.StepFailed(
        "qa", "answer", Overloaded("full", retry_after_s=5))))
    assert (step.status, step.code, step.step) == (429, "overloaded", "answer")
    assert step.headers == {"retry-after": "5"}
    assert str(step) == "pipeline 'qa', step 'answer': full"
    refused = pickle.loads(pickle.dumps(Overloaded("full", retry_after_s=3)))
    assert refused.status == 429 and refused.retry_after_s == 3
    assert refused.headers == {"retry-after": "3"} and str(refused) == "full"

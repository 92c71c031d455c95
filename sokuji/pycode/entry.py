"""A Python model's entry: ``package.module:Class`` or ``path/to/file.py:Class``, loaded, and
what its class says of itself, read once (``UserCode``): how ``predict`` is called (plain,
``async def``, a generator, an async generator), its typed inputs and outputs (a
``msgspec.Struct`` or a pydantic model, from ``predict``'s annotations), ``describe``, and
the class attributes ``task`` and ``deterministic``.

A file entry is imported as a module of its own name (``sokuji_user_<stem>_<hash>``, so two
files called ``model.py`` never collide), with its directory put on ``sys.path`` first, as
running the file would: its sibling modules import. A worker process loads the same entry
string the same way (``pool.py``), so the class it runs is the one the server checked.

The minimal class::

    class Model:
        def setup(self, options: dict) -> None: ...
        def predict(self, inputs: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
            ...

A plain function is an entry too (``module:function``, a pipeline's ``python`` step): it is
called once per request with that request's values as keyword arguments.
"""

from __future__ import annotations

import collections.abc
import hashlib
import importlib
import importlib.util
import inspect
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sokuji.errors import ConfigError

Mode = Literal["sync", "async", "generator", "async_generator"]
TASKS = ("", "embeddings", "chat")


@dataclass(frozen=True)
class UserCode:
    """A loaded entry and what it says of itself."""

    entry: str
    target: Any
    """The class (or, for a function entry, the function)."""
    mode: Mode
    """How ``predict`` (a function entry: the function) is called."""
    function: bool = False
    """A plain function: called once per request, its values as keyword arguments."""
    input_type: Any = None
    """The type of one request's input (a ``msgspec.Struct`` or pydantic model), where
    ``predict`` declares ``inputs: list[T]``; None: a dict of named values."""
    output_type: Any = None
    """The type of one result, where ``predict`` declares ``-> list[T]`` (or a generator of
    ``list[T]``); None: a dict of named values."""
    task: str = ""
    """The class's ``task``: ``embeddings`` or ``chat`` (OpenAI routes), or empty."""
    deterministic: bool = False
    """The class's ``deterministic``: the same input always gets the same answer, so the
    response cache may keep it."""
    describes: bool = False
    """The class has ``describe()`` (its V2 metadata)."""
    takes_options: bool = True
    """``setup`` takes the options (a function entry: it has an ``options`` parameter)."""

    @property
    def streams(self) -> bool:
        return self.mode in ("generator", "async_generator")

    def new(self) -> Any:
        """A new instance (a function entry: the function itself)."""
        return self.target if self.function else self.target()


def load(entry: str, key: str, base: Path | None = None) -> UserCode:
    """The entry ``module:Name`` or ``file.py:Name`` (relative to ``base``, else the current
    directory), imported and read; ``ConfigError`` naming ``key`` when it cannot be."""
    where, sep, name = entry.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ConfigError.for_key(key, entry, "must be 'package.module:Class' or "
                                  "'path/to/file.py:Class'")
    try:
        module = _import(where, base)
    except ConfigError as exc:
        raise ConfigError.for_key(key, entry, exc.message) from None
    except (Exception, SystemExit) as exc:  # the user's module failed: say where, briefly
        raise ConfigError.for_key(key, entry, f"cannot be imported: {_last_line(exc)}") \
            from exc
    target = getattr(module, name, None)
    if target is None:
        raise ConfigError.for_key(key, entry, f"module {module.__name__!r} has no {name!r}")
    return inspect_target(entry, target, key)


def inspect_target(entry: str, target: Any, key: str) -> UserCode:
    """What ``target`` (a class with ``predict``, or a function) says of itself."""
    if inspect.isclass(target):
        predict = getattr(target, "predict", None)
        if not callable(predict):
            raise ConfigError.for_key(key, entry, f"class {target.__name__} has no predict "
                                      "method")
        setup = getattr(target, "setup", None)
        takes = setup is not None and len(_params(setup)) >= 2  # self, options
        task = getattr(target, "task", "") or ""
        if task not in TASKS:
            raise ConfigError.for_key(key, entry, f"class {target.__name__} has task "
                                      f"{task!r}: must be one of {', '.join(map(repr, TASKS))}")
        in_t, out_t = _types(predict)
        return UserCode(entry=entry, target=target, mode=_mode(predict), input_type=in_t,
                        output_type=out_t, task=task,
                        deterministic=bool(getattr(target, "deterministic", False)),
                        describes=callable(getattr(target, "describe", None)),
                        takes_options=takes)
    if callable(target):
        return UserCode(entry=entry, target=target, mode=_mode(target), function=True,
                        takes_options="options" in _params(target))
    raise ConfigError.for_key(key, entry, f"is a {type(target).__name__}, not a class or a "
                              "function")


def _import(where: str, base: Path | None) -> Any:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_absolute():
            path = (base or Path.cwd()) / path
        path = path.resolve()
        if not path.is_file():
            raise ConfigError(f"no such file: {path}")
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
        name = f"sokuji_user_{path.stem}_{digest}"
        if name in sys.modules:
            return sys.modules[name]
        folder = str(path.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    return importlib.import_module(where)


def _mode(fn: Any) -> Mode:
    if inspect.isasyncgenfunction(fn):
        return "async_generator"
    if inspect.isgeneratorfunction(fn):
        return "generator"
    if inspect.iscoroutinefunction(fn):
        return "async"
    return "sync"


def _params(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _types(predict: Any) -> tuple[Any, Any]:
    """``inputs: list[T]`` and ``-> list[U]`` (or an iterator of ``list[U]``) where T, U are
    typed records; None where the annotation is absent or a dict."""
    try:
        hints = typing.get_type_hints(predict)
    except Exception:  # noqa: BLE001 (an annotation naming what cannot be imported: untyped)
        return None, None
    params = [p for p in _params(predict) if p != "self"]
    in_t = _element(hints.get(params[0])) if params else None
    ret = hints.get("return")
    origin = typing.get_origin(ret)
    if origin in (collections.abc.Iterator, collections.abc.Generator,
                  collections.abc.AsyncIterator, collections.abc.AsyncGenerator,
                  collections.abc.Iterable, collections.abc.AsyncIterable):
        ret = typing.get_args(ret)[0] if typing.get_args(ret) else None
    return in_t, _element(ret)


def _element(hint: Any) -> Any:
    """T of ``list[T]`` (or ``Sequence[T]``) when T is a typed record, else None."""
    if hint is None or typing.get_origin(hint) not in (list, collections.abc.Sequence):
        return None
    args = typing.get_args(hint)
    return args[0] if args and is_record(args[0]) else None


def is_record(t: Any) -> bool:
    """A ``msgspec.Struct`` or a pydantic model class."""
    if not inspect.isclass(t):
        return False
    import msgspec

    if issubclass(t, msgspec.Struct):
        return True
    return any(c.__module__.startswith("pydantic") and c.__name__ == "BaseModel"
               for c in t.__mro__)


def _last_line(exc: BaseException) -> str:
    """An exception as its traceback's last line says it (``ValueError: bad value``)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1]}" if text else type(exc).__name__


last_line = _last_line

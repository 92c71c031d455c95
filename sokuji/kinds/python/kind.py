"""Kind ``python``: the user's own Python class (or function) served as a model
(``PythonModel`` over a ``pycode`` runner), batched like every model.

    [[models]]
    name = "iris"
    runtime = "python"
    max_batch_size = 32
    [models.options]
    entry = "models/iris.py:Iris"      # or "package.module:Iris"
    workers = 2                        # 0: in a server thread; N: N worker processes
    n_estimators = 50                  # any other key: the class's own, given to setup()

A class whose ``task`` is ``"embeddings"`` or ``"chat"`` is served on that OpenAI route too
(``tasks.py``: what its ``predict`` receives and returns there).

The keys this kind reads are ``PythonOptions``' fields; every other key of the table (and
those of ``setup = { ... }``, for a name this kind takes) is the class's own option, given to
``setup(options)``. The entry is imported when the config loads, so a bad entry stops
start-up naming ``models[i].options.entry``; ``setup`` runs at build, and a class that fails
there stops start-up naming the model and its traceback's last line.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

import msgspec

from sokuji import config_errors
from sokuji.config import ModelConfig, ServerConfig
from sokuji.core.batcher import DynamicBatcher
from sokuji.core.limits import Limit
from sokuji.core.model import Api, ModelMetadata, TensorSpec
from sokuji.core.tensor import DATATYPES
from sokuji.errors import ConfigError, SokujiError
from sokuji.kinds.encoder.model import batcher_config
from sokuji.kinds.kind import BuildEnv, Built, Kind
from sokuji.kinds.python import tasks
from sokuji.kinds.python import values as values_
from sokuji.kinds.python.model import PythonModel
from sokuji.pycode import entry as entry_

Dims = tuple[Annotated[int, msgspec.Meta(ge=-1)], ...]
PLATFORM = "python"


class Spec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A declared input or output (V2 metadata; the codec checks requests against it)."""

    name: str
    datatype: str
    dims: Dims
    """Its whole shape (-1: any size), as each request sends it."""
    optional: bool = False


class PythonOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The keys kind python reads from ``[models.options]``."""

    entry: str
    """``package.module:Class`` or ``path/to/file.py:Class`` (relative to the working
    directory); a function (``module:function``) is called once per request."""
    workers: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    """0: ``predict`` runs in the server's threads (``instances`` of them; for code that
    releases the GIL); N: in N worker processes, each with its own ``setup``."""
    timeout_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """With workers: the most one batch may run; past it the worker is killed and replaced,
    and the batch's requests get 503 with Retry-After. 0: no bound."""
    max_rss_mb: Annotated[int, msgspec.Meta(ge=0)] = 0
    """With workers: a worker whose resident memory exceeds this after a batch is restarted
    before the next. 0: no bound."""
    event_loop: Literal["thread", "server"] = "thread"
    """Where ``async def`` code is awaited: ``thread``, an event loop of the worker thread's
    own (code that blocks stalls only its batch); ``server``, the server's own loop, as
    FastAPI awaits an ``async def`` endpoint: no thread hop, many batches at once (up to
    ``instances``), a batch nobody waits for any more cancelled; the code must never block.
    A pipeline's ``async def`` step runs so."""
    deterministic: bool | None = None
    """The same input always gets the same answer (the response cache may keep it); None:
    as the class's ``deterministic`` attribute says (default False)."""
    inputs: tuple[Spec, ...] = ()
    """Declared inputs (else the class's ``describe()``, else any, shown as first seen)."""
    outputs: tuple[Spec, ...] = ()
    """Declared outputs (needed where ``inputs`` are: V2 answers the declared ones only);
    with no inputs declared, requests may send any."""
    max_elements: Annotated[int, msgspec.Meta(ge=1)] = 1 << 24
    """The most tensor elements one request may send (413 past it, before anything runs)."""
    setup: dict[str, Any] = {}
    """The class's own options (beside any key of this table that is not one of these)."""


class Parsed(msgspec.Struct, frozen=True):
    """What ``parse`` gives ``check`` and ``build``: the kind's options, the class's own
    options, and the loaded entry."""

    options: PythonOptions
    own: dict[str, Any]
    code: Any


_KEYS = frozenset(f.name for f in msgspec.structs.fields(PythonOptions))


class PythonKind(Kind):
    options = PythonOptions
    triton_backend = "python"

    def parse(self, model: ModelConfig, at: str) -> Parsed:
        table = dict(model.options)
        ours = {k: v for k, v in table.items() if k in _KEYS}
        options = config_errors.convert(ours, PythonOptions, f"{at}.options")
        own = {k: v for k, v in table.items() if k not in _KEYS}
        for key, value in options.setup.items():
            if key in own:
                raise ConfigError.for_key(f"{at}.options.setup.{key}", value,
                                          f"is given twice (also as options.{key})")
            own[key] = value
        code = entry_.load(options.entry, f"{at}.options.entry")
        if options.deterministic is not None:
            code = dataclasses.replace(code, deterministic=options.deterministic)
        return Parsed(options, own, code)

    def check(self, model: ModelConfig, options: Parsed, at: str,
              config: ServerConfig) -> None:
        super().check(model, options, at, config)
        if model.max_batch_size < 1:
            raise ConfigError.for_key(f"{at}.max_batch_size", model.max_batch_size,
                                      "must be at least 1 (a Python model takes a list of "
                                      "requests)")
        o = options.options
        for key, specs in (("inputs", o.inputs), ("outputs", o.outputs)):
            for i, spec in enumerate(specs):
                if spec.datatype not in DATATYPES:
                    raise ConfigError.for_key(f"{at}.options.{key}[{i}].datatype",
                                              spec.datatype,
                                              f"must be one of {', '.join(sorted(DATATYPES))}")
        if o.workers and model.instances not in (1, o.workers):
            raise ConfigError.for_key(f"{at}.instances", model.instances,
                                      f"a Python model with workers runs one batch per "
                                      f"worker process: options.workers ({o.workers}) sets "
                                      "its instances")
        if options.code.function and options.code.streams:
            raise ConfigError.for_key(f"{at}.options.entry", o.entry,
                                      "is a generator function: a function entry returns "
                                      "its result (to stream, use a class whose predict "
                                      "yields)")
        if options.code.task == "embeddings" and options.code.streams:
            raise ConfigError.for_key(f"{at}.options.entry", o.entry,
                                      "declares task 'embeddings', whose predict must return "
                                      "its rows, not yield them (a generator)")
        if o.inputs and not o.outputs:
            raise ConfigError.for_key(f"{at}.options.outputs", [],
                                      "must be declared too where options.inputs is (V2 "
                                      "answers a model's declared outputs only)")
        if o.event_loop == "server" and (o.workers or options.code.mode != "async"):
            raise ConfigError.for_key(f"{at}.options.event_loop", o.event_loop,
                                      "is for async def code (not a generator) in the "
                                      "server's process (workers = 0)")
        if (o.timeout_ms or o.max_rss_mb) and not o.workers:
            key = "timeout_ms" if o.timeout_ms else "max_rss_mb"
            raise ConfigError.for_key(f"{at}.options.{key}", getattr(o, key),
                                      "needs workers >= 1 (code in a server thread cannot be "
                                      "stopped or restarted)")

    def build(self, model: ModelConfig, options: Parsed, env: BuildEnv) -> Built:
        o, code = options.options, options.code
        runner = _runner(model, o, code, options.own)
        task = tasks.for_code(code, model.name)
        runner.start()
        try:
            metadata = _metadata(model, o, code, runner, env.at)
            if isinstance(task, tasks.Embeddings):
                metadata = _embeddings_metadata(task, metadata, code, runner)
        except BaseException:
            runner.close()
            raise
        limits = (Limit("max_request_bytes",
                        model.max_request_bytes or env.server.max_request_bytes, "bytes",
                        "bytes of one request's body"),
                  Limit("options.max_elements", o.max_elements, "elements",
                        "tensor elements of one request"),
                  *(task.limits if isinstance(task, tasks.Chat) else ()))
        apis = frozenset({Api.INFER, Api.PREDICT}) | (task.apis if task else frozenset())
        served = PythonModel(model, code, runner, metadata, limits, apis, task)
        inline = code.mode == "sync" and not code.streams and not o.workers
        bc = dataclasses.replace(
            batcher_config(model, env.server.slos),
            instances=o.workers or model.instances,
            inline_max_ms=model.inline_max_ms if inline else 0.0)
        run = served.run_batch_on_loop if o.event_loop == "server" else served.run_batch
        served.batcher = DynamicBatcher(model.name, run, bc,
                                        on_batch=env.on_batch(model.name) if env.on_batch
                                        else None)
        return Built(served)


def _runner(model: ModelConfig, o: PythonOptions, code: Any, own: dict[str, Any]) -> Any:
    if not o.workers:
        from sokuji.pycode.inthread import ThreadRunner

        return ThreadRunner(code, own, model.name, instances=model.instances)
    from sokuji.pycode.pool import ProcessRunner

    return ProcessRunner(code, own, model.name, workers=o.workers, timeout_ms=o.timeout_ms,
                         max_rss_mb=o.max_rss_mb or None)


def _metadata(model: ModelConfig, o: PythonOptions, code: Any, runner: Any, at: str
              ) -> ModelMetadata:
    """Declared in the config, else the class's ``describe()``, else open."""
    if o.inputs or o.outputs:
        return ModelMetadata(PLATFORM, _specs(o.inputs), _specs(o.outputs),
                             open=not o.inputs)
    if code.describes:
        try:  # (a worker process asked it as it set up: a failure stopped start-up there)
            described = runner.describe()
        except Exception as exc:  # noqa: BLE001 (the user's code: start-up stops, naming it)
            raise ConfigError(f"model '{model.name}' ({code.entry}): describe() failed: "
                              f"{entry_.last_line(exc)}") from None
        return _described(described, model.name, code.entry)
    return ModelMetadata(PLATFORM, (), (), open=True)


def _embeddings_metadata(task: tasks.Embeddings, declared: ModelMetadata, code: Any,
                         runner: Any) -> ModelMetadata:
    """An embeddings model's metadata: its rows' width as declared, else measured by one
    call of ``predict`` on one text at start-up (a class that fails it stops start-up,
    naming the model)."""
    def run(values: dict[str, Any]) -> Any:
        if code.input_type is not None:
            values = values_.typed(values, code.input_type)
        return runner.run([values]).results[0]

    try:
        return task.metadata(declared, run)
    except SokujiError as exc:
        raise ConfigError(f"model '{task.model}' ({code.entry}): task 'embeddings': the "
                          f"width of its rows is not declared, and measuring it failed: "
                          f"{exc.message}") from None


def _specs(specs: tuple[Spec, ...]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(s.name, s.datatype, tuple(s.dims), optional=s.optional)
                 for s in specs)


def _described(doc: Any, model: str, entry: str) -> ModelMetadata:
    """``describe()``'s answer: ``{"inputs": [{"name", "datatype", "shape"}], "outputs":
    [...]}`` (V2 metadata's own form), checked."""
    try:
        parsed = msgspec.convert(doc, _Described)
        for t in (*parsed.inputs, *parsed.outputs):
            if t.datatype not in DATATYPES:
                raise msgspec.ValidationError(f"datatype {t.datatype!r} is no KServe "
                                              "datatype")
    except msgspec.ValidationError as exc:
        raise ConfigError(f"model '{model}' ({entry}): describe() returned what is not V2 "
                          f"metadata: {exc}") from None
    if parsed.inputs and not parsed.outputs:
        raise ConfigError(f"model '{model}' ({entry}): describe() names inputs but no "
                          "outputs; V2 answers a model's declared outputs only: describe "
                          "both, or neither")
    return ModelMetadata(PLATFORM, tuple(TensorSpec(t.name, t.datatype, tuple(t.shape),
                                                    optional=t.optional)
                                         for t in parsed.inputs),
                         tuple(TensorSpec(t.name, t.datatype, tuple(t.shape))
                               for t in parsed.outputs), open=not parsed.inputs)


class _DescribedTensor(msgspec.Struct, frozen=True):
    name: str
    datatype: str
    shape: Dims
    optional: bool = False


class _Described(msgspec.Struct, frozen=True):
    inputs: tuple[_DescribedTensor, ...] = ()
    outputs: tuple[_DescribedTensor, ...] = ()


KIND = PythonKind()

"""A pipeline's ``python`` step is a call of a Python model: the step's function (``module:fn``
or ``path/to/file.py:fn``) is built as a model of kind ``python`` (``kinds/python``) named
``<pipeline>.<step>``, owned by the pipeline (started and stopped with it; not addressable
by clients, who reach it only through the pipeline), so it has what every model has: its
own queue, admission (429 at its full queue), deadlines, batching, metrics and statistics,
code loaded and checked the one way, each call's outcome its own, and a failure answered
with the exception's type, never its text (which may hold another request's data).

How the function runs, by what it is:

- ``async def``: awaited on the server's event loop (``event_loop = "server"``), each call
  its own task (``max_batch_size`` 1, up to ``instances`` at once: the pipeline's
  ``max_concurrency`` unless the step sets it); a call nobody waits for any more (its step
  timed out) is cancelled. It must never block.
- a plain function: under the batcher as any sync in-thread model: on the event loop while
  it measures quick (``inline_max_ms``), else in a worker thread (``instances`` of them);
  ``thread = true`` always in a worker thread (for a function that blocks).
- ``workers = N`` (a sync function that holds the GIL): N worker processes, as a model's.

The step's ``options``: ``thread``, ``instances``, ``max_batch_size``, ``inline_max_ms`` and
``max_queue_depth`` shape the step's model; the keys of kind python (``workers``, ``timeout_ms``,
``max_rss_mb``, ``event_loop``) are that kind's; every other key is the function's own,
given to it as its ``options`` argument. A function with a ``ctx`` parameter gets the
request's context (tenant, priority, deadline); it runs in the server's process.

A ``model`` step naming a served model of kind python calls it the same way (its request:
the step's arguments by name; its output: what the model returned for it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from sokuji.config import ModelConfig, ServerConfig
from sokuji.core.forming import BatchInfo
from sokuji.core.model import ServedModel
from sokuji.errors import ConfigError
from sokuji.pipelines.config import StepConfig

SHAPE_KEYS = ("instances", "max_batch_size", "inline_max_ms", "max_queue_depth")
ASYNC_INSTANCES = 256
"""Calls of an async step at once when the pipeline bounds nothing (max_concurrency 0)."""


def model_config(pipeline: str, step: StepConfig, max_concurrency: int,
                 is_async: bool) -> ModelConfig:
    """The step's model, as a ``[[models]]`` entry would declare it."""
    options = dict(step.options)
    thread = bool(options.pop("thread", False))
    shape = {k: options.pop(k) for k in SHAPE_KEYS if k in options}
    if is_async:
        options.setdefault("event_loop", "server")
        shape.setdefault("max_batch_size", 1)
        shape.setdefault("instances", max_concurrency or ASYNC_INSTANCES)
    if thread:
        shape["inline_max_ms"] = 0.0
    return ModelConfig(name=f"{pipeline}.{step.name}", runtime="python", warmup=False,
                       cache=False, options={"entry": step.function, **options}, **shape)


def build(pipeline: str, step: StepConfig, at: str, server: ServerConfig,
          max_concurrency: int, on_batch: Callable[[str], Callable[[BatchInfo], None]] | None
          ) -> ServedModel:
    """The step's Python model, built (its code set up); errors name the step's keys."""
    from sokuji.kinds.kind import BuildEnv
    from sokuji.kinds.python.kind import KIND
    from sokuji.pycode import entry as entry_

    code = entry_.load(step.function, f"{at}.function")  # (its errors name the step's key)
    mc = model_config(pipeline, step, max_concurrency, code.mode == "async")
    parsed = KIND.parse(mc, at)  # the step's options as the model's: options.<key>
    KIND.check(mc, parsed, at, server)
    if "ctx" in _parameters(parsed.code.target) and parsed.options.workers:
        raise ConfigError.for_key(f"{at}.options.workers", parsed.options.workers,
                                  "a function that takes ctx runs in the server's process "
                                  "(workers = 0)")
    return KIND.build(mc, parsed, BuildEnv(server, at, {}, {}, on_batch)).served


def _parameters(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def wants_ctx(model: ServedModel) -> bool:
    """The model's code is a function with a ``ctx`` parameter."""
    code = getattr(model, "code", None)
    return bool(code is not None and code.function and "ctx" in _parameters(code.target))

"""A pipeline's graph from its config: which step reads what, in which order they may run.
Pure: checked once at start-up (``config._check``), errors name the key as the file spells it;
each step's options are checked against its kind's schema (``step_options.py``).

A step's input is a reference: ``input.<name>`` (the request's input), ``<step>`` (that
step's whole output) or ``<step>.<key>`` (one key of a step's output, a mapping). A step
depends on every step it reads and on those in its ``after``; the graph must be acyclic.
Steps are kept in a topological order (the config's order among equals), so running them
in that order never reads an output not yet made.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sokuji.errors import ConfigError
from sokuji.pipelines.config import PipelineConfig, StepConfig
from sokuji.pipelines.step_options import step_options

INPUT = "input"
_FUNCTION = re.compile(r"\A([A-Za-z_][\w.]*|[^:]+\.py):[A-Za-z_]\w*\Z")


@dataclass(frozen=True, slots=True)
class Ref:
    step: int | None
    """The step read (its index in ``Graph.nodes``); None: the request's input."""
    key: str | None
    """The input's name, or the output's key (None: the whole output)."""


@dataclass(frozen=True, slots=True)
class Node:
    index: int
    config: StepConfig
    args: tuple[tuple[str, Ref], ...]
    deps: tuple[int, ...]
    """The steps it waits for (indices, ascending)."""

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(frozen=True)
class Graph:
    config: PipelineConfig
    nodes: tuple[Node, ...]
    """In a topological order."""
    output: int
    extra: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.config.name

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)


def check_pipeline(p: PipelineConfig, at: str, models: set[str]) -> Graph:
    """The graph of ``p``, or a ``ConfigError`` naming the key at fault (``at`` is
    ``pipelines[i]``); ``models``: the configured models' names."""
    names: dict[str, int] = {}
    for j, step in enumerate(p.steps):
        if step.name in names:
            raise ConfigError.for_key(f"{at}.steps[{j}].name", step.name, "duplicate step name")
        if step.name == INPUT:
            raise ConfigError.for_key(f"{at}.steps[{j}].name", step.name,
                                      "'input' names the request's inputs")
        names[step.name] = j
        _check_kind(step, f"{at}.steps[{j}]", models)
    inputs = set(p.inputs) | set(p.optional_inputs)
    if p.chat_input not in p.inputs:
        raise ConfigError.for_key(f"{at}.chat_input", p.chat_input, "not one of the inputs")
    refs: list[tuple[tuple[str, tuple[int | None, str | None]], ...]] = []
    deps: list[set[int]] = []
    for j, step in enumerate(p.steps):
        mine: list[tuple[str, tuple[int | None, str | None]]] = []
        wait: set[int] = set()
        for arg, text in step.inputs.items():
            where = f"{at}.steps[{j}].inputs.{arg}"
            head, _, key = str(text).partition(".")
            if head == INPUT:
                if key not in inputs:
                    raise ConfigError.for_key(where, text, "no such pipeline input (declare it "
                                              "in inputs or optional_inputs)")
                mine.append((arg, (None, key)))
                continue
            if head not in names:
                raise ConfigError.for_key(where, text, "must be input.<name>, <step> or "
                                          "<step>.<key> of another step")
            if head == step.name:
                raise ConfigError.for_key(where, text, "a step cannot read its own output")
            mine.append((arg, (names[head], key or None)))
            wait.add(names[head])
        for name in step.after:
            if name not in names or name == step.name:
                raise ConfigError.for_key(f"{at}.steps[{j}].after", name, "no such other step")
            wait.add(names[name])
        refs.append(tuple(mine))
        deps.append(wait)
    order = _topological(p, deps, at)
    position = {old: new for new, old in enumerate(order)}
    nodes = tuple(
        Node(position[old], p.steps[old],
             tuple((arg, Ref(None if s is None else position[s], key))
                   for arg, (s, key) in refs[old]),
             tuple(sorted(position[d] for d in deps[old])))
        for old in order)
    output = p.output or p.steps[-1].name
    if output not in names:
        raise ConfigError.for_key(f"{at}.output", output, "no such step")
    for name in p.extra_outputs:
        if name not in names:
            raise ConfigError.for_key(f"{at}.extra_outputs", name, "no such step")
    return Graph(p, nodes, position[names[output]],
                 tuple(position[names[n]] for n in p.extra_outputs))


def _check_kind(step: StepConfig, at: str, models: set[str]) -> None:
    options = step_options(step, at)
    if step.kind == "model":
        if step.model not in models:
            raise ConfigError.for_key(f"{at}.model", step.model or None,
                                      "a model step needs the name of a configured model")
    elif step.kind == "python":
        if not _FUNCTION.match(step.function):
            raise ConfigError.for_key(f"{at}.function", step.function or None,
                                      "must be package.module:function or "
                                      "path/to/file.py:function")
    elif step.kind == "retrieve":
        if options.encoder is not None and options.encoder not in models:
            raise ConfigError.for_key(f"{at}.options.encoder", options.encoder, "no such model")
        if options.mode != "bm25" and options.encoder is None:
            raise ConfigError.for_key(f"{at}.options.encoder", None, f"mode '{options.mode}' "
                                      "needs the encoder that embeds queries")
    if step.on_error == "fallback" and step.fallback is None:
        raise ConfigError.for_key(f"{at}.fallback", None,
                                  "on_error = 'fallback' needs a fallback value")


def _topological(p: PipelineConfig, deps: list[set[int]], at: str) -> list[int]:
    """Kahn's algorithm, the config's order among steps ready together."""
    done: list[int] = []
    left = list(range(len(p.steps)))
    while left:
        ready = [j for j in left if deps[j] <= set(done)]
        if not ready:
            j = left[0]
            raise ConfigError.for_key(f"{at}.steps[{j}].inputs", p.steps[j].name,
                                      "the steps' inputs form a cycle")
        done.append(ready[0])
        left.remove(ready[0])
    return done

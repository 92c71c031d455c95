"""A pipeline's schema (``[[pipelines]]``): its steps, inputs and outputs, as the config
file spells them. Part of the one config (``sokuji/config.py`` holds it in
``ServerConfig.pipelines`` and validates it); the graph built from it is ``graph.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from msgspec import field

from sokuji.config_types import ZeroOrMore, ZeroOrMoreS, _Table, _why

STEP_KINDS = ("model", "retrieve", "features", "python")
StepName = Annotated[str, _why("must be letters, digits, '_' or '-'",
                               pattern=r"\A[A-Za-z0-9_-]{1,64}\Z")]


class StepConfig(_Table, frozen=True):
    """One step of a pipeline (``sokuji/pipelines/``)."""

    name: StepName
    kind: Literal["model", "retrieve", "features", "python"]
    inputs: Mapping[str, str] = field(default_factory=dict)
    """Argument name -> what it is: ``input.<name>`` (the request's input), ``<step>`` (a
    step's output) or ``<step>.<key>`` (a key of a step's output). A step starts once every
    step it names has finished; steps that do not depend on each other run concurrently."""
    after: tuple[str, ...] = ()
    """Steps this one waits for although it reads none of their outputs."""
    model: str = ""
    """kind model: the served model to call (an encoder: input ``texts``; a generator:
    ``messages`` or ``prompt``)."""
    function: str = ""
    """kind python: ``package.module:function`` or ``path/to/file.py:function`` (sync or
    async), called with the inputs as keyword arguments and the step's ``options`` as
    ``options``: a model of kind python of its own (``pipelines/python_step.py``)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Kind-specific: retrieve (index, encoder, k, mode, candidates, rerank, filters),
    features (entity, features, store), model (max_tokens, temperature), python (thread:
    always in a worker thread; instances, max_batch_size, inline_max_ms; kind python's
    workers, timeout_ms, max_rss_mb, event_loop; any other key: the function's own)."""
    timeout_ms: ZeroOrMoreS = 0.0
    """The most this step may take; 0: bounded only by the request's deadline."""
    on_error: Literal["fail", "fallback"] = "fail"
    """fail: the request fails naming the step; fallback: ``fallback`` is its output."""
    fallback: Any = None


class PipelineConfig(_Table, frozen=True):
    """A graph of steps served as one model (``/v2/models/{name}/infer``, and OpenAI chat
    when its output step generates text)."""

    name: Annotated[str, _why("must be non-empty, without '/'", pattern=r"\A[^/]+\Z")]
    steps: Annotated[tuple[StepConfig, ...],
                     _why("must be an array of tables, at least one", min_length=1)]
    inputs: tuple[str, ...] = ("question",)
    """The request's inputs (V2 input tensors by these names). On the chat endpoint,
    ``chat_input`` gets the last user message, ``messages`` the conversation and ``user``
    the request's ``user`` field."""
    optional_inputs: tuple[str, ...] = ("user", "messages")
    chat_input: str = "question"
    output: str = ""
    """The step whose output is the answer (default: the last)."""
    extra_outputs: tuple[str, ...] = ()
    """Steps whose outputs are returned beside the answer (V2: more output tensors; chat:
    a ``sources`` field), e.g. the retrieved passages."""
    version: str = "1"
    default_timeout_ms: ZeroOrMoreS = 0.0
    max_concurrency: ZeroOrMore = 256
    """Requests of this pipeline in flight at once; more get 429 (0: no bound)."""
    cache: bool = True
    """Cache whole V2 answers (the server-wide [cache] must be enabled too)."""

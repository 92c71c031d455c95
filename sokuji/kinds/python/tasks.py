"""The OpenAI tasks a Python class may declare (its ``task`` attribute): how a task's requests
become the class's inputs, and its results the route's outputs. The class stays the one it
is for V2: the same ``predict``, the same dict of named values per request, the same batcher.

- ``task = "embeddings"`` (``/v1/embeddings``, beside V2): each request's texts are
  ``{"input": np.ndarray of str (dtype object), one per text}``, as a V2 request with a
  BYTES input ``input`` is; its result is ``{"embedding": float [n, d]}`` (a row per text;
  a list of rows is taken too) and optionally ``"prompt_tokens"`` (an int) for the usage,
  else 0. The width ``d`` is the model's metadata (declared, ``describe()``, or measured at
  start-up by one call with one text), which the route checks ``dimensions`` against; a
  result of another width, or another number of rows, is a 502 naming the model. Answers
  are cached as the model says (``deterministic``), under their own key.
- ``task = "chat"`` (``/v1/chat/completions`` and ``/v1/completions``, streamed or not):
  each request is ``{"messages": [...]}`` (a chat) or ``{"prompt": str}`` (a completion),
  with ``max_tokens`` (an int: what the client asked for, else the class's ceiling),
  ``min_tokens``, ``temperature``, ``top_p``, ``stop`` (a list), ``seed`` and
  ``ignore_eos``, as plain JSON values (a V2 request sending them as ``parameters`` gives
  the class the same dict). Its result is ``{"text": str}``; a generator yields
  ``{"text": delta}`` steps, each streamed as an SSE delta as it comes. Any step (or the
  whole result) may carry ``finish_reason`` (``stop`` or ``length``), ``prompt_tokens`` and
  ``completion_tokens`` for the usage; without them a stream's completion tokens are its
  text steps (as an upstream's deltas are counted), a whole answer's 0, and prompt tokens 0
  (no tokenizer is the server's to guess with). ``max_tokens`` is a bound, not a hint: a
  request asking past the class's ``max_tokens`` attribute (default ``MAX_TOKENS``) is a
  400 naming the field; a stream is cut at ``max_tokens`` text steps (finish ``length``);
  a class that reports more completion tokens than asked is a 502.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sokuji.core.events import Delta, EventQueue, Finish
from sokuji.core.limits import Limit
from sokuji.core.model import (
    NOTHING,
    Api,
    GenerationInput,
    ModelMetadata,
    Report,
    RequestContext,
    TensorSpec,
)
from sokuji.core.request import Prepared
from sokuji.errors import (
    BadModelOutput,
    DeadlineExceeded,
    InvalidInput,
    RuntimeFailed,
    SokujiError,
)
from sokuji.kinds.python import values as values_
from sokuji.llm.request import STOP_LIMITS, Timing

log = logging.getLogger(__name__)

INPUT = "input"
"""The texts' name, in the class's inputs and in V2."""
OUTPUT = "embedding"
"""The rows' name, in the class's results and in V2."""
MAX_TOKENS = 1024
"""A chat class's ceiling on ``max_tokens`` when it sets none (its ``max_tokens``)."""
PROBE = "Sokuji measures the width of this model's embeddings."


@dataclass(frozen=True)
class TaskPrepared(Prepared):
    """A task's request, prepared: the class's values (``data``, as ``Prepared``), and what
    its answer needs (``form``)."""

    task: Any = None
    form: Any = None


class Embeddings:
    """``/v1/embeddings``: texts in, one row per text out."""

    name = "embeddings"
    apis = frozenset({Api.EMBED})

    def __init__(self, model: str, width: int = 0) -> None:
        self.model = model
        self.width = width
        """The rows' width (the metadata's); 0 until it is known."""

    @staticmethod
    def accepts(inputs: Any) -> bool:
        return isinstance(inputs, list)

    @staticmethod
    def values(texts: list[str]) -> tuple[dict[str, Any], int]:
        return {INPUT: np.array(texts, dtype=object).reshape(len(texts))}, len(texts)

    def identity(self, texts: list[str]) -> list[str]:
        return [self.name, *values_.digest(self.values(texts)[0])]

    def handle(self, inner: Any, ctx: RequestContext, rows: int) -> _Rows:
        return _Rows(self, inner, rows)

    def rows(self, value: Any, n: int) -> tuple[np.ndarray, int]:
        """A result as its float32 rows (checked: ``n`` of the model's width) and its
        prompt tokens."""
        doc = value if isinstance(value, Mapping) else values_.plain(value)
        if not isinstance(doc, Mapping) or OUTPUT not in doc:
            raise BadModelOutput(f"model '{self.model}': an embeddings result must have "
                                 f"'{OUTPUT}' (a float array, a row per text)")
        try:
            matrix = np.asarray(doc[OUTPUT], dtype=np.float32)
        except (TypeError, ValueError):
            raise BadModelOutput(f"model '{self.model}': '{OUTPUT}' is not an array of "
                                 "numbers") from None
        if matrix.ndim != 2 or matrix.shape[0] != n or \
                (self.width and matrix.shape[1] != self.width):
            want = f"[{n}, {self.width or 'd'}]"
            raise BadModelOutput(f"model '{self.model}': '{OUTPUT}' has shape "
                                 f"{list(matrix.shape)}, not {want} (a row per text, of its "
                                 "metadata's width)")
        return matrix, _count(doc, "prompt_tokens", self.model)

    def metadata(self, declared: ModelMetadata, run: Callable[[dict[str, Any]], Any]
                 ) -> ModelMetadata:
        """The model's metadata with its embedding output first, of a known width: as
        declared (or ``describe()``d), else measured by ``run`` on one text."""
        outs = list(declared.outputs)
        spec = next((t for t in outs if t.name == OUTPUT), outs[0] if len(outs) == 1 else None)
        width = spec.shape[-1] if spec is not None and spec.shape else -1
        if width <= 0:  # measured: the probe's outputs, as the class gives them on V2
            result = run(self.values([PROBE])[0])
            matrix, _ = self.rows(result, 1)
            width = int(matrix.shape[1])
            spec = TensorSpec(OUTPUT, "FP32", (-1, width))
            outs = [spec, *(TensorSpec(t.name, t.datatype, (-1,) * len(t.shape))
                            for t in values_.to_tensors(result, self.model)
                            if t.name != OUTPUT)]
        assert spec is not None
        self.width = width
        inputs = declared.inputs or (TensorSpec(INPUT, "BYTES", (-1,)),)
        return ModelMetadata(declared.platform, tuple(inputs),
                             (spec, *(t for t in outs if t.name != spec.name)),
                             open=declared.open and bool(declared.inputs))


class _Rows:
    """An embeddings request's handle: the class's result as its rows."""

    __slots__ = ("_inner", "_n", "_task", "_tokens")

    def __init__(self, task: Embeddings, inner: Any, n: int) -> None:
        self._task = task
        self._inner = inner
        self._n = n
        self._tokens = 0

    async def result(self) -> np.ndarray:
        out = await self._inner.result()
        matrix, self._tokens = self._task.rows(out.value, self._n)
        return matrix

    async def events(self) -> Any:
        yield await self.result()

    @property
    def report(self) -> Report:
        inner = self._inner.report
        if not self._tokens:
            return inner
        return Report(timing=inner.timing, input_tokens=self._tokens)

    def cancel(self) -> None:
        self._inner.cancel()


class Chat:
    """``/v1/chat/completions`` and ``/v1/completions``: a conversation (or a prompt) in,
    text out, whole or step by step."""

    name = "chat"
    apis = frozenset({Api.GENERATE})

    def __init__(self, model: str, max_tokens: int = MAX_TOKENS) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.limits = (Limit("max_tokens", max_tokens, "tokens",
                             "new tokens one request may ask for (the class's max_tokens)"),
                       *STOP_LIMITS)

    @staticmethod
    def accepts(inputs: Any) -> bool:
        return isinstance(inputs, GenerationInput)

    def values(self, req: GenerationInput) -> tuple[dict[str, Any], int]:
        """The class's values for ``req``, and the most completion tokens it may give."""
        beyond = req.extended_sampling()
        if beyond is not None:
            raise InvalidInput(f"'{beyond}' is not supported by model '{self.model}' (a "
                               "Python class takes temperature, top_p, seed and stop)",
                               param=beyond)
        asked, key = req.max_tokens, req.max_tokens_field
        if asked is not None and asked > self.max_tokens:
            raise InvalidInput(f"{key} {asked} exceeds model '{self.model}''s limit of "
                               f"{self.max_tokens} new tokens", param=key)
        bound = asked if asked is not None else self.max_tokens
        if req.min_tokens > bound:
            raise InvalidInput(f"min_tokens {req.min_tokens} exceeds {key} ({bound})",
                               param="min_tokens")
        doc: dict[str, Any]
        if req.chat:
            doc = {"messages": req.messages}
        elif isinstance(req.prompt, str):
            doc = {"prompt": req.prompt}
        else:
            raise InvalidInput(f"model '{self.model}' takes a text prompt, not token ids",
                               param="prompt")
        doc.update(max_tokens=bound, min_tokens=req.min_tokens, temperature=req.temperature,
                   top_p=req.top_p, stop=list(req.stop), seed=req.seed,
                   ignore_eos=req.ignore_eos)
        return doc, bound

    @staticmethod
    def identity(req: GenerationInput) -> None:
        return None  # a generation: never cached

    def handle(self, inner: Any, ctx: RequestContext, bound: int) -> ChatGeneration:
        return ChatGeneration(self.model, inner, ctx, bound)


class _Timing(Timing):
    """A generation's timing, with the stages the class reported after it."""

    stages: tuple[Any, ...] = ()

    def timing_entries(self) -> list[Any]:
        return [*super().timing_entries(), *self.stages]


class ChatGeneration(EventQueue):
    """A chat request's handle, as the OpenAI routes read a generation
    (``llm.request.GenerationHandle``): the class's steps as ``Delta``s, then one
    ``Finish``. ``timing``: queue is the wait for the batch, prefill the time from the
    batch's start to the first text, decode the rest."""

    def __init__(self, model: str, inner: Any, ctx: RequestContext, bound: int) -> None:
        super().__init__()
        self.model = model
        self.timing = _Timing(arrival_ns=ctx.arrival_ns)
        now = time.perf_counter_ns()  # (a lone request may have run in submit already)
        self.timing.submitted_ns = min(now, getattr(inner, "dispatched_ns", 0) or now)
        self.bound = bound
        self.completion_tokens = 0
        self._inner = inner
        self._steps = 0
        self._reported = 0
        self._reason = "stop"
        self._finished = False
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._task.add_done_callback(self._done)

    @property
    def report(self) -> Report:
        return NOTHING

    def cancel(self) -> None:
        if not self._finished:
            self._task.cancel()
            self._inner.cancel()

    async def _run(self) -> None:
        try:
            async for step in self._inner.events():
                if self._step(step):
                    self._inner.cancel()  # cut at max_tokens: the rest is not read
                    break
            if self._reported > self.bound:
                raise BadModelOutput(f"model '{self.model}': reported {self._reported} "
                                     f"completion tokens for max_tokens {self.bound}")
            self._finish(self._reason)
        except DeadlineExceeded as exc:
            self._finish("deadline", exc)
        except SokujiError as exc:
            self._finish("error", exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (a stream read too slowly, a bug: a Finish)
            log.warning("model %s: a chat stream failed: %s", self.model, exc)
            self._finish("error", RuntimeFailed(f"model '{self.model}': the stream failed "
                                                f"({type(exc).__name__})"))

    def _step(self, step: Any) -> bool:
        """One step of the class's answer for this request; True once ``max_tokens`` text
        steps have come (the stream is cut there)."""
        doc = step if isinstance(step, Mapping) else values_.plain(step)
        if not isinstance(doc, Mapping):
            raise BadModelOutput(f"model '{self.model}': a chat result is a "
                                 f"{type(step).__name__}, not a dict with 'text'")
        text = doc.get("text", "")
        if not isinstance(text, str):
            raise BadModelOutput(f"model '{self.model}': a chat result's 'text' is a "
                                 f"{type(text).__name__}, not a str")
        reason = doc.get("finish_reason")
        if reason is not None:
            if reason not in ("stop", "length"):
                raise BadModelOutput(f"model '{self.model}': finish_reason {reason!r} is "
                                     "neither 'stop' nor 'length'")
            self._reason = reason
        prompt = _count(doc, "prompt_tokens", self.model)
        if prompt:
            self.timing.prompt_tokens = prompt
        self._reported = max(self._reported, _count(doc, "completion_tokens", self.model))
        now = time.perf_counter_ns()
        if not self.timing.admitted_ns:
            self.timing.admitted_ns = getattr(self._inner, "dispatched_ns", 0) or now
        if not text:
            return False
        self._steps += 1
        if not self.timing.first_token_ns:
            self.timing.first_token_ns = now
        self.timing.token_ns.append(now)
        self.completion_tokens = max(self._reported, self._steps if self._inner_streams()
                                     else 0)
        self.put(Delta(text, self.completion_tokens))
        if self._inner_streams() and self._steps >= self.bound:
            self._reason = "length"
            return True
        return False

    def _inner_streams(self) -> bool:
        return bool(getattr(self._inner, "streams", False))

    def _finish(self, reason: str, error: SokujiError | None = None) -> None:
        if self._finished:
            return
        self._finished = True
        self.timing.end_ns = time.perf_counter_ns()
        self.completion_tokens = max(self.completion_tokens, min(self._reported, self.bound))
        try:
            self.timing.stages = tuple(self._inner.report.timing)
        except Exception:  # noqa: BLE001 (no report: nothing to add)
            self.timing.stages = ()
        self.put(Finish(reason, self.completion_tokens, error))

    def _done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            task.exception()
        self._finish("cancelled")


def _count(doc: Mapping[str, Any], key: str, model: str) -> int:
    """A token count the class reported (0: none)."""
    value = doc.get(key)
    if value is None:
        return 0
    if isinstance(value, np.ndarray | np.generic):
        value = int(np.sum(value))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadModelOutput(f"model '{model}': '{key}' is {value!r}, not a count")
    return value


def for_code(code: Any, model: str) -> Embeddings | Chat | None:
    """The task adapter of a class that declares one (None: V2 and predict only)."""
    if code.task == "embeddings":
        return Embeddings(model)
    if code.task == "chat":
        ceiling = getattr(code.target, "max_tokens", MAX_TOKENS)
        return Chat(model, ceiling if isinstance(ceiling, int) and ceiling > 0 else MAX_TOKENS)
    return None

"""A generative model served under the model contract (``core/model.py``): the GGUF loaded by
``LlamaRuntime``, its prompt rules (``llm/prompt.py``) and its continuous-batching engine.

- ``prepare(GenerationInput, ctx)``: the messages' count, the chat template, the prompt's
  size in bytes, then tokens, then ``max_tokens`` / ``min_tokens`` against the context left
  (4xx naming the field or the limit). Its ``limits`` are the prompt rules' own
  (``PromptBuilder.limits_stated``: prompt, new and context tokens, messages, stop
  strings). Inputs over ``INLINE_MAX_CHARS`` characters are prepared in the
  ``sokuji-prep`` pool (``core/offload.py``), never on the event loop; smaller ones inline
  (a thread hop would cost more than they do).
- ``submit(prepared, ctx)``: the engine's admission (429), the deadline check (504), the
  queue; the handle is the ``GenerationRequest``: ``events()`` / ``result()`` / ``cancel()``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from sokuji.config import ModelConfig
from sokuji.core import offload
from sokuji.core.model import (
    Api,
    Capacity,
    GenerationInput,
    ModelBase,
    ModelMetadata,
    RequestContext,
)
from sokuji.llm.engine import GenerationEngine
from sokuji.llm.request import GenerationRequest, SamplingParams, Timing
from sokuji.llm.runtime import LlamaRuntime

INLINE_MAX_CHARS = 4 * 1024
"""Inputs up to this many characters are templated and tokenised on the event loop (under a
millisecond); larger ones in a worker thread. (SmolLM2's tokenizer, measured: 16 KiB 3 ms,
3 MiB 0.7 s; prompts over ~40-160 KiB are refused by their size before that, see
``llm/prompt.py``.)"""


@dataclass(frozen=True)
class PreparedGeneration:
    prompt: list[int]
    params: SamplingParams


MESSAGE_MARKUP_CHARS = 64
"""What the chat template adds around each message, at most (role markers, separators):
many empty messages are as much work to template as one long one."""


def _size(inputs: GenerationInput) -> int:
    """The characters templating and tokenising will read, from above."""
    if inputs.messages is not None:
        return sum(len(m.get("content") or "") + MESSAGE_MARKUP_CHARS
                   for m in inputs.messages)
    return len(inputs.prompt) if inputs.prompt is not None else 0


GENERATES = frozenset({Api.GENERATE})


class GeneratorModel(ModelBase):
    apis = GENERATES

    def __init__(self, config: ModelConfig, runtime: LlamaRuntime) -> None:
        self.config = config
        self.runtime = runtime
        self.engine: GenerationEngine = runtime.engine
        self.metadata: ModelMetadata = runtime.describe()
        self.limits = runtime.prompts.limits_stated

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def alive(self) -> bool:
        return self.engine.alive

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    def capacity(self) -> Capacity:
        e = self.engine
        return Capacity(ready=e.alive, num_waiting=e.num_waiting, num_running=e.num_running,
                        max_queue_depth=e.config.max_queue_depth, drain_per_s=e.drain.per_s)

    def check_admission(self) -> None:
        self.engine.check_capacity()

    async def prepare(self, inputs: GenerationInput, ctx: RequestContext) -> PreparedGeneration:
        if _size(inputs) > INLINE_MAX_CHARS:
            return await offload.run(self.prepare_now, inputs)
        return self.prepare_now(inputs)

    def prepare_now(self, inputs: GenerationInput) -> PreparedGeneration:
        """``prepare`` on the calling thread (any thread: it touches no event loop)."""
        prompts = self.runtime.prompts
        if inputs.chat:
            prompt = prompts.tokens(messages=inputs.messages)
        elif isinstance(inputs.prompt, list):
            prompt = prompts.tokens(token_ids=inputs.prompt)
        else:
            prompt = prompts.tokens(text=inputs.prompt)
        params = prompts.sampling(
            len(prompt), chat=inputs.chat, max_tokens=inputs.max_tokens,
            max_tokens_field=inputs.max_tokens_field, min_tokens=inputs.min_tokens,
            ignore_eos=inputs.ignore_eos, temperature=inputs.temperature, top_p=inputs.top_p,
            seed=inputs.seed, stop=inputs.stop, top_k=inputs.top_k, min_p=inputs.min_p,
            presence_penalty=inputs.presence_penalty,
            frequency_penalty=inputs.frequency_penalty,
            repetition_penalty=inputs.repetition_penalty, logit_bias=inputs.logit_bias,
            logprobs=inputs.logprobs)
        return PreparedGeneration(prompt, params)

    def submit(self, prepared: PreparedGeneration, ctx: RequestContext,
               timing: Timing | None = None) -> GenerationRequest:
        """``timing``: the caller's (a pipeline's: its arrival, its steps), else a new one."""
        gen = GenerationRequest(self.name, prepared.prompt, prepared.params,
                                asyncio.get_running_loop(), arrival_ns=ctx.arrival_ns,
                                priority=ctx.priority, deadline_ns=ctx.deadline_ns,
                                tenant=ctx.tenant, timing=timing)
        self.engine.submit(gen)
        return gen

    def attach(self, observers: Any) -> None:
        observers.generation_engine(self.name, self.engine)
        queue = self.engine.queue
        if queue.slo:  # how many requests admission by time refused
            observers.time_refusals(self.name, lambda: int(queue.refused))

    def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    def close(self) -> None:
        self.runtime.close()

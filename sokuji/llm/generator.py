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
import dataclasses
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
from sokuji.errors import InvalidInput
from sokuji.llm.engine import GenerationEngine
from sokuji.llm.request import GenerationRequest, PrefillGroup, SamplingParams, Timing
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
    grammar: Any = None
    """Its output's compiled constraint (``llm/grammar.Compiled``: a schema, a GBNF grammar,
    a tool-call grammar), or None."""
    n: int = 1
    """Choices to generate (``submit_choices``)."""


MESSAGE_MARKUP_CHARS = 64
"""What the chat template adds around each message, at most (role markers, separators):
many empty messages are as much work to template as one long one."""


def _size(inputs: GenerationInput) -> int:
    """The characters templating and tokenising will read, from above."""
    if inputs.messages is not None:
        return sum(len(m.get("content") or "") + MESSAGE_MARKUP_CHARS
                   for m in inputs.messages)
    return len(inputs.prompt) if inputs.prompt is not None else 0


def _constraint(inputs: GenerationInput) -> Any:
    """The grammar the output must follow: the request's (``response_format``, ``grammar``,
    ``json_schema``), or its tools' (``llm/tools.tool_grammar``), or None."""
    if inputs.tools is not None:
        from sokuji.llm.grammar_spec import GrammarSpec
        from sokuji.llm.tools import tool_grammar

        lark = tool_grammar(inputs.tools)
        return GrammarSpec("lark", lark, "tools") if lark is not None else None
    return inputs.grammar


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
            prepared = await offload.run(self.prepare_now, inputs)
        else:
            prepared = self.prepare_now(inputs)
        spec = _constraint(inputs)
        if spec is None:
            return prepared
        grammars = self.runtime.grammars_ready or await offload.run(self.runtime.grammars)
        compiled = await grammars.acompile(spec, ctx.tenant)  # (a miss: off the loop)
        return dataclasses.replace(prepared, grammar=compiled)

    def prepare_now(self, inputs: GenerationInput) -> PreparedGeneration:
        """``prepare`` on the calling thread (any thread: it touches no event loop), but for
        the output's constraint, which ``prepare`` compiles (cached per tenant)."""
        prompts = self.runtime.prompts
        max_n = self.runtime.options.max_n
        if inputs.n > max_n:
            raise InvalidInput(f"'n' {inputs.n} exceeds model '{self.name}''s limit of {max_n} "
                               "choices (options.max_n)", param="n")
        if inputs.chat:
            prompt = prompts.tokens(messages=inputs.messages, tools=inputs.tools)
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
        return PreparedGeneration(prompt, params, n=inputs.n)

    def submit(self, prepared: PreparedGeneration, ctx: RequestContext,
               timing: Timing | None = None) -> GenerationRequest:
        """``timing``: the caller's (a pipeline's: its arrival, its steps), else a new one."""
        gen = GenerationRequest(self.name, prepared.prompt, prepared.params,
                                asyncio.get_running_loop(), arrival_ns=ctx.arrival_ns,
                                priority=ctx.priority, deadline_ns=ctx.deadline_ns,
                                tenant=ctx.tenant, timing=timing)
        gen.grammar = prepared.grammar
        self.engine.submit(gen)
        return gen

    def submit_choices(self, prepared: PreparedGeneration, ctx: RequestContext
                       ) -> list[GenerationRequest]:
        """``n`` generations of one prompt, one handle each, sharing its one prefill
        (``request.PrefillGroup``): the first prefills, the others start from its cells. A
        seed gives choice ``i`` the seed + i (each its own draw; reproducible as a whole).
        Admitted together: a refusal of any (429) cancels those already queued."""
        loop = asyncio.get_running_loop()
        handles: list[GenerationRequest] = []
        group = None
        try:
            for i in range(prepared.n):
                params = prepared.params
                if params.seed is not None and i:
                    params = dataclasses.replace(params, seed=params.seed + i)
                gen = GenerationRequest(self.name, prepared.prompt, params, loop,
                                        arrival_ns=ctx.arrival_ns, priority=ctx.priority,
                                        deadline_ns=ctx.deadline_ns, tenant=ctx.tenant)
                gen.grammar = prepared.grammar
                if group is None:
                    group = PrefillGroup(gen)
                gen.group = group
                self.engine.submit(gen)
                handles.append(gen)
        except BaseException:
            for gen in handles:
                gen.cancel()
            raise
        return handles

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

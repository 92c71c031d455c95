"""An encoder served under the model contract (``core/model.py``): a runtime (``Runtime``:
ONNX, synthetic) and its dynamic batcher.

- ``from_tensors`` / ``to_tensors`` (V2): its one BYTES input as UTF-8 texts, its rows as
  its one output (``core/text_tensors.py``); the texts identify an answer in the response
  cache, for V2 and OpenAI embeddings alike.
- ``limits``: the request body's bytes, texts per request (``max_batch_size``) and, for a
  runtime that reads tokens, the tokens of one text it reads (a longer text is cut there, so
  no text costs more). Texts past ``max_batch_size`` are refused (413) before tokenising.
- ``prepare(texts, ctx)``: the runtime's ``preprocess`` (tokenise) -> ``Prepared`` with the
  lengths the batcher groups by; on the event loop up to ``INLINE_MAX_CHARS``, beyond in the
  ``sokuji-prep`` pool (``core/offload.py``).
- ``submit(prepared, ctx)``: the batcher's admission (429), deadline check (504) and queue;
  the handle's ``result()`` is the request's rows. Plain method calls: no task, no thread hop
  on the way in. A batch runs in the batcher's worker thread, except a lone request at an idle
  model, measured to be quick: that one runs on the event loop, within ``submit`` itself
  (``core/inline.py``), so its answer takes no thread hop at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any

from sokuji.config import ModelConfig, ServerConfig
from sokuji.config_ops import SloConfig, budgets_for
from sokuji.core import offload, text_tensors
from sokuji.core.batcher import BatcherConfig, BatchInfo, DynamicBatcher
from sokuji.core.limits import Limit
from sokuji.core.model import (
    Api,
    Capacity,
    ModelBase,
    ModelMetadata,
    Report,
    RequestContext,
    Submission,
)
from sokuji.core.request import InferenceRequest, Prepared, Timeline
from sokuji.core.tensor import InferRequest, Tensor
from sokuji.runtimes.base import Runtime

EMBEDS = frozenset({Api.INFER, Api.EMBED})
"""What an encoder serves: V2 infer and OpenAI embeddings (a classifier: V2 only)."""

INLINE_MAX_CHARS = 4096
"""Requests whose texts total up to this many characters are tokenised on the event loop
(MiniLM: ~0.3 ms for 1 KiB, ~1.1 ms for 4 KiB; the hop to a worker thread costs ~40 us);
longer ones in the ``sokuji-prep`` pool (``core/offload.py``), so a long text never holds
up other requests. Each text's own cost is bounded by the runtime, which reads a text only
as far as its model does (``runtimes/onnx.py``)."""


DEFAULT_REQUEST_BYTES = ServerConfig().max_request_bytes
"""The server's body limit when nobody says (a model built without ``limits``: tests)."""


def text_limits(config: ModelConfig, request_bytes: int,
                read_tokens: int | None = None) -> tuple[Limit, ...]:
    """The cost bound of a model of texts: ``request_bytes`` is the server's body limit
    (a model's own ``max_request_bytes`` takes its place); ``read_tokens`` the most tokens
    of one text its runtime reads (None: it reads no tokens)."""
    limits = [Limit("max_request_bytes", config.max_request_bytes or request_bytes, "bytes",
                    "bytes of one request's body"),
              Limit("max_batch_size", config.max_batch_size, "items",
                    "texts in one request")]
    if read_tokens is not None:
        limits.append(Limit("max_sequence_length", read_tokens, "tokens",
                            "tokens of one text the model reads (a longer text is cut there)"))
    return tuple(limits)


def batcher_config(mc: ModelConfig, tenant_slos: Iterable[SloConfig] = ()) -> BatcherConfig:
    """The batcher's share of ``mc``: every field but ``policy`` (``batching`` there) and
    ``worker_nice`` is named as in ``ModelConfig``; ``slo`` from its own and its tenants'
    SLOs."""
    same = {f.name for f in fields(BatcherConfig)} - {"policy", "worker_nice", "slo",
                                                      "preferred_batch_sizes"}
    return BatcherConfig(policy=mc.batching, slo=budgets_for(mc.name, mc.slo, tenant_slos),
                         **{name: getattr(mc, name) for name in same})


class BatchedModel(ModelBase):
    """A model over a runtime and its own ``DynamicBatcher``: what every batched model
    shares (admission, capacity, readiness, start and stop); subclasses say how a request
    is prepared and what it answers (``EncoderModel``: texts; the tensor kind's
    ``TensorModel``: named tensors)."""

    batches = True
    config: ModelConfig
    runtime: Any
    batcher: DynamicBatcher

    @property
    def name(self) -> str:
        return self.batcher.name

    @property
    def alive(self) -> bool:
        return self.batcher.alive

    @property
    def num_waiting(self) -> int:
        return self.batcher.num_waiting

    def capacity(self) -> Capacity:
        b = self.batcher
        return Capacity(ready=b.alive, num_waiting=b.num_waiting, num_running=b.num_admitted
                        - b.num_waiting, max_queue_depth=b.config.max_queue_depth,
                        drain_per_s=b.drain_items_per_s)

    def check_admission(self) -> None:
        self.batcher.check_capacity()

    def submit(self, prepared: Prepared, ctx: RequestContext) -> Submission:
        tl = ctx.timeline if ctx.timeline is not None else Timeline(ctx.arrival_ns)
        return self.batcher.enqueue(InferenceRequest(
            model=self.batcher.name, payload=prepared, num_items=prepared.num_items,
            length=prepared.length, timeline=tl, request_id=ctx.request_id,
            priority=ctx.priority, deadline_ns=ctx.deadline_ns, tenant=ctx.tenant,
            num_tokens=prepared.num_tokens, group=prepared.group, inline=not ctx.company))

    def attach(self, observers: Any) -> None:
        by_time = self.batcher.by_time
        if by_time is not None:  # how many requests admission by time refused
            observers.time_refusals(self.name, lambda: int(by_time.refused))

    def neighbours(self, busy: Callable[[], bool]) -> None:
        # A lone request may run on the event loop only while the other models have nothing
        # in flight: their replies (tokens) would wait for it.
        self.batcher.gate.others_busy = busy

    def start(self) -> None:
        self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    def close(self) -> None:
        self.runtime.close()


class EncoderModel(BatchedModel):
    """Texts in (one BYTES input, OpenAI embeddings), one row per text out."""

    def __init__(self, config: ModelConfig, runtime: Runtime, batcher: DynamicBatcher,
                 apis: frozenset[Api] = EMBEDS, limits: tuple[Limit, ...] = ()) -> None:
        self.config = config
        self.runtime = runtime
        self.batcher = batcher
        self.apis = apis
        self.metadata: ModelMetadata = runtime.describe()
        self.limits = limits or text_limits(config, DEFAULT_REQUEST_BYTES)
        self._items = next(x for x in self.limits if x.key == "max_batch_size")

    @classmethod
    def over(cls, runtime: Runtime, config: ModelConfig, tenant_slos: Iterable[SloConfig],
             metric_name: str,
             on_batch: Callable[[str], Callable[[BatchInfo], None]] | None = None,
             apis: frozenset[Api] = EMBEDS, limits: tuple[Limit, ...] = ()) -> EncoderModel:
        """A loaded ``runtime`` under a batcher of its own, named ``metric_name`` (a variant:
        ``name@variant``) in metrics and statistics; ``limits`` its cost bound
        (``text_limits``)."""
        batcher = DynamicBatcher(metric_name, runtime.run_batch,
                                 batcher_config(config, tenant_slos),
                                 on_batch=on_batch(metric_name) if on_batch else None)
        return cls(config, runtime, batcher, apis, limits)

    async def prepare(self, inputs: list[str], ctx: RequestContext) -> Prepared:
        self._items.check(len(inputs), "the request's texts")
        if sum(map(len, inputs)) > INLINE_MAX_CHARS:
            return await offload.run(self.runtime.preprocess, inputs)
        return self.runtime.preprocess(inputs)

    def from_tensors(self, request: InferRequest) -> list[str]:
        tensor = request.inputs.get(self.metadata.inputs[0].name)
        if tensor is not None:
            self._items.check(len(tensor.data), f"input '{self.metadata.inputs[0].name}'")
        return text_tensors.texts(request, self.metadata, self.config.max_batch_size)

    def to_tensors(self, result: Any, report: Report) -> list[Tensor]:
        return text_tensors.rows(self.metadata, result)

    def identity(self, inputs: list[str]) -> list[str]:
        return inputs

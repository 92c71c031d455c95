"""Continuous batching over one llama.cpp context.

One engine thread owns the context. Each step builds one ``llama_batch``:

1. one token for every sequence that is decoding (the token sampled last step);
2. then prompt tokens of sequences still prefilling, up to ``n_batch`` in all, or
   ``prefill_chunk`` while others decode, so a long prompt never stalls their tokens for
   long. A new request therefore joins between decode steps instead of waiting for the
   others to finish;

then one ``llama_decode``, then a sample for every sequence whose row has logits (with its
end-of-generation logits masked to -inf first while ``ignore_eos`` or ``min_tokens`` says the
sequence may not end yet; one integer comparison for requests without them). A sequence
that finishes (end of generation, ``max_tokens``, a stop string, cancellation) frees its slot
and its KV cells at once, and the best waiting request takes the slot in the same step.

Scheduling follows the policy the encoder batcher follows (``core/policy.py``), with work
counted in generations: admission (``max_queue_depth``, ``max_concurrency``: 429 at once,
Retry-After from the measured rate at which slots free up), priorities with the same aging
rule (interactive first; a request that has waited ``priority_aging_ms`` counts as
interactive; 0: plain arrival order), and deadlines that bound the *start*: a generation
that cannot get a slot in time is refused at submission or failed (504) when its deadline
passes while it waits; one that has a slot runs to its end (``max_tokens``, a stop, or its
client's disconnect).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from sokuji.config import ModelConfig
from sokuji.core import policy
from sokuji.errors import DeadlineExceeded, ModelNotReady, RuntimeFailed, SokujiError
from sokuji.llm.native import LlamaModel, Sampler
from sokuji.llm.prefix_cache import PrefixCache
from sokuji.llm.request import Delta, Finish, GenerationRequest, TextAssembler, now_ns
from sokuji.llm.runtime import LlamaOptions

log = logging.getLogger(__name__)

# The defaults, declared once: in sokuji.config's schema and the runtime's options.
_MODEL, _OPTIONS = ModelConfig(name="-", runtime="llama"), LlamaOptions()


@dataclass(frozen=True)
class EngineConfig:
    """The engine's share of a llama model's config (``from_options``)."""

    n_batch: int = _OPTIONS.n_batch
    prefill_chunk: int = _OPTIONS.prefill_chunk
    max_queue_depth: int = _MODEL.max_queue_depth
    max_concurrency: int = _MODEL.max_concurrency
    """Generations admitted (waiting or running) at once; 0: bounded by the queue only."""
    priority_aging_ms: float = _MODEL.priority_aging_ms
    prefix_cache_bytes: int = _OPTIONS.prefix_cache_mb * 1024 * 1024
    prefix_cache_min_tokens: int = _OPTIONS.prefix_cache_min_tokens
    split_small_batches: bool = _OPTIONS.split_small_batches
    """Decode a pure-decode batch row by row when that measured cheaper (see
    ``_split_is_cheaper``); False always decodes the batch together."""

    @classmethod
    def from_options(cls, o: LlamaOptions, max_queue_depth: int, priority_aging_ms: float,
                     max_concurrency: int = 0) -> EngineConfig:
        return cls(n_batch=o.n_batch, prefill_chunk=o.prefill_chunk,
                   max_queue_depth=max_queue_depth, max_concurrency=max_concurrency,
                   priority_aging_ms=priority_aging_ms,
                   prefix_cache_bytes=o.prefix_cache_mb * 1024 * 1024,
                   prefix_cache_min_tokens=o.prefix_cache_min_tokens,
                   split_small_batches=o.split_small_batches)


class _Seq:
    __slots__ = ("assembler", "eog_banned_below", "generated", "min_tokens", "next_token",
                 "pending", "pos", "req", "sampler", "slot", "store_prefix")

    def __init__(self, req: GenerationRequest, slot: int) -> None:
        self.req = req
        self.slot = slot
        p = req.params
        self.sampler = Sampler(p.temperature, p.top_p, p.seed)
        self.assembler = TextAssembler(p.stop)
        self.pending: list[int] = list(req.prompt)
        self.pos = 0
        self.next_token: int | None = None
        self.generated = 0
        self.store_prefix = False
        # min_tokens / ignore_eos as plain ints: a request without them costs one integer
        # comparison a token (``generated < 0`` is never true).
        self.eog_banned_below = p.eog_banned_below
        self.min_tokens = p.min_tokens


class GenerationEngine:
    def __init__(self, name: str, model: LlamaModel, config: EngineConfig) -> None:
        self.name = name
        self.model = model
        self.config = config
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes,
                                        config.prefix_cache_min_tokens)
        self._cond = threading.Condition()
        self._intake: list[GenerationRequest] = []
        self._waiting: list[GenerationRequest] = []
        self._active: list[_Seq] = []
        self._free = list(range(model.shape.slots))
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self.steps = 0
        """llama_decode calls; ``rows`` counts the sequences sampled in them."""
        self.rows = 0
        self.moves = 0
        """Sequences moved down to keep the busy slots consecutive."""
        self.split_steps = 0
        """Steps decoded row by row because that measured cheaper."""
        self._cost: dict[int, float] = {}
        self._probe: dict[int, int] = {}
        self._admission = policy.Admission(name, config.max_queue_depth,
                                           config.max_concurrency, what="generations")
        self._slots = model.shape.slots
        self.drain = policy.DrainRate(self._slots)
        """Generations completed per second of a slot's time, times the slots."""
        self._aging_ns = policy.aging_ns(config.priority_aging_ms)

    # -- event-loop side ------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._intake)

    @property
    def num_running(self) -> int:
        return len(self._active)

    alive = running

    def check_capacity(self) -> None:
        waiting = self.num_waiting
        self._admission.check(waiting, waiting + len(self._active), lambda: waiting,
                              self.drain.per_s)

    def submit(self, req: GenerationRequest) -> None:
        """Admit (``Overloaded``, ``DeadlineExceeded`` at once) and queue ``req``."""
        if not self.running:
            raise ModelNotReady(f"model '{self.name}': its generation engine is not running")
        self.check_capacity()
        now = now_ns()
        if req.deadline_ns is not None:
            rate = self.drain.per_s
            ahead = sum(1 for r in (*self._waiting, *self._intake)
                        if r.priority <= req.priority) if rate > 0 else 0
            policy.check_deadline(req.deadline_ns, now, ahead, rate,
                                  saturated=len(self._active) >= self._slots)
        req.timing.submitted_ns = now
        with self._cond:
            if self._closed:  # the thread failed everyone and is ending: nobody would read it
                raise ModelNotReady(f"model '{self.name}': its generation engine is not "
                                    "running")
            self._intake.append(req)
            self._cond.notify()

    def start(self) -> None:
        if self.running:
            return
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"sokuji-llm-{self.name}",
                                        daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def warmup(self) -> None:
        """One short prefill and decode before serving (page in the weights)."""
        tokens = self.model.tokenize("Hello", add_special=True) or [0]
        self.model.decode([(t, i, 0, i == len(tokens) - 1) for i, t in enumerate(tokens)])
        self.model.forget(0)

    # -- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._intake or self._active
                               or self._waiting):
                        self._cond.wait()
                    if self._stopping:
                        break
                    if self._intake:
                        self._waiting.extend(self._intake)
                        self._intake = []
                now = now_ns()
                self._reap_waiting(now)
                self._reap_active()
                self._compact()
                self._admit(now)
                if self._active:
                    self._step()
                elif self._waiting:  # (cannot stay so: free slots were just filled)
                    with self._cond:
                        self._cond.wait(0.01)
        except Exception:  # the engine must never die silently: fail everyone, say why
            log.exception("generation engine %s failed", self.name)
            self._fail_all(RuntimeFailed(f"model '{self.name}': internal error in the "
                                         "generation engine"))
            raise
        self._fail_all(ModelNotReady(f"model '{self.name}': the server is shutting down"))

    def _fail_all(self, error: SokujiError) -> None:
        """The thread is ending: fail everything queued or running; no submission is
        accepted after this (``_closed``, under the same lock as the intake)."""
        with self._cond:
            self._closed = True
            waiting = self._waiting + self._intake
            self._waiting, self._intake = [], []
        for req in waiting:
            req.push(Finish("error", 0, error))
        for seq in list(self._active):
            self._finish(seq, "error", error)

    def _reap_waiting(self, now: int) -> None:
        keep = []
        for req in self._waiting:
            if req.cancelled:
                req.push(Finish("cancelled", 0))
            elif req.deadline_ns is not None and now >= req.deadline_ns:
                waited_ms = (now - req.timing.submitted_ns) / 1e6
                req.push(Finish("deadline", 0, DeadlineExceeded(
                    f"deadline exceeded: waited {waited_ms:.0f} ms for a free slot; the "
                    "deadline passed before it could start")))
            else:
                keep.append(req)
        self._waiting = keep

    def _rank(self, req: GenerationRequest, now: int) -> tuple[int, int]:
        """The policy's rank (class after aging), then the time it was queued."""
        queued = req.timing.submitted_ns
        return policy.rank(req.priority, now - queued, self._aging_ns), queued

    def _reap_active(self) -> None:
        """Cancelled sequences end; deadlines bound the start only (``core/policy.py``)."""
        for seq in list(self._active):
            if seq.req.cancelled:
                self._finish(seq, "cancelled")

    def _compact(self) -> None:
        """Keep the busy slots at the bottom (0..n-1). With one KV stream per sequence,
        llama.cpp computes a batch in one pass only over consecutive streams; a gap or a
        jumble split it into several passes (8 sequences: 36 ms a step in order, 75 with
        gaps, 103 shuffled, measured). A sequence above a free slot moves down: its KV
        state is copied (~1 ms for 200 tokens) -- the same bytes, so the same output."""
        while self._active and self._free:
            top = max(self._active, key=lambda q: q.slot)
            low = min(self._free)
            if low > top.slot:
                return
            if top.pos > 0 and not self.model.load_state(low, self.model.save_state(top.slot)):
                log.error("could not move a sequence from slot %d to %d", top.slot, low)
                return
            self.model.forget(top.slot)
            self._free.remove(low)
            self._free.append(top.slot)
            top.slot = low
            self.moves += 1

    def _admit(self, now: int) -> None:
        while self._free and self._waiting:
            req = min(self._waiting, key=lambda r: self._rank(r, now))
            self._waiting.remove(req)
            slot = min(self._free)
            self._free.remove(slot)
            seq = _Seq(req, slot)
            req.timing.admitted_ns = now_ns()
            cache = self.prefix_cache
            if cache.max_bytes > 0:
                match = cache.lookup(req.prompt, req.tenant)
                if match.state is not None and self.model.load_state(seq.slot, match.state):
                    self.model.forget(seq.slot, match.tokens)
                    seq.pos = match.tokens
                    seq.pending = seq.pending[match.tokens:]
                    req.timing.reused_tokens = match.tokens
                    req.timing.prefix_lookup = "hit"
                else:
                    req.timing.prefix_lookup = "miss"
                seq.store_prefix = cache.wants(req.prompt, req.tenant)
            self._active.append(seq)

    def _step(self) -> None:
        entries: list[tuple[int, int, int, bool]] = []
        rows: list[tuple[_Seq, int]] = []
        self._active.sort(key=lambda q: q.slot)  # llama.cpp wants streams in order
        for seq in self._active:
            if seq.next_token is not None:
                entries.append((seq.next_token, seq.pos, seq.slot, True))
                rows.append((seq, len(entries) - 1))
                seq.pos += 1
                seq.next_token = None
        budget = self.config.n_batch - len(entries)
        if entries:
            budget = min(budget, self.config.prefill_chunk)
        prefilled: list[_Seq] = []
        for seq in self._active:
            if budget <= 0:
                break
            if not seq.pending:
                continue
            take = seq.pending[:budget]
            seq.pending = seq.pending[len(take):]
            for tok in take:
                entries.append((tok, seq.pos, seq.slot, False))
                seq.pos += 1
            budget -= len(take)
            if not seq.pending:
                entries[-1] = (*entries[-1][:3], True)
                rows.append((seq, len(entries) - 1))
                prefilled.append(seq)
        if not entries:
            return
        if not prefilled and len(entries) == len(rows) and self._split_is_cheaper(len(rows)):
            self._decode_one_by_one(rows, entries)
            return
        t0 = time.perf_counter()
        rc = self.model.decode(entries)
        if not prefilled and len(entries) == len(rows):
            self._learn(len(rows), time.perf_counter() - t0)
        self.steps += 1
        self.rows += len(rows)
        if rc != 0:  # the KV cells of every sequence in the batch are now in doubt
            log.error("llama_decode returned %d for a batch of %d tokens", rc, len(entries))
            slots = {slot for _, _, slot, _ in entries}
            for seq in [q for q in self._active if q.slot in slots]:
                self._finish(seq, "error", RuntimeFailed(f"llama_decode failed ({rc})"))
            return
        for seq, index in rows:
            if seq.generated < seq.eog_banned_below:
                self.model.ban_eog(index)
            self._take_token(seq, seq.sampler.sample(self.model, index))
        for seq in prefilled:  # after the first tokens went out: off their TTFT
            if seq.store_prefix and seq in self._active:
                self._store_prefix(seq)

    # -- small batches that cost more than their rows one by one ----------------------------
    def _learn(self, rows: int, seconds: float) -> None:
        """EWMA of a pure-decode step's time by its number of rows."""
        old = self._cost.get(rows)
        self._cost[rows] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def _split_is_cheaper(self, rows: int) -> bool:
        """Whether ``rows`` one-row decodes measured cheaper than one ``rows``-row decode.
        (llama.cpp's Q8_0 path: a 2-row step took 28-30 ms, two 1-row steps 2 x 10.7 ms.)
        Every 32nd such step is decoded together anyway, to keep measuring."""
        if not self.config.split_small_batches or rows < 2 or rows not in self._cost \
                or 1 not in self._cost:
            return False
        self._probe[rows] = self._probe.get(rows, 0) + 1
        if self._probe[rows] % 32 == 0:
            return False
        return self._cost[rows] > 1.05 * rows * self._cost[1]

    def _decode_one_by_one(self, rows: list[tuple[_Seq, int]],
                           entries: list[tuple[int, int, int, bool]]) -> None:
        for seq, index in rows:
            t0 = time.perf_counter()
            rc = self.model.decode([entries[index]])
            self._learn(1, time.perf_counter() - t0)
            self.steps += 1
            self.rows += 1
            if rc != 0:
                log.error("llama_decode returned %d for one token", rc)
                self._finish(seq, "error", RuntimeFailed(f"llama_decode failed ({rc})"))
                continue
            if seq.generated < seq.eog_banned_below:
                self.model.ban_eog(0)
            self._take_token(seq, seq.sampler.sample(self.model, 0))
        self.split_steps += 1

    def _store_prefix(self, seq: _Seq) -> None:
        """Keep the KV state of the prompt alone (cells from the first generated token on
        are not yet written: that token is fed in the next step)."""
        self.prefix_cache.store(seq.req.prompt, seq.req.tenant,
                                self.model.save_state(seq.slot))
        seq.store_prefix = False

    def _take_token(self, seq: _Seq, token: int) -> None:
        req, t = seq.req, now_ns()
        timing = req.timing
        if not timing.first_token_ns:
            timing.first_token_ns = t
        timing.token_ns.append(t)
        if self.model.is_eog(token):  # (never while banned: its logit was -inf)
            self._finish(seq, "stop")
            return
        seq.generated += 1
        if seq.generated < seq.min_tokens:  # stop strings cannot end it yet
            text = seq.assembler.add_unchecked(self.model.piece(token))
        else:
            text = seq.assembler.add(self.model.piece(token))
        if text:
            req.push(Delta(text, seq.generated))
        if seq.assembler.stopped:
            self._finish(seq, "stop")
        elif seq.generated >= req.params.max_tokens:
            self._finish(seq, "length")
        else:
            seq.next_token = token

    def _finish(self, seq: _Seq, reason: str, error: SokujiError | None = None) -> None:
        req = seq.req
        if reason in ("stop", "length"):
            tail = seq.assembler.flush()
            if tail:
                req.push(Delta(tail, seq.generated))
        req.timing.end_ns = now_ns()
        if reason in ("stop", "length") and req.timing.admitted_ns:
            self.drain.observe(1, (req.timing.end_ns - req.timing.admitted_ns) / 1e9)
        req.push(Finish(reason, seq.generated, error))
        self._active.remove(seq)
        if seq.store_prefix and not seq.pending and reason in ("stop", "length"):
            self.model.forget(seq.slot, len(req.prompt))  # (finished in its first step)
            self._store_prefix(seq)
        self.model.forget(seq.slot)
        seq.sampler.close()
        self._free.append(seq.slot)

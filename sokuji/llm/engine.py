"""Continuous batching over one llama.cpp context.

One engine thread owns the context. Each step builds one ``llama_batch``:

1. one token for every sequence that is decoding (the token sampled last step);
2. then prompt tokens of sequences still prefilling, up to ``n_batch`` in all, or
   ``prefill_chunk`` while others decode, so a long prompt never stalls their tokens for
   long. A new request therefore joins between decode steps instead of waiting for the
   others to finish;

then one ``llama_decode``, then a sample for every sequence whose row has logits, by its own
sampler (``sampling.py``: bias, penalties, its end-of-generation tokens banned while
``ignore_eos`` or ``min_tokens`` says the sequence may not end yet -- one integer comparison
for requests without them --, then argmax or a seeded draw), which counts every token it
gives for the penalties before the next row of the same sequence is sampled. A sequence
that finishes (end of generation, ``max_tokens``, a stop string, cancellation) frees its slot
and its KV cells at once, and the best waiting request takes the slot in the same step.

With speculative decoding on (``speculative.py``), a greedy sequence's token in step 1 may
be followed by draft tokens (an n-gram lookup in its own context, or a draft model); the
target's greedy token of each row is emitted while it agrees with the draft, so several
tokens can come out of one step, each through the same checks (end of generation,
``max_tokens``, stop strings) as a single one. The rejected drafts' KV cells are removed.

Scheduling follows the policy the encoder batcher follows (``core/policy.py``; the queue
is ``waiting.py``), with work counted in generations: admission (``max_queue_depth``,
``max_concurrency``: 429 at once, Retry-After from the measured rate at which slots free
up), priorities with the same aging rule (interactive first; a request that has waited
``priority_aging_ms`` counts as interactive; 0: plain arrival order), and deadlines that
bound the *start*: a generation that cannot get a slot in time is refused at submission or
failed (504) when its deadline passes while it waits; one that has a slot runs to its end
(``max_tokens``, a stop, or its client's disconnect).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from sokuji.config import ModelConfig
from sokuji.errors import GrammarFailed, ModelNotReady, RuntimeFailed, SokujiError
from sokuji.llm.native import LlamaModel
from sokuji.llm.options import LlamaOptions
from sokuji.llm.prefix_cache import PrefixCache
from sokuji.llm.request import Finish, GenerationRequest, PrefillGroup, now_ns
from sokuji.llm.sampling import Sampled
from sokuji.llm.sequence import ATTN_TILE, Sequence
from sokuji.llm.speculative import SpecConfig, Speculator
from sokuji.llm.step_cost import StepCosts
from sokuji.llm.waiting import WaitingRoom

log = logging.getLogger(__name__)


def _waits(req: GenerationRequest) -> bool:
    """A choice that may not start yet: its leader is still prefilling the shared prompt."""
    group = req.group
    return group is not None and group.waits(req)


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
    ``step_cost.py``); False always decodes the batch together."""
    speculative: SpecConfig = SpecConfig.of(_OPTIONS)  # noqa: RUF009 (frozen)

    @classmethod
    def from_options(cls, o: LlamaOptions, max_queue_depth: int, priority_aging_ms: float,
                     max_concurrency: int = 0) -> EngineConfig:
        return cls(n_batch=o.n_batch, prefill_chunk=o.prefill_chunk,
                   max_queue_depth=max_queue_depth, max_concurrency=max_concurrency,
                   priority_aging_ms=priority_aging_ms,
                   prefix_cache_bytes=o.prefix_cache_mb * 1024 * 1024,
                   prefix_cache_min_tokens=o.prefix_cache_min_tokens,
                   split_small_batches=o.split_small_batches,
                   speculative=SpecConfig.of(o))


class GenerationEngine:
    def __init__(self, name: str, model: LlamaModel, config: EngineConfig,
                 draft: LlamaModel | None = None) -> None:
        self.name = name
        self.model = model
        self.config = config
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes,
                                        config.prefix_cache_min_tokens)
        self.queue = WaitingRoom(name, model.shape.slots, config.max_queue_depth,
                                 config.max_concurrency, config.priority_aging_ms)
        self.drain = self.queue.drain
        """Generations completed per second of a slot's time, times the slots."""
        self._active: list[Sequence] = []
        self._free = list(range(model.shape.slots))
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0
        """llama_decode calls; ``rows`` counts the sequences sampled in them."""
        self.rows = 0
        self.moves = 0
        """Sequences moved down to keep the busy slots consecutive."""
        self.split_steps = 0
        """Steps decoded row by row because that measured cheaper."""
        self.costs = StepCosts(config.split_small_batches)
        self._tile = ATTN_TILE if config.n_batch >= 2 * ATTN_TILE else config.n_batch + 1
        self.draft = draft
        self.spec = (Speculator(config.speculative, self.costs, draft, config.prefill_chunk)
                     if config.speculative.mode != "off" else None)

    # -- event-loop side ------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive()
                and not self.queue.closed)

    @property
    def num_waiting(self) -> int:
        return len(self.queue)

    @property
    def num_running(self) -> int:
        return len(self._active)

    alive = running

    def check_capacity(self) -> None:
        self.queue.check(len(self._active))

    def submit(self, req: GenerationRequest) -> None:
        """Admit (``Overloaded``, ``DeadlineExceeded`` at once) and queue ``req``."""
        if not self.running:
            raise ModelNotReady(f"model '{self.name}': its generation engine is not running")
        self.queue.put(req, len(self._active))

    def start(self) -> None:
        if self.running:
            return
        self._stopping = False
        self.queue.closed = False
        self._thread = threading.Thread(target=self._run, name=f"sokuji-llm-{self.name}",
                                        daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        with self.queue.cond:
            self._stopping = True
            self.queue.cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def warmup(self) -> None:
        """One short prefill and decode before serving (page in the weights)."""
        tokens = self.model.tokenize("Hello", add_special=True) or [0]
        for model in (self.model, self.draft):
            if model is not None:
                model.decode([(t, i, 0, i == len(tokens) - 1) for i, t in enumerate(tokens)])
                model.forget(0)

    # -- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                queue = self.queue
                with queue.cond:
                    while not (self._stopping or len(queue) or self._active):
                        queue.cond.wait()
                    if self._stopping:
                        break
                    queue.take_intake()
                now = now_ns()
                queue.reap(now)
                self._reap_active()
                self._compact()
                self._admit(now)
                if self._active:
                    self._step()
                elif queue.waiting:  # (cannot stay so: free slots were just filled)
                    with queue.cond:
                        queue.cond.wait(0.01)
        except Exception:  # the engine must never die silently: fail everyone, say why
            log.exception("generation engine %s failed", self.name)
            self._fail_all(RuntimeFailed(f"model '{self.name}': internal error in the "
                                         "generation engine"))
            raise
        self._fail_all(ModelNotReady(f"model '{self.name}': the server is shutting down"))

    def _fail_all(self, error: SokujiError) -> None:
        """The thread is ending: fail everything queued or running; no submission is
        accepted after this (``WaitingRoom.close``, under the intake's lock)."""
        for req in self.queue.close():
            req.push(Finish("error", 0, error))
        for seq in list(self._active):
            self._finish(seq, "error", error)

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
            if self.spec is not None:
                self.spec.move(top.spec, top.slot, low)
            self._free.remove(low)
            self._free.append(top.slot)
            top.slot = low
            self.moves += 1

    def _admit(self, now: int) -> None:
        while self._free and self.queue.waiting:
            req = self.queue.pop_best(now, _waits)
            if req is None:  # only choices whose leader is still prefilling
                return
            slot = min(self._free)
            self._free.remove(slot)
            seq = Sequence(req, slot, self.model.n_vocab)
            req.timing.admitted_ns = now_ns()
            group = req.group
            if group is not None and req is not group.leader and group.state is not None \
                    and self.model.load_state(seq.slot, group.state):
                self._start_member(seq, group.logits)
                continue
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
            if self.spec is not None:
                seq.spec = self.spec.admit(req.prompt, seq.sampler.greedy, req.params.max_tokens)
                req.timing.speculative = self.spec.config.mode if seq.spec else "off sampled"
            self._active.append(seq)

    def _start_member(self, seq: Sequence, logits: Any) -> None:
        """A choice of an ``n`` > 1 request, in a slot holding its leader's prompt cells: its
        first token is drawn from the leader's last prompt row, by its own sampler (no
        prefill of its own). It does not speculate."""
        req = seq.req
        seq.pos, seq.pending = len(req.prompt), []
        req.timing.reused_tokens = len(req.prompt)
        req.timing.prefix_lookup = "shared"
        self._active.append(seq)
        sampled = self._sample(seq, logits)
        if sampled is not None:
            self._take_token(seq, sampled.token, sampled)

    def _step(self) -> None:
        # Prompt pieces of >= ATTN_TILE tokens (llama.cpp's tiled attention) get a
        # llama_decode each, shorter pieces one together, and the decode rows one of their own,
        # in that order. (Under ATTN_TILE tokens a sequence takes its row kernel, as in
        # one-token decoding: ``Sequence.prompt_piece`` says why.) With one KV stream per
        # sequence llama.cpp runs a batch of prompt pieces and decode rows as separate passes
        # anyway (7 rows + a 12-token prompt: 105 ms against 53 + 51 ms apart), so decoding
        # the pieces first costs no throughput and gives a newcomer its first token one pass
        # sooner; the rows wait that pass either way.
        entries: list[tuple[int, int, int, bool]] = []
        rows: list[tuple[Sequence, int, list[int]]] = []  # (sequence, its first row, its drafts)
        longs: list[tuple[list[tuple[int, int, int, bool]],
                          list[tuple[Sequence, int, list[int]]]]] = []
        self._active.sort(key=lambda q: q.slot)  # llama.cpp wants streams in order
        decoding = [seq for seq in self._active if seq.next_token is not None]
        drafts = self._drafts(decoding)
        for seq, draft in zip(decoding, drafts, strict=True):
            assert seq.next_token is not None
            rows.append((seq, len(entries), draft))
            entries.append((seq.next_token, seq.pos, seq.slot, True))
            entries.extend((tok, seq.pos + 1 + i, seq.slot, True) for i, tok in enumerate(draft))
            seq.pos += 1 + len(draft)
            seq.next_token = None
        room = self.config.n_batch - len(entries)
        budget = min(room, self.config.prefill_chunk) if entries else room
        prefilled: list[Sequence] = []
        shorts: tuple[list[tuple[int, int, int, bool]], list[tuple[Sequence, int, list[int]]]]
        shorts = ([], [])
        for seq in self._active:
            if budget <= 0:
                break
            take = seq.prompt_piece(budget, room, self._tile) if seq.pending else []
            if not take:
                continue
            if len(take) >= self._tile:
                longs.append(([], []))
            batch, batch_rows = longs[-1] if len(take) >= self._tile else shorts
            for tok in take:
                batch.append((tok, seq.pos, seq.slot, False))
                seq.pos += 1
            budget -= len(take)
            room -= len(take)
            if not seq.pending:
                batch[-1] = (*batch[-1][:3], True)
                batch_rows.append((seq, len(batch) - 1, []))
                prefilled.append(seq)
        for long in longs:
            self._decode(*long, pure=False)
        if shorts[0]:
            self._decode(*shorts, pure=False)
        if entries:
            self._decode(entries, rows, pure=True)
        for seq in prefilled:  # after the first tokens went out: off their TTFT
            if seq.store_prefix and seq in self._active:
                self._store_prefix(seq)

    def _decode(self, entries: list[tuple[int, int, int, bool]],
                rows: list[tuple[Sequence, int, list[int]]], pure: bool) -> None:
        """One ``llama_decode`` (or its rows one by one, where that measured cheaper), then
        each row's tokens; ``pure``: no prompt tokens in it (every row has logits)."""
        if pure and len(entries) == len(rows) and self.costs.split_is_cheaper(len(rows)):
            self._decode_one_by_one(rows, entries)
            return
        t0 = time.perf_counter()
        rc = self.model.decode(entries)
        if pure:  # (drafts included)
            self.costs.learn(len(entries), time.perf_counter() - t0)
        self.steps += 1
        self.rows += len(rows)
        if rc != 0:  # the KV cells of every sequence in the batch are now in doubt
            log.error("llama_decode returned %d for a batch of %d tokens", rc, len(entries))
            slots = {slot for _, _, slot, _ in entries}
            for seq in [q for q in self._active if q.slot in slots]:
                self._finish(seq, "error", RuntimeFailed(f"llama_decode failed ({rc})"))
            return
        for seq, index, draft in rows:
            self._verify(seq, index, draft)

    def _drafts(self, decoding: list[Sequence]) -> list[list[int]]:
        """Draft tokens for each decoding sequence (``speculative.py``), within the batch.
        At most max_tokens - generated - 1 each, so a step never emits more than max_tokens
        allows; the prompt limits keep those positions inside the sequence's cells."""
        if self.spec is None or not decoding:
            return [[] for _ in decoding]
        rows = [(seq.spec, seq.slot, seq.req.params.max_tokens - seq.generated - 1)
                for seq in decoding]
        return self.spec.propose(rows, self.config.n_batch - len(decoding))

    def _verify(self, seq: Sequence, index: int, draft: list[int]) -> None:
        """Emit the target's token of row ``index``, then of each next row while the token
        before equals that row's draft input: the target's own greedy text. Cells of the
        rejected drafts are removed. (The request's counters are updated before each token
        goes out: the loop may read them as soon as a token ends the request.)"""
        timing = seq.req.timing
        timing.steps += 1
        timing.drafted_tokens += len(draft)
        accepted = 0
        group = seq.req.group
        if group is not None and not group.ready and group.leader is seq.req:
            self._share_prefill(seq, group, index)
        for i in range(len(draft) + 1):
            sampled = self._sample(seq, self.model.logits(index + i))
            if sampled is None:  # its grammar cannot go on: ended
                return
            token = sampled.token
            agreed = i < len(draft) and token == draft[i]
            accepted += agreed
            timing.accepted_tokens += agreed
            if not self._take_token(seq, token, sampled) or not agreed:
                break
        if not draft or self.spec is None or seq.spec is None:
            return
        before = seq.pos - len(draft)  # the context's length when drafted
        self.spec.observe(seq.spec, seq.slot, before, len(draft), accepted)
        if accepted < len(draft) and seq.next_token is not None:  # (still running)
            seq.pos = before + accepted
            self.model.forget(seq.slot, seq.pos)

    def _sample(self, seq: Sequence, logits: Any) -> Sampled | None:
        """The sequence's next token by its sampler, under its grammar's mask (filled for
        this position; the token then consumed) and its end-of-generation ban. None: the
        grammar allows nothing here (or refused the token): the sequence ended with a
        ``GrammarFailed`` saying why, never an unconstrained token."""
        matcher = seq.matcher
        allowed = None
        if matcher is not None:
            if not matcher.fill(seq.mask):
                self._finish(seq, "error", GrammarFailed(seq.req.model, matcher.error))
                return None
            allowed = seq.mask
        banned = self.model.eog_ids if seq.generated < seq.eog_banned_below else None
        sampled = seq.sampler.sample(logits, allowed, banned)
        if not seq.sampler.plain:
            seq.sampler.accept(sampled.token)
        if matcher is not None and not self.model.is_eog(sampled.token) \
                and not matcher.consume(sampled.token):
            self._finish(seq, "error", GrammarFailed(seq.req.model, matcher.error))
            return None
        return sampled

    def _share_prefill(self, seq: Sequence, group: PrefillGroup, index: int) -> None:
        """The leader of ``n`` choices has prefilled: keep its prompt's cells and last row's
        logits for the others (``_start_member``)."""
        group.state = self.model.save_state(seq.slot)
        group.logits = self.model.logits(index).copy()
        group.ready = True

    def _decode_one_by_one(self, rows: list[tuple[Sequence, int, list[int]]],
                           entries: list[tuple[int, int, int, bool]]) -> None:
        for seq, index, _ in rows:
            t0 = time.perf_counter()
            rc = self.model.decode([entries[index]])
            self.costs.learn(1, time.perf_counter() - t0)
            self.steps += 1
            self.rows += 1
            if rc != 0:
                log.error("llama_decode returned %d for one token", rc)
                self._finish(seq, "error", RuntimeFailed(f"llama_decode failed ({rc})"))
                continue
            self._verify(seq, 0, [])
        self.split_steps += 1

    def _store_prefix(self, seq: Sequence) -> None:
        """Keep the KV state of the prompt alone (cells from the first generated token on
        are not yet written: that token is fed in the next step)."""
        self.prefix_cache.store(seq.req.prompt, seq.req.tenant,
                                self.model.save_state(seq.slot))
        seq.store_prefix = False

    def _take_token(self, seq: Sequence, token: int, sampled: Sampled | None = None) -> bool:
        """Emit ``token``; False if it ended the sequence."""
        timing, t = seq.req.timing, now_ns()
        if not timing.first_token_ns:
            timing.first_token_ns = t
        timing.token_ns.append(t)
        # (an end of generation is never sampled while banned: its logit was -inf)
        if self.model.is_eog(token):
            reason: str | None = "stop"
        else:
            reason = seq.emit(token, self.model.piece(token), sampled, self.model.piece)
            if reason is None and seq.matcher is not None and seq.matcher.done:
                reason = "stop"  # the document is complete (whatever min_tokens asks)
        if reason is None:
            return True
        self._finish(seq, reason)
        return False

    def _finish(self, seq: Sequence, reason: str, error: SokujiError | None = None) -> None:
        req = seq.req
        group = req.group
        if group is not None and group.leader is req and not group.ready:
            group.ready = True  # ended before its prefill: the others prefill for themselves
        if reason in ("stop", "length"):
            tail = seq.flush()
            if tail is not None:
                req.push(tail)
        req.timing.end_ns = now_ns()
        if reason in ("stop", "length") and req.timing.admitted_ns:
            self.drain.observe(1, (req.timing.end_ns - req.timing.admitted_ns) / 1e9)
        req.push(Finish(reason, seq.generated, error))
        self._active.remove(seq)
        if seq.store_prefix and not seq.pending and reason in ("stop", "length"):
            self.model.forget(seq.slot, len(req.prompt))  # (finished in its first step)
            self._store_prefix(seq)
        self.model.forget(seq.slot)
        if self.spec is not None:
            self.spec.release(seq.spec, seq.slot)
        seq.sampler.close()
        self._free.append(seq.slot)

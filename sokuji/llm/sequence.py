"""One generation in a slot of the engine: where it stands in its prompt and its KV cells,
its sampler, and how a generated token becomes text for its request (UTF-8 across tokens,
stop strings, ``min_tokens``, ``max_tokens``). Used by the engine thread only."""

from __future__ import annotations

from sokuji.llm.native import Sampler
from sokuji.llm.request import Delta, GenerationRequest, TextAssembler
from sokuji.llm.speculative import SeqSpec

ATTN_TILE = 64
"""llama.cpp's CPU flash attention computes a sequence's tokens with a tiled kernel when at
least this many of them are in one micro-batch (``GGML_FA_TILE_Q``), row by row otherwise.
The two round differently: logits apart by up to ~1, enough to change greedy text."""


class Sequence:
    __slots__ = ("assembler", "eog_banned_below", "generated", "min_tokens", "next_token",
                 "pending", "pos", "req", "sampler", "slot", "spec", "store_prefix")

    def __init__(self, req: GenerationRequest, slot: int) -> None:
        self.req = req
        self.slot = slot
        p = req.params
        self.sampler = Sampler(p.temperature, p.top_p, p.seed)
        self.assembler = TextAssembler(p.stop)
        self.pending: list[int] = list(req.prompt)
        """Prompt tokens not yet prefilled."""
        self.pos = 0
        """The position of the next token fed (its KV cells hold positions below)."""
        self.next_token: int | None = None
        """The token sampled last, to feed in the next step (None: prefilling, or ended)."""
        self.generated = 0
        self.store_prefix = False
        self.spec: SeqSpec | None = None
        """Its speculation state (None: it does not speculate)."""
        # min_tokens / ignore_eos as plain ints: a request without them costs one integer
        # comparison a token (``generated < 0`` is never true).
        self.eog_banned_below = p.eog_banned_below
        self.min_tokens = p.min_tokens

    def prompt_piece(self, budget: int, room: int, tile: int = ATTN_TILE) -> list[int]:
        """The prompt tokens to feed now: about ``budget``, ``room`` at most, cut so that each
        goes through the attention kernel llama.cpp uses for it when the prompt is decoded
        whole (as llama.cpp's own API does): a rest of ``tile`` tokens or more is fed in
        pieces of at least ``tile`` with no shorter tail (and in a decode call without
        other sequences' few tokens, which llama.cpp would put in the same micro-batch as
        some of the piece: ``engine._step``); a shorter rest as it comes. So the text of a
        greedy request does not depend on what else was running when it arrived. (A prefix
        cache hit leaves a rest that may be shorter than ``tile`` of a longer prompt: those
        few tokens take the row kernel.)"""
        left = len(self.pending)
        take = min(left, budget)
        if left >= tile:
            take = max(take, tile)
            if 0 < left - take < tile:
                take = left - tile if left - tile >= tile else left
            if take > room:
                return []
        piece, self.pending = self.pending[:take], self.pending[take:]
        return piece

    def emit(self, token: int, piece: bytes) -> str | None:
        """A generated token that is not an end of generation: its text goes to the request
        (what may be released yet); returns the finish it causes ("stop": a stop string,
        "length": ``max_tokens``), or None: ``token`` is fed next."""
        self.generated += 1
        if self.generated < self.min_tokens:  # stop strings cannot end it yet
            text = self.assembler.add_unchecked(piece)
        else:
            text = self.assembler.add(piece)
        if text:
            self.req.push(Delta(text, self.generated))
        if self.assembler.stopped:
            return "stop"
        if self.generated >= self.req.params.max_tokens:
            return "length"
        self.next_token = token
        if self.spec is not None:
            self.spec.history.append(token)
        return None

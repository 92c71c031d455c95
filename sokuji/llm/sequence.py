"""One generation in a slot of the engine: where it stands in its prompt and its KV cells,
its sampler, and how a generated token becomes text for its request (UTF-8 across tokens,
stop strings, ``min_tokens``, ``max_tokens``). Used by the engine thread only.

Log-probabilities (``logprobs``) line up with the text released: a token's entry goes out
in the ``Delta`` whose text reaches the end of that token's characters (so text held back,
a partial UTF-8 character or a possible stop string, holds its tokens' entries too; a token
whose bytes complete no character yet goes out with the token that completes it). When a stop
string ends the sequence, the tokens whose text begins before the cut are reported (the
last may reach into the stop string) and the ones wholly inside it are not, as their text
is not. An end-of-generation token is never reported (it is no text).
"""

from __future__ import annotations

from collections.abc import Callable

from sokuji.core.events import TokenLogprob
from sokuji.llm.request import Delta, GenerationRequest, TextAssembler
from sokuji.llm.sampling import Sampled, TokenSampler
from sokuji.llm.speculative import SeqSpec

ATTN_TILE = 64
"""llama.cpp's CPU flash attention computes a sequence's tokens with a tiled kernel when at
least this many of them are in one micro-batch (``GGML_FA_TILE_Q``), row by row otherwise.
The two round differently: logits apart by up to ~1, enough to change greedy text."""


class Sequence:
    __slots__ = ("assembler", "eog_banned_below", "generated", "held", "mask", "matcher",
                 "min_tokens", "next_token", "pending", "pos", "req", "sampler", "slot",
                 "spec", "store_prefix")

    def __init__(self, req: GenerationRequest, slot: int, n_vocab: int) -> None:
        self.req = req
        self.slot = slot
        p = req.params
        self.sampler = TokenSampler(p.sampling, n_vocab, req.prompt)
        self.held: list[tuple[int, int, TokenLogprob]] | None = (
            [] if p.logprobs is not None else None)
        """(start, end, entry) of each token whose log-probability is not sent yet (None:
        none asked for)."""
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
        grammar = req.grammar
        self.matcher = grammar.matcher() if grammar is not None else None
        """Its walk of the request's grammar (``llm/grammar.Matcher``), or None: free text."""
        self.mask = grammar.vocab.allocate()[0] if grammar is not None else None
        """The tokens the grammar allows next (packed int32 words), filled before each row."""

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

    def emit(self, token: int, piece: bytes, sampled: Sampled | None = None,
             pieces: Callable[[int], bytes] | None = None) -> str | None:
        """A generated token that is not an end of generation: its text goes to the request
        (what may be released yet); returns the finish it causes ("stop": a stop string,
        "length": ``max_tokens``), or None: ``token`` is fed next. ``sampled`` and
        ``pieces`` (token -> bytes) give its log-probabilities where they were asked for."""
        self.generated += 1
        assembler = self.assembler
        start = len(assembler.text)
        if self.generated < self.min_tokens:  # stop strings cannot end it yet
            text = assembler.add_unchecked(piece)
        else:
            text = assembler.add(piece)
        if self.held is None:
            if text:
                self.req.push(Delta(text, self.generated))
        else:
            self._hold(start, piece, sampled, pieces)
            out = self._release()
            if text or out:
                self.req.push(Delta(text, self.generated, out))
        if assembler.stopped:
            return "stop"
        if self.generated >= self.req.params.max_tokens:
            return "length"
        self.next_token = token
        if self.spec is not None:
            self.spec.history.append(token)
        return None

    def _hold(self, start: int, piece: bytes, sampled: Sampled | None,
              pieces: Callable[[int], bytes] | None) -> None:
        assert self.held is not None
        if sampled is None or sampled.logprob is None or pieces is None:
            return
        top = tuple((_text(b), b, lp) for b, lp in ((pieces(t), lp) for t, lp in sampled.top))
        end = max(start, len(self.assembler.text))
        self.held.append((start, end, TokenLogprob(_text(piece), piece, sampled.logprob,
                                                   start, top)))

    def _release(self, everything: bool = False) -> tuple[TokenLogprob, ...]:
        held = self.held
        if not held:
            return ()
        sent = self.assembler.sent
        if everything:
            n = len(held)
        elif self.assembler.stopped:  # the ones that begin before the cut
            n = sum(1 for start, _, _ in held if start < sent)
            held[n:] = []
        else:  # through the last whose text is out (one with no character yet waits)
            n = 0
            for i, (start, end, _) in enumerate(held):
                if end > sent:
                    break
                if end > start:
                    n = i + 1
        out = tuple(entry for _, _, entry in held[:n])
        del held[:n]
        return out

    def flush(self) -> Delta | None:
        """At its end (a stop or its length): what was held back, as one last delta."""
        tail = self.assembler.flush()
        out = self._release(everything=True) if self.held is not None else ()
        if tail or out:
            return Delta(tail, self.generated, out)
        return None


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", "replace")

"""One generation in a slot of the engine: where it stands in its prompt and its KV cells,
its sampler, and how a generated token becomes text for its request (UTF-8 across tokens,
stop strings, ``min_tokens``, ``max_tokens``). Used by the engine thread only."""

from __future__ import annotations

from sokuji.llm.native import Sampler
from sokuji.llm.request import Delta, GenerationRequest, TextAssembler
from sokuji.llm.speculative import SeqSpec


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

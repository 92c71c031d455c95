"""A request's text -> prompt token ids and sampling parameters, within the model's limits,
never tokenising what cannot fit.

The checks run cheapest first, each before the work it protects:

1. token ids: their count against the prompt limit, then each id against the vocabulary;
   chat messages: their count (each renders to at least one token, so more cannot fit);
2. text (a completion's prompt, or a chat rendered through its template): its length against
   ``max_prompt_bytes`` = prompt limit x the longest token's text in bytes. No token stands
   for more input bytes than that, so a longer text cannot tokenise to few enough tokens and
   is refused without tokenising it. Characters are compared first (a string has at least as
   many UTF-8 bytes as characters, so a 3 MiB prompt is refused without even encoding it),
   then bytes. The bound holds for tokenizers that keep every input byte (byte-level BPE,
   SPM); for the others (WPM, UGM drop or merge whitespace) it is off and step 3 decides;
3. tokenisation, then the token count against the prompt limit;
4. ``max_tokens`` / ``min_tokens`` against the model's limits and the context left.

All of it is synchronous and touches no event loop: the server runs it inline for small
bodies and in a worker thread for large ones (``llama_tokenize`` and Jinja are safe to call
there; ctypes releases the GIL while llama.cpp tokenises). Each call holds the builder's
``calls`` gate, so closing the model waits for calls in flight before freeing the vocabulary
(a cancelled request does not stop its worker thread), and refuses new ones (503).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from sokuji.core.limits import Limit
from sokuji.core.offload import CallGate
from sokuji.errors import InvalidInput
from sokuji.llm.request import STOP_LIMITS, SamplingParams


class _Model(Protocol):
    n_vocab: int
    max_piece_bytes: int
    lossless: bool

    def tokenize(self, text: str, add_special: bool) -> list[int]: ...


class _Chat(Protocol):
    def render(self, messages: list[dict[str, str]], tools: Any = None) -> str: ...


class _Limits(Protocol):  # LlamaOptions
    @property
    def context_size(self) -> int: ...

    @property
    def max_new_tokens(self) -> int: ...

    @property
    def prompt_limit(self) -> int: ...


class PromptBuilder:
    """One model's prompt rules: limits, chat template, tokenizer."""

    def __init__(self, name: str, model: _Model, chat: _Chat, limits: _Limits) -> None:
        self.name = name
        self.model = model
        self.chat = chat
        self.limits = limits
        self.prompt_limit = limits.prompt_limit
        self.max_prompt_bytes: int | None = (
            self.prompt_limit * model.max_piece_bytes if model.lossless else None)
        """Longer texts (UTF-8 bytes) cannot fit; None where the tokenizer has no such
        bound."""
        self.messages = Limit("messages", self.prompt_limit, "messages",
                              "chat messages of one request (each renders to at least one "
                              "prompt token)")
        self.limits_stated: tuple[Limit, ...] = (
            Limit("options.max_prompt_tokens", self.prompt_limit, "tokens",
                  "prompt tokens after the chat template (at most context_size - 1; a text "
                  "that cannot tokenise to fewer is refused by its bytes first)"),
            Limit("options.max_new_tokens", limits.max_new_tokens, "tokens",
                  "tokens generated for one request (max_tokens)"),
            Limit("options.context_size", limits.context_size, "tokens",
                  "prompt and generated tokens of one sequence"),
            self.messages, *STOP_LIMITS)
        """The model's cost bound (``ServedModel.limits``). The first three are checked
        below with a 400 naming the request's field (``prompt``, ``messages``,
        ``max_tokens``), the rest with ``LimitExceeded`` (413); stop strings by the codec,
        for every generator (``llm.request.check_stops``)."""
        self.calls = CallGate(f"model '{name}'")
        """Calls of ``tokens`` in flight (from any thread); the runtime closes it before it
        frees the model."""

    def tokens(self, *, text: str | None = None, messages: list[dict[str, str]] | None = None,
               token_ids: Sequence[int] | None = None, tools: Any = None) -> list[int]:
        """The prompt's token ids (exactly one of the three given; ``tools``: a chat's
        ``ToolSpec``, rendered by the template); 400 when it is empty, outside the
        vocabulary, or longer than the model takes; 503 once the model is closing."""
        with self.calls:
            return self._tokens(text, messages, token_ids, tools)

    def _tokens(self, text: str | None, messages: list[dict[str, str]] | None,
                token_ids: Sequence[int] | None, tools: Any = None) -> list[int]:
        what = "messages" if messages is not None else "prompt"
        if token_ids is not None:
            self._check_count(len(token_ids), what)
            vocab = self.model.n_vocab
            bad = next((t for t in token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidInput(f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                                   param="prompt")
            return list(token_ids)
        if messages is not None:
            self.messages.check(len(messages), "the messages")  # before templating them
            text = self.chat.render(messages, tools=tools)
        assert text is not None
        self._check_size(text, what)
        prompt = self.model.tokenize(text, add_special=True)
        self._check_count(len(prompt), what)
        return prompt

    def _check_size(self, text: str, what: str) -> None:
        bound = self.max_prompt_bytes
        if bound is None or len(text) <= bound // 4:  # at most 4 bytes a character: fits
            return
        size = len(text) if len(text) > bound else len(text.encode("utf-8"))
        if size > bound:
            rendered = " (as rendered by the chat template)" if what == "messages" else ""
            raise InvalidInput(
                f"the {what}{rendered} is more than {bound} bytes long: model '{self.name}' "
                f"takes at most {self.prompt_limit} prompt tokens, and no token of its "
                f"vocabulary is longer than {self.model.max_piece_bytes} bytes, so it cannot "
                "fit (refused without tokenising)", param=what)

    def _check_count(self, n_prompt: int, what: str) -> None:
        if n_prompt == 0:
            raise InvalidInput(f"the {what} {'are' if what == 'messages' else 'is'} empty",
                               param=what)
        if n_prompt > self.prompt_limit:
            verb = "have" if what == "messages" else "has"
            raise InvalidInput(f"the {what} {verb} {n_prompt} tokens; model '{self.name}' "
                               f"takes at most {self.prompt_limit}", param=what)

    def sampling(self, n_prompt: int, *, chat: bool, max_tokens: int | None,
                 max_tokens_field: str = "max_tokens", min_tokens: int = 0,
                 ignore_eos: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int | None = None, stop: tuple[str, ...] = (), top_k: int = 0,
                 min_p: float = 0.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                 logit_bias: tuple[tuple[int, float], ...] = (),
                 logprobs: int | None = None) -> SamplingParams:
        """``max_tokens`` (None: as many as fit) and ``min_tokens`` checked against the
        model's limits and the context left after a prompt of ``n_prompt`` tokens; the
        token ids of ``logit_bias`` against the vocabulary (the codec checked the rest)."""
        vocab = self.model.n_vocab
        bad = next((t for t, _ in logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidInput(f"'logit_bias' names token id {bad}, outside model "
                               f"'{self.name}''s vocabulary (0..{vocab - 1})",
                               param="logit_bias")
        what = "messages" if chat else "prompt"
        limits = self.limits
        if max_tokens is not None and max_tokens > limits.max_new_tokens:
            raise InvalidInput(f"{max_tokens_field} {max_tokens} exceeds model '{self.name}''s "
                               f"limit of {limits.max_new_tokens} new tokens",
                               param=max_tokens_field)
        room = limits.context_size - n_prompt + 1
        if max_tokens is not None and max_tokens > room:
            raise InvalidInput(
                f"model '{self.name}''s context is {limits.context_size} tokens; you asked "
                f"for {n_prompt + max_tokens} ({n_prompt} in the {what}, {max_tokens} "
                "to generate)", param=max_tokens_field)
        effective = max_tokens or min(limits.max_new_tokens, room)
        if min_tokens > effective:
            where = (f"{max_tokens_field} ({max_tokens})" if max_tokens is not None else
                     f"the most this prompt leaves room for ({effective})")
            raise InvalidInput(f"min_tokens {min_tokens} exceeds {where}", param="min_tokens")
        return SamplingParams(max_tokens=effective, temperature=temperature, top_p=top_p,
                              seed=seed, stop=stop, min_tokens=min_tokens,
                              ignore_eos=ignore_eos, top_k=top_k, min_p=min_p,
                              presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty,
                              repetition_penalty=repetition_penalty, logit_bias=logit_bias,
                              logprobs=logprobs)

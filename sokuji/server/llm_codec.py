"""OpenAI chat and text completions: request validation and response bodies.

Every field the OpenAI API defines is either honoured or refused with a 400 that names it;
unknown fields are refused too, so a client never silently gets something else than it
asked for. Beyond OpenAI's fields, the vLLM extensions that load generators send are
honoured: ``ignore_eos`` and ``min_tokens`` (guidellm, genai-perf / aiperf ``--extra-inputs``),
``top_k``, ``min_p`` and ``repetition_penalty`` (vLLM's sampling extensions; ``top_k`` 0 or -1:
off),
``stream_options.continuous_usage_stats`` (guidellm), and NVIDIA's ``nvext.ignore_eos``
(genai-perf recipes for NIM and Triton); any other key of ``stream_options`` or ``nvext`` is
refused by name. Structured outputs: OpenAI's ``response_format`` (json_object, json_schema)
and llama-server's ``grammar`` (GBNF) and ``json_schema``, on both routes (``llm/grammar.py``);
tools on the chat route (``llm/tools.py``); ``n`` choices.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from sokuji.core.events import TokenLogprob
from sokuji.core.model import GenerationInput
from sokuji.errors import InvalidInput
from sokuji.llm.chat import validate_messages
from sokuji.llm.request import STOP_SEQUENCES, Timing, check_stops
from sokuji.llm.sampling import LOGIT_BIAS_BOUND, MAX_TOP_LOGPROBS
from sokuji.server.openai_api import parse_request

_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream",
           "stream_options", "user", "presence_penalty", "frequency_penalty", "logprobs",
           "logit_bias", "top_logprobs",
           "ignore_eos", "min_tokens", "nvext",  # vLLM / NVIDIA extensions
           "top_k", "min_p", "repetition_penalty",
           "response_format", "grammar", "json_schema"}  # (llama-server's: grammar, json_schema)
_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
_NVEXT = ("ignore_eos",)
_CHAT = _COMMON | {"messages", "max_completion_tokens", "tools",
                   "tool_choice", "parallel_tool_calls", "store", "metadata"}
_TEXT = _COMMON | {"prompt", "echo", "best_of", "suffix"}


@dataclass
class CompletionRequest(GenerationInput):
    """The model's ``GenerationInput``, and how the client wants it answered."""

    model: str
    stream: bool
    include_usage: bool
    """A last chunk with the whole usage (``stream_options.include_usage``)."""
    continuous_usage: bool
    """Usage so far in every chunk (``stream_options.continuous_usage_stats``, vLLM)."""
    user: str | None = None
    """OpenAI's end-user id (a pipeline may look up this user's features)."""


def _number(doc: dict[str, Any], key: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    value = doc.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (lo < value if lo_open else lo <= value) or value > hi:
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InvalidInput(f"'{key}' must be a number in {bound}, got {value!r}", param=key)
    return float(value)


def _int(doc: dict[str, Any], key: str) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"'{key}' must be an integer, got {value!r}", param=key)
    return value


def _flag(doc: dict[str, Any], key: str, where: str = "") -> bool:
    value = doc.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidInput(f"'{where}{key}' must be a boolean, got {value!r}",
                           param=where + key)
    return value


def _options(doc: dict[str, Any], key: str, known: tuple[str, ...]) -> dict[str, Any]:
    """An object-valued field whose keys are all known (each unknown one: 400 by name)."""
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"'{key}' must be an object, got {value!r}", param=key)
    extra = sorted(set(value) - set(known))
    if extra:
        raise InvalidInput(f"'{key}.{extra[0]}' is not supported; '{key}' takes: "
                           f"{', '.join(known)}", param=f"{key}.{extra[0]}")
    return value


def _logit_bias(doc: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: {"token id": bias in [-100, 100]} (the ids are checked
    against the vocabulary by the model, which knows it)."""
    value = doc.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidInput(f"'logit_bias' must be an object of token ids to numbers, got "
                           f"{value!r}", param="logit_bias")
    out: list[tuple[int, float]] = []
    for key, bias in value.items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) < 12 else -1
        if token < 0:
            raise InvalidInput(f"'logit_bias' key {key!r} is not a token id",
                               param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -LOGIT_BIAS_BOUND <= bias <= LOGIT_BIAS_BOUND:
            raise InvalidInput(f"'logit_bias' of token {key} must be a number in [-100, 100], "
                               f"got {bias!r}", param="logit_bias")
        out.append((token, float(bias)))
    return tuple(out)


def _logprobs(doc: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives a token's log-probability comes with (None: none asked):
    chat ``logprobs`` (a boolean) with ``top_logprobs`` (0..20); completions ``logprobs``
    (an integer 0..20, the legacy format)."""
    if not chat:
        n = _int(doc, "logprobs")
        if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
            raise InvalidInput(f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                               f"got {n}", param="logprobs")
        return n
    wanted = _flag(doc, "logprobs")
    top = _int(doc, "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidInput(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                           f"got {top}", param="top_logprobs")
    if top and not wanted:
        raise InvalidInput("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def _top_k(doc: dict[str, Any]) -> int:
    k = _int(doc, "top_k")
    if k is None or k in (0, -1):
        return 0
    if k < 0:
        raise InvalidInput(f"'top_k' must be a positive integer, or 0 or -1 (off), got {k}",
                           param="top_k")
    return k


def _refuse_unless(doc: dict[str, Any], key: str, allowed: tuple[Any, ...], why: str) -> None:
    if key in doc and doc[key] not in allowed:
        raise InvalidInput(f"'{key}' {doc[key]!r} is not supported: {why}", param=key)


MAX_N = 128
"""The most choices (``n``) the protocol layer lets through; each model bounds it further
(kind llama: ``options.max_n``)."""


def _n(doc: dict[str, Any]) -> int:
    n = _int(doc, "n")
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise InvalidInput(f"'n' must be between 1 and {MAX_N}, got {n}", param="n")
    return n


def _constraint(doc: dict[str, Any]) -> Any:
    """The output's constraint: OpenAI's ``response_format``, or llama-server's ``grammar``
    (GBNF) or ``json_schema``; at most one of them (``llm/grammar.py`` checks each, cheaply:
    nothing is compiled here)."""
    from sokuji.llm import grammar_spec as grammar

    specs = [s for s in (grammar.parse_response_format(doc.get("response_format")),
                         grammar.parse_gbnf(doc.get("grammar")),
                         grammar.parse_json_schema(doc.get("json_schema"))) if s is not None]
    if len(specs) > 1:
        raise InvalidInput(f"'{specs[0].param}' and '{specs[1].param}' both constrain the "
                           "output: send one", param=specs[1].param)
    return specs[0] if specs else None


def decode(body: bytes, chat: bool) -> CompletionRequest:
    doc, model = parse_request(body, _CHAT if chat else _TEXT)
    return decode_doc(doc, model, chat)


def decode_doc(doc: dict[str, Any], model: str, chat: bool) -> CompletionRequest:
    """A parsed body (its fields already checked against the route's) as a request for
    ``model``: also the decoder of Triton's generate bodies (``generate_codec.py``), which
    map their fields onto OpenAI's first."""
    n = _n(doc)
    constraint = _constraint(doc)
    messages, prompt, tools = None, None, None
    if chat:
        from sokuji.llm.tools import parse_tools

        messages = validate_messages(doc.get("messages"))
        tools = parse_tools(doc)
        if tools is not None and constraint is not None:
            raise InvalidInput(f"'{constraint.param}' together with 'tools' is not supported "
                               "(yet): the answer is either a call or the constrained text",
                               param=constraint.param)
    else:
        raw = doc.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if isinstance(raw, str) or (isinstance(raw, list) and raw and all(
                isinstance(t, int) and not isinstance(t, bool) for t in raw)):
            prompt = raw
        else:
            raise InvalidInput("'prompt' must be a string, a list of one string, or a list of "
                               "token ids (one prompt per request)", param="prompt")
        _refuse_unless(doc, "echo", (None, False), "echo is not implemented")
        _refuse_unless(doc, "best_of", (None, 1), "only best_of=1 is served")
        _refuse_unless(doc, "suffix", (None,), "insertion (suffix) is not implemented")
    max_tokens = _int(doc, "max_tokens")
    max_key = "max_tokens"
    if chat and doc.get("max_completion_tokens") is not None:
        max_tokens = _int(doc, "max_completion_tokens")
        max_key = "max_completion_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise InvalidInput(f"'{max_key}' must be at least 1, got {max_tokens}", param=max_key)
    min_tokens = _int(doc, "min_tokens") or 0
    if min_tokens < 0:
        raise InvalidInput(f"'min_tokens' must be at least 0, got {min_tokens}",
                           param="min_tokens")
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidInput(f"'min_tokens' {min_tokens} exceeds '{max_key}' {max_tokens}",
                           param="min_tokens")
    ignore_eos = _flag(doc, "ignore_eos")
    nvext = _options(doc, "nvext", _NVEXT)
    if "ignore_eos" in nvext:
        nv_ignore = _flag(nvext, "ignore_eos", "nvext.")
        if doc.get("ignore_eos") is not None and nv_ignore != ignore_eos:
            raise InvalidInput("'ignore_eos' and 'nvext.ignore_eos' disagree",
                               param="nvext.ignore_eos")
        ignore_eos = nv_ignore
    stop_raw = doc.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,) if stop_raw else ()
    elif isinstance(stop_raw, list):
        STOP_SEQUENCES.check(len(stop_raw), "'stop'")  # before looking at each
        if not all(isinstance(s, str) and s for s in stop_raw):
            raise InvalidInput("'stop' must be a string or a list of up to 4 non-empty "
                               "strings", param="stop")
        stop = tuple(stop_raw)
    else:
        raise InvalidInput("'stop' must be a string or a list of up to 4 non-empty strings",
                           param="stop")
    check_stops(stop)
    stream = doc.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise InvalidInput(f"'stream' must be a boolean, got {stream!r}", param="stream")
    options = _options(doc, "stream_options", _STREAM_OPTIONS)
    if "stream_options" in doc and doc["stream_options"] is not None and not stream:
        raise InvalidInput("'stream_options' is only allowed with stream=true (as OpenAI "
                           "and vLLM answer)", param="stream_options")
    user = doc.get("user")
    if user is not None and (not isinstance(user, str) or not 0 < len(user) <= 256):
        raise InvalidInput("'user' must be a string of 1 to 256 characters", param="user")
    return CompletionRequest(
        user=user, chat=chat, model=model, messages=messages, prompt=prompt, max_tokens=max_tokens,
        max_tokens_field=max_key, min_tokens=min_tokens, ignore_eos=ignore_eos,
        temperature=_number(doc, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(doc, "top_p", 1.0, 0.0, 1.0, lo_open=True), stop=stop,
        seed=_int(doc, "seed"), stream=bool(stream), top_k=_top_k(doc),
        min_p=_number(doc, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(doc, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(doc, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(doc, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        logit_bias=_logit_bias(doc), logprobs=_logprobs(doc, chat), grammar=constraint,
        tools=tools, n=n, include_usage=_flag(options, "include_usage", "stream_options."),
        continuous_usage=_flag(options, "continuous_usage_stats", "stream_options."))


class Encoder:
    """Response bodies of one completion (one id, one creation time)."""

    def __init__(self, req: CompletionRequest, model: str, timing: Timing) -> None:
        self.chat = req.chat
        self.model = model
        self.timing = timing
        self.continuous = req.stream and req.continuous_usage
        self.logprobs = req.logprobs is not None
        """Each choice carries its tokens' log-probabilities (else ``logprobs: null``)."""
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if req.chat else "text_completion"
        self.extra: dict[str, Any] = {}
        """Fields beside OpenAI's (a pipeline's ``sources``): in the whole body, or in the
        first chunk of a stream."""

    @staticmethod
    def usage(timing: Timing, completion_tokens: int) -> dict[str, Any]:
        usage = {"prompt_tokens": timing.prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": timing.prompt_tokens + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": timing.reused_tokens}}
        if timing.drafted_tokens:  # speculative decoding, in OpenAI's predicted-output terms
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": timing.accepted_tokens,
                "rejected_prediction_tokens": timing.drafted_tokens - timing.accepted_tokens}
        return usage

    def logprobs_doc(self, entries: tuple[TokenLogprob, ...] | list[TokenLogprob]
                     ) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` of a choice (or a chunk's): chat ``{"content": [...]}``,
        completions the legacy ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
        ``text_offset`` (each alternative's dict holds the chosen token too, as OpenAI's
        does). -inf (a banned or masked token) is written -9999.0, as OpenAI writes it."""
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [
                {"token": e.token, "logprob": _finite(e.logprob), "bytes": list(e.raw),
                 "top_logprobs": [{"token": t, "logprob": _finite(lp), "bytes": list(b)}
                                  for t, b, lp in e.top]} for e in entries],
                "refusal": None}
        return {"tokens": [e.token for e in entries],
                "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": [{e.token: _finite(e.logprob)}
                                 | {t: _finite(lp) for t, _, lp in e.top} for e in entries],
                "text_offset": [e.offset for e in entries]}

    def whole(self, text: str, reason: str, timing: Timing, completion_tokens: int,
              logprobs: list[TokenLogprob] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason,
                                  "logprobs": self.logprobs_doc(logprobs or [])}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            choice["text"] = text
        return orjson.dumps({"id": self.id, "object": self.object, "created": self.created,
                             "model": self.model, "choices": [choice],
                             "usage": self.usage(timing, completion_tokens), **self.extra})

    def whole_choices(self, choices: list[Any], timing: Timing, completion_tokens: int
                      ) -> bytes:
        """The body of several choices, or of one with tools (``llm_choices.Choice``); usage
        counts every choice's tokens (the prompt once: the choices share it)."""
        out = []
        for c in choices:
            choice: dict[str, Any] = {"index": c.index, "finish_reason": c.reason,
                                      "logprobs": self.logprobs_doc(c.logprobs)}
            if self.chat:
                choice["message"] = c.message()
            else:
                choice["text"] = "".join(c.texts)
            out.append(choice)
        return orjson.dumps({"id": self.id, "object": self.object, "created": self.created,
                             "model": self.model, "choices": out,
                             "usage": self.usage(timing, completion_tokens), **self.extra})

    def chunk(self, text: str | None, reason: str | None = None, role: bool = False,
              tokens: int = 0, logprobs: tuple[TokenLogprob, ...] | None = None,
              index: int = 0, delta: dict[str, Any] | None = None) -> bytes:
        """One streamed chunk of choice ``index``; with ``continuous_usage_stats`` it carries
        the usage after ``tokens`` generated tokens; ``logprobs``: those of its text's
        tokens; ``delta``: a chat delta other than plain content (tool-call pieces)."""
        choice: dict[str, Any] = {"index": index, "finish_reason": reason,
                                  "logprobs": (self.logprobs_doc(logprobs)
                                               if logprobs is not None else None)}
        if self.chat:
            body: dict[str, Any] = {"role": "assistant"} if role else {}
            if delta is not None:
                body.update(delta)
            elif text is not None:
                body["content"] = text
            choice["delta"] = body
        else:
            choice["text"] = text or ""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        doc = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": [choice]}
        if self.continuous:
            doc["usage"] = self.usage(self.timing, tokens)
        if self.extra:
            doc.update(self.extra)
            self.extra = {}
        return self._event(doc)

    def usage_chunk(self, timing: Timing, completion_tokens: int) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._event({"id": self.id, "object": obj, "created": self.created,
                            "model": self.model, "choices": [],
                            "usage": self.usage(timing, completion_tokens)})

    @staticmethod
    def _event(doc: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(doc) + b"\n\n"


def _finite(logprob: float) -> float:
    return logprob if logprob > -9999.0 else -9999.0

"""``ignore_eos`` and ``min_tokens`` in the engine, with a stand-in for llama.cpp whose
greedy choice is always to end at once (the real model: tests/integration/test_llm.py).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from sokuji.llm.engine import EngineConfig, GenerationEngine
from sokuji.llm.request import Delta, Finish, GenerationRequest, SamplingParams

EOG, A, B = 0, 5, 6
PIECES = {A: b"a", B: b"b"}


class EagerToStopModel:
    """Logits favour the end-of-generation token, then ``A``, then ``B``."""

    shape = SimpleNamespace(slots=2)
    n_vocab = 8

    @property
    def eog_ids(self) -> np.ndarray:
        """Read by the engine only for a row whose end-of-generation tokens are banned (it
        hands them to the sequence's sampler): counted."""
        self.banned += 1
        return np.array([EOG])

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.banned = 0

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> int:
        self.rows = []
        for _ in entries:
            row = np.zeros(self.n_vocab, dtype=np.float32)
            row[[EOG, A, B]] = [3.0, 2.0, 1.0]
            self.rows.append(row)
        return 0

    def logits(self, index: int) -> np.ndarray:
        return self.rows[index]

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def piece(self, token: int) -> bytes:
        return PIECES.get(token, b"?")

    def forget(self, seq: int, from_pos: int = 0) -> None:
        pass


def generate(**params: object) -> tuple[str, Finish, int]:
    """Runs one request through the engine's steps; its text, its finish, and how many
    rows had their end-of-generation tokens masked."""
    model = EagerToStopModel()
    eng = GenerationEngine("m", model, EngineConfig(prefix_cache_bytes=0))  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    try:
        req = GenerationRequest("m", [1, 2, 3], SamplingParams(temperature=0, **params),  # type: ignore[arg-type]
                                loop, arrival_ns=0)
        eng.queue.waiting.append(req)
        eng._admit(0)
        for _ in range(100):
            if not eng._active:
                break
            eng._step()
        assert not eng._active
        events: list[Delta | Finish] = []
        while not events or not isinstance(events[-1], Finish):
            events += loop.run_until_complete(req.next_events())
    finally:
        loop.close()
    text = "".join(e.text for e in events if isinstance(e, Delta))
    finish = events[-1]
    assert isinstance(finish, Finish)
    return text, finish, model.banned


def test_without_the_extensions_it_stops_at_once_and_masks_nothing() -> None:
    text, finish, banned = generate(max_tokens=8)
    assert (text, finish.reason, finish.completion_tokens, banned) == ("", "stop", 0, 0)


def test_ignore_eos_runs_to_max_tokens() -> None:
    text, finish, banned = generate(max_tokens=8, ignore_eos=True)
    assert (text, finish.reason, finish.completion_tokens) == ("a" * 8, "length", 8)
    assert banned == 8


def test_min_tokens_masks_the_end_only_until_reached() -> None:
    text, finish, banned = generate(max_tokens=8, min_tokens=3)
    assert (text, finish.reason, finish.completion_tokens, banned) == ("aaa", "stop", 3, 3)


@pytest.mark.parametrize(("min_tokens", "text", "tokens"), [
    (0, "", 0),  # the end-of-generation token comes first
    (1, "", 1),  # the first token is "a": the stop
    (4, "aaa", 4),  # "a"s before the 4th token do not count; the 4th's does
])
def test_stop_strings_count_from_the_min_tokens_th_token(min_tokens: int, text: str,
                                                         tokens: int) -> None:
    got, finish, _ = generate(max_tokens=8, min_tokens=min_tokens, stop=("a",))
    assert (got, finish.reason, finish.completion_tokens) == (text, "stop", tokens)


def test_ignore_eos_keeps_stop_strings() -> None:  # as vLLM: only the EOS is ignored
    text, finish, _ = generate(max_tokens=8, ignore_eos=True, stop=("aaa",))
    assert (text, finish.reason, finish.completion_tokens) == ("", "stop", 3)

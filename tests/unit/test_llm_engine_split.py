"""The engine's choice to decode a small batch row by row when that measured cheaper, with
a stand-in for llama.cpp (the real model is exercised in tests/integration/test_llm.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from sokuji.llm.engine import EngineConfig, GenerationEngine
from sokuji.llm.request import GenerationRequest, SamplingParams
from sokuji.llm.sequence import Sequence


class FakeModel:
    """Each decode returns logits whose argmax is 10 + the row's sequence id."""

    shape = SimpleNamespace(slots=4)
    n_vocab = 32

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, int, int, bool]]] = []

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> int:
        self.calls.append(entries)
        return 0

    def logits(self, index: int) -> np.ndarray:
        out = np.zeros(self.n_vocab, dtype=np.float32)
        out[10 + self.calls[-1][index][2]] = 1.0
        return out

    def is_eog(self, token: int) -> bool:
        return False

    def piece(self, token: int) -> bytes:
        return b"x"

    def forget(self, seq: int, from_pos: int = 0) -> None:
        pass


def engine() -> tuple[GenerationEngine, FakeModel]:
    model = FakeModel()
    return GenerationEngine("m", model, EngineConfig(prefix_cache_bytes=0)), model  # type: ignore[arg-type]


def test_split_only_when_measured_cheaper_and_still_probed() -> None:
    eng, _ = engine()
    assert not eng.costs.split_is_cheaper(2)  # nothing measured yet
    eng.costs.learn(1, 0.010)
    eng.costs.learn(2, 0.030)  # 2 rows together cost more than two single rows
    eng.costs.learn(3, 0.020)
    assert not eng.costs.split_is_cheaper(3)
    decisions = [eng.costs.split_is_cheaper(2) for _ in range(64)]
    assert decisions.count(False) == 2 and all(decisions[:31])  # every 32nd step: probe


def test_row_by_row_decoding_gives_each_sequence_its_own_logits() -> None:
    eng, model = engine()
    loop = asyncio.new_event_loop()
    try:
        seqs = []
        for slot in (0, 1):
            req = GenerationRequest("m", [1, 2], SamplingParams(max_tokens=5, temperature=0),
                                    loop, arrival_ns=0)
            seq = Sequence(req, slot, 32)
            seq.pending, seq.pos, seq.next_token = [], 2, 7
            seqs.append(seq)
        eng._active = seqs
        eng.costs.learn(1, 0.010)
        eng.costs.learn(2, 0.030)
        eng._step()
        assert [len(c) for c in model.calls] == [1, 1] and eng.split_steps == 1
        assert [s.next_token for s in seqs] == [10, 11]  # each sampled from its own row
        assert [s.pos for s in seqs] == [3, 3]
    finally:
        loop.close()


def test_split_can_be_turned_off() -> None:
    eng = GenerationEngine("m", FakeModel(), EngineConfig(  # type: ignore[arg-type]
        prefix_cache_bytes=0, split_small_batches=False))
    eng.costs.learn(1, 0.010)
    eng.costs.learn(2, 0.030)
    assert not any(eng.costs.split_is_cheaper(2) for _ in range(8))


async def test_no_submission_is_taken_once_the_engine_failed_everyone() -> None:
    from sokuji.errors import ModelNotReady

    eng, _ = engine()
    eng.start()
    try:
        eng._fail_all(ModelNotReady("dying"))  # the engine thread's last act before it ends
        assert not eng.alive
        req = GenerationRequest("m", [1, 2], SamplingParams(max_tokens=2, temperature=0),
                                asyncio.get_running_loop(), arrival_ns=0)
        try:
            eng.submit(req)
        except ModelNotReady:
            pass
        else:
            raise AssertionError("a submission after _fail_all would wait for nobody")
    finally:
        await eng.stop()


def test_a_newcomers_prompt_is_decoded_before_the_running_rows() -> None:
    """A short prompt piece and the decode rows are separate llama_decode calls, the prompt
    first: its first token comes out after its own pass, not after the rows' pass too."""
    eng, model = engine()
    loop = asyncio.new_event_loop()
    try:
        running = []
        for slot in (0, 1):
            req = GenerationRequest("m", [1, 2], SamplingParams(max_tokens=5, temperature=0),
                                    loop, arrival_ns=0)
            seq = Sequence(req, slot, 32)
            seq.pending, seq.pos, seq.next_token = [], 2, 7
            running.append(seq)
        req = GenerationRequest("m", [3, 4, 5], SamplingParams(max_tokens=5, temperature=0),
                                loop, arrival_ns=0)
        newcomer = Sequence(req, 2, 32)
        eng._active = [*running, newcomer]
        eng._step()
        assert [[slot for _, _, slot, _ in c] for c in model.calls] == [[2, 2, 2], [0, 1]]
        assert [logits for *_, logits in model.calls[0]] == [False, False, True]
        assert newcomer.next_token == 12 and newcomer.pos == 3 and not newcomer.pending
        assert [s.next_token for s in running] == [10, 11]
        assert eng.costs.measured(2) is not None  # the rows' pass is pure: its cost is learnt
    finally:
        loop.close()

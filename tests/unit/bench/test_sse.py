"""The one SSE reader benchmarks and ``sokuji bench`` share (``sokuji/bench/sse.py``)."""

from __future__ import annotations

from sokuji.bench import sse


def test_data_lines_and_what_is_not_one() -> None:
    assert sse.data(b'data: {"choices": [{"text": "a"}]}\n') == {"choices": [{"text": "a"}]}
    assert sse.data('data:{"x": 1}') == {"x": 1}  # the space after the colon is optional
    for line in (b"data: [DONE]\n", b"\n", b": server-timing total;dur=1", b"event: x",
                 b"data: [1, 2]", b"data: {not json", b"id: 3"):
        assert sse.data(line) is None, line
    assert sse.is_done(b"data: [DONE]\n") and not sse.is_done(b'data: {"x": 1}')


def test_comment_value() -> None:
    assert sse.comment(b": server-timing ttft;dur=3.1\n", "server-timing") == "ttft;dur=3.1"
    assert sse.comment(": server-timing a", "server-timing") == "a"
    assert sse.comment(b": other x", "server-timing") is None
    assert sse.comment(b'data: {"x": 1}', "server-timing") is None


def test_pieces_of_completions_and_chat_chunks() -> None:
    completions = {"choices": [{"index": 0, "text": "He"}, {"index": 1, "text": ""},
                               {"index": 2, "text": "llo"}]}
    assert sse.pieces(completions) == ["He", "llo"]
    assert sse.piece(completions) == "He"
    chat = {"choices": [{"delta": {"role": "assistant"}}, {"delta": {"content": "x"}}]}
    assert sse.pieces(chat) == ["x"]
    assert sse.piece(chat) is None  # the first choice carries no text
    assert sse.piece({"choices": []}) is None and sse.pieces({}) == []


def test_completion_tokens() -> None:
    assert sse.completion_tokens({"usage": {"completion_tokens": 7}}) == 7
    assert sse.completion_tokens({"usage": None}) is None
    assert sse.completion_tokens({"choices": []}) is None

"""What a request looks like for each kind of server, and how to read its answer.

- ``v2``: KServe V2 / Open Inference Protocol (Triton, Sokuji, KServe): one BYTES input.
- ``openai-embeddings``: ``POST /v1/embeddings``.
- ``openai-completions`` / ``openai-chat``: ``POST /v1/completions`` or
  ``/v1/chat/completions`` with ``stream: true``; server-sent events give time to first token,
  inter-token latencies and the output token count.
- ``http``: any JSON endpoint; ``body_template`` is JSON in which the string ``"{text}"`` is
  replaced by the item's text (JSON-escaped).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from sokuji.bench import sse
from sokuji.bench.dataset import Item


class TargetKind(enum.StrEnum):
    V2 = "v2"
    OPENAI_EMBEDDINGS = "openai-embeddings"
    OPENAI_COMPLETIONS = "openai-completions"
    OPENAI_CHAT = "openai-chat"
    HTTP = "http"


@dataclass(frozen=True)
class Target:
    kind: TargetKind
    base_url: str
    model: str = "minilm"
    input_name: str = "text"
    path: str | None = None
    body_template: str | None = None
    max_tokens: int = 64
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def streaming(self) -> bool:
        return self.kind in (TargetKind.OPENAI_COMPLETIONS, TargetKind.OPENAI_CHAT)

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        if self.path is not None:
            return base + self.path
        return base + {
            TargetKind.V2: f"/v2/models/{self.model}/infer",
            TargetKind.OPENAI_EMBEDDINGS: "/v1/embeddings",
            TargetKind.OPENAI_COMPLETIONS: "/v1/completions",
            TargetKind.OPENAI_CHAT: "/v1/chat/completions",
            TargetKind.HTTP: "",
        }[self.kind]

    def body(self, item: Item) -> bytes:
        if self.kind is TargetKind.V2:
            doc: Any = {"inputs": [{"name": self.input_name, "datatype": "BYTES", "shape": [1],
                                    "data": [item.text]}]}
        elif self.kind is TargetKind.OPENAI_EMBEDDINGS:
            doc = {"model": self.model, "input": item.text}
        elif self.kind is TargetKind.OPENAI_COMPLETIONS:
            doc = {"model": self.model, "prompt": item.text, "max_tokens": self.max_tokens,
                   "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}}
        elif self.kind is TargetKind.OPENAI_CHAT:
            messages = list(item.messages) or [{"role": "user", "content": item.text}]
            doc = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                   "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}}
        else:
            template = self.body_template or '{"text": "{text}"}'
            return template.replace('"{text}"', json.dumps(item.text)).encode()
        return json.dumps(doc).encode()

    def request_headers(self) -> dict[str, str]:
        return {"content-type": "application/json", **self.headers}


@dataclass
class StreamParse:
    """Accumulates a server-sent-event stream of OpenAI chunks."""

    buffer: bytes = b""
    chunks_with_text: int = 0
    usage_tokens: int | None = None
    done: bool = False

    def feed(self, data: bytes) -> int:
        """Consume bytes; return how many new content-bearing chunks (tokens) arrived."""
        self.buffer += data
        tokens = 0
        while b"\n\n" in self.buffer:
            event, self.buffer = self.buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if sse.is_done(line):
                    self.done = True
                    continue
                doc = sse.data(line)
                if doc is None:
                    continue
                usage = sse.completion_tokens(doc)
                if usage is not None:
                    self.usage_tokens = usage
                tokens += len(sse.pieces(doc))
        self.chunks_with_text += tokens
        return tokens

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks_with_text

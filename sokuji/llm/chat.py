"""Chat messages -> prompt text, through the model's own Jinja chat template (from the GGUF),
rendered in Jinja's sandbox as Hugging Face and llama.cpp do."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sokuji.errors import InvalidInput

ROLES = ("system", "user", "assistant", "developer", "tool")

# A plain ChatML template for GGUF files that carry none.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _raise(message: str) -> None:
    raise InvalidInput(f"chat template: {message}", param="messages")


class ChatTemplate:
    def __init__(self, source: str | None, bos: str, eos: str) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source or CHATML)
        self.bos, self.eos = bos, eos

    def render(self, messages: list[dict[str, str]]) -> str:
        return self.template.render(messages=messages, add_generation_prompt=True,
                                    bos_token=self.bos, eos_token=self.eos)


def validate_messages(raw: Any) -> list[dict[str, str]]:
    """OpenAI chat messages -> [{role, content}] with text content; 400 on anything else."""
    if not isinstance(raw, list) or not raw:
        raise InvalidInput("'messages' must be a non-empty list of {role, content} objects",
                           param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidInput(f"{where} must be an object with 'role' and 'content'",
                               param=where)
        role = m.get("role")
        if role not in ROLES:
            raise InvalidInput(f"{where}.role {role!r} is not one of: {', '.join(ROLES)}",
                               param=f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise InvalidInput(f"{where}.content: only text parts are supported",
                                       param=f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise InvalidInput(f"{where}.content must be a string or a list of text parts",
                               param=f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out

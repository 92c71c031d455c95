"""Chat messages -> prompt text, through the model's own Jinja chat template (from the GGUF),
rendered in Jinja's sandbox as Hugging Face and llama.cpp do."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from sokuji.errors import InvalidInput

if TYPE_CHECKING:
    from sokuji.llm.tools import ToolSpec

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
        from sokuji.llm.tools import HERMES, template_knows_tools

        self.native_tools = template_knows_tools(source)
        """The template renders ``tools``, calls and results itself, in the format served."""
        self.tool_format = HERMES

    def render(self, messages: list[dict[str, Any]], tools: ToolSpec | None = None) -> str:
        """The prompt. With ``tools`` (or tool calls / results in ``messages``), through the
        template's own tool format where it has one (``tools=`` as Hugging Face passes it),
        otherwise the fallback of ``sokuji.llm.tools.prepare_messages``; a chat without either
        renders exactly as before."""
        if tools is None:
            from sokuji.llm.tools import has_tool_messages

            if not has_tool_messages(messages):
                return self.template.render(messages=messages, add_generation_prompt=True,
                                            bos_token=self.bos, eos_token=self.eos)
        from sokuji.llm.tools import prepare_messages

        messages, listed = prepare_messages(messages, tools, self.native_tools,
                                            self.tool_format)
        extra = {"tools": listed} if listed is not None else {}
        return self.template.render(messages=messages, add_generation_prompt=True,
                                    bos_token=self.bos, eos_token=self.eos, **extra)


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``: [{id, type: function, function: {name,
    arguments}}], ``arguments`` a string (OpenAI's JSON text)."""
    if not isinstance(raw, list):
        raise InvalidInput(f"{where} must be a list of tool calls", param=where)
    out = []
    for j, call in enumerate(raw):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" \
                or not isinstance(call.get("id"), str) or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str):
            raise InvalidInput(f"{at} must be {{id, type: 'function', function: {{name, "
                               "arguments}}}} with string id, name and arguments", param=at)
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def validate_messages(raw: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages -> [{role, content}] with text content; 400 on anything else. An
    assistant message may also carry ``tool_calls`` (kept when non-empty) and a tool message
    ``tool_call_id`` and ``name`` (kept when given): a chat without them gives exactly
    ``{role, content}`` per message."""
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
        item: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                "content": content}
        if role == "assistant" and m.get("tool_calls"):
            item["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise InvalidInput(f"{where}.{key} must be a string",
                                           param=f"{where}.{key}")
                    item[key] = m[key]
        out.append(item)
    return out

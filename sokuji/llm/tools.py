"""OpenAI tool calling for the chat route (issue 28): the request's ``tools``, ``tool_choice``
and ``parallel_tool_calls`` -> a frozen ``ToolSpec``; the grammar the model's output must
follow (llguidance Lark with one ``%json`` per tool); the prompt (the chat template's own
tool format where it has one, otherwise a Hermes-style system block). The output parsed back
into ``content`` + ``tool_calls`` is ``tool_calls.py``'s.

Pure: no HTTP, no runtime; ``jsonschema`` is imported on first use (validation), llguidance
only by ``check_grammar``.

The one output convention served is Hermes' (Hermes 2 Pro, Qwen 2.5, what vLLM's ``hermes``
parser reads)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city":"Paris"}}
    </tool_call>

several calls one after another, separated by a newline. See docs/tools.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from sokuji.core.limits import Limit
from sokuji.errors import InvalidInput

MAX_TOOLS = Limit("max_tools", 128, "tools", "tools offered in one request (OpenAI's cap)")
MAX_TOOLS_BYTES = Limit("max_tools_bytes", 256 * 1024, "bytes",
                        "the request's 'tools' written as compact JSON")
MAX_SCHEMA_DEPTH = 32
"""Nesting depth of one ``parameters`` schema (deeper: 400; bounds the validators' recursion)."""
LIMITS = (MAX_TOOLS, MAX_TOOLS_BYTES)

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("auto", "none", "required")
_TOOL_KEYS = ("type", "function")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any] = field(hash=False)
    """The function's JSON Schema (``NO_PARAMETERS`` when the request gave none); valid against
    its meta-schema. Not to be mutated."""

    def to_openai(self) -> dict[str, Any]:
        """``{"type": "function", "function": {...}}`` as the request spelled it (the form Hugging
        Face chat templates take in ``tools``)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools, validated."""

    tools: tuple[Tool, ...]
    choice: str
    """``auto``, ``none``, ``required``, or ``function`` (one named function: ``forced``)."""
    forced: str | None
    parallel: bool
    """``parallel_tool_calls`` (default true): several calls in one answer."""

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    @property
    def offered(self) -> bool:
        """Whether the prompt lists the tools: always when there are tools (as OpenAI does,
        ``none`` included: the model sees them, and the grammar keeps it from calling)."""
        return bool(self.tools)


def _bad(message: str, param: str) -> InvalidInput:
    return InvalidInput(message, param=param)


def _depth(node: Any, limit: int) -> int:
    """The nesting depth of a JSON value, stopping past ``limit`` (iterative: no recursion)."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        value, d = stack.pop()
        if d > limit:
            return d
        deepest = max(deepest, d)
        if isinstance(value, dict):
            stack.extend((v, d + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, d + 1) for v in value)
    return deepest


def _check_schema(schema: Any, where: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise _bad(f"'{where}' must be a JSON Schema object, got {type(schema).__name__}", where)
    if schema.get("type", "object") != "object":
        raise _bad(f"'{where}' must describe an object (type 'object'), got type "
                   f"{schema.get('type')!r}", where)
    if not isinstance(schema.get("$schema", ""), str):
        raise _bad(f"'{where}.$schema' must be a string (a meta-schema's URI)", where)
    if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise _bad(f"'{where}' nests deeper than {MAX_SCHEMA_DEPTH} levels", where)
    import jsonschema
    from jsonschema.validators import validator_for

    cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if error is not None:
        path = "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in error.path)
        raise _bad(f"'{where}' is not a valid JSON Schema: {error.message}"
                   + (f" (at {path})" if path else ""), where)
    return schema


def _limit(limit: Limit, need: int, param: str) -> None:
    if need > limit.value:
        raise _bad(f"'{param}' has {need} {limit.unit} ({limit.what}); the limit is "
                   f"{limit.key} = {limit.value:g}", param)


def _tool(raw: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(raw, dict):
        raise _bad(f"'{where}' must be an object {{type: 'function', function: {{...}}}}", where)
    for key in raw:
        if key not in _TOOL_KEYS:
            raise _bad(f"'{where}.{key}' is not supported; a tool takes: type, function",
                       f"{where}.{key}")
    if raw.get("type") != "function":
        raise _bad(f"'{where}.type' must be 'function', got {raw.get('type')!r}",
                   f"{where}.type")
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"'{where}.function' must be an object with a name", f"{where}.function")
    for key in fn:
        if key not in _FUNCTION_KEYS:
            raise _bad(f"'{where}.function.{key}' is not supported; a function takes: "
                       f"{', '.join(_FUNCTION_KEYS)}", f"{where}.function.{key}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _bad(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-', "
                   f"got {name!r}", f"{where}.function.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"'{where}.function.description' must be a string",
                   f"{where}.function.description")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"'{where}.function.strict' must be a boolean", f"{where}.function.strict")
    params = fn.get("parameters")
    params = NO_PARAMETERS if params is None else _check_schema(
        params, f"{where}.function.parameters")
    return Tool(name, description, params)


def parse_tools(doc: dict[str, Any]) -> ToolSpec | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``; ``None`` when it
    offers no tools (absent or ``[]``, and ``tool_choice`` absent or ``none``). Each fault is an
    ``InvalidInput`` (400) naming the field: ``tools[2].function.parameters``."""
    raw = doc.get("tools")
    choice_raw = doc.get("tool_choice")
    parallel = doc.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad(f"'parallel_tool_calls' must be a boolean, got {parallel!r}",
                   "parallel_tool_calls")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise _bad("'tools' must be a list of {type: 'function', function: {...}} objects",
                   "tools")
    _limit(MAX_TOOLS, len(raw), "tools")  # before looking at each
    _limit(MAX_TOOLS_BYTES, len(json.dumps(raw, separators=(",", ":"), ensure_ascii=False)
                                .encode()), "tools")
    tools = []
    seen: dict[str, int] = {}
    for i, item in enumerate(raw):
        tool = _tool(item, i)
        if tool.name in seen:
            raise _bad(f"'tools[{i}].function.name' {tool.name!r} is also the name of "
                       f"tools[{seen[tool.name]}]: names must be unique",
                       f"tools[{i}].function.name")
        seen[tool.name] = i
        tools.append(tool)
    forced = None
    if choice_raw is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice_raw, str):
        if choice_raw not in CHOICES:
            raise _bad(f"'tool_choice' {choice_raw!r} is not one of: auto, none, required, or "
                       "{type: 'function', function: {name}}", "tool_choice")
        choice = choice_raw
    elif isinstance(choice_raw, dict):
        fn = choice_raw.get("function")
        if choice_raw.get("type") != "function" or not isinstance(fn, dict) \
                or set(choice_raw) - {"type", "function"} or set(fn) - {"name"}:
            raise _bad("'tool_choice' must be 'auto', 'none', 'required' or "
                       "{type: 'function', function: {name: ...}}", "tool_choice")
        name = fn.get("name")
        if not isinstance(name, str) or name not in seen:
            raise _bad(f"'tool_choice.function.name' {name!r} names no tool in 'tools'",
                       "tool_choice.function.name")
        choice, forced = "function", name
    else:
        raise _bad(f"'tool_choice' must be a string or an object, got {choice_raw!r}",
                   "tool_choice")
    if not tools:
        if choice != "none":
            raise _bad(f"'tool_choice' {choice_raw!r} needs 'tools'", "tool_choice")
        return None
    return ToolSpec(tuple(tools), choice, forced, True if parallel is None else parallel)


# -- the template's convention -------------------------------------------------------------

@dataclass(frozen=True)
class ToolFormat:
    """How calls are written in the model's output, and results in its prompt."""

    name: str
    open: str
    close: str
    result_open: str
    result_close: str

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it (``arguments``: the JSON text)."""
        head = f'{{"name": {json.dumps(name)}, "arguments": '
        return f"{self.open}\n{head}{arguments}}}\n{self.close}"


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "<tool_response>",
                    "</tool_response>")


def template_knows_tools(source: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself *in the format served* (Hermes): it
    reads ``tools`` and writes ``<tool_call>``. Templates with another convention (Llama 3.1's
    bare JSON, Mistral's ``[TOOL_CALLS]``) get the fallback, so that what the prompt asks for is
    what the grammar allows and the parser reads."""
    return bool(source) and re.search(r"\btools\b", source or "") is not None \
        and HERMES.open in (source or "")


def system_block(spec: ToolSpec, fmt: ToolFormat = HERMES) -> str:
    """The fallback's tools prompt (Qwen 2.5's wording, itself Hermes 2 Pro's)."""
    listed = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in spec.tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            f"within {fmt.open}{fmt.close} XML tags:\n"
            f'{fmt.open}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
            f"{fmt.close}")


def has_tool_messages(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def prepare_messages(messages: list[dict[str, Any]], spec: ToolSpec | None, native: bool,
                     fmt: ToolFormat = HERMES
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` to render: ``native`` (the template knows the format): messages with
    ``tool_calls`` (arguments as objects, as Hugging Face templates expect) and ``tools`` in
    OpenAI's form; otherwise plain ``{role, content}`` messages with the calls written out in
    ``fmt``, the results wrapped in ``<tool_response>``, the tools listed in the system message
    (appended to the first one, or a new first one), and ``tools`` None."""
    if native:
        out = []
        for m in messages:
            calls = m.get("tool_calls")
            if calls:
                m = {**m, "tool_calls": [
                    {**c, "function": {**c["function"],
                                       "arguments": _loads(c["function"]["arguments"])}}
                    for c in calls]}
            out.append(m)
        return out, [t.to_openai() for t in spec.tools] if spec and spec.offered else None
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        calls = m.get("tool_calls")
        if calls:
            text = "\n".join(fmt.call_text(c["function"]["name"], _json_text(
                c["function"]["arguments"])) for c in calls)
            content = f"{content}\n{text}" if content else text
        elif role == "tool":
            content = f"{fmt.result_open}\n{content}\n{fmt.result_close}"
        out.append({"role": role, "content": content})
    if spec and spec.offered:
        block = system_block(spec, fmt)
        if out and out[0]["role"] == "system":
            first = out[0]["content"]
            out[0] = {"role": "system", "content": f"{first}\n\n{block}" if first else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _json_text(arguments: str) -> str:
    """The arguments as written when they are JSON, else as a JSON string."""
    try:
        json.loads(arguments)
    except ValueError:
        return json.dumps(arguments)
    return arguments


# -- the constraint ------------------------------------------------------------------------

def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal (llguidance's own StructTag does the same)


def tool_grammar(spec: ToolSpec | None, fmt: ToolFormat = HERMES) -> str | None:
    """The Lark grammar (llguidance dialect) the output must match, or ``None`` (no tools: no
    constraint). Each tool's arguments are a ``%json`` of its ``parameters`` in compact JSON
    (``whitespace_flexible`` off, so a small model cannot loop on whitespace).

    - ``required``: one call, or several separated by newlines if ``parallel``;
    - a named function: exactly one call of it;
    - ``auto``: free text never containing ``<tool_call>``, or text then the call(s): once
      the model writes ``<tool_call>`` it must complete a valid call;
    - ``none``: free text never containing ``<tool_call>`` (the tools are in the prompt, as with
      OpenAI, but cannot be called)."""
    if spec is None:
        return None
    text = ("TEXT: /(.|\\n)*/ & ~/(.|\\n)*" + re.escape(fmt.open).replace("/", "\\/")
            + "(.|\\n)*/")
    lines = ["%llguidance {}"]
    if spec.choice == "none":
        return "\n".join([*lines, "start: TEXT", text]) + "\n"
    tools = [t for t in spec.tools if spec.forced in (None, t.name)]
    for i, t in enumerate(tools):
        schema = {**t.parameters, "x-guidance": {"whitespace_flexible": False}}
        head = f'\n{{"name": {json.dumps(t.name)}, "arguments": '
        lines.append(f"body_{i}: {_lit(head)} %json {json.dumps(schema)} "
                     f"{_lit(chr(125) + chr(10) + fmt.close)}")
    lines.append("body: " + " | ".join(f"body_{i}" for i in range(len(tools))))
    lines.append(f"call: {_lit(fmt.open)} body")
    more = f' ({_lit(chr(10))} call)*' if spec.parallel and spec.choice != "function" else ""
    if spec.choice == "auto":
        lines += [f"start: TEXT | head body{more}", f"head[lazy]: TEXT {_lit(fmt.open)}", text]
    else:
        lines.append(f"start: call{more}")
    return "\n".join(lines) + "\n"


def check_grammar(grammar: str, tokenizer: Any) -> None:
    """Compile ``grammar`` for llguidance's ``tokenizer``; a schema llguidance refuses (an
    unimplemented keyword, a missing ``$ref``) is a 400 on ``tools``."""
    import llguidance

    lark = llguidance.LLMatcher.grammar_from_lark(grammar)
    error = llguidance.LLMatcher.validate_grammar(lark, tokenizer)
    if error and not error.startswith("WARNING"):
        raise _bad(f"'tools': a tool's parameters cannot be enforced: {error}", "tools")

"""MiniMax-M3 tool calls as text: one renderer and one parser shared by training, rollouts and the server.

What: `render_tool_calls(calls) -> str` writes the M3 syntax (every structural tag prefixed by the
`]<]minimax[>[` namespace; `<tool_call>`, `<invoke name="...">`, one element per argument, nested
elements for objects, `<item>` for list entries); `parse_tool_calls(text, tools) -> (content, calls,
errors)` reads it back, typing scalars by the tools' JSON schemas the way vLLM's `minimax_m3` parser
does. `render_plain_chat` extends common/tokenizer.py's plain template with tools and tool results.
Invariants: a malformed call becomes a `ToolCallError`, never an exception; values are raw text
(the format has no escaping), so a string holding the namespace marker cannot be rendered.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.tokenizer import plain_chat_template

NS = "]<]minimax[>["
TOOL_CALL_START = f"{NS}<tool_call>"
TOOL_CALL_END = f"{NS}</tool_call>"  # a model turn that calls tools ends here (a stop string)
INVOKE_START = f"{NS}<invoke name="
INVOKE_END = f"{NS}</invoke>"
TOOLS_START, TOOLS_END = f"{NS}<tools>", f"{NS}</tools>"
RESPONSE_START, RESPONSE_END = f"{NS}<tool_response>", f"{NS}</tool_response>"
MAX_DEPTH = 128  # nesting bound of argument elements (vLLM's too)
_TYPE_ALIASES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
_TYPE_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_openai(self, call_id: str) -> dict[str, Any]:
        args = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": args}}


@dataclass(frozen=True)
class ToolCallError:
    message: str
    name: str | None = None  # the tool's name when the invoke got that far


# ------------------------------------------------------------------ rendering
def _as_call(call: ToolCall | Mapping[str, Any]) -> ToolCall:
    """ToolCall, an OpenAI tool call ({"function": {"name", "arguments": JSON}}) or {"name", "arguments"}."""
    if isinstance(call, ToolCall):
        return call
    fn = call.get("function", call)
    args = fn.get("arguments") or {}
    return ToolCall(fn["name"], json.loads(args) if isinstance(args, str) else dict(args))


def _check_text(text: str, what: str) -> str:
    if NS in text:
        raise ValueError(f"{what} contains the namespace marker {NS!r}, which the M3 format cannot escape")
    return text


def _render_value(value: Any) -> str:
    if isinstance(value, str):
        return _check_text(value, "a string argument")
    if value is None or isinstance(value, bool | int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{value} is not a JSON number")
        return json.dumps(value)
    if isinstance(value, Mapping):
        return "".join(_render_element(str(k), v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return "".join(_render_element("item", v) for v in value)
    raise ValueError(f"cannot render a {type(value).__name__} argument (JSON values only)")


def _render_element(name: str, value: Any) -> str:
    if not name.strip() or name.startswith("/") or ">" in name:
        raise ValueError(f"argument name {name!r} cannot be an element name (empty, '/...' or has '>')")
    _check_text(name, "an argument name")
    return f"{NS}<{name}>{_render_value(value)}{NS}</{name}>"


def render_tool_calls(calls: Sequence[ToolCall | Mapping[str, Any]]) -> str:
    """One `<tool_call>` block holding an `<invoke>` per call; "" for no calls. ValueError for a value
    the format cannot hold (a programming error of the caller, not model output)."""
    if not calls:
        return ""
    parts = [f"{TOOL_CALL_START}\n"]
    for call in map(_as_call, calls):
        if not call.name.strip() or any(c in call.name for c in "\"'>") or NS in call.name:
            raise ValueError(f"tool name {call.name!r} must be non-empty, without quotes, '>' or {NS!r}")
        parts.append(f'{INVOKE_START}"{call.name}">\n')
        parts += [f"{_render_element(k, v)}\n" for k, v in call.arguments.items()]
        parts.append(f"{INVOKE_END}\n")
    parts.append(TOOL_CALL_END)
    return "".join(parts)


def render_call_opening(name: str | None = None) -> str:
    """The text every rendered call block begins with, up to the tool's name (`name` None) or past
    it: what a server appends to the prompt to make the model call a tool (the named one)."""
    if name is None:
        return f"{TOOL_CALL_START}\n{INVOKE_START}"
    if not name.strip() or any(c in name for c in "\"'>") or NS in name:
        raise ValueError(f"tool name {name!r} must be non-empty, without quotes, '>' or {NS!r}")
    return f'{TOOL_CALL_START}\n{INVOKE_START}"{name}">\n'


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools list (OpenAI form: {"type": "function", "function": {...}}), one JSON per line."""
    lines = [json.dumps(t.get("function", t), ensure_ascii=False, separators=(",", ":")) for t in tools]
    return f"{TOOLS_START}\n" + "".join(f"{line}\n" for line in lines) + TOOLS_END


def render_tool_result(content: str) -> str:
    return f"{RESPONSE_START}{content}{RESPONSE_END}"


def render_plain_message(message: Mapping[str, Any]) -> str:
    """One message in the plain template: content (an assistant's tool calls appended, a tool
    result wrapped), then a newline. A chat renders as the concatenation of its messages."""
    content = message.get("content") or ""
    if message.get("role") == "tool":
        return render_tool_result(content) + "\n"
    return content + render_tool_calls(message.get("tool_calls") or ()) + "\n"


def render_plain_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> str:
    """plain_chat_template's text with the tools list first (when any) and tool calls / results;
    byte-identical to plain_chat_template for a chat without tools."""
    if not tools and not any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        return plain_chat_template(messages)
    head = render_tools(tools) + "\n" if tools else ""
    return head + "".join(render_plain_message(m) for m in messages)


# ------------------------------------------------------------------ parsing
class _Malformed(Exception):
    """Internal: unwinds one invoke's parse; always caught and turned into a ToolCallError."""


# An element's value: its text, or its (name, value) children in order.
_Element = str | list[tuple[str, "_Element"]]


def _parse_element(text: str, pos: int, depth: int) -> tuple[str, _Element, int]:
    if depth > MAX_DEPTH:
        raise _Malformed(f"arguments nested deeper than {MAX_DEPTH} elements")
    start = pos + len(NS) + 1
    end = text.find(">", start)
    name = text[start:end] if end >= 0 else ""
    if end < 0 or not name.strip() or name.startswith("/"):
        raise _Malformed(f"bad element tag at offset {pos}: {text[pos : pos + 40]!r}")
    close, pos = f"{NS}</{name}>", end + 1
    texts: list[str] = []
    children: list[tuple[str, _Element]] = []
    while True:
        marker = text.find(NS, pos)
        if marker < 0:
            raise _Malformed(f"element <{name}> is never closed (expected {close!r})")
        texts.append(text[pos:marker])
        if text.startswith(close, marker):
            pos = marker + len(close)
            break
        if text.startswith(f"{NS}</", marker):
            raise _Malformed(f"element <{name}> closed by {text[marker : marker + 40]!r}")
        child_name, child, pos = _parse_element(text, marker, depth + 1)
        children.append((child_name, child))
    body = "".join(texts)
    if not children:
        return name, body, pos
    if body.strip():  # text mixed with child elements is kept under a reserved key, as vLLM does
        key = "$text"
        while any(n == key for n, _ in children):
            key = "$" + key
        children.append((key, body))
    return name, children, pos


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    declared = schema.get("type")
    types.update(
        [declared] if isinstance(declared, str) else [t for t in declared or () if isinstance(t, str)]
    )
    for v in schema.get("enum") or ():
        types.add(
            {type(None): "null", bool: "boolean", int: "integer", float: "number"}.get(type(v), "string")
        )
    for key in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(key) or ():
            types |= _schema_types(choice)
    return {_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types} or {"string"}


def _container(schema: Any) -> tuple[str, dict] | None:
    """("array" | "object", the sub-schema) of the first container alternative of `schema`."""
    if not isinstance(schema, dict):
        return None
    declared = schema.get("type")
    for kind in ("array", "object"):
        if declared == kind or (isinstance(declared, list) and kind in declared):
            return kind, schema
    if declared is None and "items" in schema:
        return "array", schema
    if declared is None and ("properties" in schema or "additionalProperties" in schema):
        return "object", schema
    for key in ("anyOf", "oneOf"):
        for choice in schema.get(key) or ():
            if found := _container(choice):
                return found
    return None


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(map(_finite, value))
    if isinstance(value, dict):
        return all(map(_finite, value.values()))
    return True


def _coerce(text: str, types: set[str]) -> Any:
    """A scalar's text typed by its schema: the first type (in vLLM's priority order) it parses as."""
    for kind in _TYPE_PRIORITY:
        if kind not in types:
            continue
        if kind == "string":
            return text
        if kind == "null" and text.lower() == "null":
            return None
        if kind == "integer":
            try:
                return int(text)
            except ValueError:
                continue
        if kind == "number":
            try:
                x = float(text)
            except ValueError:
                continue
            if math.isfinite(x):
                return int(x) if x == int(x) else x
        if kind == "boolean" and text.strip().lower() in ("true", "1", "false", "0"):
            return text.strip().lower() in ("true", "1")
        if kind in ("object", "array"):
            try:
                value = json.loads(text)
            except ValueError:
                continue
            if _finite(value):
                return value
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if _finite(value) else text


def _convert(value: _Element, schema: Any) -> Any:
    schema = schema if isinstance(schema, dict) else None
    box = _container(schema)
    if isinstance(value, str):
        if schema is None:
            return value
        types = _schema_types(schema)
        if box is not None and "string" not in types and not value.strip():  # an empty list / dict
            return [] if box[0] == "array" else {}
        return _coerce(value, types)
    if box is not None and box[0] == "array":
        return [_convert(child, box[1].get("items")) for _, child in value]
    return _convert_object(value, box[1] if box is not None else None)


def _convert_object(elements: list[tuple[str, _Element]], schema: dict | None) -> dict[str, Any]:
    """Named elements -> a dict; a name repeated collects its values into a list."""
    props = (schema or {}).get("properties") or {}
    extra = (schema or {}).get("additionalProperties")
    out: dict[str, Any] = {}
    repeated: set[str] = set()
    for name, element in elements:
        value = _convert(element, props.get(name, extra))
        if name not in out:
            out[name] = value
        elif name in repeated:
            out[name].append(value)
        else:
            out[name], repeated = [out[name], value], repeated | {name}
    return out


def _tool_properties(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict]:
    table = {}
    for t in tools:
        fn = t.get("function", t)
        table[fn["name"]] = (fn.get("parameters") or {}).get("properties") or {}
    return table


def _parse_invoke(text: str, pos: int) -> tuple[str, list[tuple[str, _Element]], int]:
    """The invoke at `pos` (`NS<invoke name=`): its name, argument elements and the end offset."""
    pos += len(INVOKE_START)
    quote = text[pos] if text[pos : pos + 1] in ('"', "'") else ""
    pos += len(quote)
    end = text.find(f"{quote}>", pos)
    name = text[pos:end].strip() if end >= 0 else ""
    if not name or NS in name:
        raise _Malformed(f"bad invoke tag: {text[pos - len(INVOKE_START) : pos + 40]!r}")
    pos = end + len(quote) + 1
    params: list[tuple[str, _Element]] = []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if text.startswith(INVOKE_END, pos):
            return name, params, pos + len(INVOKE_END)
        if not text.startswith(NS, pos) or text.startswith(f"{NS}</", pos):
            what = repr(text[pos : pos + 40]) if pos < len(text) else "the end of the text"
            raise _Malformed(f"invoke {name!r}: expected an argument element or {INVOKE_END!r}, got {what}")
        try:
            arg, value, pos = _parse_element(text, pos, depth=1)
        except _Malformed as e:
            raise _Malformed(f"invoke {name!r}: {e}") from None
        params.append((arg, value))


def parse_tool_calls(
    text: str, tools: Sequence[Mapping[str, Any]] = ()
) -> tuple[str, list[ToolCall], list[ToolCallError]]:
    """(content before the first `<tool_call>`, the calls, an error per malformed piece).

    Scalars are typed by the named tool's parameter schema in `tools` (OpenAI form) and stay
    strings without one, as in vLLM. Text after the last `</tool_call>` is ignored (M3 ends its
    message there). Never raises on model output."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        errors = (
            [ToolCallError(f"{INVOKE_START!r} outside a {TOOL_CALL_START!r} block")]
            if INVOKE_START in text
            else []
        )
        return text, [], errors
    props = _tool_properties(tools)
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    pos, in_block = start + len(TOOL_CALL_START), True
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
        elif text.startswith(TOOL_CALL_END, pos):
            pos, in_block = pos + len(TOOL_CALL_END), False
        elif text.startswith(TOOL_CALL_START, pos):
            pos, in_block = pos + len(TOOL_CALL_START), True
        elif in_block and text.startswith(INVOKE_START, pos):
            try:
                name, params, pos = _parse_invoke(text, pos)
                calls.append(ToolCall(name, _convert_object(params, {"properties": props.get(name, {})})))
            except _Malformed as e:
                errors.append(ToolCallError(str(e)))
                resync = text.find(INVOKE_END, pos + 1)
                pos = len(text) if resync < 0 else resync + len(INVOKE_END)
        elif in_block:
            nxt = text.find(NS, pos + 1)  # past this marker: a tag it does not begin must not stall
            errors.append(
                ToolCallError(f"unexpected text inside the tool-call block: {text[pos : pos + 40]!r}")
            )
            pos = len(text) if nxt < 0 else nxt
        else:
            break  # text after the block ends the message
    if in_block:
        errors.append(ToolCallError(f"the tool-call block is never closed (expected {TOOL_CALL_END!r})"))
    return text[:start], calls, errors

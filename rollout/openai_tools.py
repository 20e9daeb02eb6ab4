"""OpenAI tool calling on the server: checks of `tools`, `tool_choice` and tool messages, the rule
that turns a sample's text into a reply, and the assembler of a streamed reply.

Why here: the server must render tools and parse calls exactly as training does, so the text work is
common/tool_calls.py's alone; this module holds only the wire protocol around it (each check a 400
naming the field and the fix, as rollout/openai_api.py's admission checks are).
`tool_choice` (vLLM's rules: default "auto" with tools, "none" without): "none" renders the tools
and parses nothing; "auto" parses; "required" and a named function append the opening of a call
(common/tool_calls.render_call_opening) to the prompt, so the model's turn is a call (of that
function): a prefix the model would write itself, not a grammar, so its arguments are the model's
and may be malformed.
Invariants: a reply's tool calls are `reply_for(opening + text)`, streamed or not (a stream sends
its calls when the sample ends, so its deltas concatenate to the non-streamed reply); a malformed
call comes back as plain content (finish_reason the engine's); a tool schema reaching the parser
has the shape it reads, so parsing model output never raises.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from common.tool_calls import (
    MAX_DEPTH,
    TOOL_CALL_END,
    TOOL_CALL_START,
    parse_tool_calls,
    render_call_opening,
    render_tool_calls,
)
from rollout.openai_api import OpenAIError, check_text

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names, and '.'
MAX_SCHEMA_DEPTH = 64  # nesting of a parameter schema (the parser recurses over it)
_TOOL_SHAPE = "{'type': 'function', 'function': {'name': str, 'parameters': {JSON Schema}}}"
_CHOICE_SHAPE = "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': str}}"


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request asks of tool calling (`check_tools`)."""

    tools: tuple[dict[str, Any], ...] = ()  # as the client sent them: rendered into the prompt
    choice: Literal["none", "auto", "required", "named"] = "none"
    name: str | None = None  # the function of a named choice
    parallel: bool = True  # False: only the first call of a turn is returned

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    @property
    def opening(self) -> str:
        """Text appended to the prompt: the start of the model's call ("" unless forced)."""
        if self.choice == "required":
            return render_call_opening()
        return render_call_opening(self.name) if self.choice == "named" else ""

    @property
    def kept_stops(self) -> tuple[str, ...]:
        """A turn that calls tools ends at the block's end (as a multi-turn rollout's turn does)."""
        return (TOOL_CALL_END,) if self.parses else ()


NO_TOOLS = ToolPlan()


# ------------------------------------------------------------------ admission
def _bad(message: str) -> OpenAIError:
    return OpenAIError(400, message)


def _check_schema(schema: Any, where: str, depth: int = 0) -> None:
    """The JSON Schema keys the parser reads have the types it reads them as."""
    if not isinstance(schema, dict):
        raise _bad(f"{where} must be a JSON Schema object, got {type(schema).__name__}")
    if depth > MAX_SCHEMA_DEPTH:
        raise _bad(f"{where}: the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
    kind = schema.get("type")
    if kind is not None and not (
        isinstance(kind, str) or (isinstance(kind, list) and all(isinstance(k, str) for k in kind))
    ):
        raise _bad(f"{where}.type must be a type name or a list of type names, e.g. 'integer'")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise _bad(f"{where}.enum must be a list of values")
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            if not isinstance(schema[key], list):
                raise _bad(f"{where}.{key} must be a list of schemas")
            for j, sub in enumerate(schema[key]):
                _check_schema(sub, f"{where}.{key}[{j}]", depth + 1)
    if "properties" in schema:
        if not isinstance(schema["properties"], dict):
            raise _bad(f"{where}.properties must be an object of {{name: schema}}")
        for name, sub in schema["properties"].items():
            _check_schema(sub, f"{where}.properties.{name}", depth + 1)
    extra = schema.get("additionalProperties")
    if extra is not None and not isinstance(extra, bool):
        _check_schema(extra, f"{where}.additionalProperties", depth + 1)
    items = schema.get("items")
    for j, sub in enumerate(items if isinstance(items, list) else [] if items is None else [items]):
        _check_schema(sub, f"{where}.items" + (f"[{j}]" if isinstance(items, list) else ""), depth + 1)


def _check_tool(i: int, tool: Any) -> str:
    """One entry of `tools`; its function's name."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise _bad(f"{where} must be {_TOOL_SHAPE} (only function tools are served)")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{where}.function is missing or not an object: send {_TOOL_SHAPE}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise _bad(f"{where}.function.name must be 1-64 characters of letters, digits, '_', '.' or '-'")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _bad(f"{where}.function.description must be a string")
    if fn.get("parameters") is not None:
        _check_schema(fn["parameters"], f"{where}.function.parameters")
    return name


def check_tools(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan:
    """The request's ToolPlan, or a 400 naming `tools` / `tool_choice` and the fix."""
    if tools is None:
        if tool_choice in (None, "none"):
            return NO_TOOLS
        raise _bad(f"tool_choice {tool_choice!r} needs tools: send `tools` (a list of functions) or drop it")
    if not isinstance(tools, list) or not tools:
        raise _bad(f"tools must be a non-empty list of {_TOOL_SHAPE}; omit it for a chat without tools")
    names = [_check_tool(i, t) for i, t in enumerate(tools)]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise _bad(f"tools: function names must be unique, {twice} appear more than once")
    check_text("tools", json.dumps(tools, ensure_ascii=False))
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return ToolPlan(tuple(tools), tool_choice or "auto", None, parallel)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or tool_choice.get("type", "function") != "function":
        raise _bad(f"tool_choice must be {_CHOICE_SHAPE}, got {json.dumps(tool_choice)[:200]}")
    if fn.get("name") not in names:
        raise _bad(f"tool_choice.function.name {fn.get('name')!r} is not one of the tools: {names}")
    return ToolPlan(tuple(tools), "named", fn["name"], parallel)


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion (a hostile value may be deep)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        deepest = max(deepest, d)
        if isinstance(v, dict | list) and d <= MAX_DEPTH:
            todo += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest


def _check_calls(i: int, calls: Any) -> set[str]:
    """An assistant message's `tool_calls` (OpenAI form, arguments a JSON object's text); their ids."""
    where = f"messages[{i}].tool_calls"
    shape = "{'id': str, 'type': 'function', 'function': {'name': str, 'arguments': JSON object text}}"
    if not isinstance(calls, list) or not calls:
        raise _bad(f"{where} must be a non-empty list of {shape}")
    ids: set[str] = set()
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise _bad(f"{where}[{j}] must be {shape}")
        cid, name, args = call.get("id"), fn.get("name"), fn.get("arguments")
        if not isinstance(cid, str) or not cid or cid in ids:
            raise _bad(f"{where}[{j}].id must be a non-empty string, unique in the message")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise _bad(
                f"{where}[{j}].function.name must be 1-64 characters of letters, digits, '_', '.', '-'"
            )
        if not isinstance(args, str):
            raise _bad(f"{where}[{j}].function.arguments must be a string holding a JSON object")
        check_text(f"{where}[{j}].function.arguments", args)
        try:
            value = json.loads(args or "{}")
        except ValueError as e:
            raise _bad(f"{where}[{j}].function.arguments is not valid JSON ({e})") from None
        except RecursionError:  # nested beyond the decoder's stack
            value = None
        if value is None or _depth(value) > MAX_DEPTH:
            raise _bad(f"{where}[{j}].function.arguments: nested deeper than {MAX_DEPTH} levels")
        if not isinstance(value, dict):
            raise _bad(f"{where}[{j}].function.arguments must be a JSON object, got {type(value).__name__}")
        ids.add(cid)
    try:  # what the model's format cannot hold (the namespace marker in a value, a bad key)
        render_tool_calls(calls)
    except ValueError as e:
        raise _bad(f"{where}: {e}") from None
    return ids


def check_tool_messages(messages: list[dict[str, Any]]) -> bool:
    """400 unless every `tool_calls` is well formed and every `role: "tool"` message answers a call
    of the assistant message before it (other tool results between); whether any tool turn is there."""
    open_ids: set[str] | None = None  # the last assistant message's call ids, while results follow
    seen = False
    for i, m in enumerate(messages):
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise _bad(f"messages[{i}].tool_calls: only assistant messages carry tool calls")
            open_ids, seen = _check_calls(i, m["tool_calls"]), True
        elif m["role"] == "tool":
            if open_ids is None:
                raise _bad(
                    f"messages[{i}]: a 'tool' message must follow an assistant message with tool_calls "
                    "(or another tool message answering it)"
                )
            if m.get("tool_call_id") not in open_ids:
                raise _bad(
                    f"messages[{i}].tool_call_id must name a call of the assistant message before it: "
                    f"one of {sorted(open_ids)}"
                )
            seen = True
        else:
            open_ids = None
    return seen


# ------------------------------------------------------------------ replies
@dataclass(frozen=True)
class ToolReply:
    """One choice's message as the reply shows it."""

    content: str | None
    finish_reason: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI form, with ids


def reply_for(text: str, finish_reason: str, plan: ToolPlan) -> ToolReply:
    """The reply for a sample's whole text (`plan.opening` + what the model wrote)."""
    if not plan.parses:
        return ToolReply(text, finish_reason)
    content, calls, errors = parse_tool_calls(text, plan.tools)
    if errors or not calls:  # no call, or a malformed one: the text as the model wrote it
        return ToolReply(text, finish_reason)
    calls = calls if plan.parallel else calls[:1]
    # OpenAI: "tool_calls" when the model chose to call; a named (forced) call finishes as "stop".
    reason = "stop" if plan.choice == "named" else "tool_calls"
    return ToolReply(content or None, reason, [c.to_openai(f"call_{uuid.uuid4().hex[:24]}") for c in calls])


def _opening_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (it may still become the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallStream:
    """One streamed choice: `feed(delta)` returns the content that can go out now (the text before the
    first `<tool_call>`, less an end that may begin one); `finish(reason)` the rest of the content
    and the reply, from `reply_for` on the whole text."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.text, self.sent = plan, plan.opening, 0
        self._start = -1  # where the first block starts, once seen
        self._scanned = 0  # the text before this offset holds no block start

    def feed(self, delta: str) -> str:
        self.text += delta
        if not self.plan.parses:
            safe = len(self.text)
        else:
            if self._start < 0:  # search only the new text (and a marker straddling its start)
                self._start = self.text.find(TOOL_CALL_START, self._scanned)
                self._scanned = max(0, len(self.text) - len(TOOL_CALL_START) + 1)
            safe = self._start
            if safe < 0:
                safe = len(self.text) - _opening_tail(self.text, TOOL_CALL_START)
        out = self.text[self.sent : max(safe, self.sent)]
        self.sent += len(out)
        return out

    def finish(self, finish_reason: str) -> tuple[str, ToolReply]:
        # The content sent is text before the first block: a prefix of the reply's content, which
        # is that text (calls parsed) or all of it (none, or malformed).
        reply = reply_for(self.text, finish_reason, self.plan)
        return (reply.content or "")[self.sent :], reply

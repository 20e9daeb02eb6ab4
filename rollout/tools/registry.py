"""Tools by name: a name, a JSON schema for its arguments and a function; `@tool` registers one.

Why: a new tool task is a few lines, and every call is checked against the schema before it runs.
Supported schema subset: type (string, integer, number, boolean, null, array, object; or a list of
them), properties, required, additionalProperties: false, items, enum. Invariant: `call` never
raises; a bad call or a failing tool returns its error message as the result text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_PY_TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
    "array": list,
    "object": dict,
}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of type object
    fn: Callable[..., str]

    def to_openai(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


def validate(value: Any, schema: Mapping[str, Any], where: str = "arguments") -> str | None:
    """The first violation of `schema` by `value` as a message, or None."""
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        is_bool = isinstance(value, bool)
        if not any(isinstance(value, _PY_TYPES[t]) and (t == "boolean" or not is_bool) for t in names):
            return f"{where} must be {' or '.join(names)}, got {type(value).__name__} {value!r:.60}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {schema['enum']}, got {value!r:.60}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                return f"{where}: missing required argument {key!r}"
        for key, v in value.items():
            if key in props:
                if err := validate(v, props[key], f"{where}.{key}" if where != "arguments" else key):
                    return err
            elif schema.get("additionalProperties") is False:
                return f"{where}: unknown argument {key!r} (expected {sorted(props)})"
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            if err := validate(v, schema["items"], f"{where}[{i}]"):
                return err
    return None


class Registry:
    def __init__(self):
        self.tools: dict[str, Tool] = {}

    def add(self, t: Tool) -> Tool:
        if t.name in self.tools:
            raise ValueError(f"tool {t.name!r} is already registered")
        self.tools[t.name] = t
        return t

    def openai_tools(self, names: list[str] | None = None) -> list[dict[str, Any]]:
        return [self.tools[n].to_openai() for n in (names or sorted(self.tools))]

    def call(self, name: str, arguments: Mapping[str, Any]) -> tuple[str, bool]:
        """(result text, is_error). Never raises."""
        t = self.tools.get(name)
        if t is None:
            return f"error: unknown tool {name!r} (available: {', '.join(sorted(self.tools))})", True
        if err := validate(dict(arguments), t.parameters):
            return f"error: {name}: {err}", True
        try:
            return str(t.fn(**arguments)), False
        except Exception as e:  # a tool's own failure is the model's feedback, not the caller's crash
            return f"error: {name}: {type(e).__name__}: {e}", True


REGISTRY = Registry()


def tool(name: str, description: str, parameters: dict[str, Any], registry: Registry = REGISTRY):
    """Decorator: register `fn(**arguments) -> str` as a tool in `registry`."""

    def wrap(fn: Callable[..., str]) -> Callable[..., str]:
        registry.add(Tool(name, description, parameters, fn))
        return fn

    return wrap

"""Multi-turn environments: `reset(row) -> messages`, `step(text) -> (replies, reward, done, info)`.

`ToolEnv`: each assistant turn is parsed with common/tool_calls.py; its calls run through the
registry and come back as `role: "tool"` messages (a malformed call or a failing tool is an error
message, never an exception); a turn without calls is the final answer, scored by `score_math_dapo`.
Invariants: at most `max_turns` assistant turns and `max_calls_per_turn` calls run per turn; the
reward is 0 until the episode ends (one reward per trajectory).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.scoring import score_math_dapo
from common.tool_calls import parse_tool_calls
from rollout.tools.registry import REGISTRY, Registry

Message = dict[str, Any]


class Environment(Protocol):
    def reset(self, row: Mapping[str, Any]) -> list[Message]: ...

    def step(self, assistant_text: str) -> tuple[list[Message], float, bool, dict[str, Any]]: ...


@dataclass
class ToolEnv:
    tool_names: list[str]
    registry: Registry = REGISTRY
    max_turns: int = 4
    max_calls_per_turn: int = 4
    system_prompt: str = ""
    turns: int = field(default=0, init=False)
    truth: str = field(default="", init=False)

    def __post_init__(self):
        missing = [n for n in self.tool_names if n not in self.registry.tools]
        if missing:
            raise ValueError(f"unknown tools {missing}; registered: {sorted(self.registry.tools)}")
        if self.max_turns < 1 or self.max_calls_per_turn < 1:
            raise ValueError("max_turns and max_calls_per_turn must be >= 1")

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.registry.openai_tools(self.tool_names)

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """row: {"prompt": str, "answer": str} -> the first messages."""
        self.turns, self.truth = 0, str(row["answer"])
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*head, {"role": "user", "content": row["prompt"]}]

    def step(self, assistant_text: str) -> tuple[list[Message], float, bool, dict[str, Any]]:
        self.turns += 1
        content, calls, errors = parse_tool_calls(assistant_text, self.tools)
        info: dict[str, Any] = {"tool_calls": len(calls), "tool_errors": len(errors),
                                "malformed": len(errors), "turn": self.turns}  # fmt: skip
        if not calls and not errors:  # the final answer
            return [], score_math_dapo(content, self.truth)["score"], True, info
        if self.turns >= self.max_turns:
            info["truncated"] = "max_turns"
            return [], score_math_dapo(content, self.truth)["score"], True, info
        replies = [{"role": "tool", "content": f"error: malformed tool call: {e.message}"} for e in errors]
        for i, call in enumerate(calls):
            if i >= self.max_calls_per_turn:
                replies.append(
                    {
                        "role": "tool",
                        "content": f"error: more than {self.max_calls_per_turn} calls in one turn",
                    }
                )
                info["tool_errors"] += len(calls) - i
                break
            if call.name not in self.tool_names:
                text, is_error = f"error: tool {call.name!r} is not available here", True
            else:
                text, is_error = self.registry.call(call.name, call.arguments)
            info["tool_errors"] += is_error
            replies.append({"role": "tool", "name": call.name, "content": text})
        return replies, 0.0, False, info

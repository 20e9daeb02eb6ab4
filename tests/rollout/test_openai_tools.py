"""rollout/openai_tools.py: a streamed reply, fed in any split of its text, sends the same content
and tool calls as the non-streamed reply; no text of a tool-call block goes out as content first."""

from __future__ import annotations

import random

import pytest

from common.tool_calls import NS, TOOL_CALL_START, ToolCall, render_tool_calls
from rollout.openai_tools import ToolCallStream, check_tools, reply_for

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]  # fmt: skip
CALL = render_tool_calls([ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 1, "b": 1})])
TEXTS = [
    "plain words only",
    "Let me add.\n" + CALL,
    CALL,
    "almost a marker at the end ]<]mini",
    f"{NS} a marker alone, then {NS}<tool_cal",
    "cut inside " + CALL[:60],
    f'bad {NS}<tool_call>\n{NS}<invoke name="add">\n{NS}<a>1{NS}</b>\n{NS}</invoke>\n{NS}</tool_call>',
    "",
]
CHOICES = ["auto", "none", "required", {"type": "function", "function": {"name": "add"}}]


def _stream(text: str, plan, cuts: list[int]):
    """(content before the end, content at the end, the final reply) of `text` fed in pieces."""
    stream = ToolCallStream(plan)
    early = "".join(stream.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)]))
    rest, reply = stream.finish("stop")
    return early, rest, reply


@pytest.mark.parametrize("choice", CHOICES, ids=str)
@pytest.mark.parametrize("text", TEXTS)
def test_any_split_streams_the_non_streamed_reply(text, choice):
    plan = check_tools(TOOLS, choice, None)
    whole = reply_for(plan.opening + text, "stop", plan)
    rng = random.Random(len(text))
    splits = [[], list(range(1, len(text)))] + [
        sorted(rng.sample(range(1, len(text)), min(len(text) - 1, k))) for k in (1, 3, 9) if len(text) > 1
    ]
    for cuts in splits:
        early, rest, reply = _stream(text, plan, cuts)
        assert early + rest == (whole.content or "")
        assert [c["function"] for c in reply.tool_calls] == [c["function"] for c in whole.tool_calls]
        assert reply.finish_reason == whole.finish_reason
        if plan.parses:  # nothing of a block (or of what may begin one) went out before the end
            full = plan.opening + text
            start = full.find(TOOL_CALL_START)
            assert early == full[: len(early)] and (start < 0 or len(early) <= start)


def test_the_reply_rule_for_calls_malformed_calls_and_no_parsing():
    auto, none = check_tools(TOOLS, None, None), check_tools(TOOLS, "none", None)
    named = check_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, False)
    ok = reply_for("Let me add.\n" + CALL, "stop", auto)
    assert ok.content == "Let me add.\n" and ok.finish_reason == "tool_calls"
    assert [c["function"]["arguments"] for c in ok.tool_calls] == ['{"a": 2, "b": 3}', '{"a": 1, "b": 1}']
    assert reply_for(CALL, "stop", named).finish_reason == "stop"
    assert len(reply_for(CALL, "stop", named).tool_calls) == 1  # parallel_tool_calls=False
    assert reply_for(CALL, "stop", none) == type(ok)(CALL, "stop")
    cut = reply_for(CALL[:-5], "length", auto)
    assert (cut.content, cut.tool_calls, cut.finish_reason) == (CALL[:-5], [], "length")

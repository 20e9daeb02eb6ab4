"""rollout/tools/env.py: ToolEnv episodes with the real calculator and the DAPO scorer."""

import rollout.tools.calculator  # noqa: F401  (registers the calculator)
from common.tool_calls import NS, TOOL_CALL_END, TOOL_CALL_START, ToolCall, render_tool_calls
from rollout.tools.env import ToolEnv

ROW = {"prompt": "What is 123*45?", "answer": "5535"}


def test_a_correct_call_then_the_answer_scores_one():
    env = ToolEnv(["calculator"])
    assert env.reset(ROW)[-1] == {"role": "user", "content": ROW["prompt"]}
    reply, reward, done, info = env.step(
        render_tool_calls([ToolCall("calculator", {"expression": "123*45"})])
    )
    assert reply == [{"role": "tool", "name": "calculator", "content": "5535"}] and not done and reward == 0
    assert info["tool_calls"] == 1 and info["tool_errors"] == 0
    reply, reward, done, _ = env.step("Answer: 5535")
    assert done and reward == 1.0 and reply == []


def test_a_malformed_call_gets_an_error_message_from_the_environment():
    env = ToolEnv(["calculator"])
    env.reset(ROW)
    invoke = f'{NS}<invoke name="calculator">{NS}<expression>1+{NS}</x>{NS}</invoke>'
    reply, _, done, info = env.step(f"{TOOL_CALL_START}\n{invoke}\n{TOOL_CALL_END}")
    assert not done and info["tool_errors"] == 1 and reply[0]["role"] == "tool"
    assert reply[0]["content"].startswith("error: malformed tool call") and "closed by" in reply[0]["content"]
    reply, _, _, info = env.step(render_tool_calls([ToolCall("calculator", {"expression": "1/0"})]))
    assert "division by zero" in reply[0]["content"] and info["tool_errors"] == 1


def test_the_turn_limit_ends_the_episode():
    env = ToolEnv(["calculator"], max_turns=2)
    env.reset(ROW)
    call = render_tool_calls([ToolCall("calculator", {"expression": "1+1"})])
    assert env.step(call)[2] is False
    _, reward, done, info = env.step(call)
    assert done and reward == -1.0 and info["truncated"] == "max_turns"

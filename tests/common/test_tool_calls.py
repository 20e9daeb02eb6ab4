"""common/tool_calls.py: round trips, agreement with vLLM's own minimax_m3 parser, malformed input."""

import json

import pytest

from common.tokenizer import plain_chat_template
from common.tool_calls import (
    NS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    ToolCall,
    parse_tool_calls,
    render_plain_chat,
    render_tool_calls,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "s": {"type": "string"},
        "i": {"type": "integer"},
        "x": {"type": "number"},
        "b": {"type": "boolean"},
        "n": {"type": ["null", "string"]},
        "obj": {"type": "object", "properties": {"k": {"type": "integer"}, "t": {"type": "string"}}},
        "lst": {"type": "array", "items": {"type": "number"}},
        "nested": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
        "objs": {"type": "array", "items": {"type": "object", "properties": {"v": {"type": "integer"}}}},
        "empty_l": {"type": "array", "items": {"type": "integer"}},
        "empty_o": {"type": "object"},
    },
}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": SCHEMA}} for n in ("f", "g")]
CASES = [
    {},
    {"s": "plain"},
    {"s": '<b>bold</b> & <invoke name="x"> \'q\' "dq" </tool_call>'},
    {"s": "  leading and trailing\nnewlines\n"},
    {"s": ""},
    {"s": "42"},
    {"s": "héllo 世界 🙂"},
    {"i": 42, "x": -3.25, "b": True},
    {"i": -(10**20), "b": False, "n": None},
    {"obj": {"k": 7, "t": "seven"}},
    {"lst": [1.5, 2, -0.125]},
    {"nested": [["a", "b"], [], ["<c>"]]},
    {"objs": [{"v": 1}, {"v": 2}]},
    {"empty_l": [], "empty_o": {}},
    {"s": "x", "i": 1, "obj": {"k": 0}, "lst": [0]},
]


@pytest.mark.parametrize("args", CASES)
def test_render_then_parse_round_trips(args):
    calls = [ToolCall("f", args), ToolCall("g", {"s": "second"})]
    text = "thinking <i>aloud</i>\n" + render_tool_calls(calls)
    content, parsed, errors = parse_tool_calls(text, TOOLS)
    assert errors == []
    assert content == "thinking <i>aloud</i>\n"
    assert parsed == calls


def test_without_a_schema_scalars_stay_strings():
    _, calls, errors = parse_tool_calls(render_tool_calls([ToolCall("h", {"a": 3})]))
    assert errors == [] and calls == [ToolCall("h", {"a": "3"})]


def test_rendered_calls_parse_the_same_with_vllms_minimax_m3_parser():
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers.minimax_m3_tool_parser import MinimaxM3ToolParser
    except ImportError as e:
        pytest.skip(f"vllm is not importable: {e}")

    class NoVocab:  # the parser reads text only; it asks the tokenizer for a vocabulary of markers
        def get_vocab(self):
            return {}

    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], model="m", tools=TOOLS)
    for args in CASES:
        calls = [ToolCall("f", args), ToolCall("g", {"i": 5})]
        text = "content " + render_tool_calls(calls)
        got = MinimaxM3ToolParser(NoVocab(), request.tools).extract_tool_calls(text, request)
        theirs = [(c.function.name, json.loads(c.function.arguments)) for c in got.tool_calls]
        content, ours, errors = parse_tool_calls(text, TOOLS)
        assert errors == []
        assert theirs == [(c.name, c.arguments) for c in ours] == [(c.name, c.arguments) for c in calls]
        assert got.content == content


@pytest.mark.parametrize(
    "body, expect",
    [
        (f'{NS}<invoke name="f">{NS}<s>x{NS}</invoke>', "closed by"),
        (f'{NS}<invoke name="f">{NS}<s>x{NS}</t>{NS}</invoke>', "closed by"),
        (f'{NS}<invoke name="">{NS}</invoke>', "bad invoke tag"),
        (f'{NS}<invoke name="f">stray text{NS}</invoke>', "expected an argument element"),
        (f'{NS}<invoke name="f">{NS}<>x{NS}</>{NS}</invoke>', "bad element tag"),
        ("just words", "unexpected text"),
        (f'{NS}<invoke name="f">' + f"{NS}<a>" * 200 + "x", "deeper than"),
    ],
)
def test_malformed_calls_become_error_entries(body, expect):
    text = f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"
    _, calls, errors = parse_tool_calls(text, TOOLS)
    assert calls == [] and len(errors) >= 1 and expect in errors[0].message


def test_a_malformed_call_does_not_hide_the_good_ones():
    good = render_tool_calls([ToolCall("f", {"i": 1})])
    bad = f'{NS}<invoke name="f">{NS}<i>2{NS}</j>{NS}</invoke>\n'
    text = good.replace(
        TOOL_CALL_END, bad + render_tool_calls([ToolCall("g", {"i": 3})])[len(TOOL_CALL_START) :]
    )
    _, calls, errors = parse_tool_calls(text, TOOLS)
    assert calls == [ToolCall("f", {"i": 1}), ToolCall("g", {"i": 3})] and len(errors) == 1


def test_unterminated_block_and_invoke_outside_a_block_are_errors():
    text = render_tool_calls([ToolCall("f", {"i": 1})])[: -len(TOOL_CALL_END)]
    _, calls, errors = parse_tool_calls(text, TOOLS)
    assert calls == [ToolCall("f", {"i": 1})] and "never closed" in errors[0].message
    content, calls, errors = parse_tool_calls(f'hi {NS}<invoke name="f">{NS}</invoke>')
    assert content.startswith("hi") and calls == [] and "outside" in errors[0].message


def test_unrenderable_values_raise_value_error():
    for args in ({"s": f"a{NS}b"}, {"x": float("nan")}, {"bad>name": 1}):
        with pytest.raises(ValueError):
            render_tool_calls([ToolCall("f", args)])


def test_plain_chat_without_tools_is_byte_identical_and_with_tools_concatenates_messages():
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+35="}]
    assert render_plain_chat(chat) == plain_chat_template(chat)
    call = {"type": "function", "function": {"name": "f", "arguments": json.dumps({"i": 2})}}
    turn = [
        {"role": "assistant", "content": "let me", "tool_calls": [call]},
        {"role": "tool", "content": "4"},
    ]
    text = render_plain_chat(chat + turn, TOOLS)
    assert text.endswith(
        "let me"
        + render_tool_calls([ToolCall("f", {"i": 2})])
        + "\n"
        + f"{NS}<tool_response>4{NS}</tool_response>\n"
    )
    assert text.count("\n" + plain_chat_template(chat)) == 1


def test_a_block_cut_inside_a_tag_is_an_error_not_a_hang():
    # A sample cut by max_tokens can end anywhere, e.g. inside the closing tag: "...NS</tool_".
    text = render_tool_calls([ToolCall("f", {"i": 1})])
    for cut in range(len(TOOL_CALL_START), len(text)):
        _, calls, errors = parse_tool_calls(text[:cut], TOOLS)
        assert errors and len(calls) <= 1
    _, calls, errors = parse_tool_calls(f"{TOOL_CALL_START}{NS}<other>{NS}</tool_", TOOLS)
    assert calls == [] and "unexpected text" in errors[0].message

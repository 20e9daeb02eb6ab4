"""OpenAI tool calling over real HTTP with the `openai` client: a live server over the native engine
and a tiny model that has learnt its replies (tests/rollout/tool_echo.py), so the tool calls in a
reply are what the model wrote, parsed by common/tool_calls.py, streamed and not."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from common.tokenizer import ByteTokenizer
from common.tool_calls import TOOL_CALL_END, TOOL_CALL_START, render_call_opening, render_plain_chat
from rollout.native import NativeEngine
from rollout.server import build_app
from tests.rollout.live_server import live_server
from tests.rollout.tool_echo import CALLS, MALFORMED, ROWS, TOOLS, tool_echo_model

GREEDY = {"model": "echo", "temperature": 0.0, "tools": TOOLS}


@pytest.fixture(scope="module")
def served():
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tool_echo_model()
    tok = ByteTokenizer()
    engine = NativeEngine(model, max_pages=128, max_batch_tokens=512, kv_dtype="fp32", index_dtype="fp32")
    app = build_app(engine, tok, model_name="echo", default_max_tokens=400)
    with live_server(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120), url, tok
    torch.set_num_threads(n_threads)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or ()]


def _expected(user: str) -> list[tuple[str, dict]]:
    return [(c.name, c.arguments) for c in CALLS[user]]


def _streamed(client, **kw):
    """(content, [(name, arguments)], finish_reason, call ids) of a streamed reply, from the raw chunks."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    calls = [calls[k] for k in sorted(calls)]
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls], finish, [c["id"] for c in calls]


def test_a_reply_that_calls_tools_has_content_tool_calls_and_finish_reason_tool_calls(served):
    client, _, tok = served
    out = client.chat.completions.create(messages=_user("add 2 and 3"), **GREEDY)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me add.\n"
    assert _calls(choice.message.tool_calls) == _expected("add 2 and 3")
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and c.type == "function"
                                      for i, c in zip(ids, choice.message.tool_calls))  # fmt: skip
    # The turn ended at the block's end (kept in the sampled text), as a multi-turn rollout's does.
    assert tok.decode(choice.model_extra["token_ids"]) == ROWS["add 2 and 3"]
    assert choice.model_extra["stop_reason"] == TOOL_CALL_END
    assert out.usage.prompt_tokens == len(tok.chat_prompt(_user("add 2 and 3"), TOOLS))


def test_streamed_tool_call_deltas_concatenate_to_the_non_streamed_reply(served):
    client, _, _ = served
    for user in ("add 2 and 3", "what is 7+8"):
        full = client.chat.completions.create(messages=_user(user), **GREEDY).choices[0]
        content, calls, finish, ids = _streamed(client, messages=_user(user), **GREEDY)
        assert (content or None, calls, finish) == (full.message.content, _calls(full.message.tool_calls),
                                                    full.finish_reason)  # fmt: skip
        assert calls == _expected(user) and len(set(ids)) == len(calls)
    # The client's own accumulator reads the same deltas.
    with client.chat.completions.stream(messages=_user("add 2 and 3"), **GREEDY) as stream:
        final = stream.get_final_completion().choices[0]
    assert _calls(final.message.tool_calls) == _expected("add 2 and 3")
    assert final.message.content == "Let me add.\n" and final.finish_reason == "tool_calls"


def test_a_malformed_or_cut_call_comes_back_as_plain_content(served):
    client, _, _ = served
    out = client.chat.completions.create(messages=_user("break it"), **GREEDY).choices[0]
    assert out.message.content == MALFORMED and out.message.tool_calls is None
    assert out.finish_reason == "stop"
    content, calls, finish, _ = _streamed(client, messages=_user("break it"), **GREEDY)
    assert (content, calls, finish) == (MALFORMED, [], "stop")
    # Cut by max_tokens inside the block: the block never closes.
    cut = client.chat.completions.create(messages=_user("add 2 and 3"), max_tokens=40, **GREEDY).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls is None
    assert cut.message.content == ROWS["add 2 and 3"][: len(cut.message.content)] and TOOL_CALL_START in (
        cut.message.content
    )
    assert _streamed(client, messages=_user("add 2 and 3"), max_tokens=40, **GREEDY)[:3] == (
        cut.message.content, [], "length")  # fmt: skip


def test_tool_choice_none_renders_the_tools_and_parses_nothing(served):
    client, _, tok = served
    out = client.chat.completions.create(messages=_user("add 2 and 3"), tool_choice="none", **GREEDY)
    (choice,) = out.choices
    assert choice.message.tool_calls is None and choice.message.content == ROWS["add 2 and 3"]
    assert choice.finish_reason == "stop"  # eos after the block: no stop at the block's end
    assert out.usage.prompt_tokens == len(tok.chat_prompt(_user("add 2 and 3"), TOOLS))
    assert _streamed(client, messages=_user("add 2 and 3"), tool_choice="none", **GREEDY)[:3] == (
        ROWS["add 2 and 3"], [], "stop")  # fmt: skip


@pytest.mark.parametrize(
    ("tool_choice", "opening", "finish"),
    [("required", render_call_opening(), "tool_calls"),
     ({"type": "function", "function": {"name": "add"}}, render_call_opening("add"), "stop")],
)  # fmt: skip
def test_required_and_named_tool_choice_open_the_call_in_the_prompt(served, tool_choice, opening, finish):
    client, _, tok = served
    messages = _user("what is 7+8")
    out = client.chat.completions.create(messages=messages, tool_choice=tool_choice,
                                         extra_body={"return_token_ids": True}, **GREEDY)  # fmt: skip
    (choice,) = out.choices
    assert out.model_extra["prompt_token_ids"] == tok.chat_prompt(messages, TOOLS) + tok.encode(
        opening, add_special_tokens=False
    )
    assert tok.decode(choice.model_extra["token_ids"]) == ROWS["what is 7+8"][len(opening) :]
    assert _calls(choice.message.tool_calls) == _expected("what is 7+8")
    assert choice.message.content is None and choice.finish_reason == finish
    assert _streamed(client, messages=messages, tool_choice=tool_choice, **GREEDY)[:3] == (
        "", _expected("what is 7+8"), finish)  # fmt: skip


def test_parallel_tool_calls_false_returns_the_first_call_only(served):
    client, _, _ = served
    kw = dict(messages=_user("add 2 and 3"), parallel_tool_calls=False, **GREEDY)
    out = client.chat.completions.create(**kw).choices[0]
    assert _calls(out.message.tool_calls) == _expected("add 2 and 3")[:1]
    assert _streamed(client, **kw)[1] == _expected("add 2 and 3")[:1]


HISTORY = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "add 2 and 3, then 1 and 1"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "2"}]},
    {"role": "assistant", "content": "5 and 2."},
    {"role": "user", "content": "and 7+8?"},
]  # fmt: skip


def test_tool_calls_and_results_in_the_history_render_as_the_trainer_renders_them(served):
    client, url, tok = served
    ids_please = {"return_token_ids": True}
    out = client.chat.completions.create(messages=HISTORY, max_tokens=2, extra_body=ids_please, **GREEDY)
    # The plain template of common/tool_calls.py, content parts joined and a null content empty.
    trained = [dict(m) for m in HISTORY]
    trained[2]["content"], trained[4]["content"] = "", "2"
    want = tok.encode(render_plain_chat(trained, TOOLS))
    assert out.model_extra["prompt_token_ids"] == want == tok.chat_prompt(trained, TOOLS)
    # Without tools in the request the history still renders its calls and results.
    body = {"model": "echo", "messages": HISTORY, "max_tokens": 1, "return_token_ids": True}
    ids = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["prompt_token_ids"]
    assert ids == tok.encode(render_plain_chat(trained))


# --------------------------------------------------------------------------------- bad requests
def _tools(**function) -> list[dict]:
    return [{"type": "function", "function": {"name": "add", **function}}]


def _deep(n: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _assistant_calls(*calls) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


def _call(cid="call_1", name="add", arguments='{"a": 1}') -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


U = {"role": "user", "content": "hi"}
T1 = {"role": "tool", "tool_call_id": "call_1", "content": "5"}
BAD = [  # (fields of the body, words the 400 names)
    ({"tools": []}, ["tools", "non-empty"]),
    ({"tools": {"name": "add"}}, ["tools must be a non-empty list"]),
    ({"tools": [{"type": "retrieval"}]}, ["tools[0]", "function tools"]),
    ({"tools": [{"type": "function"}]}, ["tools[0].function", "missing"]),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, ["tools[0].function.name", "letters"]),
    ({"tools": [{"type": "function", "function": {}}]}, ["tools[0].function.name"]),
    ({"tools": _tools() + _tools()}, ["tools", "unique", "add"]),
    ({"tools": _tools(description=5)}, ["tools[0].function.description", "string"]),
    ({"tools": _tools(parameters="x")}, ["tools[0].function.parameters", "JSON Schema object"]),
    ({"tools": _tools(parameters={"properties": ["a"]})}, ["tools[0].function.parameters.properties"]),
    ({"tools": _tools(parameters={"properties": {"a": {"type": 5}}})},
     ["tools[0].function.parameters.properties.a.type", "type name"]),
    ({"tools": _tools(parameters={"anyOf": {"type": "integer"}})}, ["parameters.anyOf", "list"]),
    ({"tools": _tools(parameters={"items": 3})}, ["parameters.items", "JSON Schema object"]),
    ({"tools": _tools(parameters={"enum": "ab"})}, ["parameters.enum", "list"]),
    ({"tools": _tools(parameters=_deep(80))}, ["tools[0].function.parameters", "deeper than 64"]),
    ({"tools": _tools(), "tool_choice": "always"}, ["tool_choice must be", "'required'"]),
    ({"tools": _tools(), "tool_choice": {"type": "function"}}, ["tool_choice must be"]),
    ({"tools": _tools(), "tool_choice": {"type": "function", "function": {"name": "sub"}}},
     ["tool_choice.function.name", "'sub'", "add"]),
    ({"tool_choice": "auto"}, ["tool_choice", "needs tools"]),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, ["tool_choice", "needs tools"]),
    ({"parallel_tool_calls": "sometimes"}, ["parallel_tool_calls"]),
    ({"messages": [U, T1]},
     ["messages[1]", "must follow an assistant message with tool_calls"]),
    ({"messages": [U, _assistant_calls(_call()), {"role": "tool", "tool_call_id": "call_9", "content": "5"}]},
     ["messages[2].tool_call_id", "call_1"]),
    ({"messages": [U, _assistant_calls(_call()), {"role": "tool", "content": "5"}]},
     ["messages[2].tool_call_id"]),
    ({"messages": [U, _assistant_calls(_call()), U, T1]}, ["messages[3]", "must follow"]),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [_call()]}]},
     ["messages[0].tool_calls", "only assistant"]),
    ({"messages": [U, _assistant_calls()]}, ["messages[1].tool_calls", "non-empty"]),
    ({"messages": [U, _assistant_calls(_call(arguments="{a: 1"))]},
     ["messages[1].tool_calls[0].function.arguments", "not valid JSON"]),
    ({"messages": [U, _assistant_calls(_call(arguments="[1, 2]"))]}, ["function.arguments", "JSON object"]),
    ({"messages": [U, _assistant_calls(_call(arguments='{"a": ' + "[" * 200 + "]" * 200 + "}"))]},
     ["messages[1].tool_calls[0].function.arguments", "deeper than 128"]),
    ({"messages": [U, _assistant_calls(_call(arguments="[" * 100_000 + "]" * 100_000))]},
     ["messages[1].tool_calls[0].function.arguments", "deeper than 128"]),
    ({"messages": [U, _assistant_calls({**_call(), "function": {"name": "add", "arguments": {"a": 1}}})]},
     ["messages[1].tool_calls[0].function.arguments", "string"]),
    ({"messages": [U, _assistant_calls(_call(), _call())]}, ["messages[1].tool_calls[1].id", "unique"]),
    ({"messages": [U, _assistant_calls(_call(name="a>b"))]}, ["messages[1].tool_calls[0].function.name"]),
    ({"messages": [U, _assistant_calls(_call(arguments=json.dumps({"s": "x]<]minimax[>[y"})))]},
     ["messages[1].tool_calls", "namespace marker"]),
    ({"messages": [U, {"role": "assistant", "content": None}]}, ["role", "content"]),
    ({"tools": _tools(), "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     ["tools and tool messages", "text chats only"]),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "words"), BAD)
def test_bad_tools_tool_choice_or_tool_messages_are_400_naming_the_field(served, fields, words):
    _, url, _ = served
    body = {"model": "echo", "messages": [U], "max_tokens": 2, **fields}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    msg = r.json()["error"]["message"]
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    ok = httpx.post(f"{url}/v1/chat/completions", json={"model": "echo", "messages": [U], "max_tokens": 2})
    assert ok.status_code == 200


def test_a_lone_surrogate_in_tools_is_400_naming_tools(served):
    _, url, _ = served
    raw = (b'{"model":"echo","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function",'
           b'"function":{"name":"add","description":"\\ud800"}}]}')  # fmt: skip
    r = httpx.post(f"{url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert (
        r.status_code == 400
        and "tools: the text holds a lone UTF-16 surrogate" in r.json()["error"]["message"]
    )


def test_the_openai_client_gets_a_bad_request_error_naming_tool_choice(served):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError, match=r"tool_choice\.function\.name"):
        client.chat.completions.create(messages=_user("hi"), tool_choice={"type": "function",
                                       "function": {"name": "mul"}}, **GREEDY)  # fmt: skip


# --------------------------------------------------------------------------------- HF templates
HF_TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>{% for t in tools %}{{ t.function | tojson }}{% endfor %}</s>"
    "{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_an_hf_template_renders_the_tools_and_history_and_one_without_tools_is_400(tmp_path):
    from transformers import AutoTokenizer

    from common.tokenizer import load_tokenizer
    from tests.rollout.test_server_prompt_ids import _hf_tokenizer
    from tests.rollout.tiny_models import build

    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    for name, template in (("tools", HF_TOOL_TEMPLATE), ("plain", plain)):
        raw = AutoTokenizer.from_pretrained(_hf_tokenizer(tmp_path / name))
        raw.chat_template = template
        raw.save_pretrained(tmp_path / name)
    tok, untooled = load_tokenizer(str(tmp_path / "tools")), load_tokenizer(str(tmp_path / "plain"))
    # What transformers renders for the chat, tool-call arguments as dicts (its convention).
    messages = [dict(m) for m in HISTORY]
    messages[2]["content"], messages[4]["content"] = "", "2"
    messages[2]["tool_calls"] = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in HISTORY[2]["tool_calls"]
    ]
    text = tok.tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '<call>add {"a": 2, "b": 3}</call>' in text and '"name": "add"' in text
    body = {"model": "hf", "messages": HISTORY, "tools": TOOLS, "max_tokens": 1, "return_token_ids": True}
    replies = []
    for t in (tok, untooled):
        engine = NativeEngine(build(), max_pages=64, kv_dtype="fp32", index_dtype="fp32")
        with live_server(build_app(engine, t, model_name="hf")) as url:
            replies.append(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60))
    ok, refused = replies
    assert ok.status_code == 200 and ok.json()["prompt_token_ids"] == tok.encode(text)
    assert refused.status_code == 400, refused.text[:300]
    assert "messages / tools: the chat template of tokenizer" in refused.json()["error"]["message"]
    assert "does not render tools" in refused.json()["error"]["message"]


def test_the_readme_loop_sends_the_reply_message_and_tool_results_back(served):
    client, _, tok = served
    messages = _user("add 2 and 3")
    reply = client.chat.completions.create(messages=messages, **GREEDY).choices[0]
    assert reply.finish_reason == "tool_calls"
    messages.append(reply.message)  # the client's own message object, as OpenAI's docs do
    for call, result in zip(reply.message.tool_calls, ("5", "2")):
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    ids_please = {"return_token_ids": True}
    out = client.chat.completions.create(messages=messages, max_tokens=2, extra_body=ids_please, **GREEDY)
    history = [*_user("add 2 and 3"),
               {"role": "assistant", "content": "Let me add.\n", "tool_calls": CALLS["add 2 and 3"]},
               {"role": "tool", "content": "5"}, {"role": "tool", "content": "2"}]  # fmt: skip
    assert out.model_extra["prompt_token_ids"] == tok.encode(render_plain_chat(history, TOOLS))

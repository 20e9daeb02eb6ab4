"""common/tokenizer.py: one chat template for training and serving, and the tokenizer a checkpoint
or an exported adapter records."""

import json

import pytest

from common.tokenizer import (
    RECORD_FILE,
    ByteTokenizer,
    load_tokenizer,
    recorded_tokenizer,
    tokenizer_for,
    write_tokenizer_record,
)

CHATS = [
    [{"role": "user", "content": "12+35="}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7*6="}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_byte_chat_prompt_is_bos_then_the_plain_template(messages):
    tok = ByteTokenizer()
    text = "".join(m["content"] + "\n" for m in messages)
    assert tok.apply_chat_template(messages) == text
    assert tok.chat_prompt(messages) == [tok.bos_token_id, *(b + 3 for b in text.encode())]


def test_checkpoint_record_names_the_byte_tokenizer(tmp_path):
    assert recorded_tokenizer(tmp_path) is None
    write_tokenizer_record(tmp_path, "byte")
    assert json.loads((tmp_path / RECORD_FILE).read_text()) == {"tokenizer": "byte"}
    assert isinstance(tokenizer_for(tmp_path), ByteTokenizer)


def test_adapter_record_wins_over_the_checkpoint(tmp_path):
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    base.mkdir()
    adapter.mkdir()
    (adapter / "adapter_metadata.json").write_text(json.dumps({"tokenizer": "byte"}))
    assert isinstance(tokenizer_for(base, adapter), ByteTokenizer)


def test_no_record_is_a_clear_error_naming_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--tokenizer byte"):
        tokenizer_for(tmp_path)


def test_hf_record_saves_the_tokenizer_files_beside_the_checkpoint(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    src = tmp_path / "src"
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>").save_pretrained(src)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_tokenizer_record(ckpt, str(src))
    assert recorded_tokenizer(ckpt) == str(ckpt)
    tok = tokenizer_for(ckpt)
    assert tok.encode("a", add_special_tokens=False) == load_tokenizer(str(src)).encode(
        "a", add_special_tokens=False
    )


# ------------------------------------------------------------------ tools
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
TOOL_CHAT = [
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
]  # fmt: skip
TOOL_TEMPLATE = (
    "{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
    "({{ c.function.name }} a={{ c.function.arguments.a }}){% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_byte_chat_prompt_with_tools_is_the_plain_tool_template():
    from common.tool_calls import render_plain_chat

    tok = ByteTokenizer()
    assert tok.apply_chat_template(TOOL_CHAT, TOOLS) == render_plain_chat(TOOL_CHAT, TOOLS)
    assert tok.chat_prompt(TOOL_CHAT, TOOLS) == tok.encode(render_plain_chat(TOOL_CHAT, TOOLS))
    assert tok.chat_prompt(CHATS[1], ()) == tok.chat_prompt(CHATS[1])  # no tools: the plain template


def _word_level(tmp_path, template: str | None):
    tokenizers = pytest.importorskip("tokenizers")
    from tests.common.hf_tokenizers import saved_hf_tokenizer

    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "a": 2}, unk_token="a"))
    return saved_hf_tokenizer(tmp_path, raw, template)


def test_hf_template_gets_tools_and_tool_calls_with_dict_arguments(tmp_path):
    tok = _word_level(tmp_path, TOOL_TEMPLATE)
    assert (
        tok.apply_chat_template(TOOL_CHAT, TOOLS) == "[add;]<user>2+3?<assistant>(add a=2)<tool>5<assistant>"
    )


def test_hf_template_that_does_not_read_tools_refuses_them_and_no_template_is_the_plain_one(tmp_path):
    from common.tool_calls import render_plain_chat

    tok = _word_level(tmp_path / "t", "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tok.apply_chat_template(CHATS[0]) == "12+35="
    with pytest.raises(ValueError, match="does not render tools"):
        tok.apply_chat_template(CHATS[0], TOOLS)
    with pytest.raises(ValueError, match="does not render tool_calls"):
        tok.apply_chat_template(TOOL_CHAT)
    plain = _word_level(tmp_path / "p", None)
    assert plain.apply_chat_template(TOOL_CHAT, TOOLS) == render_plain_chat(TOOL_CHAT, TOOLS)

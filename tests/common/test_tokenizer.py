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

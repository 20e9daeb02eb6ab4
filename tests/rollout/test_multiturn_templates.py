"""Multi-turn rendering with a Hugging Face chat template (the real model's path: `env_turn_ids` with
an HF tokenizer): the tokens a trajectory appends after a tool-calling turn, with the prompt and the
model's turns, are exactly the template's tokens for the whole conversation; a template that does not
render an assistant's content is refused by name. A byte-level tokenizer (one token per byte,
no merges) makes token equality the same as text equality."""

from __future__ import annotations

import pytest

from common.tool_calls import ToolCall, render_tool_calls
from rollout import multiturn

M3_LIKE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}<|user|>{{ m.content }}<|end|>\n"
    "{% elif m.role == 'assistant' %}<|assistant|>{{ m.content }}<|end|>\n"
    "{% elif m.role == 'tool' %}<|tool|>{{ m.content }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _byte_level(tmp_path, template: str):
    tokenizers = pytest.importorskip("tokenizers")
    from tests.common.hf_tokenizers import saved_hf_tokenizer

    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(sorted(alphabet))}}
    raw = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = tokenizers.decoders.ByteLevel()
    return saved_hf_tokenizer(tmp_path, raw, template)


def test_appended_environment_tokens_continue_the_templates_own_rendering(tmp_path):
    tok = _byte_level(tmp_path, M3_LIKE)
    user = {"role": "user", "content": "123*45="}
    turn1 = "Let me compute. " + render_tool_calls([ToolCall("calculator", {"expression": "123*45"})])
    replies = [{"role": "tool", "content": "5535"}]
    turn2 = "Answer: 5535"
    ids = tok.chat_prompt([user]) + tok.encode(turn1, add_special_tokens=False)
    ids += multiturn.env_turn_ids(tok, replies) + tok.encode(turn2, add_special_tokens=False)
    whole = [user, {"role": "assistant", "content": turn1}, *replies]
    want = tok.encode(tok.apply_chat_template(whole), add_special_tokens=False)
    assert ids == want + tok.encode(turn2, add_special_tokens=False)
    assert tok.decode(multiturn.env_turn_ids(tok, replies)) == "<|end|>\n<|tool|>5535<|end|>\n<|assistant|>"
    # Two replies (two calls in one turn) come back in order, each in the tool role.
    two = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    assert (
        tok.decode(multiturn.env_turn_ids(tok, two))
        == "<|end|>\n<|tool|>1<|end|>\n<|tool|>2<|end|>\n<|assistant|>"
    )


def test_a_template_that_drops_assistant_content_is_refused_by_name(tmp_path):
    """A template that renders an assistant turn without its text (here: only a placeholder) cannot
    take appended tokens: refused with the tokenizer's name. Content it transforms (e.g. `| trim`)
    still passes: the trajectory keeps the model's own tokens."""
    tok = _byte_level(tmp_path, M3_LIKE.replace("<|assistant|>{{ m.content }}", "<|assistant|>[call]"))
    with pytest.raises(ValueError, match=f"{tmp_path}.*does not render an assistant message's content"):
        multiturn.env_turn_ids(tok, [{"role": "tool", "content": "5"}])
    trims = _byte_level(
        tmp_path / "trim", M3_LIKE.replace("{{ m.content }}<|end|>", "{{ m.content | trim }}<|end|>")
    )
    assert trims.decode(multiturn.env_turn_ids(trims, [{"role": "tool", "content": "5"}])).endswith(
        "<|assistant|>"
    )

"""The tools warm-up's examples (rollout/bases/tools_warmup.py): the rendered episode and which tokens
carry loss, at what weight. No model is trained here."""

from __future__ import annotations

from common.data import arithmetic_dataset
from common.tokenizer import ByteTokenizer
from rollout.bases.tools_warmup import DIGITS, direct_example, tool_example


def _prompt():
    return arithmetic_dataset(1, seed=0, ops=["*"], digits=DIGITS, split="train")[0]


def test_tool_example_weights_only_the_copied_tokens():
    tok, p = ByteTokenizer(), _prompt()
    expression = p.messages[-1]["content"].rstrip("=")
    ids, weights = tool_example(tok, p, copy_weight=8.0)
    plain_ids, plain_weights = tool_example(tok, p)
    assert ids == plain_ids
    heavy = [i for i, w in enumerate(weights) if w == 8.0]
    # the expression inside the call, then the result's digits in the answer: nothing else
    assert tok.decode([ids[i] for i in heavy]) == expression + p.ground_truth
    assert all(w in (0.0, 1.0) for i, w in enumerate(weights) if i not in heavy)
    assert [w > 0 for w in weights] == [w > 0 for w in plain_weights]


def test_tool_example_trains_call_and_answer_not_prompt_or_reply():
    tok, p = ByteTokenizer(), _prompt()
    ids, weights = tool_example(tok, p)
    n_prompt = len(tok.chat_prompt(p.messages))
    assert not any(weights[:n_prompt])
    trained = [t for t, w in zip(ids, weights, strict=True) if w > 0]
    answer = [*tok.encode(f"Answer: {p.ground_truth}", add_special_tokens=False), tok.eos_token_id]
    assert trained[-len(answer) :] == answer
    assert "<tool_response>" not in tok.decode(trained)


def test_direct_example_trains_the_whole_answer():
    tok, p = ByteTokenizer(), _prompt()
    ids, weights = direct_example(tok, p)
    n_prompt = len(tok.chat_prompt(p.messages))
    assert weights == [0.0] * n_prompt + [1.0] * (len(ids) - n_prompt)


def test_a_cached_base_is_reused_only_while_its_record_matches_the_builder(tmp_path):
    """`cached_base`, which every base builder's ensure_* uses: a record with the builder's defining
    settings is reused; one built with other values or before a setting existed is named and rebuilt."""
    import json

    from rollout.bases.tools_warmup import build_tools_base
    from rollout.bases.warmup import INFO_FILE, builder_defaults, cached_base

    settings = builder_defaults(build_tools_base, "tool_share", "copy_weight", "mix_steps")
    assert settings == {"tool_share": 0.3, "copy_weight": 8.0, "mix_steps": 60}
    said: list[str] = []
    assert not cached_base(tmp_path, settings, said.append) and not said  # nothing cached: no message
    (tmp_path / INFO_FILE).write_text(json.dumps({**settings, "steps": 200}))
    assert cached_base(tmp_path, settings, said.append) and not said
    (tmp_path / INFO_FILE).write_text(json.dumps({"tool_share": 0.3, "steps": 900}))  # an older builder's
    assert not cached_base(tmp_path, settings, said.append)
    assert "copy_weight" in said[0] and "rebuilding" in said[0]

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

"""Native engine multi-turn continuation (tiny model, CPU, fp32 cache): a parked sequence continued
after appending environment tokens gives the tokens and log-probs of re-prefilling its whole history,
runs only the new tokens through the model, keeps its pages accounted while parked, and stays exact
when pages run short (parked pages evicted and recomputed, running sequences preempted)."""

from __future__ import annotations

import pytest
import torch

from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine
from tests.rollout.tiny_models import build, prompts

pytestmark = pytest.mark.usefixtures("one_thread")
ENV_IDS = [(40, 41, 42, 43, 44, 45, 46), (50, 51, 52), ()]  # the "environment" turns appended


@pytest.fixture(scope="module")
def model():
    return build()


def engine(model, **kw) -> NativeEngine:
    kw.setdefault("max_pages", 64)
    return NativeEngine(model, kv_dtype="fp32", index_dtype="fp32", **kw)


def run_turns(eng: NativeEngine, reqs: list[Request], turn_tokens: int) -> dict:
    """Every request through len(ENV_IDS) + 1 model turns, continuing each sample as soon as its
    turn ends; returns (request id, sample) -> [(history before the turn, tokens, logprobs)]."""
    for r in reqs:
        eng.add_request(r, park=True)
    turns: dict = {}
    while eng.has_unfinished():
        for c in eng.step():
            key = (c.request_id, c.sample_index)
            turns.setdefault(key, []).append((c.prompt_token_ids, c.token_ids, c.logprobs))
            k = len(turns[key])
            if k <= len(ENV_IDS):
                eng.continue_sequence(*key, ENV_IDS[k - 1], max_tokens=turn_tokens)
            else:
                eng.release(*key)
    return turns


def test_continuation_equals_reprefilling_the_whole_history_greedy(model):
    greedy = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    reqs = [Request(p, greedy, request_id=f"r{i}") for i, p in enumerate(prompts([21, 13], 5))]
    eng = engine(model, max_batch_tokens=32)
    turns = run_turns(eng, reqs, turn_tokens=6)
    for seq in turns.values():
        assert len(seq) == 4
        for history, tokens, lps in seq[1:]:  # every continued turn vs a fresh request of its history
            ref = engine(model).generate([Request(history, SamplingParams(temperature=0.0, max_tokens=6,
                                                                         ignore_eos=True))])[0]  # fmt: skip
            assert tokens == ref.token_ids
            torch.testing.assert_close(lps, ref.logprobs, atol=1e-5, rtol=0)
    # No re-prefill: the first turns' prompts, then per continuation the last sampled token + env ids.
    prompt_tokens = 21 + 13
    env_tokens = 2 * sum(1 + len(ids) for ids in ENV_IDS)
    assert eng.stats().prefill_tokens == prompt_tokens + env_tokens
    assert eng.stats().pages_in_use == 0 and eng.num_parked == 0


def test_sampled_multiturn_logprobs_equal_the_training_forward_of_the_whole_trajectory(model):
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    eng = engine(model)
    turns = run_turns(eng, [Request(prompts([17], 6)[0], sp, n=3, seed=11, request_id="g")], turn_tokens=5)
    assert len(turns) == 3
    for seq in turns.values():
        full = list(seq[-1][0]) + seq[-1][1]  # the last turn's history + its tokens: the trajectory
        with torch.no_grad():
            lp, _ = model.token_logprobs(torch.tensor(full[:-1])[None], torch.tensor(full[1:])[None])
        for history, tokens, lps in seq:  # each turn's log-probs at its own positions
            at = len(history) - 1
            torch.testing.assert_close(lps, lp[0, at : at + len(tokens)], atol=1e-4, rtol=0)


def test_parked_pages_are_counted_and_short_pages_evict_them_without_changing_output(model):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, ignore_eos=True)
    reqs = [Request(p, sp, seed=3 * i, request_id=f"r{i}", n=2 if i == 0 else 1)
            for i, p in enumerate(prompts([30, 18, 25], 7))]  # fmt: skip
    roomy = run_turns(engine(model), reqs, turn_tokens=7)
    tight_engine = engine(model, max_pages=6, max_batch_tokens=24)
    tight = run_turns(tight_engine, reqs, turn_tokens=7)
    assert tight_engine.stats().preemptions > 0
    assert roomy.keys() == tight.keys()
    for key in roomy:
        for (h1, t1, l1), (h2, t2, l2) in zip(roomy[key], tight[key], strict=True):
            assert h1 == h2 and t1 == t2
            torch.testing.assert_close(l1, l2, atol=1e-5, rtol=0)
    assert tight_engine.stats().pages_in_use == 0

    eng = engine(model)
    eng.add_request(Request(prompts([40], 8)[0], sp, request_id="p"), park=True)
    while eng.has_unfinished():
        eng.step()
    assert eng.num_parked == 1 and eng.stats().pages_in_use == 4  # 40 + 9 cached tokens, 16 per page
    with pytest.raises(ValueError, match="already in flight"):
        eng.add_request(Request((5, 6), sp, request_id="p"))
    with pytest.raises(ValueError, match="append_ids must be in"):
        eng.continue_sequence("p", 0, [10**6], max_tokens=4)
    with pytest.raises(ValueError, match="no parked sample 1"):
        eng.continue_sequence("p", 1, [5], max_tokens=4)
    eng.release("p", 0)
    assert eng.stats().pages_in_use == 0


def test_stop_string_ends_a_turn_and_the_next_turn_starts_a_fresh_match(model):
    tok_text = {t: chr(t) for t in range(512)}
    eng = NativeEngine(model, max_pages=64, kv_dtype="fp32", index_dtype="fp32",
                       detokenize=lambda ids: "".join(tok_text[int(t)] for t in ids))  # fmt: skip
    ref = engine(model).generate([Request((7, 8, 9), SamplingParams(temperature=0.0, max_tokens=12,
                                                                   ignore_eos=True))])[0]  # fmt: skip
    stop = chr(ref.token_ids[3])  # the 4th greedy token, as a one-character stop string
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop,))
    eng.add_request(Request((7, 8, 9), sp, request_id="s"), park=True)
    (first,) = drain(eng)
    assert first.finish_reason == "stop" and first.token_ids == ref.token_ids[: len(first.token_ids)]
    assert first.token_ids[-1] == ref.token_ids[3] or stop in "".join(map(chr, first.token_ids))
    eng.continue_sequence("s", 0, [], max_tokens=3)
    (second,) = drain(eng)
    assert second.prompt_token_ids == (7, 8, 9, *first.token_ids) and len(second.token_ids) >= 1
    eng.release("s", 0)


def drain(eng: NativeEngine) -> list:
    out = []
    while eng.has_unfinished():
        out += eng.step()
    return out

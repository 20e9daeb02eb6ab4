"""NativeEngine.abort: dropped samples leave the scheduler, free their pages, and the rest finish
exactly as they would have."""

from __future__ import annotations

import pytest

from model.config import ModelConfig
from model.modeling import MiniMaxM3ForCausalLM
from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine


@pytest.fixture(scope="module")
def model():
    return MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(std=0.05, seed=0).eval()


def _engine(model):
    return NativeEngine(model, max_pages=64, max_batch_tokens=64, kv_dtype="fp32", index_dtype="fp32")


def _request(rid: str, n: int = 3) -> Request:
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    return Request(tuple(range(3, 40)), params, n=n, seed=5, request_id=rid)


def test_abort_of_a_whole_request_frees_every_page_and_leaves_the_engine_idle(model):
    engine = _engine(model)
    engine.add_request(_request("a"))
    for _ in range(3):
        engine.step()
    assert engine.stats().pages_in_use > 0
    assert engine.abort("a") == 3 and engine.abort("a") == 0
    assert engine.stats().pages_in_use == 0 and not engine.has_unfinished()


def test_abort_before_the_prompt_is_prefilled_drops_the_queued_siblings_too(model):
    engine = _engine(model)
    engine.add_request(_request("a"))
    assert engine.abort("a") == 3
    assert not engine.has_unfinished() and engine.stats().pages_in_use == 0


def test_aborting_one_sample_leaves_the_others_and_other_requests_unchanged(model):
    ref = {
        (c.request_id, c.sample_index): c.token_ids
        for c in _engine(model).generate([_request("a"), _request("b", 1)])
    }
    engine = _engine(model)
    engine.add_request(_request("a"))
    engine.add_request(_request("b", 1))
    done = engine.step() + engine.step()
    assert engine.abort("a", sample_index=1) == 1
    while engine.has_unfinished():
        done += engine.step()
    got = {(c.request_id, c.sample_index): c.token_ids for c in done}
    assert sorted(got) == [("a", 0), ("a", 2), ("b", 0)]
    assert all(got[k] == ref[k] for k in got)
    assert engine.stats().pages_in_use == 0

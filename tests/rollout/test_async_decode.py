"""Async decode (tiny model, CPU, static decode path): the engine launches the next all-decode step
before reading the current one's tokens back, and ends every request exactly where the synchronous
engine does: same tokens, log-probs, finish reasons and adapter versions, with sequences that stop on
a token (their launched row dropped, draw and cache slot undone), an adapter sync between steps
(the launched step cancelled), an abort between steps and parked multi-turn sequences."""

from __future__ import annotations

import pytest
import torch

from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine
from tests.rollout.tiny_models import build, prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return build(seed=1)


def pair(model, **kw) -> tuple[NativeEngine, NativeEngine]:
    """(synchronous, async) engines on the static decode path, fp32 caches."""
    kw = dict(max_pages=64, max_batch_tokens=64, max_num_seqs=8, kv_dtype="fp32", index_dtype="fp32", **kw)
    sync = NativeEngine(model, static_decode=True, async_decode=False, **kw)
    asy = NativeEngine(model, static_decode=True, **kw)
    assert asy.async_decode and not sync.async_decode
    return sync, asy


def assert_same(a, b) -> None:
    assert [(c.request_id, c.sample_index) for c in a] == [(c.request_id, c.sample_index) for c in b]
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    assert [c.adapter_versions for c in a] == [c.adapter_versions for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


def stopping_requests(model) -> list[Request]:
    """Greedy and sampled requests of several lengths; request 0 stops on its own 4th greedy token and
    the sampled pair on a token it draws early, so rows already launched ahead must be dropped."""
    p = prompts([21, 9, 33, 14], 4)
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    ref = NativeEngine(model, max_pages=64, kv_dtype="fp32", index_dtype="fp32").generate(
        [Request(p[0], greedy), Request(p[1], SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True),
                                        n=2, seed=7)]
    )  # fmt: skip
    stop0, stop1 = ref[0].token_ids[3], ref[1].token_ids[5]
    kw = dict(max_tokens=14, ignore_eos=True)
    return [
        Request(p[0], SamplingParams(temperature=0.0, stop_token_ids=(stop0,), **kw)),
        Request(p[1], SamplingParams(temperature=1.0, stop_token_ids=(stop1,), **kw), n=2, seed=7),
        Request(p[2], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=9, ignore_eos=True), seed=3),
        Request(p[3], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)),
    ]  # fmt: skip


def test_async_decode_equals_the_synchronous_engine_when_sequences_stop_on_tokens(model):
    reqs = stopping_requests(model)
    sync, asy = pair(model)
    a, b = sync.generate(reqs), asy.generate(reqs)
    assert_same(a, b)
    assert a[0].finish_reason == "stop" and len(a[0].token_ids) < 14
    assert asy.lookahead_steps > 0 and asy.lookahead_discarded > 0  # rows dropped after stop tokens
    assert sync.lookahead_steps == 0
    assert asy.stats().pages_in_use == 0 and asy._inflight is None
    assert asy.stats().tokens_generated == sync.stats().tokens_generated


def _steps(eng: NativeEngine, reqs: list[Request], at: int, action) -> list:
    order = {eng.add_request(r): k for k, r in enumerate(reqs)}
    done, n = [], 0
    while eng.has_unfinished():
        done += eng.step()
        n += 1
        if n == at:
            action(eng)
    return sorted(done, key=lambda c: (order[c.request_id], c.sample_index))


def test_an_adapter_sync_cancels_the_step_launched_ahead(model):
    """The sync takes effect at the next step, as in the synchronous engine: the step already
    launched under the old weights is dropped and re-run."""
    g = torch.Generator().manual_seed(0)
    new = {"model.norm.weight": torch.randn(model.config.hidden_size, generator=g) * 3}
    old = model.model.norm.weight.detach().clone()
    reqs = [Request(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
            for p in prompts([17, 30, 5], 9)]  # fmt: skip
    out = []
    for eng in pair(model):
        out.append(_steps(eng, reqs, 5, lambda e: e.set_adapter(new, version=1)))
        model.model.norm.weight.data.copy_(old)
    assert_same(*out)
    assert any(c.adapter_versions[-1] == 1 and 0 in c.adapter_versions for c in out[1])


def test_an_abort_between_steps_drops_the_launched_row(model):
    reqs = [Request(p, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), seed=i,
                    request_id=f"r{i}") for i, p in enumerate(prompts([17, 30, 5], 9))]  # fmt: skip
    sync, asy = pair(model)
    out = [_steps(eng, reqs, 6, lambda e: e.abort("r1")) for eng in (sync, asy)]
    assert_same(*out)
    assert [c.request_id for c in out[1]] == ["r0", "r2"]
    assert asy.stats().pages_in_use == 0 and asy._inflight is None


def test_parked_turns_continue_from_the_synchronous_state(model):
    """Turns that end on a stop token while their next row runs ahead are parked with that row undone:
    the next turn prefills only the last sampled token and the environment's, as without async."""
    reqs = stopping_requests(model)[:2]
    env = [(40, 41, 42), (50,)]
    turns = []
    engines = pair(model)
    for eng in engines:
        for k, r in enumerate(reqs):
            eng.add_request(Request(r.prompt_token_ids, r.params, n=r.n, seed=r.seed, request_id=f"t{k}"),
                            park=True)  # fmt: skip
        got: dict = {}
        while eng.has_unfinished():
            for c in eng.step():
                key = (c.request_id, c.sample_index)
                got.setdefault(key, []).append((c.token_ids, c.finish_reason, c.logprobs))
                k = len(got[key])
                if k <= len(env):
                    eng.continue_sequence(*key, env[k - 1], max_tokens=6)
                else:
                    eng.release(*key)
        turns.append(got)
    (a, b), (sync, asy) = turns, engines
    assert a.keys() == b.keys()
    for key in a:
        for (t1, f1, l1), (t2, f2, l2) in zip(a[key], b[key], strict=True):
            assert t1 == t2 and f1 == f2
            torch.testing.assert_close(l1, l2, atol=1e-5, rtol=0)
    assert asy.lookahead_discarded > 0
    assert asy.stats().prefill_tokens == sync.stats().prefill_tokens
    assert asy.stats().pages_in_use == 0 and asy.num_parked == 0


def test_async_decode_needs_the_static_path(model):
    with pytest.raises(ValueError, match="async_decode"):
        NativeEngine(model, max_pages=8, async_decode=True)
    assert not NativeEngine(model, max_pages=8).async_decode  # a plain CPU engine runs synchronously

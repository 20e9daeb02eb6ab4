"""Native engine on the tiny model (CPU): its log-probs equal the training forward's, greedy output
ignores batch composition, group prefix sharing equals independent samples, preemption is
invisible in the output, stops and adapter swaps behave as documented, bad requests fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.modeling import MiniMaxM3ForCausalLM
from rollout.engine import Completion, Request, SamplingParams
from rollout.native import NativeEngine
from tests.rollout.tiny_models import build, prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> MiniMaxM3ForCausalLM:
    return build()


def fp32_engine(model, **kw) -> NativeEngine:
    kw.setdefault("max_pages", 64)
    return NativeEngine(model, kv_dtype="fp32", index_dtype="fp32", **kw)


def training_logprobs(model, c: Completion, temperature: float = 1.0, kv_sim: bool = False) -> torch.Tensor:
    """The trainer's view: `token_logprobs` of the sampled tokens at the sampling temperature."""
    ids_S = torch.tensor(c.prompt_token_ids + tuple(c.token_ids))
    P = len(c.prompt_token_ids)
    with torch.no_grad():
        lp_1S, _ = model.token_logprobs(
            ids_S[None, :-1], ids_S[None, 1:], kv_sim=kv_sim, temperature=temperature
        )
    return lp_1S[0, P - 1 :]


def assert_same_samples(a: list[Completion], b: list[Completion]) -> None:
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


def test_engine_logprobs_equal_training_forward_fp32(model):
    sp1 = SamplingParams(max_tokens=20, ignore_eos=True)
    sp2 = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_tokens=12, ignore_eos=True)
    reqs = [Request(p, sp, seed=i) for i, (p, sp) in enumerate(zip(prompts([37, 12, 26]), [sp1, sp2, sp1]))]
    out = fp32_engine(model, max_batch_tokens=40).generate(reqs)
    for c, sp in zip(out, [sp1, sp2, sp1]):
        assert len(c.token_ids) == sp.max_tokens and c.finish_reason == "length"
        assert c.logprobs.dtype == torch.float32
        torch.testing.assert_close(c.logprobs, training_logprobs(model, c, sp.temperature), atol=1e-5, rtol=0)


def test_engine_logprobs_with_nvfp4_kv_equal_forward_with_kv_simulation():
    m = build(seed=3, kv_cache_dtype="nvfp4")
    reqs = [
        Request(p, SamplingParams(max_tokens=16, ignore_eos=True), seed=5 + i)
        for i, p in enumerate(prompts([30, 19], 1))
    ]
    out = NativeEngine(m, max_pages=32, max_batch_tokens=32).generate(reqs)
    for c in out:
        torch.testing.assert_close(c.logprobs, training_logprobs(m, c, kv_sim=True), atol=1e-5, rtol=0)
    assert (training_logprobs(m, out[0]) - out[0].logprobs).abs().max() > 1e-5, "NVFP4 KV should matter"


def test_greedy_output_is_identical_whatever_the_batch_composition(model):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    target, *others = prompts([29, 14, 40, 8], 2)
    alone = fp32_engine(model).generate([Request(target, greedy)])[0]
    batched = fp32_engine(model, max_batch_tokens=64).generate(
        [
            Request(others[0], greedy),
            Request(target, greedy),
            Request(others[1], SamplingParams(), n=2),
            Request(others[2], greedy),
        ]
    )[1]
    chunked = fp32_engine(model, max_batch_tokens=7).generate(
        [Request(others[1], greedy), Request(target, greedy)]
    )[1]
    assert alone.token_ids == batched.token_ids == chunked.token_ids
    torch.testing.assert_close(batched.logprobs, alone.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked.logprobs, alone.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("prompt_len", [37, 32])  # partial last page (copy-on-write) / page aligned
def test_group_prefix_sharing_equals_independent_requests_with_derived_seeds(model, prompt_len):
    (p,) = prompts([prompt_len], 3)
    sp = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    eng = fp32_engine(model)
    group = eng.generate([Request(p, sp, n=4, seed=100)])
    shared = eng.stats().shared_prefix_pages
    assert shared == 3 * (prompt_len // 16)
    assert eng.stats().prefill_tokens == prompt_len  # the prompt ran through the model once
    independent = fp32_engine(model).generate([Request(p, sp, seed=100 + i) for i in range(4)])
    assert_same_samples(group, independent)
    assert [c.seed for c in group] == [100, 101, 102, 103]
    assert len({tuple(c.token_ids) for c in group}) == 4
    assert eng.stats().pages_in_use == 0


def test_preemption_under_tiny_page_budget_gives_identical_output(model):
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True)
    reqs = [
        Request(p, sp, seed=7 * i, n=2 if i == 1 else 1) for i, p in enumerate(prompts([20, 30, 11, 25], 4))
    ]
    reference = fp32_engine(model, max_pages=64).generate(reqs)
    eng = fp32_engine(model, max_pages=5, max_batch_tokens=48)
    tight = eng.generate(reqs)
    stats = eng.stats()
    assert stats.preemptions > 0
    assert sum(c.num_preemptions for c in tight) == stats.preemptions
    assert_same_samples(tight, reference)
    assert stats.pages_in_use == 0 and stats.tokens_generated == 5 * 24


def test_stop_token_ids_and_stop_strings_end_generation_after_the_matching_token(model):
    (p,) = prompts([15], 5)
    base = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    free = fp32_engine(model).generate([Request(p, base)])[0].token_ids
    stop_tok = free[5]
    cut = free.index(stop_tok) + 1
    out = fp32_engine(model).generate([Request(p, dataclasses.replace(base, stop_token_ids=(stop_tok,)))])[0]
    assert out.token_ids == free[:cut] and out.finish_reason == "stop" and out.stop_reason == stop_tok

    def detok(ids):
        return "".join(f"<{i}>" for i in ids)

    stop_str = f"<{free[3]}><{free[4]}>"
    eng = fp32_engine(model, detokenize=detok)
    out = eng.generate([Request(p, dataclasses.replace(base, stop=(stop_str,)))])[0]
    assert out.token_ids == free[:5] and out.stop_reason == stop_str
    # The model's EOS stops too unless ignore_eos.
    eos_model = build()
    eos_model.config.eos_token_id = free[2]
    out = fp32_engine(eos_model).generate([Request(p, dataclasses.replace(base, ignore_eos=False))])[0]
    assert out.token_ids == free[: free.index(free[2]) + 1] and out.finish_reason == "stop"


def test_adapter_swap_mid_stream_changes_only_later_tokens_and_records_versions():
    m = build(seed=1)
    (p,) = prompts([18], 6)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = fp32_engine(m).generate([Request(p, greedy)])[0]
    new_head = m.lm_head.weight.detach() + 0.5 * torch.randn(
        m.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)
    )
    eng = fp32_engine(m)
    eng.add_request(Request(p, greedy))
    done = eng.step() + eng.step() + eng.step() + eng.step()  # prefill + 3 decodes: 4 tokens
    eng.set_adapter({"lm_head.weight": new_head}, version=1)
    while eng.has_unfinished():
        done += eng.step()
    (c,) = done
    assert c.adapter_versions == [0] * 4 + [1] * 8 and c.adapter_version == 0
    assert c.token_ids[:4] == before.token_ids[:4] and c.token_ids[4:] != before.token_ids[4:]
    assert eng.generate([Request(p, greedy)])[0].adapter_versions == [1] * 12
    with pytest.raises(ValueError, match="no matching"):
        eng.set_adapter({"not.a.param": new_head}, version=2)
    with pytest.raises(ValueError, match="shapes"):
        eng.set_adapter({"lm_head.weight": new_head[:3]}, version=2)
    assert eng.stats().adapter_version == 1


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ((5, 600, 7), SamplingParams(), "vocabulary|\\[0, 512\\)"),
        ((5, -1, 7), SamplingParams(), "\\[0, 512\\)"),
        (tuple([5] * 4096), SamplingParams(), "positions"),
        ((5, 6), SamplingParams(stop_token_ids=(999,)), "stop_token_ids"),
        ((5, 6), SamplingParams(stop=("x",)), "detokenize"),
        ((5,) * 40, SamplingParams(max_tokens=60), "pages"),
    ],
)
def test_bad_requests_raise_value_error_before_any_compute(model, prompt, params, match):
    eng = fp32_engine(model, max_pages=4)
    with pytest.raises(ValueError, match=match):
        eng.add_request(Request(prompt, params))
    with pytest.raises(ValueError, match=match):  # all or nothing: the good request is not queued
        eng.generate([Request((5, 6, 7)), Request(prompt, params)])
    assert not eng.has_unfinished() and eng.stats().steps == 0


def test_set_adapter_loads_lora_tensors_in_place_and_changes_samples():
    from model.layers.lora import LoRAConfig, apply_lora, lora_state_dict

    m = apply_lora(build(seed=2), LoRAConfig(r=4))
    (p,) = prompts([21], 7)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    eng = fp32_engine(m)
    base = eng.generate([Request(p, greedy)])[0]
    tensors = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) * 0.2
               for k, v in lora_state_dict(m).items()}  # fmt: skip
    storage = {k: v.data_ptr() for k, v in m.named_parameters()}
    eng.set_adapter(tensors, version=3)
    assert {k: v.data_ptr() for k, v in m.named_parameters()} == storage  # in place, no re-allocation
    tuned = eng.generate([Request(p, greedy)])[0]
    assert tuned.adapter_versions == [3] * 8 and tuned.token_ids != base.token_ids
    torch.testing.assert_close(tuned.logprobs, training_logprobs(m, tuned), atol=1e-5, rtol=0)


def test_groups_beyond_seq_limit_or_single_token_still_complete_and_free_every_page(model):
    ps = prompts([37, 16], 8)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    reqs = [
        Request(ps[0], sp, n=5, seed=1),
        Request(ps[1], dataclasses.replace(sp, max_tokens=1), n=3, seed=9),
    ]
    reference = fp32_engine(model).generate(reqs)
    eng = fp32_engine(model, max_num_seqs=2, max_pages=8)
    out = eng.generate(reqs)
    assert [(c.request_id, c.sample_index) for c in out] == [("req-0", i) for i in range(5)] + [
        ("req-1", i) for i in range(3)
    ]
    assert_same_samples(out, reference)
    assert [len(c.token_ids) for c in out] == [6] * 5 + [1] * 3
    assert eng.stats().pages_in_use == 0 and not eng.has_unfinished()


def test_page_allocator_refcounts_free_a_page_only_after_its_last_release():
    from rollout.native.scheduler import PageAllocator

    alloc = PageAllocator(3)
    a, b = alloc.allocate(2)
    alloc.share([a])
    alloc.release([a, b])
    assert alloc.num_free == 2 and alloc.refcount[a] == 1
    alloc.release([a])
    assert alloc.num_free == 3
    with pytest.raises(RuntimeError, match="released more often"):
        alloc.release([a])
    with pytest.raises(RuntimeError, match="asked for 4"):
        alloc.allocate(4)


def test_duplicate_in_flight_request_id_is_rejected(model):
    eng = fp32_engine(model)
    eng.add_request(Request((5, 6, 7), request_id="a"))
    with pytest.raises(ValueError, match="already in flight"):
        eng.add_request(Request((5, 6), request_id="a"))
    eng.step()


def test_adapter_swap_during_group_prefill_makes_siblings_recompute_instead_of_sharing_stale_kv():
    m = build(seed=4)
    (p,) = prompts([40], 9)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    new_head = m.lm_head.weight.detach() * 1.5
    eng = fp32_engine(m, max_batch_tokens=16)
    eng.add_request(Request(p, sp, n=3, seed=20))
    done = eng.step()  # first prompt chunk under version 0
    eng.set_adapter({"lm_head.weight": new_head}, version=1)
    while eng.has_unfinished():
        done += eng.step()
    assert eng.stats().shared_prefix_pages == 0
    siblings = sorted((c for c in done if c.sample_index > 0), key=lambda c: c.sample_index)
    fresh = fp32_engine(m).generate([Request(p, sp, seed=20 + i) for i in (1, 2)])
    assert_same_samples(siblings, fresh)
    assert all(c.adapter_versions == [1] * 5 for c in done)

"""CUDA-graph decode of the native engine (GPU only): replayed graphs, which sample inside the replay,
give the eager runner's tokens and log-probs (fp32 torch paths and bf16 Triton paths), seeded sampling
is unchanged by graphs (sampled in the graph, or re-sampled eagerly for truncated rows), and an adapter
sync under graphs takes effect at the next step without a re-capture."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.config import ModelConfig
from model.modeling import MiniMaxM3ForCausalLM
from rollout.engine import Completion, Request, SamplingParams
from rollout.native import NativeEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> MiniMaxM3ForCausalLM:
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), **overrides)
    model = MiniMaxM3ForCausalLM(cfg).init_weights(std=0.05, seed=seed)
    return model.to(device="cuda", dtype=dtype).eval()


def prompts(lengths, seed=0) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(3, 512, (n,), generator=g).tolist()) for n in lengths]


def requests(temperature: float = 0.0, n_prompts: int = 5, max_tokens: int = 24,
             top_p: float | None = None) -> list[Request]:  # fmt: skip
    top_p = (0.9 if temperature else 1.0) if top_p is None else top_p
    sp = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, ignore_eos=True)
    lengths = [9, 40, 17, 3, 70, 25, 33][:n_prompts]  # 5 sequences: bucket 8; page-crossing decodes
    return [Request(p, sp, seed=11 + i) for i, p in enumerate(prompts(lengths, 1))]


def engines(model, fp32_cache: bool, **kw) -> dict[str, NativeEngine]:
    kw = dict(max_pages=64, max_batch_tokens=128, max_num_seqs=16, **kw)
    if fp32_cache:
        kw.update(kv_dtype="fp32", index_dtype="fp32")
    return {
        "graphs": NativeEngine(model, cuda_graphs=True, **kw),
        "static": NativeEngine(model, cuda_graphs=False, static_decode=True, **kw),
        "eager": NativeEngine(model, cuda_graphs=False, static_decode=False, **kw),
    }


def assert_same(a: list[Completion], b: list[Completion], atol: float = 1e-5) -> None:
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=atol, rtol=0)


def assert_graphs_ran(eng: NativeEngine) -> None:
    r = eng.runner
    assert r.graph_error is None, r.graph_error
    assert r.num_captures >= 1 and r.static_steps > 0 and r.cuda_graphs


def test_graph_replay_equals_eager_runner_fp32():
    model = build(torch.float32)
    engs = engines(model, fp32_cache=True)
    out = {name: eng.generate(requests()) for name, eng in engs.items()}
    assert_graphs_ran(engs["graphs"])
    r = engs["graphs"].runner
    assert r.sampled_in_pass == r.static_steps  # greedy, untruncated: every decode step sampled in the graph
    assert_same(out["graphs"], out["static"], atol=1e-5)
    assert_same(out["graphs"], out["eager"], atol=1e-5)


def test_graph_replay_equals_eager_runner_bf16_nvfp4_kv():
    model = build(torch.bfloat16, seed=2, kv_cache_dtype="nvfp4")
    engs = engines(model, fp32_cache=False)
    out = {name: eng.generate(requests()) for name, eng in engs.items()}
    assert_graphs_ran(engs["graphs"])
    assert_same(out["graphs"], out["static"], atol=1e-5)  # same kernels, same padded shapes
    # Unpadded eager passes run other launch shapes (other split-K / tiles): bf16 rounding may flip a
    # near-tie and the sequence then diverges; a broken replay would agree on almost nothing.
    agree = sum(a == b for x, y in zip(out["graphs"], out["eager"]) for a, b in zip(x.token_ids, y.token_ids))
    assert agree >= 0.5 * sum(len(c.token_ids) for c in out["eager"])


def assert_compiled(eng: NativeEngine) -> None:
    assert eng.runner.compile_error is None, eng.runner.compile_error
    assert eng.runner.compile_decode


def test_compiled_graph_replay_equals_eager_runner_fp32():
    model = build(torch.float32, seed=6)
    kw = dict(max_pages=64, max_batch_tokens=128, max_num_seqs=16, kv_dtype="fp32", index_dtype="fp32")
    compiled = NativeEngine(model, cuda_graphs=True, compile_decode=True, **kw)
    eager = NativeEngine(model, cuda_graphs=False, static_decode=False, **kw)
    out_c, out_e = compiled.generate(requests()), eager.generate(requests())
    assert_graphs_ran(compiled)
    assert_compiled(compiled)
    assert_same(out_c, out_e, atol=1e-4)  # Inductor reorders fp32 sums: not bit-exact


def test_compiled_graph_replay_bf16_nvfp4_kv_runs_the_triton_kernels():
    model = build(torch.bfloat16, seed=2, kv_cache_dtype="nvfp4")
    kw = dict(max_pages=64, max_batch_tokens=128, max_num_seqs=16)
    compiled = NativeEngine(model, cuda_graphs=True, compile_decode=True, **kw)
    static = NativeEngine(model, cuda_graphs=False, static_decode=True, **kw)
    out_c, out_s = compiled.generate(requests()), static.generate(requests())
    assert_graphs_ran(compiled)
    assert_compiled(compiled)
    # bf16 rounding of fused ops differs from the unfused ones: a near-tie may flip and a sequence
    # diverge after it; a broken compiled pass would agree on almost nothing.
    agree = sum(a == b for x, y in zip(out_c, out_s) for a, b in zip(x.token_ids, y.token_ids))
    assert agree >= 0.5 * sum(len(c.token_ids) for c in out_s)
    lp_c = torch.cat([c.logprobs[:4] for c in out_c])  # first tokens: before any divergence
    lp_s = torch.cat([c.logprobs[:4] for c in out_s])
    assert (lp_c - lp_s).abs().mean() < 0.05


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_seeded_sampling_is_identical_with_and_without_graphs(top_p):
    """top_p 1: the replay samples (noise kernel and exponential race inside the graph); top_p 0.9: the
    replay's logits are re-sampled eagerly with the same keys. Either way: the eager runner's samples."""
    model = build(torch.float32, seed=4)
    engs = engines(model, fp32_cache=True)
    out = {name: eng.generate(requests(temperature=0.8, top_p=top_p)) for name, eng in engs.items()}
    assert_graphs_ran(engs["graphs"])
    r = engs["graphs"].runner
    assert r.sampled_in_pass == (r.static_steps if top_p == 1.0 else 0)
    assert_same(out["graphs"], out["static"])
    assert_same(out["graphs"], out["eager"])
    again = engs["graphs"].generate(requests(temperature=0.8, top_p=top_p))
    assert_same(out["graphs"], again)


def _generate_with_swap(eng: NativeEngine, swap_after: int, tensors: dict) -> list[Completion]:
    order = {eng.add_request(r): k for k, r in enumerate(requests(n_prompts=3, max_tokens=16))}
    done, steps = [], 0
    while eng.has_unfinished():
        done += eng.step()
        steps += 1
        if steps == swap_after:
            eng.set_adapter(tensors, version=1)
    return sorted(done, key=lambda c: order[c.request_id])


@pytest.mark.parametrize("compile_decode", [False, True])
def test_adapter_sync_under_graphs_takes_effect_at_the_next_step_without_recapture(compile_decode):
    model = build(torch.float32, seed=5)
    g = torch.Generator().manual_seed(0)
    new_norm = {"model.norm.weight": (torch.randn(model.config.hidden_size, generator=g) * 3).cuda()}
    old_norm = {"model.norm.weight": model.model.norm.weight.detach().clone()}
    engs = engines(model, fp32_cache=True)
    graphs = engs["graphs"]
    if compile_decode:
        graphs = NativeEngine(model, cuda_graphs=True, compile_decode=True, max_pages=64,
                              max_batch_tokens=128, max_num_seqs=16, kv_dtype="fp32",
                              index_dtype="fp32")  # fmt: skip
    graphs.generate(requests(n_prompts=3, max_tokens=4))  # captured before the swap
    captures = graphs.runner.num_captures
    swapped = _generate_with_swap(graphs, 6, new_norm)
    assert graphs.runner.num_captures == captures, "an adapter sync must not re-capture"
    model.model.norm.weight.data.copy_(old_norm["model.norm.weight"])
    reference = _generate_with_swap(engs["eager"], 6, new_norm)
    model.model.norm.weight.data.copy_(old_norm["model.norm.weight"])
    unswapped = engs["eager"].generate(requests(n_prompts=3, max_tokens=16))
    assert_same(swapped, reference, atol=1e-4 if compile_decode else 1e-5)
    assert any(c.adapter_versions[-1] == 1 and 0 in c.adapter_versions for c in swapped)
    assert [c.token_ids for c in swapped] != [c.token_ids for c in unswapped], "the swap must matter"

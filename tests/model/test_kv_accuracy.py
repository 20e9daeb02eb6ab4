"""KV accuracy measurement (benchmarks/kv_accuracy.py) and the nvfp4_4over6 cache dtype it measures."""

import dataclasses

import pytest
import torch

from benchmarks.kv_accuracy import (
    REFERENCE,
    KVChoice,
    cached_logprobs,
    compare,
    next_token_metrics,
    simulated_logprobs,
    summarize,
    with_kv_choice,
)
from model import nvfp4
from model.config import ModelConfig, QuantConfig
from model.kv_cache import KVCache, kv_quant_dequant, slot_mapping
from model.modeling import MiniMaxM3ForCausalLM


def tiny(**overrides) -> ModelConfig:
    return dataclasses.replace(ModelConfig.preset("tiny"), quantization=QuantConfig(), **overrides)


@pytest.fixture(scope="module")
def model_and_seqs():
    # std 0.1: peaked enough distributions that a KV rounding visibly moves them.
    model = MiniMaxM3ForCausalLM(tiny()).init_weights(std=0.1, seed=3).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (40, 57)]
    return model, seqs, [5, 9]


def test_bf16_against_bf16_gives_zero_kl_and_full_top1_agreement(model_and_seqs):
    model, seqs, score_from = model_and_seqs
    ref = cached_logprobs(with_kv_choice(model, REFERENCE), seqs)
    again = cached_logprobs(with_kv_choice(model, KVChoice("bf16 again", "bf16")), seqs)
    kl_T, agree_T, pos_T = compare(ref, again, score_from)
    assert kl_T.shape[0] == (40 - 1 - 5) + (57 - 1 - 9)  # predictions of tokens after score_from
    assert torch.equal(kl_T, torch.zeros_like(kl_T)) and bool(agree_T.all())
    s = summarize(kl_T, agree_T, pos_T)
    assert s["kl_mean"] == 0.0 and s["top1_agree"] == 1.0 and s["buckets"]["0-127"]["n"] == kl_T.shape[0]


@pytest.mark.parametrize("kv", ["nvfp4", "nvfp4_4over6"])
def test_nvfp4_kv_against_bf16_gives_positive_kl(model_and_seqs, kv):
    model, seqs, score_from = model_and_seqs
    ref = cached_logprobs(with_kv_choice(model, REFERENCE), seqs)
    var = cached_logprobs(with_kv_choice(model, KVChoice(kv, kv, kv)), seqs)
    kl_T, agree_T, _ = compare(ref, var, score_from)
    assert float(kl_T.mean()) > 1e-6 and bool((kl_T >= 0).all())
    assert 0.0 < float(agree_T.double().mean()) <= 1.0


def test_cached_path_equals_kv_sim_forward_with_per_layer_overrides(model_and_seqs):
    model, seqs, _ = model_and_seqs
    choice = KVChoice("mixed", "nvfp4_4over6", "nvfp4", overrides=((0, "bf16"), (2, "fp8")))
    variant = with_kv_choice(model, choice)
    assert [variant.config.kv_dtype_for_layer(i) for i in range(4)] == [
        "bf16",
        "nvfp4_4over6",
        "fp8",
        "nvfp4_4over6",
    ]
    # 2e-4: a few positions whose fp8 / NVFP4 rounding flips between the two summation orders
    # (1.4e-4 seen on some CPUs, in 5 of 29,184 log-probs).
    for a, b in zip(cached_logprobs(variant, seqs), simulated_logprobs(variant, seqs), strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0)


def test_next_token_metrics_kl_matches_definition_and_argmax_flip():
    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5]]), dim=-1)
    var = torch.log_softmax(torch.tensor([[1.0, 0.5, -1.0], [1.2, 1.0, 0.5]]), dim=-1)
    m = next_token_metrics(ref, var)
    want = (ref.exp() * (ref - var)).sum(-1).double()
    torch.testing.assert_close(m["kl"], want)
    assert m["agree"].tolist() == [True, False]


def test_nvfp4_4over6_cache_round_trip_equals_kv_quant_dequant_four_over_six():
    cfg = tiny(kv_cache_dtype="nvfp4_4over6", index_cache_dtype="nvfp4_4over6")
    cache = KVCache(cfg, num_pages=4)
    plain = KVCache(tiny(kv_cache_dtype="nvfp4", index_cache_dtype="nvfp4"), num_pages=4)
    assert cache.total_bytes_per_token() == plain.total_bytes_per_token()
    assert cache.kv[1].shape[-1] == cfg.head_dim // 2 + cfg.head_dim // 16
    g = torch.Generator().manual_seed(1)
    T, N, C = 30, cfg.num_key_value_heads, cfg.head_dim
    k_TNC, v_TNC = torch.randn(T, N, C, generator=g) * 2, torch.randn(T, N, C, generator=g)
    idx_TC = torch.randn(T, cfg.index_head_dim, generator=g)
    table_P = torch.tensor([2, 0])
    slots_T = slot_mapping(table_P[None], torch.zeros(T, dtype=torch.long), torch.arange(T), cache.page_size)
    for c in (cache, plain):
        c.set_scales(1, 0.003, 0.001, 0.002)
        c.append(1, slots_T, k_TNC, v_TNC, idx_TC)
    k_got, v_got = cache.gather(1, table_P, T)
    assert torch.equal(k_got, nvfp4.kv_quant_dequant(k_TNC, torch.tensor(0.003), four_over_six=True))
    assert torch.equal(v_got, nvfp4.kv_quant_dequant(v_TNC, torch.tensor(0.001), four_over_six=True))
    idx_got = cache.gather_index(1, table_P, T)
    assert torch.equal(idx_got, nvfp4.kv_quant_dequant(idx_TC, torch.tensor(0.002), four_over_six=True))
    assert torch.equal(k_got, kv_quant_dequant(k_TNC, "nvfp4_4over6", cache.scales[1, 0]))
    # The writer really differs from plain NVFP4 (some blocks pick max/4) and is more accurate.
    k_plain, _ = plain.gather(1, table_P, T)
    assert not torch.equal(k_got, k_plain)
    assert (k_got - k_TNC).square().sum() < (k_plain - k_TNC).square().sum()

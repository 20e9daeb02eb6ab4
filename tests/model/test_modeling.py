"""The whole causal LM: meta-device full size, cached decode == full forward, logprobs, grads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.capacity import num_parameters
from model.config import ModelConfig, QuantConfig
from model.modeling import MiniMaxM3ForCausalLM


def tiny(**overrides) -> ModelConfig:
    return dataclasses.replace(ModelConfig.preset("tiny"), **overrides)


def build(cfg: ModelConfig, seed: int = 0, dtype=torch.float32) -> MiniMaxM3ForCausalLM:
    torch.manual_seed(seed)
    return MiniMaxM3ForCausalLM(cfg).to(dtype).init_weights(std=0.05, seed=seed).eval()


def test_full_size_m3_on_meta_device_matches_planner_and_published_size():
    for name in ("m3", "m3.1-flash"):
        cfg = dataclasses.replace(ModelConfig.preset(name), num_mtp_modules=0)
        with torch.device("meta"):
            model = MiniMaxM3ForCausalLM(cfg)
        n = model.num_parameters()
        assert n == num_parameters(cfg), name
        assert 426e9 <= n <= 428e9, n
    active = num_parameters(cfg, active=True)
    assert 22e9 <= active <= 24e9, active


def decode_token_by_token(model, ids_S, cache_dtype=None) -> torch.Tensor:
    S = ids_S.shape[0]
    page = model.config.index_block_size
    n_pages = -(-S // page)
    cache = model.new_kv_cache(n_pages + 1, dtype=cache_dtype)
    table_1P = torch.arange(1, n_pages + 1).unsqueeze(0)  # page 0 left unused on purpose
    rows = []
    for t in range(S):
        rows.append(
            model.forward_cached(
                ids_S[t : t + 1], torch.tensor([t]), torch.tensor([0]), cache, table_1P, torch.tensor([t + 1])
            )
        )
    return torch.cat(rows)


@torch.no_grad()
def test_cached_decode_token_by_token_reproduces_full_forward_fp32():
    model = build(tiny())
    ids_S = torch.randint(0, model.config.vocab_size, (53,), generator=torch.Generator().manual_seed(1))
    full_SV = model(ids_S.unsqueeze(0))[0]
    cached_SV = decode_token_by_token(model, ids_S, cache_dtype="fp32")
    torch.testing.assert_close(cached_SV, full_SV, atol=1e-5, rtol=0)


@torch.no_grad()
def test_cached_decode_with_nvfp4_kv_matches_forward_with_kv_simulation():
    cfg = tiny(kv_cache_dtype="nvfp4", index_cache_dtype="bf16")
    model = build(cfg, seed=3)
    ids_S = torch.randint(0, cfg.vocab_size, (41,), generator=torch.Generator().manual_seed(2))
    sim_SV = model(ids_S.unsqueeze(0), kv_sim=True)[0]
    plain_SV = model(ids_S.unsqueeze(0))[0]
    cached_SV = decode_token_by_token(model, ids_S)
    torch.testing.assert_close(cached_SV, sim_SV, atol=1e-5, rtol=0)
    assert (sim_SV - plain_SV).abs().max() > 1e-4, "NVFP4 KV simulation should change the logits"


@torch.no_grad()
def test_cached_prefill_of_ragged_batch_matches_forward():
    """Two sequences of different lengths prefilled in one flattened call, then one decode step each."""
    model = build(tiny(), seed=5)
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 512, (n,), generator=gen) for n in (37, 20)]
    cache = model.new_kv_cache(8, dtype="fp32")
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]])
    prompt = [s[:-1] for s in seqs]
    ids_T = torch.cat(prompt)
    pos_T = torch.cat([torch.arange(len(p)) for p in prompt])
    seq_T = torch.cat([torch.full((len(p),), i) for i, p in enumerate(prompt)])
    lens = torch.tensor([len(p) for p in prompt])
    model.forward_cached(ids_T, pos_T, seq_T, cache, tables, lens)
    last = model.forward_cached(
        torch.stack([s[-1] for s in seqs]), lens.clone(), torch.tensor([0, 1]), cache, tables, lens + 1
    )
    for i, s in enumerate(seqs):
        ref = model(s.unsqueeze(0))[0, -1]
        torch.testing.assert_close(last[i], ref, atol=1e-5, rtol=0)


def test_token_logprobs_equal_log_softmax_of_logits_and_padding_is_ignored():
    model = build(tiny(), seed=2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 30), generator=gen)
    logits = model(ids[:, :-1])
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    lp, ent = model.token_logprobs(ids[:, :-1], ids[:, 1:], chunk_tokens=7, with_entropy=True)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(ent, -(p * torch.log_softmax(logits, -1)).sum(-1), atol=1e-5, rtol=0)
    # A right-padded row gives the same log-probs on its real tokens.
    seq_ids = torch.zeros(2, 29, dtype=torch.long)
    seq_ids[1, 20:] = -1
    lp_pad, _ = model.token_logprobs(ids[:, :-1], ids[:, 1:], seq_ids_BS=seq_ids)
    short, _ = model.token_logprobs(ids[1:, :20], ids[1:, 1:21])
    torch.testing.assert_close(lp_pad[1, :20], short[0], atol=1e-5, rtol=0)


def test_gradients_reach_trainable_weights_but_not_nvfp4_experts_with_checkpointing():
    model = build(tiny(), seed=4).train()
    model.gradient_checkpointing = True
    for p in model.parameters():
        p.requires_grad_(True)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    lp, _ = model.token_logprobs(ids[:, :-1], ids[:, 1:])
    lp.mean().backward()
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.weight.grad is not None and attn.q_proj.weight.grad.abs().sum() > 0
    moe = model.model.layers[1].block_sparse_moe
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    assert moe.experts.fmt == "nvfp4"
    assert all(not b.requires_grad for b in moe.experts.buffers())


def test_bf16_experts_config_builds_float_bank():
    cfg = tiny(quantization=QuantConfig(routed_experts="bf16"))
    model = build(cfg)
    assert model.model.layers[1].block_sparse_moe.experts.fmt == "float"
    with pytest.raises(ValueError, match="preset"):
        ModelConfig.preset("nope")

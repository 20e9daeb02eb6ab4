"""Attention (dense + MSA), norm, rope and the paged ops: oracles, cache equivalence, gradients."""

import dataclasses
import random

import pytest
import torch
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

from model.config import ModelConfig
from model.kernels.indexer import index_select_blocks
from model.kernels.sparse_attention import sparse_attention
from model.kv_cache import KVCache, slot_mapping
from model.layers.attention import Attention, select_blocks
from model.layers.norm import RMSNorm, rms_norm
from model.layers.rope import apply_rope, rope_cos_sin

DENSE, SPARSE = 0, 1  # layer ids in the tiny preset: layer 0 full attention, layers 1-3 MSA


def tiny(**overrides) -> ModelConfig:
    return dataclasses.replace(ModelConfig.preset("tiny"), **overrides)


def make_attention(cfg: ModelConfig, layer: int, seed: int = 0, dyadic: bool = False) -> Attention:
    """Random weights. `dyadic`: small multiples of 1/16 (norms 1/8) so the projections and norms
    are exact in fp32 whatever the summation order, making quantized-cache comparisons bitwise."""
    attn = Attention(cfg, layer)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            is_norm = name.endswith("norm.weight")
            if dyadic:
                p.copy_(torch.randint(-2, 3, p.shape, generator=g) / (8 if is_norm else 16))
            elif is_norm:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return attn


def make_x(S: int, D: int, seed: int = 1, dyadic: bool = False, B: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dyadic:
        return torch.randint(-2, 3, (B, S, D), generator=g) / 4
    return torch.randn(B, S, D, generator=g)


def select_loop(scores: list[float], q_block: int, topk: int, local: int, init: int) -> list[int]:
    """Brute-force statement of the MSA selection rule (docs/FACTS.md, "MSA and the lightning indexer")."""
    forced: list[int] = []
    for b in [q_block - d for d in range(local)] + list(range(init)):
        if 0 <= b <= q_block and b not in forced:
            forced.append(b)
    rest = sorted((b for b in range(q_block + 1) if b not in forced), key=lambda b: (-scores[b], b))
    chosen = (forced + rest)[:topk]
    return chosen + [-1] * (topk - len(chosen))


def msa_reference(attn: Attention, x_SD: torch.Tensor) -> torch.Tensor:
    """Loop-level MSA for one sequence at positions 0..S-1: per token and KV group, block scores
    by max over visible keys, brute-force selection, softmax over the selected causal keys."""
    cfg, S = attn.config, x_SD.shape[0]
    q, k, v, iq, ik = attn._project(x_SD, torch.arange(S))
    H, N, C, bs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.index_block_size
    out = torch.zeros(S, H, C)
    for t in range(S):
        qb = t // bs
        for g in range(N):
            if attn.is_sparse:
                scores = [max(float(iq[t, g] @ ik[j]) for j in range(b * bs, min(t + 1, (b + 1) * bs)))
                          for b in range(qb + 1)]  # fmt: skip
                blocks = select_loop(scores, qb, cfg.index_topk_blocks, cfg.index_local_blocks,
                                     cfg.index_init_blocks)  # fmt: skip
            else:
                blocks = list(range(qb + 1))
            keys = [j for j in range(t + 1) if j // bs in blocks]
            for h in range(g * H // N, (g + 1) * H // N):
                p = torch.softmax(k[keys, g] @ q[t, h] / C**0.5, dim=0)
                out[t, h] = p @ v[keys, g]
    return attn.o_proj(out.reshape(S, H * C))


# ----------------------------------------------------------------------------- norm and rope
def test_rms_norm_is_gemma_formula_in_fp32_and_keeps_dtype():
    x = torch.randn(3, 5, 64)
    w = torch.randn(64) * 0.1
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert torch.allclose(rms_norm(x, w, 1e-6), want, atol=1e-6)
    norm = RMSNorm(64)
    assert torch.equal(norm.weight, torch.zeros(64))  # identity scale at init
    xb = x.bfloat16()
    out = norm(xb)
    assert out.dtype == torch.bfloat16
    assert torch.equal(
        out, (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    )


def test_rms_norm_matches_transformers_gemma_norm():
    ours, theirs = RMSNorm(32), hf.MiniMaxM3VLRMSNorm(32)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    x = torch.randn(4, 32).bfloat16()
    assert torch.equal(ours(x), theirs(x))


def test_rope_matches_transformers_partial_neox_and_passes_tail_through():
    cfg = hf_text_config(tiny())
    rotary = hf.MiniMaxM3VLRotaryEmbedding(cfg)
    pos = torch.tensor([[0, 1, 7, 300, 4095]])
    q, k = torch.randn(1, 4, 5, 32), torch.randn(1, 2, 5, 32)  # transformers layout [B, H, S, C]
    cos_hf, sin_hf = rotary(q, pos)
    q_hf, k_hf = hf.apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    cos, sin = rope_cos_sin(pos, 16, 10_000.0)
    q_ours = apply_rope(q.transpose(1, 2), cos, sin).transpose(1, 2)
    k_ours = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)
    assert torch.allclose(q_ours, q_hf, atol=1e-6) and torch.allclose(k_ours, k_hf, atol=1e-6)
    assert torch.equal(q_ours[..., 16:], q[..., 16:])


def test_rope_scores_depend_only_on_relative_position():
    q, k = torch.randn(1, 1, 32), torch.randn(1, 1, 32)

    def score(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([pq]), 16, 10_000.0)
        ck, sk = rope_cos_sin(torch.tensor([pk]), 16, 10_000.0)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    assert score(10, 3) == pytest.approx(score(1007, 1000), abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-3)


# ----------------------------------------------------------------------------- block selection
@pytest.mark.parametrize(
    "topk,local,init", [(2, 1, 0), (4, 2, 1), (3, 1, 2), (8, 1, 0), (5, 3, 2), (1, 2, 0)]
)
def test_select_blocks_matches_loop_reference(topk, local, init):
    g = torch.Generator().manual_seed(topk * 10 + local)
    NB = 6
    scores = torch.randint(-3, 4, (4, 3, 9, NB), generator=g).float()  # integers: plenty of ties
    q_block = torch.randint(0, NB, (4, 3, 9), generator=g)
    got = select_blocks(scores, q_block, topk=topk, local_blocks=local, init_blocks=init)
    assert got.shape == (4, 3, 9, topk)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in q_block.shape)).tolist():
        want = select_loop(scores[tuple(idx)].tolist(), int(q_block[tuple(idx)]), topk, local, init)
        assert got[tuple(idx)].tolist() == want, (idx, want)


def test_select_blocks_forces_own_block_even_with_the_lowest_score_and_pads_with_minus_one():
    scores = torch.tensor([[5.0, 4.0, -9.0, 100.0]])  # block 3 is not a candidate for q_block 2
    got = select_blocks(scores, torch.tensor([2]), topk=6, local_blocks=1, init_blocks=0)
    assert got.tolist() == [[2, 0, 1, -1, -1, -1]]


# ----------------------------------------------------------------------------- training forward
def dense_causal_reference(attn: Attention, x_SD: torch.Tensor) -> torch.Tensor:
    S, H, N, C = x_SD.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v, _, _ = attn._project(x_SD, torch.arange(S))
    k, v = k.repeat_interleave(H // N, dim=1), v.repeat_interleave(H // N, dim=1)
    scores = torch.einsum("shc,thc->hst", q, k) / C**0.5
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hst,thc->shc", torch.softmax(scores, -1), v)
    return attn.o_proj(out.reshape(S, H * C))


def test_msa_equals_dense_causal_attention_when_topk_covers_all_blocks():
    cfg = tiny(index_topk_blocks=5)
    x = make_x(70, cfg.hidden_size)  # 5 blocks of 16
    sparse = make_attention(cfg, SPARSE)
    dense = Attention(cfg, DENSE)
    dense.load_state_dict(sparse.state_dict(), strict=False)  # same q/k/v/o and norms
    with torch.no_grad():
        out_sparse = sparse(x, torch.arange(70)[None])
        out_dense = dense(x, torch.arange(70)[None])
        want = dense_causal_reference(sparse, x[0])
    assert (out_sparse[0] - want).abs().max() < 2e-6
    assert (out_dense[0] - want).abs().max() < 2e-6


@pytest.mark.parametrize("topk,local,init", [(2, 1, 0), (3, 2, 1), (2, 1, 1)])
def test_msa_with_few_blocks_matches_masked_reference(topk, local, init):
    cfg = tiny(index_topk_blocks=topk, index_local_blocks=local, index_init_blocks=init)
    attn = make_attention(cfg, SPARSE, seed=topk + local)
    x = make_x(75, cfg.hidden_size)
    with torch.no_grad():
        got = attn(x, torch.arange(75)[None])[0]
        want = msa_reference(attn, x[0])
        assert (got - want).abs().max() < 2e-6
        # sparsity matters here: dense attention gives something else
        assert (got - dense_causal_reference(attn, x[0])).abs().max() > 1e-3


def hf_text_config(cfg: ModelConfig) -> MiniMaxM3VLTextConfig:
    hcfg = MiniMaxM3VLTextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, rotary_dim=cfg.rotary_dim, rms_norm_eps=cfg.rms_norm_eps,
        # transformers ignores `rotary_dim`: partial rotation comes from partial_rotary_factor only.
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim},
        layer_types=cfg.layer_types, mlp_layer_types=cfg.mlp_layer_types, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_block_size=cfg.index_block_size,
        index_topk_blocks=cfg.index_topk_blocks, index_local_blocks=cfg.index_local_blocks,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
    )  # fmt: skip
    hcfg._attn_implementation = "eager"
    return hcfg


@pytest.mark.parametrize("layer", [DENSE, SPARSE])
def test_matches_transformers_attention_with_copied_weights(layer):
    cfg = tiny()  # top-2 of up to 6 blocks, local 1, init 0 (transformers has no init blocks)
    ours = make_attention(cfg, layer, seed=5)
    hcfg = hf_text_config(cfg)
    theirs = hf.MiniMaxM3VLAttention(hcfg, layer)
    renamed = {k.replace("index_", "indexer."): v for k, v in ours.state_dict().items()}
    theirs.load_state_dict(renamed)
    S = 90
    x, pos = make_x(S, cfg.hidden_size, seed=6), torch.arange(S)[None]
    cos_sin = hf.MiniMaxM3VLRotaryEmbedding(hcfg)(x, pos)
    causal = torch.zeros(1, 1, S, S).masked_fill(
        ~torch.ones(S, S, dtype=torch.bool).tril(), torch.finfo(x.dtype).min
    )
    with torch.no_grad():
        want, _ = theirs(x, cos_sin, causal, position_ids=pos)
        got = ours(x, pos)
        assert (got - want).abs().max() < 1e-5
        if layer == SPARSE:
            # Same block sets; transformers' slot order within the forced/top-k list is unspecified.
            theirs_blocks = theirs.indexer(x, cos_sin, None, pos)  # [B, N, S, min(topk, NB)]
            ours_blocks = ours.index_blocks(x, pos)
            assert torch.equal(theirs_blocks.sort(-1).values, ours_blocks.sort(-1).values)


def test_packed_sequences_equal_separate_forwards_and_padding_is_ignored():
    cfg = tiny()
    attn = make_attention(cfg, SPARSE, seed=2)
    lens = [23, 41]
    xs = [make_x(n, cfg.hidden_size, seed=10 + i) for i, n in enumerate(lens)]
    pad = 6
    x_packed = torch.cat([*xs, torch.randn(1, pad, cfg.hidden_size)], dim=1)
    pos = torch.cat([torch.arange(lens[0]), torch.arange(lens[1]), torch.zeros(pad, dtype=torch.long)])[None]
    seq_ids = torch.tensor([0] * lens[0] + [1] * lens[1] + [-1] * pad)[None]
    with torch.no_grad():
        packed = attn(x_packed, pos, seq_ids)
        separate = [attn(x, torch.arange(x.shape[1])[None]) for x in xs]
        assert (packed[:, : lens[0]] - separate[0]).abs().max() < 2e-6
        assert (packed[:, lens[0] : sum(lens)] - separate[1]).abs().max() < 2e-6
        assert torch.equal(packed[:, sum(lens) :], torch.zeros(1, pad, cfg.hidden_size))
        x_other_pad = x_packed.clone()
        x_other_pad[:, sum(lens) :] = 1e3
        assert torch.equal(attn(x_other_pad, pos, seq_ids)[:, : sum(lens)], packed[:, : sum(lens)])


@pytest.mark.parametrize("layer", [DENSE, SPARSE])
def test_query_chunking_does_not_change_the_training_forward(layer):
    cfg = tiny()
    attn = make_attention(cfg, layer, seed=12)
    x = make_x(61, cfg.hidden_size, B=2, seed=12)
    pos = torch.cat([torch.arange(25), torch.arange(30), torch.zeros(6, dtype=torch.long)]).expand(2, 61)
    seq_ids = torch.tensor([0] * 25 + [1] * 30 + [-1] * 6).expand(2, 61)
    with torch.no_grad():
        whole = attn(x, pos, seq_ids)
        attn.query_chunk = 16
        chunked = attn(x, pos, seq_ids)
    assert (whole - chunked).abs().max() < 1e-6


def test_right_padded_batch_equals_unpadded_rows():
    cfg = tiny()
    attn = make_attention(cfg, SPARSE, seed=4)
    x = make_x(50, cfg.hidden_size, B=2, seed=4)
    seq_ids = torch.zeros(2, 50, dtype=torch.long)
    seq_ids[1, 33:] = -1
    with torch.no_grad():
        out = attn(x, torch.arange(50).expand(2, 50), seq_ids)
        short = attn(x[1:, :33], torch.arange(33)[None])
    assert (out[1, :33] - short[0]).abs().max() < 2e-6


def test_gradients_reach_all_attention_projections_and_input_through_kv_simulation():
    cfg = tiny()
    attn = make_attention(cfg, SPARSE, seed=3)
    x = make_x(40, cfg.hidden_size, seed=3).requires_grad_()
    out = attn(x, torch.arange(40)[None], kv_sim_dtype="nvfp4", index_sim_dtype="nvfp4")
    (out * torch.randn_like(out)).sum().backward()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        grad = getattr(attn, name).weight.grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert x.grad is not None and x.grad.abs().sum() > 0
    # Block selection is a discrete top-k: the indexer gets no gradient from the attention output.
    for name in ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm"):
        assert getattr(attn, name).weight.grad is None, name


def test_forward_rejects_bad_shapes_with_clear_errors():
    attn = make_attention(tiny(), SPARSE)
    x = torch.randn(1, 8, 128)
    with pytest.raises(ValueError, match=r"positions_BS must be an integer \[B=1, S=8\]"):
        attn(x, torch.arange(7)[None])
    with pytest.raises(ValueError, match="seq_ids_BS must be"):
        attn(x, torch.arange(8)[None], torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="kv_sim_dtype='int4' is not a KV cache dtype"):
        attn(x, torch.arange(8)[None], kv_sim_dtype="int4")
    with pytest.raises(ValueError, match="full-attention layer"):
        make_attention(tiny(), DENSE).index_blocks(x, torch.arange(8)[None])


# ----------------------------------------------------------------------------- cached steps
def run_cached(attn, cache, xs, schedule, seed=0):
    """Feed sequences xs[b] [S_b, D] through forward_cached; schedule = steps, each a list of
    (seq, start, end) chunks. Tokens of a step are shuffled. Returns per-sequence outputs."""
    rng = random.Random(seed)
    page = cache.page_size
    n_pages = [-(-x.shape[0] // page) for x in xs]
    perm = torch.randperm(cache.num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.zeros(len(xs), max(n_pages), dtype=torch.long)
    for b, n in enumerate(n_pages):
        table[b, :n] = torch.tensor(perm[sum(n_pages[:b]) : sum(n_pages[: b + 1])])
    outs = [torch.zeros(x.shape[0], x.shape[1]) for x in xs]
    lens = [0] * len(xs)
    for step in schedule:
        tokens = [(b, p) for b, s, e in step for p in range(s, e)]
        rng.shuffle(tokens)
        for b, _, e in step:
            lens[b] = e
        x_TD = torch.stack([xs[b][p] for b, p in tokens])
        pos_T = torch.tensor([p for _, p in tokens])
        seq_T = torch.tensor([b for b, _ in tokens])
        with torch.no_grad():
            out_TD = attn.forward_cached(x_TD, pos_T, seq_T, cache, table, torch.tensor(lens))
        for i, (b, p) in enumerate(tokens):
            outs[b][p] = out_TD[i]
    return outs


def chunked(seq: int, length: int, sizes: list[int]):
    steps, s, i = [], 0, 0
    while s < length:
        e = min(length, s + sizes[i % len(sizes)])
        steps.append([(seq, s, e)])
        s, i = e, i + 1
    return steps


@pytest.mark.parametrize("layer", [DENSE, SPARSE])
@pytest.mark.parametrize("chunks", [[1], [13, 1, 30, 2]], ids=["token_by_token", "chunks"])
def test_cached_steps_match_full_forward_fp32(layer, chunks):
    cfg = tiny()
    attn = make_attention(cfg, layer, seed=7)
    x = make_x(70, cfg.hidden_size, seed=7)
    with torch.no_grad():
        want = attn(x, torch.arange(70)[None])[0]
    cache = KVCache(cfg, num_pages=9, dtype="fp32", index_dtype="fp32")
    got = run_cached(attn, cache, [x[0]], chunked(0, 70, chunks))[0]
    assert (got - want).abs().max() < 1e-5


def test_cached_ragged_sequences_interleaved_in_one_call_match_full_forward():
    cfg = tiny(index_topk_blocks=3, index_init_blocks=1)
    attn = make_attention(cfg, SPARSE, seed=8)
    lens = [37, 5, 66]
    xs = [make_x(n, cfg.hidden_size, seed=20 + i)[0] for i, n in enumerate(lens)]
    rng = random.Random(0)
    pos, schedule = [0, 0, 0], []
    while any(p < n for p, n in zip(pos, lens)):
        step = []
        for b, n in enumerate(lens):
            if pos[b] < n and rng.random() < 0.8:
                e = min(n, pos[b] + rng.choice([1, 1, 2, 9, 17]))
                step.append((b, pos[b], e))
                pos[b] = e
        if step:
            schedule.append(step)
    cache = KVCache(cfg, num_pages=12, dtype="fp32", index_dtype="fp32")
    got = run_cached(attn, cache, xs, schedule, seed=1)
    with torch.no_grad():
        for b, x in enumerate(xs):
            want = attn(x[None], torch.arange(lens[b])[None])[0]
            assert (got[b] - want).abs().max() < 1e-5, b


@pytest.mark.parametrize("dtype", ["nvfp4", "fp8"])
@pytest.mark.parametrize("layer", [DENSE, SPARSE])
def test_quantized_cache_matches_full_forward_with_kv_simulation(dtype, layer):
    cfg = tiny(kv_cache_dtype=dtype, index_cache_dtype=dtype)
    attn = make_attention(cfg, layer, seed=9, dyadic=True)
    attn.k_scale.fill_(0.004)  # non-default scales: the cache must be given the same ones
    attn.v_scale.fill_(0.002)
    attn.index_k_scale.fill_(0.003)
    x = make_x(60, cfg.hidden_size, seed=9, dyadic=True)
    with torch.no_grad():
        want = attn(x, torch.arange(60)[None], kv_sim_dtype=dtype, index_sim_dtype=dtype)[0]
        unsimulated = attn(x, torch.arange(60)[None])[0]
    cache = KVCache(cfg, num_pages=8)
    cache.set_scales(layer, *attn.kv_scales())
    got = run_cached(attn, cache, [x[0]], chunked(0, 60, [1, 7, 20]))[0]
    assert (got - want).abs().max() < 1e-5
    assert (want - unsimulated).abs().max() > 1e-4  # the simulation is not a no-op
    with torch.no_grad():  # kv_sim=True reads the same dtypes from the config
        assert torch.equal(attn(x, torch.arange(60)[None], kv_sim=True)[0], want)


def test_rollback_is_a_shorter_length_and_stale_slots_are_never_read():
    cfg = tiny()
    attn = make_attention(cfg, SPARSE, seed=13)
    x_old, x_new = make_x(40, cfg.hidden_size, seed=13)[0], make_x(10, cfg.hidden_size, seed=14)[0]
    cache = KVCache(cfg, num_pages=4, dtype="fp32", index_dtype="fp32")
    table = torch.tensor([[2, 0, 3]])
    with torch.no_grad():
        attn.forward_cached(x_old, torch.arange(40), torch.zeros(40, dtype=torch.long), cache, table,
                            torch.tensor([40]))  # fmt: skip
        # Roll back to 30 tokens, then poison the stale slots 30..39: NaN would leak if read.
        nan = torch.full((10, 2, 32), float("nan"))
        stale_slots = slot_mapping(table, torch.zeros(10, dtype=torch.long), torch.arange(30, 40), 16)
        cache.append(SPARSE, stale_slots, nan, nan, nan[:, 0])
        got = torch.stack([
            attn.forward_cached(x_new[i : i + 1], torch.tensor([30 + i]), torch.tensor([0]), cache, table,
                                torch.tensor([31 + i]))[0]
            for i in range(10)
        ])  # fmt: skip
        want = attn(torch.cat([x_old[:30], x_new])[None], torch.arange(40)[None])[0, 30:]
    assert (got - want).abs().max() < 1e-5


# ----------------------------------------------------------------------------- op argument checks
def test_paged_ops_reject_bad_arguments_with_clear_errors():
    cfg = tiny()
    cache = KVCache(cfg, num_pages=2, dtype="fp32", index_dtype="fp32")
    table, seq, pos, lens = (
        torch.zeros(1, 2, dtype=torch.long),
        torch.zeros(3, dtype=torch.long),
        torch.arange(3),
        torch.tensor([3]),
    )
    q = torch.randn(3, 4, 32)
    kv = cache.kv_view(SPARSE)
    with pytest.raises(ValueError, match="q_THC must be a float"):
        sparse_attention(q[0], kv, table, seq, pos, lens, softmax_scale=1.0)
    with pytest.raises(ValueError, match="head dim 16 != K/V cache head dim 32"):
        sparse_attention(q[..., :16], kv, table, seq, pos, lens, softmax_scale=1.0)
    with pytest.raises(ValueError, match="H=3 must be a multiple"):
        sparse_attention(q[:, :3], kv, table, seq, pos, lens, softmax_scale=1.0)
    with pytest.raises(ValueError, match="positions_T must be a 1-D integer tensor of T=3"):
        sparse_attention(q, kv, table, seq, pos[:2], lens, softmax_scale=1.0)
    with pytest.raises(ValueError, match="seq_lens_B must be a 1-D integer tensor of B=1"):
        sparse_attention(q, kv, table, seq, pos, torch.tensor([3, 3]), softmax_scale=1.0)
    with pytest.raises(ValueError, match=r"selected_TNK must be an integer \[T=3, N=2, K\]"):
        sparse_attention(
            q, kv, table, seq, pos, lens, torch.zeros(3, 1, 2, dtype=torch.long), softmax_scale=1.0
        )
    with pytest.raises(ValueError, match="index_q_TNC head dim 8 != index cache head dim 32"):
        index_select_blocks(q[:, :2, :8], cache.index_view(SPARSE), table, seq, pos, lens, topk=2,
                            local_blocks=1, init_blocks=0)  # fmt: skip
    with pytest.raises(ValueError, match="block_tables_BP must be a 2-D integer tensor"):
        index_select_blocks(q[:, :2], cache.index_view(SPARSE), table[0], seq, pos, lens, topk=2,
                            local_blocks=1, init_blocks=0)  # fmt: skip


def test_forward_cached_rejects_a_cache_with_another_page_size():
    attn = make_attention(tiny(), SPARSE)
    cache = KVCache(tiny(index_block_size=32), num_pages=2)
    with pytest.raises(ValueError, match="cache page size 32 != sparse block size 16"):
        attn.forward_cached(torch.randn(1, 128), torch.tensor([0]), torch.tensor([0]), cache,
                            torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))  # fmt: skip

"""Block-sparse MSA training attention (Triton forward/backward, FlexAttention twin) vs the dense reference.

CPU: the checks below run in one subprocess under TRITON_INTERPRET=1 (as tests/model/test_kernel_groups.py
does); each pytest test reads one check's result. GPU (-m gpu): the same checks on CUDA, in process.
`python -m tests.model.test_kernels_train_msa [check ...]` prints {check: [ok, message]} as JSON.

Every check poisons the kernels' outputs and gradients with NaN first (`POISON_OUTPUTS`). Problems mix
a plain row with a row holding two packed sequences and trailing padding (or many sequences shorter
than a key tile), ragged lengths not a multiple of the tile sizes, and random selections (forced local
block + top-k). The interpreter runs `INTERPRETER_CONFIG`'s small tiles plus explicit configurations
(v1's gathered mask, split dK/dV tiles); the GPU checks add every `CONFIGS` entry at an M3-like shape.
In process (plain torch, no kernel): the tile plan and the FlexAttention block lists against a dense
mask, the configuration and the backend dispatch.

Tolerances: at fp32 the kernel computes the same softmax with an online (tiled) max and sum and exp2
instead of exp: ~1e-6 relative; checked at 1e-4 of the max magnitude. bf16 inputs round P and the
dot operands to bf16 (2^-9 relative): 3e-2.
"""

import itertools
import json
import os
import sys

import pytest
import torch

from tests.model.interpreted import run_module_interpreted, run_named

CHECKS = [
    "fp32_grads_equal_autograd_of_reference",
    "v1_gathered_mask_on_every_tile_matches_reference",
    "merged_dkv_tiles_with_short_packed_sequences_match_reference",
    "full_selection_equals_dense_causal_attention",
    "bf16_matches_reference_within_bf16_rounding",
    "nvfp4_kv_sim_is_straight_through",
    "flex_forward_equals_reference",
    "attention_layer_kernel_path_equals_torch_path",
]
GPU_CHECKS = ["every_config_matches_reference_at_m3_like_shape"]


def _problem(B, S, H, N, C, bs, K, seed, dtype, device, layout="packed"):
    """layout "plain": one sequence per row; "packed": row 1 = two sequences then padding; "short":
    every row = sequences of 3-23 tokens (several inside one key tile), then padding."""
    from model.kernels.indexer import select_blocks

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, C, generator=gen)
    k = torch.randn(B, S, N, C, generator=gen)
    v = torch.randn(B, S, N, C, generator=gen)
    seq = torch.zeros(B, S, dtype=torch.long)
    pos = torch.arange(S).expand(B, S).clone()
    if layout == "packed" and B > 1:  # row 1: two packed sequences, then padding
        a, b = S // 3, S - S // 6
        seq[1, a:b], seq[1, b:] = 1, -1
        pos[1, a:b], pos[1, b:] = torch.arange(b - a), 0
    elif layout == "short":
        for row in range(B):
            start, sid = 0, 0
            for length in [5, 11, 3, 23, 7, 17, 4, 13, 9, 19] * S:
                if start + length > S - 3:  # the last 3+ tokens: padding
                    seq[row, start:], pos[row, start:] = -1, 0
                    break
                seq[row, start : start + length], pos[row, start : start + length] = sid, torch.arange(length)
                start, sid = start + length, sid + 1
    NB = -(-S // bs)
    sel = select_blocks(
        torch.randn(B, N, S, NB, generator=gen),
        (pos // bs)[:, None, :],
        topk=K,
        local_blocks=1,
        init_blocks=0,
    )
    to = lambda t: t.to(device)
    return to(q.to(dtype)), to(k.to(dtype)), to(v.to(dtype)), to(sel), to(seq), to(pos), NB


def _dense_allowed(sel, seq, pos, bs):
    """[B, N, S, S] bool: the spec's mask written out independently of the kernels' plan."""
    kblk_BS = pos // bs
    chosen_BNSS = (sel[:, :, :, None, :] == kblk_BS[:, None, None, :, None]).any(-1)
    S = seq.shape[1]
    causal_SS = torch.arange(S)[None, :] <= torch.arange(S)[:, None]
    same_BSS = (seq[:, :, None] == seq[:, None, :]) & (seq[:, :, None] >= 0)
    return chosen_BNSS & (same_BSS & causal_SS)[:, None]


def _tile_counts(allowed_BNSS, bq, tk):
    """Allowed pairs per (query tile, key tile) of a dense mask: [B, N, NQT, NT]."""
    B, N, S, _ = allowed_BNSS.shape
    nqt, nt = -(-S // bq), -(-S // tk)
    padded = torch.zeros(B, N, nqt * bq, nt * tk, dtype=torch.int32)
    padded[:, :, :S, :S] = allowed_BNSS.int()
    return padded.view(B, N, nqt, bq, nt, tk).sum((3, 5))


def _grads(fn, q, k, v, go):
    qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(qi, ki, vi)
    return [out, *torch.autograd.grad((out.float() * go).sum(), [qi, ki, vi])]


def _close(names, got, want, rtol, what):
    for name, g, w in zip(names, got, want):
        g, w = g.float().cpu(), w.float().cpu()
        if not torch.isfinite(g).all():
            return False, f"{what}: {name} has non-finite values (unwritten output?)"
        err, scale = (g - w).abs().max().item(), w.abs().max().item()
        if not err <= rtol * max(scale, 1e-6):
            return False, f"{what}: {name} max err {err} > {rtol} * {scale}"
    return True, ""


def _kernel_vs_ref(B, S, H, N, C, bs, K, seed, dtype, device, rtol, layout="packed", **kw):
    from model.kernels.sparse_attention import sparse_attention_train_ref
    from model.kernels.triton_msa_train import msa_train_triton

    q, k, v, sel, seq, pos, NB = _problem(B, S, H, N, C, bs, K, seed, dtype, device, layout)
    args = dict(block_size=bs, num_blocks=NB, softmax_scale=C**-0.5)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    got = _grads(lambda a, b, c: msa_train_triton(a, b, c, sel, seq, pos, **args, **kw), q, k, v, go)
    want = _grads(lambda a, b, c: sparse_attention_train_ref(a, b, c, sel, seq, pos, **args), q, k, v, go)
    return _close(
        ["out", "dq", "dk", "dv"], got, want, rtol, f"S={S} H={H} N={N} C={C} bs={bs} K={K} {dtype} {kw}"
    )


def fp32_grads_equal_autograd_of_reference(device):
    return _kernel_vs_ref(2, 56, 4, 2, 32, 16, 2, 0, torch.float32, device, 1e-4)


def bf16_matches_reference_within_bf16_rounding(device):
    return _kernel_vs_ref(2, 40, 2, 1, 32, 16, 2, 1, torch.bfloat16, device, 3e-2)


def v1_gathered_mask_on_every_tile_matches_reference(device):
    """The 2026-11-30 mask (per-element gather, no full-tile skip) stays correct."""
    from model.kernels.triton_msa_train import MSATrainConfig

    cfg = MSATrainConfig(m_rows=16, tk=16, dkv_rows=None, skip_full_tiles=False, gather_mask=True)
    return _kernel_vs_ref(2, 56, 4, 2, 32, 16, 2, 10, torch.float32, device, 1e-4, config=cfg)


def merged_dkv_tiles_with_short_packed_sequences_match_reference(device):
    """dK/dV programs over two merged key tiles walking half query tiles; several sequences start
    inside one key tile (the kernels' block-0 case) and tiles straddle 32-token blocks unaligned."""
    from model.kernels.triton_msa_train import MSATrainConfig

    cfg = MSATrainConfig(m_rows=32, tk=16, dkv_keys=32, dkv_rows=16)
    return _kernel_vs_ref(2, 80, 4, 2, 16, 32, 2, 11, torch.float32, device, 1e-4, "short", config=cfg)


def full_selection_equals_dense_causal_attention(device):
    """top-k covering every block is dense causal attention: an oracle independent of the reference."""
    from model.kernels.triton_msa_train import msa_train_triton, plan_tiles, resolve_config, tile_sizes

    if device == "cuda":  # 128-row GPU query tiles need a longer sequence to mix full and partial tiles;
        B, S, H, N, C, bs, dtype, rtol = 1, 512, 4, 2, 64, 64, torch.bfloat16, 3e-2  # bf16 only there
    else:
        B, S, H, N, C, bs, dtype, rtol = 1, 48, 4, 2, 16, 16, torch.float32, 1e-4
    q, k, v, _, seq, pos, NB = _problem(B, S, H, N, C, bs, 1, 2, dtype, device, "plain")
    sel = torch.arange(NB, device=device).expand(B, N, S, NB).contiguous()  # every block, causality clips
    sizes = tile_sizes(resolve_config(None), H // N, bs)
    plan = plan_tiles(sel, seq, pos, block_size=bs, num_blocks=NB, **sizes)
    if not 0 < plan["n_full"].item() < plan["counts"].sum().item():
        return False, "the problem must mix full and partial tiles, or a path goes untested"
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(device)
    got = _grads(
        lambda a, b, c: msa_train_triton(
            a, b, c, sel, seq, pos, block_size=bs, num_blocks=NB, softmax_scale=C**-0.5
        ),
        q,
        k,
        v,
        go,
    )

    def dense(a, b, c):
        o = torch.nn.functional.scaled_dot_product_attention(
            a.transpose(1, 2),
            b.transpose(1, 2),
            c.transpose(1, 2),
            is_causal=True,
            scale=C**-0.5,
            enable_gqa=True,
        )
        return o.transpose(1, 2)

    return _close(["out", "dq", "dk", "dv"], got, _grads(dense, q, k, v, go), rtol, "full selection vs SDPA")


def nvfp4_kv_sim_is_straight_through(device):
    """kv_sim: forward = attention over the cache's rounded K/V; d/dk = the reference's d/dk_hat."""
    from model.kernels.sparse_attention import sparse_attention_train, sparse_attention_train_ref
    from model.kv_cache import kv_quant_dequant

    B, S, H, N, C, bs = 2, 40, 2, 1, 32, 16
    # On CUDA the kernel takes bf16/fp16 only (hardware casts; see triton_msa_train_supported).
    dtype, rtol = (torch.bfloat16, 3e-2) if device == "cuda" else (torch.float32, 1e-4)
    q, k, v, sel, seq, pos, NB = _problem(B, S, H, N, C, bs, 2, 4, dtype, device)
    ks, vs = torch.tensor(0.02, device=device), torch.tensor(0.03, device=device)
    args = dict(block_size=bs, num_blocks=NB, softmax_scale=C**-0.5)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(device)
    got = _grads(
        lambda a, b, c: sparse_attention_train(
            a, b, c, sel, seq, pos, **args, kv_sim_dtype="nvfp4", k_scale=ks, v_scale=vs, backend="triton"
        ),
        q,
        k,
        v,
        go,
    )
    k_hat, v_hat = kv_quant_dequant(k, "nvfp4", ks), kv_quant_dequant(v, "nvfp4", vs)
    if torch.equal(k_hat, k):
        return False, "NVFP4 simulation changed nothing: the check would be vacuous"
    want = _grads(
        lambda a, b, c: sparse_attention_train_ref(a, b, c, sel, seq, pos, **args), q, k_hat, v_hat, go
    )
    return _close(["out", "dq", "dk", "dv"], got, want, rtol, "nvfp4 kv_sim")


def flex_forward_equals_reference(device):
    """FlexAttention twin, forward (torch has no CPU backward for it); on CUDA also the gradients, with
    the compiled kernel's 128-token blocks (16-token selection blocks inside them: mask_mod decides)."""
    from model.kernels.msa_train_flex import msa_train_flex
    from model.kernels.sparse_attention import sparse_attention_train_ref

    S, fb, K = (256, 128, 9) if device == "cuda" else (64, 16, 2)
    q, k, v, sel, seq, pos, NB = _problem(2, S, 4, 2, 32, 16, K, 6, torch.float32, device)
    # Shared selections make full blocks (mask_mod skipped): on CUDA the second half of the rows all
    # take blocks 0-8 (one whole 128-token flex block), here the first half takes token 0's.
    if device == "cuda":
        sel[:, :, S // 2 :] = torch.arange(K, device=device)
    else:
        sel[:, :, : S // 2] = sel[:, :, :1]
    args = dict(block_size=16, num_blocks=NB, softmax_scale=32**-0.5)
    if device == "cuda":
        go = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(device)
        got = _grads(
            lambda a, b, c: msa_train_flex(a, b, c, sel, seq, pos, **args, flex_block=fb), q, k, v, go
        )
        ref = _grads(lambda a, b, c: sparse_attention_train_ref(a, b, c, sel, seq, pos, **args), q, k, v, go)
        # fp32 through the compiled kernel may use tf32 dots (2^-11 relative): 2e-3.
        return _close(["out", "dq", "dk", "dv"], got, ref, 2e-3, "flex (cuda)")
    want = sparse_attention_train_ref(q, k, v, sel, seq, pos, **args)
    with torch.no_grad():
        got = msa_train_flex(q, k, v, sel, seq, pos, **args, flex_block=fb)
    return _close(["out"], [got], [want], 1e-4, "flex forward")


def attention_layer_kernel_path_equals_torch_path(device):
    """Attention.forward on a sparse layer: the kernel path (auto-dispatched here) equals the dense-mask
    chunked path, outputs and parameter gradients, with padding and an NVFP4 KV simulation."""
    from model.config import ModelConfig
    from model.layers import attention as attn_mod

    cfg = ModelConfig.preset("tiny")
    layer = attn_mod.Attention(cfg, 1).to(device)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    B, S = 2, 40
    x = torch.randn(B, S, cfg.hidden_size, generator=gen).to(device)
    pos = torch.arange(S).expand(B, S).contiguous().to(device)
    seq = torch.zeros(B, S, dtype=torch.long)
    seq[1, 29:] = -1
    seq = seq.to(device)
    results = []
    for use_kernel in (True, False):
        layer.zero_grad()
        if not use_kernel:
            saved = attn_mod.sparse_attention_train_supported
            attn_mod.sparse_attention_train_supported = lambda *a: False
        try:
            y = layer(x, pos, seq, kv_sim_dtype="nvfp4")
        finally:
            if not use_kernel:
                attn_mod.sparse_attention_train_supported = saved
        y.square().sum().backward()
        results.append(
            [
                y.detach(),
                *(p.grad.clone() for p in (layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight)),
            ]
        )
    return _close(["y", "dWq", "dWk", "dWv"], *results, 1e-4, "layer kernel vs torch path")


def every_config_matches_reference_at_m3_like_shape(device):
    """Each `CONFIGS` entry (GPU tiles: M 64-128 rows, 64-128 keys) in bf16, G = 16, head dim 128,
    128-token blocks, packed rows and a length that is not a multiple of any tile."""
    from model.kernels.triton_msa_train import CONFIGS

    for name in CONFIGS:
        ok, msg = _kernel_vs_ref(2, 600, 32, 2, 128, 128, 3, 12, torch.bfloat16, device, 3e-2, config=name)
        if not ok:
            return False, f"{name}: {msg}"
    return True, ""


def run_checks(names, device="cpu"):
    from model.kernels import triton_msa_train

    triton_msa_train.POISON_OUTPUTS = True
    return run_named(globals(), names, device)


def run_interpreted(names, timeout_s=600.0):
    return run_module_interpreted("tests.model.test_kernels_train_msa", names, timeout_s)


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_interpreted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_msa_train_kernel_under_interpreter(interpreted, check):
    ok, msg = interpreted[check]
    assert ok, msg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("check", CHECKS + GPU_CHECKS)
def test_msa_train_kernel_on_cuda(check):
    ok, msg = run_checks([check], "cuda")[check]
    assert ok, msg


# ------------------------------------------------------------------ in process: plan, flex lists, dispatch
@pytest.mark.parametrize("bq,tk", [(4, 16), (8, 8), (16, 32), (32, 16)])
def test_plan_pair_counts_equal_dense_mask_counts(bq, tk):
    pytest.importorskip("triton")
    from model.kernels.triton_msa_train import tile_pairs

    for layout in ("packed", "short"):
        _, _, _, sel, seq, pos, _ = _problem(2, 75, 1, 2, 16, 32, 3, 20, torch.float32, "cpu", layout)
        got = tile_pairs(sel, seq, pos, block_size=32, bq=bq, tk=tk)
        assert torch.equal(got, _tile_counts(_dense_allowed(sel, seq, pos, 32), bq, tk)), layout


def test_plan_lists_hold_exactly_the_visited_tiles_in_order_with_full_flags():
    pytest.importorskip("triton")
    from model.kernels.triton_msa_train import plan_tiles

    bq, tk = 8, 16
    for layout, tkd in (("packed", 16), ("short", 16), ("packed", 32)):
        _, _, _, sel, seq, pos, NB = _problem(2, 75, 1, 2, 16, 32, 3, 21, torch.float32, "cpu", layout)
        sel[:, :, 40:] = sel[:, :, 40:41]  # shared selections: full tiles occur in the packed layout
        plan = plan_tiles(sel, seq, pos, block_size=32, num_blocks=NB, bq=bq, tk=tk, tkd=tkd)
        allowed = _dense_allowed(sel, seq, pos, 32)
        pairs, pairs_d = _tile_counts(allowed, bq, tk), _tile_counts(allowed, bq, tkd)
        assert plan["n_full"].item() == (pairs == bq * tk).sum().item()
        assert layout == "short" or plan["n_full"].item() > 0
        both = [(plan["lists"], plan["counts"], pairs, tk),
                (plan["tlists"], plan["tcounts"], pairs_d.transpose(2, 3), tkd)]  # fmt: skip
        for lists, counts, pairs_view, keys in both:
            for idx in itertools.product(*map(range, counts.shape)):
                visited = (pairs_view[idx] > 0).nonzero()[:, 0]
                want = visited * 2 + (pairs_view[idx][visited] == bq * keys).long()
                assert counts[idx].item() == len(visited)
                assert torch.equal(lists[idx][: len(visited)].long(), want), (layout, tkd, idx)


def test_flex_block_lists_cover_every_allowed_pair_and_full_blocks_are_full():
    pytest.importorskip("triton")
    from model.kernels.msa_train_flex import flex_block_mask

    _, _, _, sel, seq, pos, NB = _problem(2, 75, 1, 2, 16, 32, 3, 22, torch.float32, "cpu", "packed")
    sel[:, :, 30:] = sel[:, :, 30:31]
    fb, G = 16, 2
    pairs = _tile_counts(_dense_allowed(sel, seq, pos, 32), fb, fb).repeat_interleave(G, dim=1)
    for use_full in (True, False):
        bm = flex_block_mask(sel, seq, pos, block_size=32, num_blocks=NB, group=G, flex_block=fb,
                             use_full_blocks=use_full)  # fmt: skip

        def listed(num, idx, shape=pairs.shape):
            out = torch.zeros(shape, dtype=torch.bool)
            for i in itertools.product(*map(range, num.shape)):
                out[i][idx[i][: num[i]].long()] = True
            return out

        partial = listed(bm.kv_num_blocks, bm.kv_indices)
        full = listed(bm.full_kv_num_blocks, bm.full_kv_indices) if use_full else torch.zeros_like(partial)
        assert not (partial & full).any()
        assert torch.equal(partial | full, pairs > 0)
        assert torch.equal(full, (pairs == fb * fb) & use_full)
        assert full.any() == use_full


def test_msa_train_config_rejects_bad_tiles_and_unknown_names(monkeypatch):
    pytest.importorskip("triton")
    from model.kernels.triton_msa_train import CONFIGS, MSATrainConfig, resolve_config

    for bad in (dict(m_rows=48), dict(tk=8), dict(dkv_rows=256), dict(dkv_keys=32), dict(fwd_warps=2)):
        with pytest.raises(ValueError):
            MSATrainConfig(**bad)
    assert resolve_config("v1") is CONFIGS["v1"]
    with pytest.raises(ValueError, match="unknown MSA train config"):
        resolve_config("v9")
    monkeypatch.setenv("MSA_TRAIN_CONFIG", "v2-m64")
    assert resolve_config(None) is CONFIGS["v2-m64"]


def test_train_backend_explicit_wins_then_environment_then_auto(monkeypatch):
    from model.kernels.sparse_attention import resolve_train_backend

    q, k = torch.zeros(1, 4, 4, 16), torch.zeros(1, 4, 2, 16)
    monkeypatch.delenv("MSA_TRAIN_BACKEND", raising=False)
    if "TRITON_INTERPRET" not in os.environ:  # CPU tensors, no interpreter: the reference
        assert resolve_train_backend("auto", q, k, 16, True) == "torch"
    monkeypatch.setenv("MSA_TRAIN_BACKEND", "flex")
    assert resolve_train_backend("auto", q, k, 16, True) == "flex"
    assert resolve_train_backend("triton", q, k, 16, True) == "triton"
    monkeypatch.setenv("MSA_TRAIN_BACKEND", "fast")
    with pytest.raises(ValueError, match="MSA_TRAIN_BACKEND"):
        resolve_train_backend("auto", q, k, 16, True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(run_checks(sys.argv[1:] or CHECKS)))

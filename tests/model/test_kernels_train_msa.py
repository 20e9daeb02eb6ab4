"""Block-sparse MSA training attention (Triton forward/backward, FlexAttention twin) vs the dense reference.

CPU: the checks below run in one subprocess under TRITON_INTERPRET=1 (as tests/model/test_kernels_*.py
do); each pytest test reads one check's result. GPU (-m gpu): the same checks on CUDA, in process.
`python -m tests.model.test_kernels_train_msa [check ...]` prints {check: [ok, message]} as JSON.

Every check poisons the kernels' outputs and gradients with NaN first (`POISON_OUTPUTS`). Problems mix
a plain row with a row holding two packed sequences and trailing padding, ragged lengths not a
multiple of the tile sizes, and random selections (forced local block + top-k).

Tolerances: at fp32 the kernel computes the same softmax with an online (tiled) max and sum and exp2
instead of exp: ~1e-6 relative; checked at 1e-4 of the max magnitude. bf16 inputs round P and the
dot operands to bf16 (2^-9 relative): 3e-2.
"""

import json
import sys

import pytest
import torch

from tests.model.interpreted import run_module_interpreted, run_named

CHECKS = [
    "fp32_grads_equal_autograd_of_reference",
    "full_selection_equals_dense_causal_attention",
    "bf16_matches_reference_within_bf16_rounding",
    "nvfp4_kv_sim_is_straight_through",
    "flex_forward_equals_reference",
    "attention_layer_kernel_path_equals_torch_path",
]


def _problem(B, S, H, N, C, bs, K, seed, dtype, device, packed=True):
    from model.kernels.indexer import select_blocks

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, C, generator=gen)
    k = torch.randn(B, S, N, C, generator=gen)
    v = torch.randn(B, S, N, C, generator=gen)
    seq = torch.zeros(B, S, dtype=torch.long)
    pos = torch.arange(S).expand(B, S).clone()
    if packed and B > 1:  # row 1: two packed sequences, then padding
        a, b = S // 3, S - S // 6
        seq[1, a:b], seq[1, b:] = 1, -1
        pos[1, a:b], pos[1, b:] = torch.arange(b - a), 0
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


def _kernel_vs_ref(B, S, H, N, C, bs, K, seed, dtype, device, rtol, **kw):
    from model.kernels.sparse_attention import sparse_attention_train_ref
    from model.kernels.triton_msa_train import msa_train_triton

    q, k, v, sel, seq, pos, NB = _problem(B, S, H, N, C, bs, K, seed, dtype, device)
    args = dict(block_size=bs, num_blocks=NB, softmax_scale=C**-0.5)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    got = _grads(lambda a, b, c: msa_train_triton(a, b, c, sel, seq, pos, **args, **kw), q, k, v, go)
    want = _grads(lambda a, b, c: sparse_attention_train_ref(a, b, c, sel, seq, pos, **args), q, k, v, go)
    return _close(
        ["out", "dq", "dk", "dv"], got, want, rtol, f"S={S} H={H} N={N} C={C} bs={bs} K={K} {dtype}"
    )


def fp32_grads_equal_autograd_of_reference(device):
    return _kernel_vs_ref(2, 56, 4, 2, 32, 16, 2, 0, torch.float32, device, 1e-4)


def bf16_matches_reference_within_bf16_rounding(device):
    return _kernel_vs_ref(2, 40, 2, 1, 32, 16, 2, 1, torch.bfloat16, device, 3e-2)


def full_selection_equals_dense_causal_attention(device):
    """top-k covering every block is dense causal attention: an oracle independent of the reference."""
    from model.kernels.triton_msa_train import msa_train_triton

    B, S, H, N, C, bs = 1, 48, 4, 2, 16, 16
    q, k, v, _, seq, pos, NB = _problem(B, S, H, N, C, bs, 1, 2, torch.float32, device, packed=False)
    sel = torch.arange(NB, device=device).expand(B, N, S, NB).contiguous()  # every block, causality clips
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

    return _close(["out", "dq", "dk", "dv"], got, _grads(dense, q, k, v, go), 1e-4, "full selection vs SDPA")


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
    from model.kernels.sparse_attention import sparse_attention_train_ref
    from model.kernels.triton_msa_train import msa_train_flex

    S, fb = (256, 128) if device == "cuda" else (64, 16)
    q, k, v, sel, seq, pos, NB = _problem(2, S, 4, 2, 32, 16, 2, 6, torch.float32, device)
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
@pytest.mark.parametrize("check", CHECKS)
def test_msa_train_kernel_on_cuda(check):
    ok, msg = run_checks([check], "cuda")[check]
    assert ok, msg


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(run_checks(sys.argv[1:] or CHECKS)))

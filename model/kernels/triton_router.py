"""Triton MoE router epilogue for inference: logits -> (top-k expert ids, weights) in one launch.

Why: after the router's fp32 GEMM (cuBLAS, kept) the torch path launches sigmoid, + bias, topk,
gather, sum, divide and multiply: seven small kernels per MoE layer of a launch-bound decode step.
Here a program holds ROWS rows of E scores in registers, selects K experts by K rounds of argmax and
writes ids and weights once. Used by `model.layers.moe.select_experts` in inference mode when
torch.compile is not tracing (Inductor fuses the torch path itself).

Invariants: the arithmetic of `select_experts_ref`, op for op in fp32: s = 1 / (1 + exp(-logit))
(compiled: libdevice's expf and a correctly rounded divide, as torch's CUDA sigmoid), key = s + bias,
weights = s[ids] / sum(s[ids]) * scale with the sum taken sequentially from 0. That is torch's CPU
order, and on the H200 (torch 2.11) its CUDA order at K <= 4 for all but the smallest T; torch's
CUDA `sum(-1)` picks its order by shape (a shuffle tree at T = 1), so weights can differ from it by a
few ulps. Ids in descending key order, equal keys by ascending expert id (torch.topk's CUDA kernel
selects the same set, in another order; its CPU kernel may take any tied expert). A NaN key ranks
first, as torch.topk's NaN. No host sync; outputs: new contiguous ids int64 and weights fp32 [T, K].
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from model.kernels.triton_common import opaque_to_compile, use_hw_casts

ROW_ELEMENTS = 2048  # scores per program: 16 tokens of 128 experts, a decode batch in a few programs


@triton.jit
def sigmoid_f32(x, HW: tl.constexpr):
    """1 / (1 + exp(-x)) in fp32 as torch's CUDA sigmoid computes it: expf (libdevice, not the
    ex2.approx of tl.exp) and a correctly rounded divide; numpy's exp in the interpreter."""
    if HW:
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + e)


@triton.jit
def _router_topk_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, T, stride_lt, scale,
                        E: tl.constexpr, E_P2: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr,
                        ROWS: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    offs_t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_e = tl.arange(0, E_P2)
    offs_k = tl.arange(0, K_P2)
    is_t = offs_t < T
    is_e = offs_e < E
    t64 = offs_t.to(tl.int64)
    mask = is_t[:, None] & is_e[None, :]
    logit = tl.load(logits_ptr + t64[:, None] * stride_lt + offs_e[None, :], mask=mask, other=0.0)
    score = sigmoid_f32(logit, HW)
    key = score + tl.load(bias_ptr + offs_e, mask=is_e, other=0.0)[None, :]
    key = tl.where(key != key, float("inf"), key)  # NaN first (and an id in range), as torch.topk
    avail = is_e[None, :] & (offs_t >= 0)[:, None]  # [ROWS, E_P2]: padding columns never chosen
    ids = tl.zeros((ROWS, K_P2), tl.int32)
    w = tl.zeros((ROWS, K_P2), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    for k in tl.static_range(K):
        cand = tl.where(avail, key, float("-inf"))
        best = tl.max(cand, axis=1)
        # Among the largest keys the lowest expert id; an available column always matches.
        pick = tl.min(tl.where(avail & (cand == best[:, None]), offs_e[None, :], E_P2), axis=1)
        hit = offs_e[None, :] == pick[:, None]
        s_k = tl.sum(tl.where(hit, score, 0.0), axis=1)  # the one chosen score (+ exact zeros)
        avail = avail & ~hit
        ids = tl.where(offs_k[None, :] == k, pick[:, None], ids)
        w = tl.where(offs_k[None, :] == k, s_k[:, None], w)
        total = total + s_k  # sequential, from 0: see the module notes
    w = tl.math.div_rn(w, total[:, None]) * scale
    out_off = t64[:, None] * K + offs_k[None, :]
    out_mask = is_t[:, None] & (offs_k < K)[None, :]
    tl.store(ids_ptr + out_off, ids.to(tl.int64), mask=out_mask)
    tl.store(w_ptr + out_off, w, mask=out_mask)


def router_topk_supported(logits_TE: torch.Tensor, top_k: int) -> bool:
    """fp32 [T, E] logits with unit last stride, 1 <= top_k <= min(E, 32), E <= 1024 (a row in registers)."""
    return (
        logits_TE.dim() == 2 and logits_TE.dtype == torch.float32 and logits_TE.stride(-1) == 1
        and logits_TE.shape[0] > 0 and 1 <= top_k <= min(logits_TE.shape[1], 32)
        and logits_TE.shape[1] <= 1024
    )  # fmt: skip


@opaque_to_compile
def router_topk_triton(
    logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [T, K], weights fp32 [T, K]) of sigmoid-scored experts chosen on score + bias and
    weighted by score / sum * scale; see the module notes."""
    if not router_topk_supported(logits_TE, top_k):
        raise ValueError(f"router_topk_triton: need fp32 logits [T, E] (unit last stride, E <= 1024) and "
                         f"1 <= top_k <= min(E, 32), got {logits_TE.dtype} {tuple(logits_TE.shape)} "
                         f"strides {logits_TE.stride()}, top_k={top_k}")  # fmt: skip
    T, E = logits_TE.shape
    if bias_E.shape != (E,) or bias_E.dtype != torch.float32 or not bias_E.is_contiguous():
        raise ValueError(f"router_topk_triton: bias must be contiguous fp32 [{E}], got {bias_E.dtype} "
                         f"{tuple(bias_E.shape)}")  # fmt: skip
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits_TE.device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits_TE.device)
    e_p2, k_p2 = triton.next_power_of_2(E), triton.next_power_of_2(top_k)
    rows = max(1, ROW_ELEMENTS // e_p2)
    _router_topk_kernel[(triton.cdiv(T, rows),)](
        logits_TE, bias_E, ids, weights, T, logits_TE.stride(0), scale,
        E=E, E_P2=e_p2, K=top_k, K_P2=k_p2, ROWS=rows, HW=use_hw_casts(),
        num_warps=4,
    )  # fmt: skip
    return ids, weights

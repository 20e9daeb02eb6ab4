"""Triton MoE combine: each token's K weighted expert rows summed in fp32, rounded, plus the shared expert.

Why: after the routed experts' down projection (`y_SD` fp32, one row per token-slot s = t * K + k,
router weight applied) the NVFP4 decode path launched `sum(1)`, the cast into `out_TD` and the MoE
block's `+ shared_experts(x)`: three kernels per MoE layer of a launch-bound decode step; here one.
Called by `moe_nvfp4_triton` and `cuda_moe.moe_nvfp4_mma`, which run only where Triton runs; other shapes
(K >= 16, a shared term of another dtype) take `moe_combine_ref`.

Invariants: bit for bit the torch ops it replaces on CUDA: the K slots summed in the order of torch's
CUDA `sum(1)` for K < 16 (one thread per output, four accumulators from 0, slot k into k % 4, combined
left to right: the sequential order, torch's CPU one, for K <= 4), one rounding to out's dtype, then
`+ shared` computed in fp32 and rounded again (the two roundings of `out_TD + shared_TD`). No host
sync; writes every element of out_TD.
"""

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import f32_to_bf16, use_hw_casts

BLOCK = 1024  # output elements per program: K loads of 8 contiguous fp32 per thread at 4 warps
MAX_SLOTS = 15  # torch's CUDA sum over >= 16 values splits them across threads (another order)


@triton.jit
def _round_to(x, dt: tl.constexpr, HW: tl.constexpr):
    """fp32 x -> dt (bf16: round to nearest even in both the compiled kernel and the interpreter)."""
    if dt == tl.bfloat16:
        out = f32_to_bf16(x, HW)
    else:
        out = x.to(dt)
    return out


@triton.jit
def _moe_combine_kernel(y_ptr, shared_ptr, out_ptr, n, D, K: tl.constexpr, HAS_SHARED: tl.constexpr,
                        HW: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    t = offs // D
    row = y_ptr + t * (K - 1) * D + offs  # slot 0 of token t: (t * K) * D + offs % D
    acc0 = tl.zeros((BLOCK,), tl.float32)
    acc1 = tl.zeros((BLOCK,), tl.float32)
    acc2 = tl.zeros((BLOCK,), tl.float32)
    acc3 = tl.zeros((BLOCK,), tl.float32)
    for k in tl.static_range(K):
        y = tl.load(row + k * D, mask=mask, other=0.0)
        if k % 4 == 0:
            acc0 = acc0 + y
        elif k % 4 == 1:
            acc1 = acc1 + y
        elif k % 4 == 2:
            acc2 = acc2 + y
        else:
            acc3 = acc3 + y
    dt = out_ptr.dtype.element_ty
    out = _round_to(((acc0 + acc1) + acc2) + acc3, dt, HW)
    if HAS_SHARED:
        shared = tl.load(shared_ptr + offs, mask=mask, other=0.0)
        out = _round_to(out.to(tl.float32) + shared.to(tl.float32), dt, HW)
    tl.store(out_ptr + offs, out, mask=mask)


def moe_combine_ref(y_SD: torch.Tensor, top_k: int, out_TD: torch.Tensor,
                    shared_TD: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The torch ops the kernel replaces (the spec): out_TD = round(sum over slots) (+ shared_TD)."""
    T, D = out_TD.shape
    out_TD.copy_(y_SD.view(T, top_k, D).sum(1))
    return out_TD if shared_TD is None else out_TD.add_(shared_TD)


def moe_combine_supported(y_SD: torch.Tensor, top_k: int, out_TD: torch.Tensor,
                          shared_TD: torch.Tensor | None) -> bool:  # fmt: skip
    """Contiguous fp32 y [T * K, D] with K <= MAX_SLOTS, a contiguous out [T, D], and a shared term
    (if any) of out's shape and dtype, contiguous."""
    T, D = out_TD.shape
    return (
        y_SD.dtype == torch.float32 and y_SD.shape == (T * top_k, D) and y_SD.is_contiguous()
        and 1 <= top_k <= MAX_SLOTS and out_TD.is_contiguous() and out_TD.numel() > 0
        and (shared_TD is None or (shared_TD.shape == out_TD.shape and shared_TD.dtype == out_TD.dtype
                                   and shared_TD.is_contiguous()))
    )  # fmt: skip


def moe_combine(y_SD: torch.Tensor, top_k: int, out_TD: torch.Tensor,
                shared_TD: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """out_TD[t] = round(sum_k y_SD[t * K + k]) (+ shared_TD[t], rounded again), in place; returns
    out_TD. One launch where supported (`moe_combine_supported`), else `moe_combine_ref`."""
    if not moe_combine_supported(y_SD, top_k, out_TD, shared_TD):
        return moe_combine_ref(y_SD, top_k, out_TD, shared_TD)
    n, D = out_TD.numel(), out_TD.shape[1]
    _moe_combine_kernel[(triton.cdiv(n, BLOCK),)](
        y_SD, out_TD if shared_TD is None else shared_TD, out_TD, n, D, K=top_k,
        HAS_SHARED=shared_TD is not None, HW=use_hw_casts(), BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    return out_TD

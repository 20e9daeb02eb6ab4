"""Triton LoRA epilogue for inference: y + bf16((x A^T) B^T * scaling) in two launches instead of six.

Why: in a GRPO rollout every adapted linear (q / k / v / o and the dense MLP / shared expert's gate /
up / down by default) runs `LoRALinear.forward`'s cast of x, A, B, the scaling multiply, the cast of
the delta and the add beside the base GEMM: seven kernels where the base alone is one, about 40 per
layer of a launch-bound graph-captured decode step. Here a shrink launch computes x A^T ([T, R],
fp32, split over the input features into partial sums) and an expand launch sums the splits in
order, multiplies by B^T and the scaling and adds the rounded delta into the base output in place.
Used by `model.layers.lora.LoRALinear` in inference mode (`triton_inference_path`) for fp32 adapters
on 2-D inputs; bf16 adapters and training keep the torch ops.

Invariants: torch's roundings (x and the adapter in fp32, delta = fp32 (x A^T) B^T * scaling rounded
once to y's dtype, then y + delta rounded once); the fp32 sums run in another order than cuBLAS
(deterministic: splits reduced in split order, no atomics), so results agree with torch up to fp32
summation order. No host sync (CUDA-graph captured).
"""

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import f32_to_bf16, opaque_to_compile, use_hw_casts

BT = 16  # tokens per program (tl.dot's smallest M)
BK = 64  # input features per shrink step
K_PER_SPLIT = 512  # input features per shrink program (untuned: one split per 512 features)
BO = 64  # output features per expand program


@triton.jit
def _lora_shrink_kernel(x_ptr, stride_xt, a_ptr, part_ptr, T, n_in, R, R_P2: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, K_SPLIT: tl.constexpr):  # fmt: skip
    """part[s, t, :R] = sum over this split's features k of fp32(x[t, k]) * A[:, k]."""
    pid_t, pid_s = tl.program_id(0), tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_r = tl.arange(0, R_P2)
    is_t, is_r = offs_t < T, offs_r < R
    acc = tl.zeros((BT, R_P2), tl.float32)
    for k0 in range(pid_s * K_SPLIT, tl.minimum((pid_s + 1) * K_SPLIT, n_in), BK):
        offs_k = k0 + tl.arange(0, BK)
        is_k = offs_k < n_in
        x = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
                    mask=is_t[:, None] & is_k[None, :], other=0.0).to(tl.float32)  # fmt: skip
        a = tl.load(
            a_ptr + offs_r[:, None] * n_in + offs_k[None, :], mask=is_r[:, None] & is_k[None, :], other=0.0
        )
        acc = tl.dot(x, tl.trans(a), acc, input_precision="ieee")
    out = part_ptr + (pid_s * T + offs_t[:, None]).to(tl.int64) * R_P2 + offs_r[None, :]
    tl.store(out, acc, mask=is_t[:, None])


@triton.jit
def _lora_expand_kernel(y_ptr, stride_yt, part_ptr, b_ptr, T, n_out, R, n_splits, scaling,
                        R_P2: tl.constexpr, BT: tl.constexpr, BO: tl.constexpr,
                        Y_BF16: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    """y[t, o] = y[t, o] + round(scaling * sum_r (sum_s part[s, t, r]) * B[o, r]), rounded to y's dtype."""
    pid_t, pid_o = tl.program_id(0), tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_o = pid_o * BO + tl.arange(0, BO)
    offs_r = tl.arange(0, R_P2)
    is_t, is_o = offs_t < T, offs_o < n_out
    xa = tl.zeros((BT, R_P2), tl.float32)
    for s in range(n_splits):  # in split order: deterministic
        xa += tl.load(part_ptr + (s * T + offs_t[:, None]).to(tl.int64) * R_P2 + offs_r[None, :],
                      mask=is_t[:, None], other=0.0)  # fmt: skip
    b = tl.load(
        b_ptr + offs_o[:, None] * R + offs_r[None, :], mask=is_o[:, None] & (offs_r < R)[None, :], other=0.0
    )
    delta = tl.dot(xa, tl.trans(b), input_precision="ieee") * scaling
    y_ptrs = y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + offs_o[None, :]
    mask = is_t[:, None] & is_o[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    if Y_BF16:
        out = f32_to_bf16(y + f32_to_bf16(delta, HW).to(tl.float32), HW)
    else:
        out = (y + delta.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptrs, out, mask=mask)


def lora_delta_supported(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """x [T, I] with unit last stride, y [T, O] with unit last stride, fp32 contiguous A [R, I] and
    B [O, R] (R <= 128), y in bf16 or fp32."""
    return (
        x.dim() == 2 and y.dim() == 2 and x.shape[0] == y.shape[0] and x.shape[0] > 0
        and x.stride(-1) == 1 and y.stride(-1) == 1
        and a.dtype == torch.float32 and b.dtype == torch.float32 and a.is_contiguous() and b.is_contiguous()
        and a.shape[1] == x.shape[1] and b.shape == (y.shape[1], a.shape[0]) and a.shape[0] <= 128
        and y.dtype in (torch.bfloat16, torch.float32)
    )  # fmt: skip


@opaque_to_compile
def add_lora_delta_(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """y += round_y(((fp32 x) A^T) B^T * scaling), in place, rounded as `LoRALinear.forward`; returns y."""
    if not lora_delta_supported(x, y, a, b):
        raise ValueError(f"add_lora_delta_: need x [T, I], y [T, O] (bf16 / fp32, unit last stride), "
                         f"fp32 A [R, I] and B [O, R]; got x {tuple(x.shape)}, y {tuple(y.shape)} {y.dtype}, "
                         f"A {tuple(a.shape)} {a.dtype}, B {tuple(b.shape)} {b.dtype}")  # fmt: skip
    T, n_in = x.shape
    n_out, R = b.shape
    r_p2 = max(16, triton.next_power_of_2(R))
    n_splits = triton.cdiv(n_in, K_PER_SPLIT)
    part = torch.empty((n_splits, T, r_p2), dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(triton.cdiv(T, BT), n_splits)](
        x, x.stride(0), a, part, T, n_in, R, R_P2=r_p2, BT=BT, BK=BK, K_SPLIT=K_PER_SPLIT, num_warps=4
    )
    _lora_expand_kernel[(triton.cdiv(T, BT), triton.cdiv(n_out, BO))](
        y, y.stride(0), part, b, T, n_out, R, n_splits, scaling, R_P2=r_p2, BT=BT, BO=BO,
        Y_BF16=y.dtype == torch.bfloat16, HW=use_hw_casts(), num_warps=4,
    )  # fmt: skip
    return y

"""Triton swigluoai for inference: MiniMax's clamped SwiGLU in one elementwise launch instead of seven.

Why: `swigluoai_ref` (model.kernels.moe) is clamp, clamp, mul, sigmoid, mul, add, mul: seven kernels
per dense MLP and per shared expert of a launch-bound decode step; here each element is read once
and written once. Used by `model.kernels.moe.swigluoai` in inference mode when torch.compile is not
tracing (Inductor fuses the torch path itself).

Invariants: bit for bit the torch formula on CUDA in bf16 and fp32. Torch computes each bf16 op in
fp32 and rounds its result to bf16, so the kernel rounds after every op too (RNE, `f32_to_bf16`);
alpha enters as fp32 (torch's opmath scalar), limit as the input dtype (torch's clamp bound); the
sigmoid is torch's CUDA one (`sigmoid_f32`). In the interpreter numpy's exp stands in for expf: a
result can land one input-dtype ulp from torch's CPU sigmoid (Sleef) there. gate and up: same shape
and dtype, contiguous; the output is a new contiguous tensor like gate.
"""

from functools import cache

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import f32_to_bf16, opaque_to_compile, use_hw_casts
from model.kernels.triton_router import sigmoid_f32

BLOCK = 1024  # elements per program: 8 per thread at 4 warps (16-byte bf16 vectors)


@triton.jit
def _round(x, IS_BF16: tl.constexpr, HW: tl.constexpr):
    """x (fp32) rounded to the input dtype and back: what storing a torch op's result does."""
    if IS_BF16:
        x = f32_to_bf16(x, HW).to(tl.float32)
    return x


@triton.jit
def _swigluoai_kernel(gate_ptr, up_ptr, out_ptr, n, alpha, limit, IS_BF16: tl.constexpr, HW: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # clamp: exact (limit is already in the input dtype); NaN passes through, as torch.clamp's.
    g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                   propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    s = _round(sigmoid_f32(_round(alpha * g, IS_BF16, HW), HW), IS_BF16, HW)
    y = _round(g * s, IS_BF16, HW) * _round(u + 1.0, IS_BF16, HW)
    if IS_BF16:
        y = f32_to_bf16(y, HW)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@cache
def _in_dtype(x: float, dtype: torch.dtype) -> float:
    """x rounded to `dtype`, as torch.clamp converts its bound (a CPU scalar: no device work)."""
    return float(torch.tensor(x, dtype=dtype))


def swigluoai_supported(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """bf16 or fp32 gate and up of one shape, both contiguous and non-empty."""
    return (
        gate.dtype in (torch.bfloat16, torch.float32) and up.dtype == gate.dtype
        and up.shape == gate.shape and gate.is_contiguous() and up.is_contiguous() and gate.numel() > 0
    )  # fmt: skip


@opaque_to_compile
def swigluoai_triton(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up, +-limit) + 1), elementwise."""
    if not swigluoai_supported(gate, up):
        raise ValueError(f"swigluoai_triton: need contiguous bf16 / fp32 gate and up of one shape and "
                         f"dtype, got {gate.dtype} {tuple(gate.shape)}, {up.dtype} "
                         f"{tuple(up.shape)}")  # fmt: skip
    out = torch.empty_like(gate)
    n = gate.numel()
    _swigluoai_kernel[(triton.cdiv(n, BLOCK),)](
        gate, up, out, n, alpha, _in_dtype(limit, gate.dtype), IS_BF16=gate.dtype == torch.bfloat16,
        HW=use_hw_casts(), BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    return out

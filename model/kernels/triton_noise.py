"""Counter-based sampling noise on CUDA: one launch fills a whole batch's draw.

What: out[b, j] = u (or -log u) with u = ((splitmix64(key_b + j * golden) >> 40) + 0.5) / 2^24 for the
active rows, 0 (uniform) / 1 (exponential) for the others, as rollout/native/sampler.py's torch twin
`counter_noise_torch` (the CPU path) computes it. Why: in torch that is a dozen passes over a [B, V]
int64 tensor (at B = 64 and M3's 200K vocabulary about 1 GB of traffic per step); here each value is
computed in registers and written once. Keys and flags are device tensors, so the launch has no host
input and a captured CUDA graph can replay it (rollout/native/runner.py samples inside the graph).
Invariants: uniforms equal the torch twin's bit for bit (integer hash, exact conversion); the
exponential's log may differ from torch.log in the last ulp; every element of the output is written.
"""

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import opaque_to_compile

GOLDEN: tl.constexpr = tl.constexpr(0x9E3779B97F4A7C15)
MIX1: tl.constexpr = tl.constexpr(0xBF58476D1CE4E5B9)
MIX2: tl.constexpr = tl.constexpr(0x94D049BB133111EB)
BLOCK = 1024


@triton.jit
def _noise_kernel(keys_ptr, active_ptr, out_ptr, n, stride_o, EXP: tl.constexpr, BLOCK: tl.constexpr):
    pid_b = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + pid_b).to(tl.uint64, bitcast=True)
    is_active = tl.load(active_ptr + pid_b) != 0
    z = key + offs_n.to(tl.uint64) * GOLDEN  # unsigned: wrapping multiplies, logical shifts
    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    z = z ^ (z >> 31)
    u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    # Inactive rows (greedy) are still hashed: a row-uniform branch would save ALU work only, and the
    # kernel is bound by the [B, n] store it does anyway.
    if EXP:
        u = tl.where(is_active, -tl.log(u), 1.0)
    else:
        u = tl.where(is_active, u, 0.0)
    tl.store(out_ptr + pid_b * stride_o + offs_n, u, mask=offs_n < n)


@opaque_to_compile
def counter_noise_triton(
    keys_B: torch.Tensor, is_active_B: torch.Tensor, n: int, exponential: bool
) -> torch.Tensor:
    """fp32 [B, n]: row b is the draw of key keys_B[b] (int64) where is_active_B[b] (bool), else the
    fill (0 uniform, 1 exponential); both inputs on the output's device."""
    if keys_B.dtype != torch.int64 or keys_B.dim() != 1:
        raise ValueError(f"keys_B must be int64 [B], got {keys_B.dtype} {tuple(keys_B.shape)}")
    a = is_active_B
    if a.dtype != torch.bool or a.shape != keys_B.shape or a.device != keys_B.device:
        raise ValueError(f"is_active_B must be bool {tuple(keys_B.shape)} on {keys_B.device}, got "
                         f"{a.dtype} {tuple(a.shape)} on {a.device}")  # fmt: skip
    B = keys_B.shape[0]
    out_Bn = torch.empty((B, n), dtype=torch.float32, device=keys_B.device)
    if B and n:
        grid = (B, triton.cdiv(n, BLOCK))
        flags_B = is_active_B.contiguous().view(torch.uint8)  # same bytes: no bool pointers in the kernel
        _noise_kernel[grid](keys_B.contiguous(), flags_B, out_Bn, n, out_Bn.stride(0), EXP=exponential,
                            BLOCK=BLOCK)  # fmt: skip
    return out_Bn

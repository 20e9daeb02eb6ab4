"""Counter-based sampling noise on CUDA: one launch fills a whole batch's draw.

What: out[row_r, j] = u (or -log u) with u = ((splitmix64(key_r + j * golden) >> 40) + 0.5) / 2^24,
as rollout/native/sampler.py's torch twin `counter_noise_torch` (the CPU path) computes it. Why: in
torch that is a dozen passes over a [B, V] int64 tensor (at B = 64 and M3's 200K vocabulary about
1 GB of traffic per step); here each value is computed in registers and written once.
Invariants: uniforms equal the torch twin's bit for bit (integer hash, exact conversion); the
exponential's log may differ from torch.log in the last ulp; rows not listed are not written.
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
def _noise_kernel(row_key_ptr, out_ptr, n, stride_o, EXP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(row_key_ptr + 2 * r)
    key = tl.load(row_key_ptr + 2 * r + 1).to(tl.uint64, bitcast=True)
    z = key + j.to(tl.uint64) * GOLDEN  # unsigned: wrapping multiplies, logical shifts
    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    z = z ^ (z >> 31)
    u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    if EXP:
        u = -tl.log(u)
    tl.store(out_ptr + row * stride_o + j, u, mask=j < n)


@opaque_to_compile
def counter_noise_triton(row_key_R2: torch.Tensor, out_Bn: torch.Tensor, exponential: bool) -> None:
    """Writes row row_key_R2[r, 0] of `out_Bn` (fp32 [B, n]) from the draw key row_key_R2[r, 1] (int64
    pairs on out's device); the other rows are left as they are."""
    R, n = row_key_R2.shape[0], out_Bn.shape[1]
    if R and n:
        grid = (R, triton.cdiv(n, BLOCK))
        _noise_kernel[grid](row_key_R2, out_Bn, n, out_Bn.stride(0), EXP=exponential, BLOCK=BLOCK)

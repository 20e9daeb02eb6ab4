"""Counter-based sampling noise on CUDA: one launch fills a whole batch's draw.

What: out[rows[r], j] = u (or -log u) with u = ((splitmix64(key_r + j * golden) >> 40) + 0.5) / 2^24,
the values rollout/native/sampler.py computes with torch ops on the CPU. Why: in torch that formula is
a dozen passes over a [B, V] int64 tensor (at B = 64 and M3's 200K vocabulary about 1 GB of traffic
per step); here each value is computed in registers and written once.
Invariants: uniforms equal the torch formula's bit for bit (integer hash, exact conversion); the
exponential's log may differ from torch.log in the last ulp; rows not listed keep the fill value.
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
def _noise_kernel(keys_ptr, rows_ptr, out_ptr, n, stride_o, EXP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + r).to(tl.uint64, bitcast=True)
    row = tl.load(rows_ptr + r).to(tl.int64)
    z = key + j.to(tl.uint64) * GOLDEN  # unsigned: wrapping multiplies, logical shifts
    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    z = z ^ (z >> 31)
    u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    if EXP:
        u = -tl.log(u)
    tl.store(out_ptr + row * stride_o + j, u, mask=j < n)


@opaque_to_compile
def counter_noise_triton(
    keys_R: torch.Tensor, rows: list[int], B: int, n: int, exponential: bool
) -> torch.Tensor:
    """[B, n] fp32 on keys_R's device: row rows[r] from draw key keys_R[r] (int64), the others 0
    (uniforms) or 1 (exponential)."""
    device = keys_R.device
    if len(rows) == B:
        out = torch.empty((B, n), dtype=torch.float32, device=device)
        rows_R = torch.arange(B, dtype=torch.int32, device=device)
    else:
        out = torch.full((B, n), 1.0 if exponential else 0.0, dtype=torch.float32, device=device)
        rows_R = torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)
    if rows and n:
        grid = (len(rows), triton.cdiv(n, BLOCK))
        _noise_kernel[grid](keys_R, rows_R, out, n, out.stride(0), EXP=exponential, BLOCK=BLOCK)
    return out

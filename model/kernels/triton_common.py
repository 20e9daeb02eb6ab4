"""Shared Triton device helpers for the decode kernels: E2M1 decode and round-to-nearest-even casts.

Why a module of its own: the KV append, indexer, sparse-attention and MoE kernels all decode E2M1
nibbles and round fp32 to E4M3 / bf16, and every one of them must do it the same way, bit for bit,
as `model.nvfp4` (FACTS sections 3 and 6).

Two implementations of each rounding cast, chosen by the constexpr `HW`:
- HW=True (compiled for a GPU): the hardware conversion (`cvt.rn.satfinite` on sm_90), which is
  round-to-nearest-even, exactly torch's `.to(torch.float8_e4m3fn)` / `.to(torch.bfloat16)`;
- HW=False (the CPU interpreter, `TRITON_INTERPRET=1`): integer bit manipulation. Triton 3.9's
  interpreter rounds half away from zero, drops the carry of a rounded-up mantissa when the exponent
  is odd, and truncates subnormals, so its own casts are not RNE; the integer versions are.
Both are correct RNE; the tests check the software ones bit-exactly against torch on the CPU and the
hardware ones on the GPU (gpu-marked test).

E2M1 -> float without tables (FACTS 6): the byte ((q & 0x8) << 4) | ((q & 0x7) << 2) read as
float8_e4m3fn is e2m1(q) * 2^-6 for all 16 codes; callers fold the 2^6 into their block scale.
"""

import os

import torch
import triton
import triton.language as tl

E2M1_FP8_SHIFT: tl.constexpr = tl.constexpr(64.0)
"""e2m1(q) = fp8_bits(q) * 2^6: the factor folded into block scales by every E2M1 decode."""


def use_hw_casts() -> bool:
    """True when kernels run compiled on a GPU (hardware RNE casts), False in the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")


def triton_available(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on tensors like `t`: CUDA tensors, or any tensor when the
    interpreter is on (CPU tests)."""
    return t.is_cuda or not use_hw_casts()


def num_sms(device: torch.device) -> int:
    """Multiprocessors to fill (132 on an H200); a small number for the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@triton.jit
def e2m1_to_f32_x64(q):
    """uint8 nibbles q (0..15) -> fp32 e2m1(q) * 2^-6 (exact; multiply by 64 * block scale)."""
    bits = ((q & 0x8) << 4) | ((q & 0x7) << 2)
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def f32_to_e4m3(x, HW: tl.constexpr):
    """fp32 (already clamped to [-448, 448]) -> float8e4nv, round to nearest even."""
    if HW:
        out = x.to(tl.float8e4nv)
    else:
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = tl.abs(x)
        abits = a.to(tl.int32, bitcast=True)
        # Normal range (|x| >= 2^-6): round the fp32 mantissa to 3 bits (add half-ulp minus one
        # plus the kept lsb: ties go to even), then rebias the exponent from 127 to 7.
        rounded = abits + 0x7FFFF + ((abits >> 20) & 1)
        normal = (rounded >> 20) - (120 << 3)
        # Subnormal range: |x| / 2^-9 rounded to an integer 0..8 by the 2^23 trick (fp32 add is
        # RNE); 8 is exactly the code of 2^-6, so both ranges meet seamlessly.
        sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        mag = tl.where(a < 0.015625, sub, normal)
        out = (mag | sign).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return out


@triton.jit
def f32_to_bf16(x, HW: tl.constexpr):
    """fp32 (finite) -> bfloat16, round to nearest even."""
    if HW:
        out = x.to(tl.bfloat16)
    else:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return out


@triton.jit
def load_nvfp4_tile(row_ptrs, is_row, C: tl.constexpr, ROWS: tl.constexpr):
    """NVFP4 rows (C/2 code bytes then C/16 e4m3 scales at each of `row_ptrs` [ROWS]) -> fp32
    [ROWS, C] of e2m1 * block_scale (the global scale is left to the caller; exact in fp32 and in
    bf16). Rows with is_row False read as zeros. C/16 must be a power of two.

    Bytes are loaded in their stored order ([ROWS, C/16, 8], 8 contiguous bytes per block, so the
    loads vectorise); the low / high nibbles are decoded separately and interleaved by join +
    reshape, which puts element 2i (low) before 2i + 1 (high) as the format requires."""
    NB: tl.constexpr = C // 16
    offs_g = tl.arange(0, NB)
    offs_j = tl.arange(0, 8)
    byte_ptrs = row_ptrs[:, None, None] + offs_g[None, :, None] * 8 + offs_j[None, None, :]
    packed = tl.load(byte_ptrs, mask=is_row[:, None, None], other=0)
    s_bits = tl.load(row_ptrs[:, None] + C // 2 + offs_g[None, :], mask=is_row[:, None], other=0)
    s_x64 = s_bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * E2M1_FP8_SHIFT
    lo = e2m1_to_f32_x64(packed & 0xF) * s_x64[:, :, None]
    hi = e2m1_to_f32_x64(packed >> 4) * s_x64[:, :, None]
    return tl.reshape(tl.join(lo, hi), (ROWS, C))


@triton.jit
def load_nvfp4_tile_direct(row_ptrs, is_row, C: tl.constexpr):
    """`load_nvfp4_tile` without the join + reshape interleave: element c reads byte c // 2 (each
    byte loaded twice, from L1) and shifts out its own nibble. Slower; used by the attention
    kernel's bf16-dot fallback for NVFP4 pages, which gave wrong results on the H200 (Triton 3.6)
    when its tile came through the interleave at head dim 32 / page 16 (v1)."""
    offs_c = tl.arange(0, C)
    packed = tl.load(row_ptrs[:, None] + offs_c[None, :] // 2, mask=is_row[:, None], other=0).to(tl.int32)
    s_bits = tl.load(row_ptrs[:, None] + C // 2 + offs_c[None, :] // 16, mask=is_row[:, None], other=0)
    s_x64 = s_bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * E2M1_FP8_SHIFT
    q = (packed >> ((offs_c[None, :] % 2) * 4)) & 0xF
    return e2m1_to_f32_x64(q) * s_x64


@triton.jit
def dot_bf16(a, b, HW: tl.constexpr):
    """bf16 x bf16 -> fp32 tensor-core dot. The interpreter's dot multiplies bf16 storage as raw
    integers, so there both operands go through fp32 first (exact: the same products, fp32 sums)."""
    if HW:
        out = tl.dot(a, b)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    return out


@triton.jit
def nvfp4_tile_to_fp8(row_ptrs, is_row, C: tl.constexpr, ROWS: tl.constexpr, HW: tl.constexpr):
    """NVFP4 rows -> float8e4nv [ROWS, C] = e4m3_rne(clamp(e2m1 * block_scale, +-448)): bit for bit
    `nvfp4.kv_dequantize_fp8` (the real value is this times the global scale)."""
    prod = load_nvfp4_tile(row_ptrs, is_row, C, ROWS)
    return f32_to_e4m3(tl.minimum(tl.maximum(prod, -448.0), 448.0), HW)

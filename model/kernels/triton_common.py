"""Shared Triton device helpers for the decode kernels: E2M1 decode and round-to-nearest-even casts.

Why a module of its own: the KV append, indexer, sparse-attention and MoE kernels all decode E2M1
nibbles and round fp32 to E4M3 / bf16, and each must do it as `model.nvfp4` does, bit for bit. E2M1
decodes without tables by the bit trick of docs/FACTS.md, "Kernel facts" (callers fold 2^6 into the
block scale); `e2m1_half_f16` / `e2m1_half_scaled_f16` (the attention's v6) decode four code
bytes per 32-bit register in inline PTX straight into a dot operand.

Invariants: every rounding cast is round-to-nearest-even in both implementations chosen by the
constexpr `HW` (the hardware `cvt.rn.satfinite` when compiled for a GPU; integer bit manipulation in
the interpreter, whose own casts are not RNE); tests check the software casts against torch on CPU,
the hardware ones on GPU, and both tile decodes against `model.nvfp4`.
"""

import os
import warnings

import torch
import triton
import triton.language as tl

# Why software casts under TRITON_INTERPRET=1: Triton 3.9's interpreter rounds half away from zero,
# drops the carry of a rounded-up mantissa when the exponent is odd and truncates subnormals.

E2M1_FP8_SHIFT: tl.constexpr = tl.constexpr(64.0)
"""e2m1(q) = fp8_bits(q) * 2^6: the factor folded into block scales by every E2M1 decode."""


def use_hw_casts() -> bool:
    """True when kernels run compiled on a GPU (hardware RNE casts), False in the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")


def opaque_to_compile(fn):
    """Marks a kernel's launch function opaque to torch.compile: a compiled caller (the engine's
    compiled decode pass, rollout/native/runner.py) calls it as it is, so Inductor fuses only the torch
    code around our kernels and never re-emits their Triton source in its own modules."""
    return torch.compiler.disable(fn, recursive=True)


def triton_available(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on tensors like `t`: CUDA tensors, or any tensor when the
    interpreter is on (CPU tests)."""
    return t.is_cuda or not use_hw_casts()


def num_sms(device: torch.device) -> int:
    """Multiprocessors to fill (132 on an H200); a small number for the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# Messages of the compiler failures that Triton's autotuner does not skip itself (it only skips
# OutOfResources / PTXASError / CompileTimeAssertionFailure): an MLIR pass that rejects a layout
# (seen on the H200, Triton 3.6: "PassManager::run failed" in TritonGPUOptimizeDotOperands for one
# indexer config) raises a plain RuntimeError. CUDA runtime errors are RuntimeErrors too and must
# still surface, so only these messages are turned into an infinite time.
_COMPILE_FAILURES = ("PassManager::run failed", "LLVM ERROR", "Illegal shared layout")
_warned_configs: set[str] = set()


def is_compile_failure(exc: BaseException) -> bool:
    """Whether `exc` is a Triton compile failure of one configuration (not a launch / CUDA error)."""
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COMPILE_FAILURES)


def tune_class(*sizes: int) -> int:
    """One autotune key for launch sizes that vary from step to step (slots, rows, row blocks, work
    items): the bit length of each, packed. A decode engine's batch changes at almost every step;
    keyed by the exact sizes the autotuner re-benchmarked every configuration at each new size (the
    first M3.1-width engine run on the H200 spent most of its time tuning), keyed by class it tunes
    once per doubling. Every configuration is valid at any size: the class only picks the fastest."""
    out = 0
    for n in sizes:
        out = out * 64 + max(0, int(n)).bit_length()
    return out


def safe_do_bench(kernel_call, quantiles, bench=None):
    """`do_bench` for `triton.autotune(do_bench=...)`: a configuration whose compile fails times as
    +inf (one warning per distinct message) so the tuner picks another instead of killing the
    process; every other exception propagates. `bench` (tests) replaces triton.testing.do_bench."""
    if bench is None:
        import triton.testing

        bench = triton.testing.do_bench
    try:
        return bench(kernel_call, quantiles=quantiles)
    except RuntimeError as exc:
        if not is_compile_failure(exc):
            raise
        msg = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        if msg not in _warned_configs:
            _warned_configs.add(msg)
            warnings.warn(f"autotune: a configuration failed to compile, skipped: {msg}", stacklevel=2)
        return [float("inf")] * len(quantiles) if quantiles else float("inf")


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
    if not HW:  # the software cast needs the clamp; sm_90's cvt.rn.satfinite saturates to +-448 itself
        prod = tl.minimum(tl.maximum(prod, -448.0), 448.0)
    return f32_to_e4m3(prod, HW)


@triton.jit
def e2m1_nibble_f32_x2p126(w, NIB: tl.constexpr):
    """Nibble NIB (0..7) of int32 words w -> fp32 e2m1 * 2^-126, exactly, in three integer ops.

    The nibble is shifted to the top of the word (its sign bit at bit 31); an arithmetic shift right
    by 6 then puts its magnitude bits at fp32 bits 22-24 (mantissa msb + the two low exponent bits)
    and copies the sign over bits 25-31, of which the mask 0x81C00000 keeps bit 31. Read as fp32 the
    magnitude codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 times 2^-126 (code 1 is the subnormal 2^-127).
    Callers scale the other operand by 2^100 so products stay normal, and fold 2^26 into their
    result scale. Subnormal inputs are full speed in FFMA and kept by it (no .ftz in Triton's PTX)."""
    if NIB < 7:
        t = w << (28 - 4 * NIB)
    else:
        t = w
    return ((t >> 6) & -2118123520).to(tl.float32, bitcast=True)  # -2118123520 = 0x81C00000 as int32


# ------------------------------------------------------------ v6: scaled E2M1 halves in registers
# The attention's v6 decode (its K / V tiles are dot operands decoded in
# registers). Four code bytes per 32-bit register w -> e4m3 bytes worth e2m1 * 2^-6 of their low
# (even) or high (odd) nibbles (the identity of docs/FACTS.md, "Kernel facts": low nibbles
# ((w << 4) & 0x80808080) | ((w << 2) & 0x1C1C1C1C), high ones (w & 0x80808080) | ((w >> 2) &
# 0x1C1C1C1C)) -> two e4m3x2 -> f16x2 converts. Unary on purpose: Triton moves a dot operand's layout
# conversion up through elementwise ops only (unary inline asm, arith, fp_to_fp, bitcast) to their
# loads, and a second asm input ended that chain (compile report: every decoded tile was then staged
# in shared memory).
_E2M1_LO_F16X4 = tl.constexpr(
    "{ .reg .b32 t, u; .reg .b16 lo, hi;\n"
    " shl.b32 t, $2, 4; and.b32 t, t, 0x80808080; shl.b32 u, $2, 2; and.b32 u, u, 0x1C1C1C1C;\n"
    " or.b32 t, t, u; mov.b32 {lo, hi}, t; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }"
)
_E2M1_HI_F16X4 = tl.constexpr(
    "{ .reg .b32 t, u; .reg .b16 lo, hi;\n"
    " and.b32 t, $2, 0x80808080; shr.b32 u, $2, 2; and.b32 u, u, 0x1C1C1C1C;\n"
    " or.b32 t, t, u; mov.b32 {lo, hi}, t; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }"
)


@triton.jit
def e2m1_half_f16(codes, HI: tl.constexpr, HW: tl.constexpr):
    """uint8 code bytes -> fp16 e2m1 * 2^-6 of their low (HI False: even values) or high nibbles,
    elementwise and exact."""
    if HW and HI:
        out = tl.inline_asm_elementwise(_E2M1_HI_F16X4, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True,
                                        pack=4)  # fmt: skip
    elif HW:
        out = tl.inline_asm_elementwise(_E2M1_LO_F16X4, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True,
                                        pack=4)  # fmt: skip
    else:
        if HI:
            bits = (codes & 0x80) | ((codes >> 2) & 0x1C)
        else:
            bits = ((codes << 4) & 0x80) | ((codes << 2) & 0x1C)
        out = bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return out


@triton.jit
def e2m1_half_scaled_f16(codes_rj, scales_rb, HI: tl.constexpr, HW: tl.constexpr):
    """Code bytes [R, J] (uint8) and their rows' block scale bytes [R, J / 8] (uint8 e4m3; byte j of a
    row is in block j // 8) -> fp16 [R, J] e2m1 * 2^-6 * block scale of the low (HI False: even
    values) or high nibbles (multiply by 64 and the global scale afterwards).

    Exact: e2m1 * 2^-6 is a multiple of 2^-7 with <= 2 significant bits, an e4m3 scale a multiple of
    2^-9 with <= 4, so the product has <= 6 significant bits, is a multiple of 2^-16 (fp16's subnormal
    step is 2^-24; PTX f16 arithmetic keeps subnormals) and is at most 6 * 2^-6 * 448 = 42.
    Why the scales come in as [R, J / 8] and are broadcast here: loaded as an [R, J] gather (address
    j // 8, no 4-byte runs) they cannot be cp.async'd, stay a register load in a blocked layout, and
    Triton then put the whole decode in that layout and staged the decoded fp16 tile in shared
    memory for the dot; as [R, J / 8] rows (8 contiguous bytes) they are cp.async'd and read back in
    the layout whose broadcast + reshape is the dot operand's (compile report: no staged tile)."""
    R: tl.constexpr = codes_rj.shape[0]
    J: tl.constexpr = codes_rj.shape[1]
    s_rb = scales_rb.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # before the broadcast: fewer cvts
    s_rj = tl.reshape(tl.broadcast_to(s_rb[:, :, None], (R, J // 8, 8)), (R, J))
    return e2m1_half_f16(codes_rj, HI, HW) * s_rj


@triton.jit
def pow2_row_scale(x_rc):
    """Per fp32 row of x: (2^k putting the row's amax in [2^14, 2^15), 2^-k), k from the amax's
    exponent alone (rows with amax below 2^-112 take the factor of 2^-112). Scaled by it, a bf16 row
    is exact in fp16 down to amax * 2^-31 (fp16's subnormal step 2^-24 over bf16's 8 significant
    bits) and nothing overflows 65504; the inverse is a normal fp32."""
    amax_r = tl.max(tl.abs(x_rc), axis=1)
    exp_r = tl.maximum((amax_r.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15)  # biased exponent
    mul_r = ((127 + 14 + 127 - exp_r) << 23).to(tl.float32, bitcast=True)  # 2^(14 - (exp_r - 127))
    inv_r = ((exp_r - 14) << 23).to(tl.float32, bitcast=True)
    return mul_r, inv_r

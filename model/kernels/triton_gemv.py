"""Triton W4A16 decode GEMV (v3): one NVFP4 matrix times <= 4 bf16 rows, split-K on FMA units.

Why: a decode step multiplies each dense NVFP4 weight by 1-4 rows, and the tensor core's smallest M
is 16, so the tile kernel of model/kernels/triton_moe.py spends most of its instructions preparing
operands for one useful multiply. Here int32 weight words are decoded straight into fp32 FMAs (three
integer ops per weight, block scale per 16 products) and K is split so a 6144-row matrix fills every
SM. `nvfp4_linear_triton(..., variant=)`: "v3" (default) for T <= GEMV_MAX_ROWS (the tile kernel
above), "v2" the tile kernel always (the baseline benchmarks time). History: benchmarks/RESULTS.md.

Invariants: no host sync (CUDA-graph safe); splits reduced in the launch by the last-arriving program
in split order (deterministic), every launch leaving its tile counters at 0; the result is the
unrounded-weight product (the reference rounds weights to bf16 first: < 2^-8 relative per weight).
"""

from typing import Literal

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import (
    e2m1_nibble_f32_x2p126,
    f32_to_bf16,
    opaque_to_compile,
    safe_do_bench,
    use_hw_casts,
)
from model.kernels.triton_moe import _launch, _parts, split_planes

# Legend: T rows, N output features, K input features, BN / BK tile sizes, MR rows per program.
# `_w4a16_gemv_kernel`: grid (N / BN, SPLIT_K); weights decoded by `e2m1_nibble_f32_x2p126`.

GemvVariant = Literal["v3", "v2"]
"""v3: split-K FMA GEMV for T <= GEMV_MAX_ROWS; v2: the MoE module's tile kernel for every T."""

# For m <= 4 rows the tensor core has nothing to do (its M is 16): the v2 tile kernel spends ~17 SASS
# per weight element on byte extraction, the fp8 convert chain, a bf16 pack and its shared-memory
# operand round trip, for one useful multiply (compile report, RESULTS.md v3). Here each weight costs
# three integer ops (`e2m1_nibble_f32_x2p126`) and one FFMA per row, the block scale is applied once
# per 16 products, and the grid is (N / BN) x SPLIT_K programs so a 6144-row matrix fills 132 SMs
# several times over. Numerics: fp32 products of x with e2m1 (exact), summed per 16-block, times
# float(s), summed in fp32, times scale_2: the unrounded weights, where the reference multiplies by
# bf16(e2m1 * s * scale_2) (differs by that rounding, < 2^-8 relative per weight).
GEMV_MAX_ROWS = 4
# x is scaled by 2^100 so its products with e2m1 * 2^-126 (`e2m1_nibble_f32_x2p126`) stay normal fp32.
X_PRESCALE: tl.constexpr = tl.constexpr(1.2676506002282294e30)
RESULT_SCALE: tl.constexpr = tl.constexpr(67108864.0)  # 2^26 = 2^126 / 2^100


@triton.jit
def _fma_row_blocks(x_row, row, n_rows, k0, w_nbw, s_nb, is_blk, NB: tl.constexpr):
    """One activation row against the decoded tile: [BN, NB] block sums of x * e2m1, times float(s).

    x[k0 : k0 + 16 * NB] is loaded contiguously and split into the 8 nibble planes of the weight words
    (plane i holds elements 8 * word + i), so each FFMA pairs a weight with its own activation."""
    offs_b = tl.arange(0, NB)
    offs_e = tl.arange(0, 16)
    is_x = is_blk[:, None] & (tl.full((NB, 1), row, tl.int32) < n_rows)
    x_be = tl.load(x_row + k0 + offs_b[:, None] * 16 + offs_e[None, :], mask=is_x, other=0.0)
    x_be = x_be.to(tl.float32) * X_PRESCALE
    x0, x1, x2, x3, x4, x5, x6, x7 = split_planes(x_be, NB, 2)  # [NB, 2] each
    t = e2m1_nibble_f32_x2p126(w_nbw, 0) * x0[None]
    t = t + e2m1_nibble_f32_x2p126(w_nbw, 1) * x1[None]
    t = t + e2m1_nibble_f32_x2p126(w_nbw, 2) * x2[None]
    t = t + e2m1_nibble_f32_x2p126(w_nbw, 3) * x3[None]
    t = t + e2m1_nibble_f32_x2p126(w_nbw, 4) * x4[None]
    t = t + e2m1_nibble_f32_x2p126(w_nbw, 5) * x5[None]
    t = t + e2m1_nibble_f32_x2p126(w_nbw, 6) * x6[None]
    t = t + e2m1_nibble_f32_x2p126(w_nbw, 7) * x7[None]
    return tl.sum(t, axis=2) * s_nb


@triton.jit
def _store_split(y_rn, offs_r, is_r, offs_n, is_n, out_ptr, stride_om, part_ptr, cnt_ptr, tile, pid_k,
                 n_rows_p, n_out, SPLIT_K: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    """Output tile y [R, BN] (fp32, complete over K when SPLIT_K = 1) -> bf16 rows of out.

    SPLIT_K > 1 (no second launch, no host sync, CUDA-graph safe): each program stores its fp32
    partial to part[pid_k], then takes a ticket from the tile's counter (acq_rel, gpu scope, after a
    CTA barrier: the CUTLASS serial split-K pattern); the program drawing the last ticket sums the
    SPLIT_K partials in split order (deterministic, whatever the arrival order), writes bf16, and
    resets the counter to 0 for the next launch."""
    mask = is_r[:, None] & is_n[None, :]
    o_ptrs = out_ptr + offs_r[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(o_ptrs, f32_to_bf16(y_rn, HW), mask=mask)
    else:
        split_stride = n_out * n_rows_p  # int32: SPLIT_K * rows * n_out < 2^31
        p_ptrs = part_ptr + offs_r[:, None].to(tl.int64) * n_out + offs_n[None, :]
        tl.store(p_ptrs + pid_k * split_stride, y_rn, mask=mask)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros_like(y_rn)
            for s in tl.static_range(SPLIT_K):  # L2 reads (.cg): the other programs' partials
                total += tl.load(p_ptrs + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(o_ptrs, f32_to_bf16(total, HW), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, stride_xm, w_ptr, stride_wn, s_ptr, stride_sn, sc2_ptr,
    out_ptr, stride_om, part_ptr, cnt_ptr,
    n_rows, n_out, n_in,
    MR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """y [n_rows <= MR, n_out] = x @ W.T, W as int32 words [n_out, n_in / 8] + e4m3 scale bytes; grid
    (n_out / BN, SPLIT_K): program (n, k) owns rows n * BN.. of W over the k-th K range."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NB: tl.constexpr = BK // 16
    k_split = tl.cdiv(tl.cdiv(n_in, SPLIT_K), BK) * BK
    k_begin = pid_k * k_split
    k_end = tl.minimum(k_begin + k_split, n_in)
    offs_n = pid_n * BN + tl.arange(0, BN)
    is_n = offs_n < n_out
    offs_b = tl.arange(0, NB)
    offs_w = tl.arange(0, 2)
    # Two int32 words (16 nibbles) per scale block; a thread's words of a row are contiguous.
    w_ptrs = (
        w_ptr
        + offs_n[:, None, None].to(tl.int64) * stride_wn
        + offs_b[None, :, None] * 2
        + offs_w[None, None, :]
    )
    s_ptrs = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + offs_b[None, :]
    acc0 = tl.zeros((BN, NB), tl.float32)
    acc1 = tl.zeros((BN, NB), tl.float32)
    acc2 = tl.zeros((BN, NB), tl.float32)
    acc3 = tl.zeros((BN, NB), tl.float32)
    for k0 in range(k_begin, k_end, BK):
        is_blk = k0 + offs_b * 16 < k_end
        w_nbw = tl.load(w_ptrs + k0 // 8, mask=is_n[:, None, None] & is_blk[None, :, None], other=0)
        s_bits = tl.load(s_ptrs + k0 // 16, mask=is_n[:, None] & is_blk[None, :], other=0)
        s_nb = s_bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        acc0 += _fma_row_blocks(x_ptr, 0, n_rows, k0, w_nbw, s_nb, is_blk, NB)
        if MR > 1:
            acc1 += _fma_row_blocks(x_ptr + stride_xm, 1, n_rows, k0, w_nbw, s_nb, is_blk, NB)
        if MR > 2:
            acc2 += _fma_row_blocks(x_ptr + 2 * stride_xm, 2, n_rows, k0, w_nbw, s_nb, is_blk, NB)
            acc3 += _fma_row_blocks(x_ptr + 3 * stride_xm, 3, n_rows, k0, w_nbw, s_nb, is_blk, NB)
    scale = tl.load(sc2_ptr) * RESULT_SCALE
    offs_r = tl.arange(0, MR)
    y_rn = tl.where(offs_r[:, None] == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
    if MR > 1:
        y_rn = tl.where(offs_r[:, None] == 1, tl.sum(acc1, axis=1)[None, :], y_rn)
    if MR > 2:
        y_rn = tl.where(offs_r[:, None] == 2, tl.sum(acc2, axis=1)[None, :], y_rn)
        y_rn = tl.where(offs_r[:, None] == 3, tl.sum(acc3, axis=1)[None, :], y_rn)
    _store_split(y_rn * scale, offs_r, offs_r < n_rows, offs_n, is_n, out_ptr, stride_om, part_ptr, cnt_ptr,
                 pid_n, pid_k, MR, n_out, SPLIT_K, HW)  # fmt: skip


# Compiled launches time these on first use per (n_out, n_in, rows): 64-128 weights per thread per K
# step, 1-4 K splits (a 6144-row matrix at BN = 16: 384 to 1536 programs). Offline sm_90 compile
# (benchmarks/kernel_compile_report.py): no spills; 5.1-5.6 SASS per weight at 1 row, 9.1-10.5 at 4
# rows (the v2 tile kernel: 12.5-17.5 at any row count).
_GEMV_CONFIGS = [
    triton.Config({"BN": bn, "BK": bk, "SPLIT_K": sk}, num_warps=w, num_stages=1)
    for bn, bk, sk, w in [(16, 512, 1, 4), (16, 512, 2, 4), (16, 512, 4, 4), (32, 512, 2, 4), (64, 256, 2, 8)]
]
_w4a16_gemv_tuned = triton.autotune(_GEMV_CONFIGS, key=["n_out", "n_in", "n_rows"], do_bench=safe_do_bench)(
    _w4a16_gemv_kernel
)
MAX_SPLIT_K = max(c.kwargs["SPLIT_K"] for c in _GEMV_CONFIGS)
_COUNTERS: dict[tuple, torch.Tensor] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 tile counters for split-K launches, one buffer per (device, stream), kept between
    calls: every launch leaves its counters at 0 again. Allocated on first use: warm up before CUDA
    graph capture (autotuning needs that anyway)."""
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" must share one buffer
        device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _launch_gemv(x, w, out, n_rows, *, bn=16, bk=512, split_k=2):
    """v3 GEMV launch: autotuned when compiled at decode sizes, the given tile elsewhere (tests)."""
    (w_p, w_s, w_2) = w
    _, N, KW = w_p.shape
    mr = 1 if n_rows == 1 else 2 if n_rows == 2 else 4
    part = torch.empty((MAX_SPLIT_K * mr * N,), dtype=torch.float32, device=x.device)
    counters = split_counters(x.device, triton.cdiv(N, 8))
    args = (x, x.stride(0), w_p, w_p.stride(1), w_s, w_s.stride(1), w_2, out, out.stride(0), part, counters,
            n_rows, N, 8 * KW)  # fmt: skip
    if use_hw_casts() and N * 8 * KW >= 1 << 20:
        _w4a16_gemv_tuned[lambda m: (triton.cdiv(N, m["BN"]), m["SPLIT_K"])](*args, MR=mr, HW=True)
    else:
        _w4a16_gemv_kernel[(triton.cdiv(N, bn), split_k)](*args, MR=mr, BN=bn, BK=bk, SPLIT_K=split_k,
                                                          HW=use_hw_casts())  # fmt: skip


@opaque_to_compile
def nvfp4_linear_triton(x_TK: torch.Tensor, packed_NK2: torch.Tensor, scales_NK16: torch.Tensor,
                        scale_2: torch.Tensor, *, variant: GemvVariant = "v3") -> torch.Tensor:  # fmt: skip
    """W4A16 y [T, N] = x @ dequant(W).T (bf16 x, fp32 accumulation, bf16 out): one launch, no
    other device work (decode GEMVs are a few microseconds: any extra op is a measurable share).
    variant "v3": T <= GEMV_MAX_ROWS runs the split-K FMA GEMV, larger T the v2 tile kernel; "v2":
    the v2 tile kernel for every T (kept so benchmarks time the versions in one run)."""
    if variant not in GemvVariant.__args__:
        raise ValueError(
            f"nvfp4_linear_triton: variant must be one of {GemvVariant.__args__}, got {variant!r}"
        )
    T = x_TK.shape[0]
    N = packed_NK2.shape[0]
    y = torch.empty((T, N), dtype=torch.bfloat16, device=x_TK.device)
    w = _parts(packed_NK2.unsqueeze(0), scales_NK16.unsqueeze(0), scale_2)
    if variant == "v3" and 0 < T <= GEMV_MAX_ROWS:
        _launch_gemv(x_TK, w, y, T)
    else:
        _launch(x_TK, x_TK, x_TK, x_TK, w, w, y, 1, False, False, 0.0, 0.0, n_rows=T, linear=True)
    return y

"""Triton paged (block-sparse) attention decode over NVFP4 / FP8 / bf16 K/V pages.

Why: decode attention reads, per query token and KV group, only the indexer's selected pages, so it
is bound by those bytes (NVFP4 pages move 1.78x fewer than FP8). One program takes the G query heads
of a KV group (each K/V page read once for the group), dequantizes pages in registers and runs an
online softmax in the exp2 domain; splits of the block list are merged by log-sum-exp. NVFP4 pages
of head dim 128 in packed 72-byte rows (what `PagedKV` stores) stay code bytes that are decoded in
registers into the dot operands (v6: keys on the MMA's M side for Q.K, no decoded tile staged in
shared memory; 1.47x the deleted v5 at B = 64, 128K on the H200). FP8 pages, other NVFP4 shapes
and `variant="v2"` take the FP8 path: q, P and the pages (NVFP4 decoded byte-wise to e4m3) meet in
FP8-valued dots. History: benchmarks/RESULTS.md.

Invariants: semantics are `model.kernels.sparse_attention`'s; v6 equals `sparse_attention_ref` on
the real inputs up to P's e4m3 rounding and fp32 order, the FP8 path equals it on FP8-emulated
inputs (`fp8_emulated`) up to the same, the bf16 path up to bf16 rounding of q and P; a row with no
visible key gets zeros.
"""

from typing import Literal

import torch
import triton
import triton.language as tl

from model import nvfp4
from model.kernels.triton_common import (
    dot_bf16,
    e2m1_half_scaled_f16,
    f32_to_bf16,
    f32_to_e4m3,
    load_nvfp4_tile_direct,
    num_sms,
    nvfp4_tile_to_fp8,
    opaque_to_compile,
    pow2_row_scale,
    safe_do_bench,
    tune_class,
    use_hw_casts,
)
from model.kv_cache import PagedKV

FMT_FLOAT, FMT_FP8, FMT_NVFP4 = 0, 1, 2
_FMT = {"bf16": FMT_FLOAT, "fp8": FMT_FP8, "nvfp4": FMT_NVFP4, "nvfp4_4over6": FMT_NVFP4}
PROGRAMS_PER_SM = 4
MERGE_COLUMNS = 32  # head-dim columns per `_merge_kernel` program
DecodeVariant = Literal["v6", "v2"]
"""v6 (the default): NVFP4 pages of head dim 128 in packed rows as dot operands decoded in registers,
every other cache on the FP8 / bf16 path; v2: the byte-wise decode to e4m3 for every NVFP4 shape
(the baseline the benchmarks compare with)."""
V6_HEAD_DIM = 128  # v6 reads packed 72-byte rows (8-byte aligned) of 128 values
LOG2E = 1.4426950408889634
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)  # finite "minus infinity": exp2(NEG_BIG - m) == 0, no NaN


@triton.jit
def _load_tile(row_ptrs, is_row, C: tl.constexpr, ROWS: tl.constexpr, FMT: tl.constexpr,
               FP8_DOT: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    """Stored K or V rows -> the dot operand [ROWS, C]: e4m3 (FP8_DOT) or bf16, global scale excluded."""
    if FMT == 2:
        if FP8_DOT:
            tile = nvfp4_tile_to_fp8(row_ptrs, is_row, C, ROWS, HW)
        else:
            tile = f32_to_bf16(load_nvfp4_tile_direct(row_ptrs, is_row, C), HW)
    else:
        offs_c = tl.arange(0, C)
        raw = tl.load(row_ptrs[:, None] + offs_c[None, :], mask=is_row[:, None], other=0)
        if FMT == 1:
            tile = raw.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
            if not FP8_DOT:
                tile = tile.to(tl.float32).to(tl.bfloat16)  # exact, no rounding
        else:
            tile = f32_to_bf16(raw.to(tl.float32), HW)
    return tile


# Legend: T tokens, H query heads, N kv heads, G = H / N, C head dim, K selected slots, P block-table
# width, BPS blocks per split.
#
# `_sparse_attn_kernel`, grid (T, N, SPLITS): the [G, C] query tile of KV group n of token t walks
# BPS of the group's selected blocks (all blocks 0..pos // page when dense). K and V tiles are loaded
# in stored byte order and dequantized in registers: NVFP4 -> e4m3(e2m1 * block_scale) (bit-exact
# with `nvfp4.kv_dequantize_fp8`; the bit trick of docs/FACTS.md, "Kernel facts"), FP8 and bf16 as
# stored; the per-layer global scales multiply the scores (k_scale) and the output (v_scale), never
# the tiles. FP8 path: Q quantized per head row to e4m3 (scale amax / 448), FP8 score dot with fp32
# accumulation, P cast to e4m3 for P.V, the row sum l from fp32 P. bf16 path (bf16 cache, or pages /
# head dims too small for FP8 MMA): bf16 dots. SPLITS = 1 writes the output, otherwise (m, l, acc)
# partials that `_merge_kernel` (grid (T, N, C / CB)) combines: out = sum_s acc_s 2^(m_s - M) /
# sum_s l_s 2^(m_s - M) * v_scale. SPLITS makes T * N * SPLITS cover ~4 waves of SMs.
@triton.jit
def _slot_count(pos, slot0, BPS, n_slots, PAGE: tl.constexpr, DENSE: tl.constexpr):
    """Slots this split walks: dense, the blocks up to the query's own; sparse, the selection's slots
    up to slot pos // PAGE (selections are left-packed and causal, so later slots hold only -1)."""
    if DENSE:
        return tl.minimum(BPS, pos // PAGE + 1 - slot0)
    return tl.minimum(BPS, tl.minimum(n_slots, pos // PAGE + 1) - slot0)


@triton.jit
def _slot_page(sel_row, slot, bt_row, pos, offs_s, sub0, PAGE: tl.constexpr, DENSE: tl.constexpr):
    """(block, its page, which of the sub-tile's tokens are keys) of a slot; a -1 slot reads page 0's
    address and has no keys (negative positions)."""
    if DENSE:
        blk = slot.to(tl.int64)
    else:
        blk = tl.load(sel_row + slot).to(tl.int64)
    page = tl.load(bt_row + tl.maximum(blk, 0)).to(tl.int64)
    tok_s = blk * PAGE + sub0 + offs_s
    return blk, page, (tok_s <= pos) & (tok_s >= 0)


@triton.jit
def _sparse_attn_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, stride_kp, stride_kh, stride_ks,
    bt_ptr, stride_bb, seq_ptr, pos_ptr,
    sel_ptr, stride_st, stride_sn,
    kscale_ptr, vscale_ptr, sm_scale_log2,
    out_ptr, stride_ot, stride_oh,
    part_ptr, ml_ptr,
    n_slots, BPS, SPLITS, n_work, tune_class,
    G: tl.constexpr, G_P2: tl.constexpr, C: tl.constexpr, PAGE: tl.constexpr,
    FMT: tl.constexpr, FP8_DOT: tl.constexpr, DENSE: tl.constexpr, IS_SPLIT: tl.constexpr,
    HW: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    seq = tl.load(seq_ptr + pid_t).to(tl.int64)
    pos = tl.load(pos_ptr + pid_t).to(tl.int64)
    slot0 = pid_s * BPS
    n_iter = _slot_count(pos, slot0, BPS, n_slots, PAGE, DENSE)
    sel_row = sel_ptr + pid_t * stride_st + pid_n * stride_sn
    bt_row = bt_ptr + seq * stride_bb

    offs_g = tl.arange(0, G_P2)
    offs_c = tl.arange(0, C)
    offs_s = tl.arange(0, SUB)
    NSUB: tl.constexpr = PAGE // SUB
    is_head = offs_g < G
    q_gc = tl.load(q_ptr + pid_t * stride_qt + (pid_n * G + offs_g[:, None]) * stride_qh + offs_c[None, :],
                   mask=is_head[:, None], other=0.0).to(tl.float32)  # fmt: skip
    k_scale = 1.0
    v_scale = 1.0
    if FMT != 0:
        k_scale = tl.load(kscale_ptr).to(tl.float32)
        v_scale = tl.load(vscale_ptr).to(tl.float32)
    if FP8_DOT:
        # Per-row e4m3 quantization: the row's amax maps to 448 (e4m3's largest finite value).
        amax_g = tl.maximum(tl.max(tl.abs(q_gc), axis=1), 1e-30)
        q_mul_g = tl.math.div_rn(tl.full(amax_g.shape, 448.0, tl.float32), amax_g)
        q_op = f32_to_e4m3(tl.minimum(tl.maximum(q_gc * q_mul_g[:, None], -448.0), 448.0), HW)
        factor_g = tl.math.div_rn(amax_g, tl.full(amax_g.shape, 448.0, tl.float32)) * (
            k_scale * sm_scale_log2
        )
    else:
        q_op = f32_to_bf16(q_gc, HW)
        factor_g = tl.full((G_P2,), 1.0, tl.float32) * (k_scale * sm_scale_log2)

    m_g = tl.full((G_P2,), NEG_BIG, tl.float32)
    l_g = tl.zeros((G_P2,), tl.float32)
    acc_gc = tl.zeros((G_P2, C), tl.float32)
    k_base = kv_ptr + (2 * pid_n) * stride_kh
    # One [SUB, C] K and V tile per step (SUB <= PAGE tokens: a page's sub-tiles are consecutive steps;
    # SUB < PAGE halves the registers a decoded tile holds, so deeper pipelining fits).
    for i in range(0, n_iter * NSUB):
        slot = i // NSUB
        sub0 = (i % NSUB) * SUB
        _, page, is_key = _slot_page(sel_row, slot0 + slot, bt_row, pos, offs_s, sub0, PAGE, DENSE)
        k_page = k_base + page * stride_kp
        row_off = (sub0 + offs_s) * stride_ks
        k_rows = k_page + row_off
        k_sc = _load_tile(k_rows, is_key, C, SUB, FMT, FP8_DOT, HW)
        if FP8_DOT:
            s_gs = tl.dot(q_op, tl.trans(k_sc))
        else:
            s_gs = dot_bf16(q_op, tl.trans(k_sc), HW)
        s_gs = tl.where(is_key[None, :], s_gs * factor_g[:, None], float("-inf"))
        m_new = tl.maximum(m_g, tl.max(s_gs, axis=1))
        alpha = tl.math.exp2(m_g - m_new)
        p_gs = tl.math.exp2(s_gs - m_new[:, None])
        l_g = l_g * alpha + tl.sum(p_gs, axis=1)
        v_sc = _load_tile(k_rows + stride_kh, is_key, C, SUB, FMT, FP8_DOT, HW)
        if FP8_DOT:
            pv_gc = tl.dot(f32_to_e4m3(p_gs, HW), v_sc)
        else:
            pv_gc = dot_bf16(f32_to_bf16(p_gs, HW), v_sc, HW)
        acc_gc = acc_gc * alpha[:, None] + pv_gc
        m_g = m_new

    if IS_SPLIT:
        row = (pid_t * tl.num_programs(1) + pid_n) * SPLITS + pid_s
        # Padded heads (>= G) are not written: `_merge_kernel` never reads them.
        part_gc = part_ptr + (row * G_P2 + offs_g[:, None]) * C + offs_c[None, :]
        tl.store(part_gc, acc_gc, mask=is_head[:, None])
        tl.store(ml_ptr + (row * G_P2 + offs_g) * 2, m_g, mask=is_head)
        tl.store(ml_ptr + (row * G_P2 + offs_g) * 2 + 1, l_g, mask=is_head)
    else:
        out_gc = tl.where(l_g[:, None] > 0, acc_gc / tl.maximum(l_g, 1e-30)[:, None], 0.0) * v_scale
        o_ptrs = out_ptr + pid_t * stride_ot + (pid_n * G + offs_g[:, None]) * stride_oh + offs_c[None, :]
        tl.store(o_ptrs, out_gc.to(out_ptr.dtype.element_ty), mask=is_head[:, None])


# Compiled launches at decode sizes time a few warp / pipeline-depth choices per shape on first use.
# Used for 128-token pages (the M3 block size), where both sub-tile sizes are valid FP8 MMA shapes.
_sparse_attn_tuned = triton.autotune(
    [
        triton.Config({"SUB": sub}, num_warps=w, num_stages=st)
        for sub, w, st in [(128, 8, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3)]
    ],
    key=["tune_class", "FMT", "FP8_DOT"],
    do_bench=safe_do_bench,
)(_sparse_attn_kernel)


# `_sparse_attn_v6_kernel` (NVFP4 pages, C = 128, packed 72-byte rows), grid, walk, online softmax and
# split partials as `_sparse_attn_kernel`; K and V reach the tensor cores as dot operands decoded in
# registers from their code bytes (`e2m1_half_scaled_f16`), never as decoded tiles staged in shared
# memory (the deleted v5's bound: L1/TEX 79% busy on those stores and LDSM reads, DRAM 16%; RESULTS.md).
# Byte j of a row holds values 2j (low nibble) and 2j + 1 (high), block j // 8, so each side is two
# [SUB, C/2] halves, even and odd, and no register interleave is ever needed.
# - S^T = K Q^T, keys on the MMA's M side: the decoded K halves are the A operand (registers), the
#   query's even / odd columns the B operand [C/2, G_P2] (fp16, loaded once).
#   The block scales are folded into the decoded A in registers (one mul.f16x2 per two values),
#   not expanded into the query per scale block as the indexer does: that would make the B operand
#   G_P2 x C/16 = 128 columns wide (8x the MMA work) for G = 16.
# - O += P V: V's decoded halves are the B operand [SUB, C/2] of two dots into even / odd
#   accumulators [G_P2, C/2] (M = G_P2 = 16: mma.sync, whose B operand may live in registers); V's
#   scales vary along both dims of that operand (per key row, per 16 dims), so they too are folded
#   into the decoded values. The output stores columns 2j and 2j + 1 from the two accumulators.
# Where Triton still goes through shared memory (TTGIR / SASS, sm_90, Triton 3.9; compile report):
# - every code and scale byte: cp.async'd there (pipelined), then read straight into the dot-operand
#   layout. K's rows are its contiguous axis (LDS.U16 pairs); V's contraction axis (keys) is the
#   strided one, so its B operand is read one byte per LDS.U8 (4 consecutive keys per register):
#   the transpose P V needs, paid on raw bytes (1 B per 2 values) instead of v5's decoded fp16 tiles.
# - P: it leaves the first dot as P^T [SUB, G_P2] in the wgmma accumulator layout and must become
#   the A operand [G_P2, SUB] of the second: a local_alloc of SUB x 16 fp16 (4 KB at SUB = 128) per
#   step, the one staged floating-point tile (v5 stages two decoded [SUB, C] tiles plus P).
# - the per-head statistics (alpha: [G_P2] from the wgmma to the mma.sync layout), a few bytes.
# Numerics: the decoded K and V equal `nvfp4.kv_dequantize`'s e2m1 * block scale exactly (fp16, see
# `e2m1_half_scaled_f16`; no e4m3 rounding or 448 saturation as on the FP8 path), the query is the
# bf16 row exactly (fp16 after a power-of-two prescale per head, `pow2_row_scale`; fp32 queries round
# to fp16), every product exact in the fp32 accumulators. P is rounded to e4m3 and back to fp16 as on
# the FP8 path (the row sum l from fp32 P). So v6 equals `sparse_attention_ref` up to P's e4m3 rounding,
# fp32 order and the output's rounding to q's dtype.
@triton.jit
def _sparse_attn_v6_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, stride_kp, stride_kh,
    bt_ptr, stride_bb, seq_ptr, pos_ptr,
    sel_ptr, stride_st, stride_sn,
    kscale_ptr, vscale_ptr, sm_scale_log2,
    out_ptr, stride_ot, stride_oh,
    part_ptr, ml_ptr,
    n_slots, BPS, SPLITS, tune_class,
    G: tl.constexpr, G_P2: tl.constexpr, C: tl.constexpr, PAGE: tl.constexpr,
    DENSE: tl.constexpr, IS_SPLIT: tl.constexpr, HW: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    seq = tl.load(seq_ptr + pid_t).to(tl.int64)
    pos = tl.load(pos_ptr + pid_t).to(tl.int64)
    slot0 = pid_s * BPS
    n_iter = _slot_count(pos, slot0, BPS, n_slots, PAGE, DENSE)
    sel_row = sel_ptr + pid_t * stride_st + pid_n * stride_sn
    bt_row = bt_ptr + seq * stride_bb
    HALF: tl.constexpr = C // 2  # code bytes per row; the C / 16 scale bytes follow
    ROW: tl.constexpr = HALF + C // 16  # packed row bytes: a constant stride (8-byte aligned rows)
    NSUB: tl.constexpr = PAGE // SUB
    offs_g = tl.arange(0, G_P2)
    offs_j = tl.arange(0, HALF)
    offs_b = tl.arange(0, C // 16)
    offs_s = tl.arange(0, SUB)
    is_head = offs_g < G

    q_head = q_ptr + pid_t * stride_qt + (pid_n * G + offs_g) * stride_qh
    q_gc = tl.load(q_head[:, None] + tl.arange(0, C)[None, :], mask=is_head[:, None], other=0.0)
    mul_g, inv_g = pow2_row_scale(q_gc.to(tl.float32))
    q_even = q_head[None, :] + 2 * offs_j[:, None]  # [C/2, G_P2]: column g holds head g's values 2j
    qe_jg = (tl.load(q_even, mask=is_head[None, :], other=0.0).to(tl.float32) * mul_g[None, :]).to(tl.float16)
    qo_jg = (tl.load(q_even + 1, mask=is_head[None, :], other=0.0).to(tl.float32) * mul_g[None, :]).to(
        tl.float16
    )
    # Scores in the exp2 domain: undo the query prescale, the decode's 2^-6, apply k_scale.
    factor_g = inv_g * (tl.load(kscale_ptr).to(tl.float32) * (64.0 * sm_scale_log2))
    v_scale = tl.load(vscale_ptr).to(tl.float32)

    m_g = tl.full((G_P2,), NEG_BIG, tl.float32)
    l_g = tl.zeros((G_P2,), tl.float32)
    acc_e = tl.zeros((G_P2, HALF), tl.float32)  # output columns 2j
    acc_o = tl.zeros((G_P2, HALF), tl.float32)  # output columns 2j + 1
    k_base = kv_ptr + (2 * pid_n) * stride_kh
    for i in range(0, n_iter * NSUB):
        slot = i // NSUB
        sub0 = (i % NSUB) * SUB
        _, page, is_key = _slot_page(sel_row, slot0 + slot, bt_row, pos, offs_s, sub0, PAGE, DENSE)
        k_rows = k_base + page * stride_kp + (sub0 + offs_s) * ROW
        # K unmasked: a selected block's page is allocated, and a garbage row (even a NaN scale) only
        # reaches its own row of S^T, which the where below drops.
        codes_sj = tl.load(k_rows[:, None] + offs_j[None, :])
        scale_sb = tl.load(k_rows[:, None] + HALF + offs_b[None, :])
        s_sg = tl.dot(e2m1_half_scaled_f16(codes_sj, scale_sb, False, HW), qe_jg)
        s_sg = tl.dot(e2m1_half_scaled_f16(codes_sj, scale_sb, True, HW), qo_jg, s_sg)
        s_sg = tl.where(is_key[:, None], s_sg * factor_g[None, :], float("-inf"))
        m_new = tl.maximum(m_g, tl.max(s_sg, axis=0))
        alpha = tl.math.exp2(m_g - m_new)
        p_sg = tl.math.exp2(s_sg - m_new[None, :])
        l_g = l_g * alpha + tl.sum(p_sg, axis=0)
        p_gs = tl.trans(f32_to_e4m3(p_sg, HW).to(tl.float16))  # the FP8 path's rounding of P (exact to fp16)
        # V's scales masked: P is 0 on rows that are not keys, but a garbage scale byte there could
        # decode to NaN (0 x NaN = NaN); a zero scale gives zeros whatever the codes.
        v_rows = k_rows + stride_kh
        vcodes_sj = tl.load(v_rows[:, None] + offs_j[None, :])
        vscale_sb = tl.load(v_rows[:, None] + HALF + offs_b[None, :], mask=is_key[:, None], other=0)
        acc_e = tl.dot(p_gs, e2m1_half_scaled_f16(vcodes_sj, vscale_sb, False, HW), acc_e * alpha[:, None])
        acc_o = tl.dot(p_gs, e2m1_half_scaled_f16(vcodes_sj, vscale_sb, True, HW), acc_o * alpha[:, None])
        m_g = m_new

    acc_e = acc_e * 64.0  # the decode's 2^-6
    acc_o = acc_o * 64.0
    if IS_SPLIT:
        row = (pid_t * tl.num_programs(1) + pid_n) * SPLITS + pid_s
        part_gj = part_ptr + (row * G_P2 + offs_g[:, None]) * C + 2 * offs_j[None, :]
        tl.store(part_gj, acc_e, mask=is_head[:, None])  # padded heads: never read by the merge
        tl.store(part_gj + 1, acc_o, mask=is_head[:, None])
        tl.store(ml_ptr + (row * G_P2 + offs_g) * 2, m_g, mask=is_head)
        tl.store(ml_ptr + (row * G_P2 + offs_g) * 2 + 1, l_g, mask=is_head)
    else:
        inv_l = tl.where(l_g > 0, v_scale / tl.maximum(l_g, 1e-30), 0.0)
        o_gj = out_ptr + pid_t * stride_ot + (pid_n * G + offs_g[:, None]) * stride_oh + 2 * offs_j[None, :]
        tl.store(o_gj, (acc_e * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=is_head[:, None])
        tl.store(o_gj + 1, (acc_o * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=is_head[:, None])


# (SUB, warps, stages, register cap) for 128-token pages: 64- and 128-key tiles (keys on M: wgmma from
# M = 64 per warp group). Stages (compile report, sm_90): 2-4 keep one K/V tile of code bytes in
# flight per program, 5 double-buffers it (shared 15 -> 25 KB at SUB = 64, 27 -> 45 KB at 128);
# registers (131-176) allow 1-3 programs per SM. Register caps (ncu: occupancy-bound at 18.8%,
# register-limited): ptxas fits SUB = 128 in 128 registers without spills (4 programs per SM), SUB =
# 64 in 112; the H200 autotune picked (128, 4, 5, 128) at B = 64, 128K (RESULTS.md, session 10).
V6_CONFIGS = ((64, 4, 2, None), (64, 4, 5, None), (128, 4, 2, None), (128, 4, 5, None), (128, 8, 2, None),
              (128, 8, 5, None), (128, 4, 2, 128), (128, 4, 5, 128), (64, 4, 5, 112))  # fmt: skip
_sparse_attn_v6_tuned = triton.autotune(
    [triton.Config({"SUB": sub}, num_warps=w, num_stages=st, maxnreg=r) for sub, w, st, r in V6_CONFIGS],
    key=["tune_class", "PAGE"],
    do_bench=safe_do_bench,
)(_sparse_attn_v6_kernel)


# `_merge_kernel`, grid (T, N, C / CB): one CB-column slice of a KV group's G heads per program, so
# a batch-64 merge is 4x as many programs as one per group (it was latency-bound at 256 programs:
# 16 us for 6 MB, ncu, RESULTS.md 2026-12-02), and the G_P2 - G padded heads are never read.
@triton.jit
def _merge_kernel(
    part_ptr, ml_ptr, vscale_ptr, out_ptr, stride_ot, stride_oh,
    SPLITS: tl.constexpr, S_P2: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
    C: tl.constexpr, CB: tl.constexpr, FMT: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_p = tl.arange(0, S_P2)
    offs_g = tl.arange(0, G_P2)
    offs_c = tl.program_id(2) * CB + tl.arange(0, CB)
    is_split = offs_p < SPLITS
    is_head = offs_g < G
    is_pg = is_split[:, None] & is_head[None, :]
    row_p = (pid_t * tl.num_programs(1) + pid_n) * SPLITS + offs_p
    ml = ml_ptr + (row_p[:, None] * G_P2 + offs_g[None, :]) * 2
    m_pg = tl.load(ml, mask=is_pg, other=NEG_BIG)
    l_pg = tl.load(ml + 1, mask=is_pg, other=0.0)
    m_g = tl.max(m_pg, axis=0)
    w_pg = tl.math.exp2(m_pg - m_g[None, :])
    l_g = tl.sum(l_pg * w_pg, axis=0)
    acc_ptrs = part_ptr + ((row_p[:, None, None] * G_P2 + offs_g[None, :, None]) * C + offs_c[None, None, :])
    acc_pgc = tl.load(acc_ptrs, mask=is_pg[:, :, None], other=0.0)
    acc_gc = tl.sum(acc_pgc * w_pg[:, :, None], axis=0)
    v_scale = 1.0
    if FMT != 0:
        v_scale = tl.load(vscale_ptr).to(tl.float32)
    out_gc = tl.where(l_g[:, None] > 0, acc_gc / tl.maximum(l_g, 1e-30)[:, None], 0.0) * v_scale
    o_ptrs = out_ptr + pid_t * stride_ot + (pid_n * G + offs_g[:, None]) * stride_oh + offs_c[None, :]
    tl.store(o_ptrs, out_gc.to(out_ptr.dtype.element_ty), mask=is_head[:, None])


def plan_splits(n_work: int, n_slots: int, device: torch.device) -> tuple[int, int]:
    """(splits, blocks per split) so that n_work * splits covers PROGRAMS_PER_SM waves of SMs."""
    target = PROGRAMS_PER_SM * num_sms(device)
    splits = max(1, min(n_slots, -(-target // max(1, n_work))))
    bps = -(-n_slots // splits)
    return -(-n_slots // bps), bps


def uses_fp8_dot(kv_dtype: str, head_dim: int, page: int) -> bool:
    """FP8 dots for FP8 / NVFP4 caches when the tiles fit FP8 MMA (k >= 32 on both products)."""
    return kv_dtype != "bf16" and head_dim >= 32 and page >= 32


@opaque_to_compile
def sparse_attention_triton(
    q_THC: torch.Tensor, kv_cache: PagedKV, block_tables_BP: torch.Tensor, seq_idx_T: torch.Tensor,
    positions_T: torch.Tensor, selected_TNK: torch.Tensor | None, *, softmax_scale: float,
    force_bf16_dot: bool = False, out_THC: torch.Tensor | None = None, sub_tile: int | None = None,
    variant: DecodeVariant = "v6",
) -> torch.Tensor:  # fmt: skip
    """[T, H, C] in q's dtype (written into `out_THC` if given); see the module notes. No host syncs.
    `variant`: "v6" runs `_sparse_attn_v6_kernel` on NVFP4 pages of head dim 128 in packed 8-byte
    aligned rows (FP8 dots possible) and `_sparse_attn_kernel` on everything else; "v2" the byte-wise
    decode to e4m3 for every NVFP4 shape (the baseline the benchmarks compare with)."""
    if variant not in DecodeVariant.__args__:
        raise ValueError(
            f"sparse attention: variant must be one of {DecodeVariant.__args__}, got {variant!r}"
        )
    T, H, C = q_THC.shape
    pages = kv_cache.pages
    N, page = pages.shape[1] // 2, pages.shape[2]
    G = H // N
    if out_THC is None:
        out_THC = torch.empty_like(q_THC)
    if T == 0:
        return out_THC
    is_dense = selected_TNK is None
    n_slots = block_tables_BP.shape[1] if is_dense else selected_TNK.shape[2]
    splits, bps = plan_splits(T * N, max(1, n_slots), q_THC.device)
    g_p2 = max(16, triton.next_power_of_2(G))
    fp8_dot = uses_fp8_dot(kv_cache.dtype, C, page) and not force_bf16_dot
    fmt = _FMT[kv_cache.dtype]
    is_packed = C == V6_HEAD_DIM and pages.stride(2) == C // 2 + C // 16 and pages.data_ptr() % 8 == 0
    is_v6 = variant == "v6" and fmt == FMT_NVFP4 and fp8_dot and is_packed
    if splits > 1:
        part = torch.empty((T * N * splits * g_p2 * C,), dtype=torch.float32, device=q_THC.device)
        ml = torch.empty((T * N * splits * g_p2 * 2,), dtype=torch.float32, device=q_THC.device)
    else:
        part = ml = out_THC  # unused
    sel = selected_TNK if selected_TNK is not None else block_tables_BP
    sel_strides = (0, 0) if is_dense else (selected_TNK.stride(0), selected_TNK.stride(1))
    # Autotune only where a launch is big enough to matter (small test shapes keep one compile).
    # `sub_tile` (tokens per K/V tile, dividing the page; tests) fixes the tile and skips tuning.
    is_tuned = use_hw_casts() and T * N * splits >= 256 and page == 128 and sub_tile is None
    sub_kw = {} if is_tuned else {"SUB": sub_tile or page}
    if is_v6:
        kernel = _sparse_attn_v6_tuned if is_tuned else _sparse_attn_v6_kernel
        kernel[(T, N, splits)](
            q_THC, q_THC.stride(0), q_THC.stride(1),
            pages, pages.stride(0), pages.stride(1),
            block_tables_BP, block_tables_BP.stride(0), seq_idx_T, positions_T,
            sel, *sel_strides,
            kv_cache.k_scale, kv_cache.v_scale, softmax_scale * LOG2E,
            out_THC, out_THC.stride(0), out_THC.stride(1), part, ml,
            n_slots, bps, splits, tune_class(n_slots, T * N),
            G=G, G_P2=g_p2, C=C, PAGE=page, DENSE=is_dense, IS_SPLIT=splits > 1, HW=use_hw_casts(),
            **sub_kw,
        )  # fmt: skip
    else:
        kernel = _sparse_attn_tuned if is_tuned else _sparse_attn_kernel
        kernel[(T, N, splits)](
            q_THC, q_THC.stride(0), q_THC.stride(1),
            pages, pages.stride(0), pages.stride(1), pages.stride(2),
            block_tables_BP, block_tables_BP.stride(0), seq_idx_T, positions_T,
            sel, *sel_strides,
            kv_cache.k_scale, kv_cache.v_scale, softmax_scale * LOG2E,
            out_THC, out_THC.stride(0), out_THC.stride(1), part, ml,
            n_slots, bps, splits, T * N, tune_class(n_slots, T * N),
            G=G, G_P2=g_p2, C=C, PAGE=page, FMT=fmt, FP8_DOT=fp8_dot, DENSE=is_dense,
            IS_SPLIT=splits > 1, HW=use_hw_casts(), **sub_kw,
        )  # fmt: skip
    if splits > 1:
        cb = min(C, MERGE_COLUMNS)
        _merge_kernel[(T, N, C // cb)](
            part, ml, kv_cache.v_scale, out_THC, out_THC.stride(0), out_THC.stride(1),
            SPLITS=splits, S_P2=triton.next_power_of_2(splits), G=G, G_P2=g_p2, C=C, CB=cb, FMT=fmt,
        )  # fmt: skip
    return out_THC


def triton_attention_supported(q_THC: torch.Tensor, kv_cache: PagedKV) -> bool:
    """Shapes and dtypes the kernel handles (else the torch path): a power-of-two head dim >= 16,
    page >= 16, a bf16 / fp8 / NVFP4 cache (fp32 caches stay on the exact torch path)."""
    C, page = q_THC.shape[-1], kv_cache.pages.shape[2]
    is_pow2 = C >= 16 and C & (C - 1) == 0 and page >= 16 and page & (page - 1) == 0
    # NVFP4 pages through bf16 dots (tiles too small for FP8 MMA) gave wrong results on the H200 in v1
    # (join + reshape interleave); v2 decodes that tile element by element and passed on the H200.
    return is_pow2 and kv_cache.dtype in _FMT and kv_cache.pages.is_contiguous() and q_THC.stride(-1) == 1


def fp8_emulated(q_THC: torch.Tensor, kv_cache: PagedKV) -> tuple[torch.Tensor, PagedKV]:
    """The FP8 path's inputs as exact fp32 values, for `sparse_attention_ref`: q rows rounded to e4m3
    with scale amax / 448, pages replaced by fp32 pages of the FP8 tiles times the global scales."""
    q = q_THC.float()
    amax = q.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    q8 = (q * (torch.tensor(448.0) / amax)).clamp(-448, 448).to(torch.float8_e4m3fn)
    q_emul = q8.float() * (amax / torch.tensor(448.0))
    pages = kv_cache.pages
    if kv_cache.dtype == "fp8":
        vals = pages.view(torch.float8_e4m3fn).float()
    else:
        vals, _ = nvfp4.kv_dequantize_fp8(pages, 1.0)
        vals = vals.float()
    scale = torch.stack([kv_cache.k_scale, kv_cache.v_scale]).repeat(pages.shape[1] // 2)
    emul = PagedKV((vals * scale[None, :, None, None]).contiguous(), "fp32", kv_cache.k_scale,
                   kv_cache.v_scale, kv_cache.head_dim)  # fmt: skip
    return q_emul, emul


@triton.jit
def _nvfp4_to_fp8_kernel(buf_ptr, out_ptr, n_rows, C: tl.constexpr, ROWS: tl.constexpr, HW: tl.constexpr):
    offs_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    is_row = offs_r < n_rows
    row_ptrs = buf_ptr + offs_r.to(tl.int64) * (C // 2 + C // 16)
    fp8_rc = nvfp4_tile_to_fp8(row_ptrs, is_row, C, ROWS, HW)
    offs_c = tl.arange(0, C)
    out_ptrs = out_ptr + offs_r[:, None].to(tl.int64) * C + offs_c[None, :]
    tl.store(out_ptrs, fp8_rc.to(tl.uint8, bitcast=True), mask=is_row[:, None])


@opaque_to_compile
def nvfp4_rows_to_fp8_triton(buf_RX: torch.Tensor) -> torch.Tensor:
    """The FP8 path's page dequantizer on its own: NVFP4 rows [R, X] -> float8_e4m3fn [R, C] (the bits
    `nvfp4.kv_dequantize_fp8` gives; used to test the in-kernel byte-wise decode bit for bit). v6
    rounds nothing to e4m3, so it has no such dequantizer."""
    R, X = buf_RX.shape
    C = X * 16 // 9
    out = torch.empty((R, C), dtype=torch.uint8, device=buf_RX.device)
    _nvfp4_to_fp8_kernel[(triton.cdiv(R, 16),)](buf_RX, out, R, C=C, ROWS=16, HW=use_hw_casts())
    return out.view(torch.float8_e4m3fn)

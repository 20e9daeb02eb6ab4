"""Triton NVFP4 MoE decode on FMA units (v6): the routed experts as grouped split-K GEMVs of <= 4 rows.

What: `moe_nvfp4_gemv(x, ids, weights, w1, w3, w2, ...)` = sum_k w[t, k] * expert_{ids[t, k]}(x[t]),
the op and calling convention of `moe_nvfp4_triton` (its `variant="v6"` calls this for decode-sized
batches). Why: at decode each expert sees ~2 slots, and the tile kernel pads every expert to 16 rows
(the smallest tensor-core M); here slots are grouped into blocks of RB = 4 rows per expert and the
weights are decoded straight into fp32 FMAs (`model.kernels.triton_gemv`'s method), padding rows
never loaded or multiplied. Two launches: fused gate/up + swigluoai, then down x router weight.

Invariants: no host sync; every launch leaves its split-K tile counters at 0 and writes every valid
act row and every y row; split reduction in split order (deterministic). Products are exact fp32
(x * e2m1), so results differ from `moe_experts_ref` by < 2^-8 relative per weight; gate, up, act
and y round to bf16 where the tile kernel rounds them. History: benchmarks/RESULTS.md.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import (
    e2m1_nibble_f32_x2p126,
    f32_to_bf16,
    opaque_to_compile,
    safe_do_bench,
    tune_class,
    use_hw_casts,
)
from model.kernels.triton_gemv import RESULT_SCALE, X_PRESCALE, split_counters
from model.kernels.triton_moe import _group_by_expert, _parts, split_planes
from model.kernels.triton_moe_combine import moe_combine

# Legend: T tokens, D model dim, F expert ffn dim, E experts, K top-k, S = T*K slots, MB row blocks,
# RB rows per block, MR valid rows of a block (a constexpr per compiled loop), BN output features per
# program, BK / BK34 K step of the 1-2 / 3-4 row loops, NB = step / 16 scale blocks per K step.
#
# Slots are grouped by `triton_moe._group_by_expert` (`rows` [MB * RB] slot or -1, `block_expert`
# [MB] expert or -1). `_moe_gemv_kernel`, grid (MB, N / BN, SPLIT_K), runs twice: GLU (a program
# gathers its block's x rows, token = slot // K, streams w1 and w3 over its K range once, and after
# the split sum stores act = bf16(swigluoai(bf16(gate), bf16(up))) at the rows' padded positions),
# then down (act rows x w2 -> y[slot] = bf16(acc) * router weight; the caller sums a token's K slots
# in fp32 and rounds once). Per K step: [BN, BK / 8] int32 words per matrix, each nibble decoded
# once with three integer ops, one FFMA per weight and row, block scale per 16 products. The K
# splits of a tile are reduced in the launch by the program that draws the tile counter's last
# ticket (serial split-K, as `triton_gemv._store_split`). The K loop is specialised on the block's
# valid-row count (1-4, one compiled loop each); the 3- and 4-row loops take a narrower K step
# (BK34) because the kernel's one register allocation is its largest loop's (CONFIGS_WHY).
ROW_BLOCK = 4  # RB: slot rows per block (why 4, not 2 or 8: benchmarks/RESULTS.md, moved docstrings)
MAX_SLOTS_PER_EXPERT = ROW_BLOCK  # v6 dispatch bound on T*K / E: one block per expert on average
POISON_INTERMEDIATES = False  # tests set True: act and y start as NaN, so a missed row shows


@triton.jit
def _x_planes(x_row, k0, is_blk, NB: tl.constexpr):
    """x[k0 : k0 + 16 * NB] of one row (fp32, times 2^100 so the products with e2m1 * 2^-126 stay
    normal), loaded contiguously (16-byte vectors, each value converted once) and split into the 8
    nibble planes of the weight words ([NB, 2] each: plane i holds elements 8 * word + i)."""
    offs_b = tl.arange(0, NB)
    offs_e = tl.arange(0, 16)
    x_be = tl.load(x_row + k0 + offs_b[:, None] * 16 + offs_e[None, :], mask=is_blk[:, None], other=0.0)
    return split_planes(x_be.to(tl.float32) * X_PRESCALE, NB, 2)


@triton.jit
def _plane(wa, wb, NIB: tl.constexpr, x0, x1, x2, x3, ta0, ta1, ta2, ta3, tb0, tb1, tb2, tb3,
           MR: tl.constexpr, GLU: tl.constexpr):  # fmt: skip
    """Nibble plane NIB of the weight words (decoded once) times plane NIB of each of the MR rows."""
    da = e2m1_nibble_f32_x2p126(wa, NIB)
    ta0 += da * x0[None]
    if MR > 1:
        ta1 += da * x1[None]
    if MR > 2:
        ta2 += da * x2[None]
    if MR > 3:
        ta3 += da * x3[None]
    if GLU:
        db = e2m1_nibble_f32_x2p126(wb, NIB)
        tb0 += db * x0[None]
        if MR > 1:
            tb1 += db * x1[None]
        if MR > 2:
            tb2 += db * x2[None]
        if MR > 3:
            tb3 += db * x3[None]
    return ta0, ta1, ta2, ta3, tb0, tb1, tb2, tb3


@triton.jit
def _k_loop(xr0, xr1, xr2, xr3, wa_rows, sa_rows, wb_rows, sb_rows, is_n, k_begin, k_end, MR: tl.constexpr,
            BN: tl.constexpr, BK_12: tl.constexpr, BK34: tl.constexpr, GLU: tl.constexpr):  # fmt: skip
    """The first MR rows (x row pointers xr0..xr3) times the expert's weight rows (w*_rows: [BN]
    pointers to each output feature's int32 words, s*_rows to its scale bytes) over K in [k_begin,
    k_end) -> per-row sums [BN] for w1 (or the one matrix) and for w3 (zeros without GLU), before
    scale_2. MR is a constexpr: rows beyond it are neither loaded nor multiplied.

    Per K step the 8 nibble planes are the outer loop and the rows the inner one, so each decoded
    plane is used by every row right away and only one plane of decoded weights is live at a time."""
    BK: tl.constexpr = BK34 if MR > 2 else BK_12  # K step: BK34 for 3 and 4 rows, BK_12 for 1 and 2
    NB: tl.constexpr = BK // 16
    offs_b = tl.arange(0, NB)
    # Two int32 words (16 nibbles) per scale block; a thread's words of a row are contiguous.
    w_off = offs_b[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    wa_ptrs = wa_rows[:, None, None] + w_off
    wb_ptrs = wb_rows[:, None, None] + w_off
    sa_ptrs = sa_rows[:, None] + offs_b[None, :]
    sb_ptrs = sb_rows[:, None] + offs_b[None, :]
    a0 = tl.zeros((BN, NB), tl.float32)
    a1 = tl.zeros((BN, NB), tl.float32)
    a2 = tl.zeros((BN, NB), tl.float32)
    a3 = tl.zeros((BN, NB), tl.float32)
    b0 = tl.zeros((BN, NB), tl.float32)
    b1 = tl.zeros((BN, NB), tl.float32)
    b2 = tl.zeros((BN, NB), tl.float32)
    b3 = tl.zeros((BN, NB), tl.float32)
    for k0 in range(k_begin, k_end, BK):
        is_blk = k0 + offs_b * 16 < k_end  # whole 16-blocks: n_in is a multiple of 16
        is_w = is_n[:, None, None] & is_blk[None, :, None]
        is_s = is_n[:, None] & is_blk[None, :]
        wa = tl.load(wa_ptrs + k0 // 8, mask=is_w, other=0)
        sa = tl.load(sa_ptrs + k0 // 16, mask=is_s, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        wb = wa
        sb = sa
        if GLU:  # both tiles' loads issued before any FMA: twice the bytes in flight per step
            wb = tl.load(wb_ptrs + k0 // 8, mask=is_w, other=0)
            sb = tl.load(sb_ptrs + k0 // 16, mask=is_s, other=0).to(tl.float8e4nv, bitcast=True)
            sb = sb.to(tl.float32)
        # x planes of each row (rows beyond MR alias row 0's: never used)
        x00, x01, x02, x03, x04, x05, x06, x07 = _x_planes(xr0, k0, is_blk, NB)
        x10, x11, x12, x13, x14, x15, x16, x17 = x00, x01, x02, x03, x04, x05, x06, x07
        x20, x21, x22, x23, x24, x25, x26, x27 = x00, x01, x02, x03, x04, x05, x06, x07
        x30, x31, x32, x33, x34, x35, x36, x37 = x00, x01, x02, x03, x04, x05, x06, x07
        if MR > 1:
            x10, x11, x12, x13, x14, x15, x16, x17 = _x_planes(xr1, k0, is_blk, NB)
        if MR > 2:
            x20, x21, x22, x23, x24, x25, x26, x27 = _x_planes(xr2, k0, is_blk, NB)
        if MR > 3:
            x30, x31, x32, x33, x34, x35, x36, x37 = _x_planes(xr3, k0, is_blk, NB)
        t = tl.zeros((BN, NB, 2), tl.float32)
        ta0, ta1, ta2, ta3, tb0, tb1, tb2, tb3 = t, t, t, t, t, t, t, t
        ta0, ta1, ta2, ta3, tb0, tb1, tb2, tb3 = _plane(wa, wb, 0, x00, x10, x20, x30, ta0, ta1, ta2, ta3,
                                                        tb0, tb1, tb2, tb3, MR, GLU)  # fmt: skip
        ta0, ta1, ta2, ta3, tb0, tb1, tb2, tb3 = _plane(wa, wb, 1, x01, x11, x21, x31, ta0, ta1, ta2, ta3,
                                                        tb0, tb1, tb2, tb3, MR, GLU)  # fmt: skip
        ta0, ta1, ta2, ta3, tb0, tb1, tb2, tb3 = _plane(wa, wb, 2, x02, x12, x22, x32, ta0, ta1, ta2, ta3,
                                                        tb0, tb1, tb2, tb3, MR, GLU)  # fmt: skip
        ta0, ta1, ta2, ta3, tb0, tb1, tb2, tb3 = _plane(wa, wb, 3, x03, x13, x23, x33, ta0, ta1, ta2, ta3,
                                                        tb0, tb1, tb2, tb3, MR, GLU)  # fmt: skip
        ta0, ta1, ta2, ta3, tb0, tb1, tb2, tb3 = _plane(wa, wb, 4, x04, x14, x24, x34, ta0, ta1, ta2, ta3,
                                                        tb0, tb1, tb2, tb3, MR, GLU)  # fmt: skip
        ta0, ta1, ta2, ta3, tb0, tb1, tb2, tb3 = _plane(wa, wb, 5, x05, x15, x25, x35, ta0, ta1, ta2, ta3,
                                                        tb0, tb1, tb2, tb3, MR, GLU)  # fmt: skip
        ta0, ta1, ta2, ta3, tb0, tb1, tb2, tb3 = _plane(wa, wb, 6, x06, x16, x26, x36, ta0, ta1, ta2, ta3,
                                                        tb0, tb1, tb2, tb3, MR, GLU)  # fmt: skip
        ta0, ta1, ta2, ta3, tb0, tb1, tb2, tb3 = _plane(wa, wb, 7, x07, x17, x27, x37, ta0, ta1, ta2, ta3,
                                                        tb0, tb1, tb2, tb3, MR, GLU)  # fmt: skip
        # Block scale once per 16 products (the 2 words of a block), per row.
        a0 += tl.sum(ta0, axis=2) * sa
        b0 += tl.sum(tb0, axis=2) * sb
        if MR > 1:
            a1 += tl.sum(ta1, axis=2) * sa
            b1 += tl.sum(tb1, axis=2) * sb
        if MR > 2:
            a2 += tl.sum(ta2, axis=2) * sa
            b2 += tl.sum(tb2, axis=2) * sb
        if MR > 3:
            a3 += tl.sum(ta3, axis=2) * sa
            b3 += tl.sum(tb3, axis=2) * sb
    return (tl.sum(a0, axis=1), tl.sum(a1, axis=1), tl.sum(a2, axis=1), tl.sum(a3, axis=1),
            tl.sum(b0, axis=1), tl.sum(b1, axis=1), tl.sum(b2, axis=1), tl.sum(b3, axis=1))  # fmt: skip


@triton.jit
def _rows_tile(y0, y1, y2, y3, offs_r):
    """Per-row sums [BN] -> the output tile [RB, BN]."""
    y = tl.where(offs_r[:, None] == 0, y0[None, :], 0.0)
    y = tl.where(offs_r[:, None] == 1, y1[None, :], y)
    y = tl.where(offs_r[:, None] == 2, y2[None, :], y)
    return tl.where(offs_r[:, None] == 3, y3[None, :], y)


@triton.jit
def _epilogue(ya, yb, mask, rows_r, slot_r, offs_n, out_ptr, stride_om, router_w_ptr, swiglu_alpha,
              swiglu_limit, GLU: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    """Complete (all K) fp32 tiles -> GLU: bf16 act rows at the padded positions rows_r; down: fp32
    y rows at the slots, bf16(acc) * router weight. The tile kernel's two epilogues, op for op."""
    if GLU:
        gate = tl.minimum(f32_to_bf16(ya, HW).to(tl.float32), swiglu_limit)
        up = tl.minimum(tl.maximum(f32_to_bf16(yb, HW).to(tl.float32), -swiglu_limit), swiglu_limit)
        act = gate * tl.sigmoid(swiglu_alpha * gate) * (up + 1.0)
        o_ptrs = out_ptr + rows_r[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, f32_to_bf16(act, HW), mask=mask)
    else:
        is_r = slot_r >= 0
        w_r = tl.load(router_w_ptr + tl.maximum(slot_r, 0), mask=is_r, other=0.0).to(tl.float32)
        y = f32_to_bf16(ya, HW).to(tl.float32) * w_r[:, None]
        o_ptrs = out_ptr + tl.maximum(slot_r, 0)[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, y, mask=mask)


@triton.jit
def _moe_gemv_kernel(
    x_ptr, stride_xm, rows_ptr, block_expert_ptr, router_w_ptr,
    wa_ptr, sa_ptr, sc2a_ptr, wb_ptr, sb_ptr, sc2b_ptr,
    stride_we, stride_wn, stride_se, stride_sn,
    out_ptr, stride_om, part_ptr, cnt_ptr,
    n_slots, n_out, n_in, swiglu_alpha, swiglu_limit, tune_class,
    TOPK: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    BK34: tl.constexpr, GLU: tl.constexpr, HW: tl.constexpr, ONLY_MR: tl.constexpr = 0,
):  # fmt: skip
    """Program (m, n, k): row block m (expert block_expert[m], <= RB slot rows), output features
    n * BN.., the k-th K range. GLU: x = tokens (gathered), wa / wb = w1 / w3, out = act [MB * RB, F];
    else x = act (padded rows), wa = w2, out = y [S, D] fp32. Words: int32 [E, n_out, n_in / 8];
    scales: bytes [E, n_out, n_in / 16] (strides in elements). ONLY_MR (compile report only): compile
    just the loop for that many valid rows instead of the branch over 1..RB."""
    tl.static_assert(RB == 4, "the row tile is assembled from 4 per-row accumulators")
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:  # unused block (MB bounds the blocks any routing can need): nothing to read or write
        return
    e = e.to(tl.int64)
    offs_r = tl.arange(0, RB)
    rows_r = pid_m * RB + offs_r  # padded row positions (act rows)
    slot_r = tl.load(rows_ptr + rows_r)  # -1: padding, always after the valid rows of a block
    n_valid = tl.sum((slot_r >= 0).to(tl.int32), axis=0)
    # Row pointers: GLU gathers the slots' tokens, down reads act in padded order. Padding rows point
    # at row 0 and are never read (the loop for n_valid rows only touches the first n_valid).
    row_base = pid_m * RB
    s0 = tl.load(rows_ptr + row_base)
    s1 = tl.load(rows_ptr + row_base + 1)
    s2 = tl.load(rows_ptr + row_base + 2)
    s3 = tl.load(rows_ptr + row_base + 3)
    if GLU:
        xr0 = x_ptr + (tl.maximum(s0, 0) // TOPK).to(tl.int64) * stride_xm
        xr1 = x_ptr + (tl.maximum(s1, 0) // TOPK).to(tl.int64) * stride_xm
        xr2 = x_ptr + (tl.maximum(s2, 0) // TOPK).to(tl.int64) * stride_xm
        xr3 = x_ptr + (tl.maximum(s3, 0) // TOPK).to(tl.int64) * stride_xm
    else:
        xr0 = x_ptr + row_base.to(tl.int64) * stride_xm
        xr1 = xr0 + stride_xm
        xr2 = xr1 + stride_xm
        xr3 = xr2 + stride_xm

    k_split = tl.cdiv(tl.cdiv(n_in, SPLIT_K), BK) * BK
    k_begin = pid_k * k_split
    k_end = tl.minimum(k_begin + k_split, n_in)  # an empty last split sums zeros
    offs_n = pid_n * BN + tl.arange(0, BN)
    is_n = offs_n < n_out
    wa_rows = wa_ptr + e * stride_we + offs_n.to(tl.int64) * stride_wn
    sa_rows = sa_ptr + e * stride_se + offs_n.to(tl.int64) * stride_sn
    wb_rows = wb_ptr + e * stride_we + offs_n.to(tl.int64) * stride_wn
    sb_rows = sb_ptr + e * stride_se + offs_n.to(tl.int64) * stride_sn
    zero = tl.zeros((BN,), tl.float32)
    a0, a1, a2, a3, b0, b1, b2, b3 = zero, zero, zero, zero, zero, zero, zero, zero
    # One specialised loop per valid-row count (uniform per program): FMA work follows the real rows.
    # 3 and 4 rows may take a narrower K step (BK34) so that their registers do not set the occupancy
    # of the 1- and 2-row loops (one register allocation per kernel: the largest branch's).
    if ONLY_MR > 0:
        a0, a1, a2, a3, b0, b1, b2, b3 = _k_loop(xr0, xr1, xr2, xr3, wa_rows, sa_rows, wb_rows, sb_rows, is_n,
                                                 k_begin, k_end, ONLY_MR, BN, BK, BK34, GLU)  # fmt: skip
    elif n_valid == 1:
        a0, a1, a2, a3, b0, b1, b2, b3 = _k_loop(xr0, xr1, xr2, xr3, wa_rows, sa_rows, wb_rows, sb_rows,
                                                 is_n, k_begin, k_end, 1, BN, BK, BK34, GLU)  # fmt: skip
    elif n_valid == 2:
        a0, a1, a2, a3, b0, b1, b2, b3 = _k_loop(xr0, xr1, xr2, xr3, wa_rows, sa_rows, wb_rows, sb_rows,
                                                 is_n, k_begin, k_end, 2, BN, BK, BK34, GLU)  # fmt: skip
    elif n_valid == 3:
        a0, a1, a2, a3, b0, b1, b2, b3 = _k_loop(xr0, xr1, xr2, xr3, wa_rows, sa_rows, wb_rows, sb_rows,
                                                 is_n, k_begin, k_end, 3, BN, BK, BK34, GLU)  # fmt: skip
    else:
        a0, a1, a2, a3, b0, b1, b2, b3 = _k_loop(xr0, xr1, xr2, xr3, wa_rows, sa_rows, wb_rows, sb_rows,
                                                 is_n, k_begin, k_end, 4, BN, BK, BK34, GLU)  # fmt: skip

    ya = _rows_tile(a0, a1, a2, a3, offs_r) * (tl.load(sc2a_ptr + e) * RESULT_SCALE)
    yb = ya
    if GLU:
        yb = _rows_tile(b0, b1, b2, b3, offs_r) * (tl.load(sc2b_ptr + e) * RESULT_SCALE)
    mask = (slot_r >= 0)[:, None] & is_n[None, :]
    if SPLIT_K == 1:
        _epilogue(ya, yb, mask, rows_r, slot_r, offs_n, out_ptr, stride_om, router_w_ptr, swiglu_alpha,
                  swiglu_limit, GLU, HW)  # fmt: skip
    else:
        # fp32 partials per split at the slots' rows ([SPLIT_K (x 2 with GLU), S, n_out]); the program
        # drawing the tile's last ticket (acq_rel, gpu scope, after a CTA barrier) sums them in split
        # order, runs the epilogue and resets the counter for the next launch.
        split_stride = n_out.to(tl.int64) * n_slots  # (n_slots may be the constant 1)
        p_ptrs = part_ptr + tl.maximum(slot_r, 0)[:, None].to(tl.int64) * n_out + offs_n[None, :]
        tl.store(p_ptrs + pid_k * split_stride, ya, mask=mask)
        if GLU:
            tl.store(p_ptrs + (SPLIT_K + pid_k) * split_stride, yb, mask=mask)
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(1) + pid_n
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            ta = tl.zeros_like(ya)
            tb = tl.zeros_like(ya)
            for s in tl.static_range(SPLIT_K):  # L2 reads (.cg): the other programs' partials
                ta += tl.load(p_ptrs + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
                if GLU:
                    tb += tl.load(p_ptrs + (SPLIT_K + s) * split_stride, mask=mask, other=0.0,
                                  cache_modifier=".cg")  # fmt: skip
            _epilogue(ta, tb, mask, rows_r, slot_r, offs_n, out_ptr, stride_om, router_w_ptr, swiglu_alpha,
                      swiglu_limit, GLU, HW)  # fmt: skip
            tl.atomic_xchg(cnt_ptr + tile, 0)


@dataclass(frozen=True)
class MoeGemvTile:
    """A fixed launch configuration (interpreter tests, small shapes); compiled launches at decode
    sizes autotune over `_CONFIGS` instead."""

    block_n: int = 16  # BN output features per program
    block_k: int = 512  # BK: K step of the 1- and 2-row loops (NB = BK / 16 scale blocks)
    block_k34: int = 128  # BK34: K step of the 3- and 4-row loops (<= BK: fewer registers)
    split_k: int = 1  # K ranges per output tile, reduced in-launch
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k", "block_k34", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"MoeGemvTile.{name} must be a power of two, got {v}")
        if not 32 <= self.block_k34 <= self.block_k:
            raise ValueError(
                f"MoeGemvTile: need 32 <= block_k34 <= block_k (two 16-value blocks at least; the K"
                f" splits are multiples of block_k), got block_k={self.block_k}, block_k34={self.block_k34}"
            )
        if self.split_k < 1:
            raise ValueError(f"MoeGemvTile.split_k must be >= 1, got {self.split_k}")


DEFAULT_TILE = MoeGemvTile()
# Compiled launches time these on first use per (n_out, n_in, slots). At T = 64 there are ~110 active
# blocks x n_out / BN tiles (21K programs at BN = 16): enough without K splits; at T = 1 only 4 blocks,
# where splits fill the SMs. See CONFIGS_WHY for the tiles.
_CONFIGS = [
    triton.Config({"BN": bn, "BK": bk, "BK34": bk34, "SPLIT_K": sk}, num_warps=w, num_stages=1)
    for bn, bk, bk34, sk, w in [
        (16, 512, 128, 1, 4), (16, 512, 256, 1, 4), (16, 256, 128, 1, 4), (16, 512, 128, 2, 4),
        (16, 512, 128, 4, 4),
    ]
]  # fmt: skip
CONFIGS_WHY = """Offline sm_90 compiles (benchmarks/kernel_compile_report.py --groups moe_gemv; Triton 3.9).
A kernel gets one register allocation, its largest branch's: the 4-row loop at BK = 512 needs 255
registers with GLU (2 programs per SM; the merged kernel spills), which would hold the 1- and
2-row loops (most blocks at T = 64) to that occupancy too. Hence BK34, the 3-4 row loops' own K step:
(16, 512, 128, 4 warps): GLU kernel 128 registers (4 programs/SM), down 96 (5), no spills; SASS per
weight at 1 / 2 / 3 / 4 rows: GLU 5.01 / 6.46 / 8.75 / 10.25 (v3 GEMV at 1 row: 5.1-5.6), down 5.62 /
7.17 / 10.88 / 12.69. (16, 512, 256): GLU 168 registers (3/SM), down 128 (4), 3-4 rows cheaper (GLU
8.64 / 10.58, down 9.91 / 12.34). (16, 256, 128): GLU 127 (4/SM), down 96 (5), half the K step at 1-2
rows (GLU 5.44 / 6.95, down 6.16 / 8.06). Rejected: BN = 32 (GLU spills 1.4 KB at 4 rows), 2 warps at
BK = 256 (the merged GLU kernel takes 255 registers and spills)."""
MAX_SPLIT_K = max(c.kwargs["SPLIT_K"] for c in _CONFIGS)
_glu_tuned = triton.autotune(_CONFIGS, key=["n_out", "n_in", "tune_class"], do_bench=safe_do_bench)(
    _moe_gemv_kernel
)
_down_tuned = triton.autotune(_CONFIGS, key=["n_out", "n_in", "tune_class"], do_bench=safe_do_bench)(
    _moe_gemv_kernel
)


def use_moe_gemv(n_slots: int, n_experts: int) -> bool:
    """Whether the v6 dispatch takes this module: at most MAX_SLOTS_PER_EXPERT slots per expert on
    average (decode batches); larger batches re-read each expert's weights once per 4-row block."""
    return 0 < n_slots <= MAX_SLOTS_PER_EXPERT * n_experts


def _launch(x, rows, block_expert, router_w, wa, wb, out, n_slots, topk, glu, alpha, limit, tile):
    (wa_p, wa_s, wa_2), (wb_p, wb_s, wb_2) = wa, wb
    _, N, KW = wa_p.shape  # KW int32 words per row = in / 8
    n_in = 8 * KW
    n_mb = block_expert.numel()
    tuned = tile is None and use_hw_casts() and N * n_in >= 1 << 20
    t = tile or DEFAULT_TILE
    split_k = MAX_SPLIT_K if tuned else t.split_k
    n_part = split_k * (2 if glu else 1) * n_slots * N if split_k > 1 else 1
    part = torch.empty((n_part,), dtype=torch.float32, device=x.device)
    min_bn = min(c.kwargs["BN"] for c in _CONFIGS) if tuned else t.block_n
    counters = split_counters(x.device, n_mb * triton.cdiv(N, min_bn))  # one per (row block, N tile)
    args = (
        x, x.stride(0), rows, block_expert, router_w,
        wa_p, wa_s, wa_2, wb_p, wb_s, wb_2,
        wa_p.stride(0), wa_p.stride(1), wa_s.stride(0), wa_s.stride(1),
        out, out.stride(0), part, counters, n_slots, N, n_in, alpha, limit, tune_class(n_slots),
    )  # fmt: skip
    meta = dict(TOPK=topk, RB=ROW_BLOCK, GLU=glu)
    if tuned:
        tuner = _glu_tuned if glu else _down_tuned
        tuner[lambda m: (n_mb, triton.cdiv(N, m["BN"]), m["SPLIT_K"])](*args, **meta, HW=True)
    else:
        _moe_gemv_kernel[(n_mb, triton.cdiv(N, t.block_n), t.split_k)](
            *args, **meta, BN=t.block_n, BK=t.block_k, BK34=t.block_k34, SPLIT_K=t.split_k,
            HW=use_hw_casts(), num_warps=t.num_warps,
        )  # fmt: skip


def _scratch(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if POISON_INTERMEDIATES:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@opaque_to_compile
def moe_nvfp4_gemv(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
    w1: tuple, w3: tuple, w2: tuple, *, swiglu_alpha: float, swiglu_limit: float,
    out_TD: torch.Tensor | None = None, tile: MoeGemvTile | None = None,
    shared_TD: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) for bf16 x_TD [T, D]; each w* = (packed uint8
    [E, out, in/2], scales e4m3 [E, out, in/16], scale_2 fp32 [E]). No host syncs (CUDA-graph safe
    after a warm-up call: autotuning and the split counters allocate on first use). tile: a fixed
    launch configuration (default: autotuned when compiled at decode sizes, `DEFAULT_TILE` elsewhere).
    shared_TD (bf16 [T, D], the shared expert): added after the sum's rounding, as `out + shared`."""
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    E, F = w1[0].shape[0], w1[0].shape[1]
    if x_TD.dtype != torch.bfloat16 or x_TD.stride(-1) != 1:
        raise ValueError(f"moe_nvfp4_gemv: x must be bf16 with unit last stride, got {x_TD.dtype}")
    if D % 16 or F % 16:
        raise ValueError(f"moe_nvfp4_gemv: D={D} and F={F} must be multiples of 16 (whole scale blocks)")
    for name, w, shape in (
        ("w1", w1, (E, F, D // 2)),
        ("w3", w3, (E, F, D // 2)),
        ("w2", w2, (E, D, F // 2)),
    ):
        if tuple(w[0].shape) != shape:
            raise ValueError(f"moe_nvfp4_gemv: {name} packed must be {shape}, got {tuple(w[0].shape)}")
    if out_TD is None:
        out_TD = torch.empty_like(x_TD)
    S = T * K
    if S == 0:
        return out_TD.zero_() if shared_TD is None else out_TD.zero_().add_(shared_TD)
    rows, block_expert = _group_by_expert(topk_ids_TK.reshape(-1), E, block_rows=ROW_BLOCK)
    act = _scratch((rows.numel(), F), torch.bfloat16, x_TD.device)
    y_SD = _scratch((S, D), torch.float32, x_TD.device)
    weights_S = topk_weights_TK.reshape(-1).contiguous()
    glu = (_parts(*w1), _parts(*w3))
    _launch(x_TD, rows, block_expert, weights_S, *glu, act, S, K, True, swiglu_alpha, swiglu_limit, tile)
    down = _parts(*w2)
    _launch(
        act, rows, block_expert, weights_S, down, down, y_SD, S, K, False, swiglu_alpha, swiglu_limit, tile
    )
    return moe_combine(y_SD, K, out_TD, shared_TD)

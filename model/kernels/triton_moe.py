"""Triton NVFP4 MoE decode: W4A16 grouped GEMV/GEMM, fused gate/up + swigluoai, then down x router weight.

Why: at decode nearly every routed expert is touched, so a layer streams every expert's weights once
per step; NVFP4 moves 3.56x fewer bytes than bf16 if the weights are decoded in registers and never
written back (the torch path dequantizes to bf16 in memory first). Token-slots are grouped by expert
on device in one launch (`_group_by_expert`: `_group_kernel`) into BM-row blocks, one [BM, BN] tile
per program, bf16 tensor-core dots. Also the one-matrix LINEAR path (`nvfp4_linear_triton`, the
shared expert `nvfp4_mlp_triton`) above the <= 4-row GEMV of `model.kernels.triton_gemv`. On CUDA,
decode-sized routed batches take the tensor-core kernel of `model.kernels.cuda_moe` (`variant="v7"`,
the default); the tile kernel here serves every other size and device Triton runs on.

Invariants: no host sync; the weights multiplied are exactly bf16(e2m1 * (float(s) * scale_2)), as
`nvfp4_linear` / `ExpertBank.dequantized` (both decodes; no lookup table); fp32 accumulation; the
caller sums a token's K slots in fp32 and rounds once (`model.kernels.triton_moe_combine`, which
also adds the shared expert). History: benchmarks/RESULTS.md.
"""

from typing import Literal

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import (
    E2M1_FP8_SHIFT,
    dot_bf16,
    e2m1_to_f32_x64,
    f32_to_bf16,
    num_sms,
    opaque_to_compile,
    safe_do_bench,
    triton_available,
    tune_class,
    use_hw_casts,
)
from model.kernels.triton_moe_combine import moe_combine

BM = 16  # tokens per row block: the smallest tl.dot M; decode groups hold ~1-4 tokens
PROGRAMS_PER_SM = 4
F16_SHIFT: tl.constexpr = tl.constexpr(16384.0)  # e2m1 = fp16_bits(nibble) * 2^14, folded into the scale


@triton.jit
def _w_planes(w_ptrs, s_ptrs, is_w, sc2, HW: tl.constexpr):
    """Packed weight words [BN, BW] (int32, 8 nibbles: nibble i = element 8 * word + i) and their
    block-scale bytes (one per word, block = word // 2) -> 8 bf16 planes [BN, BW], plane i holding
    bf16(e2m1 * (float(s) * scale_2)) of elements 8 * word + i: the exact weights of the reference.

    Why planes: one 32-bit load brings 8 weights, each plane is 2 shifts + 1 and/or per element into
    an fp16 bit pattern (e2m1 * 2^-14 exactly, subnormal 0.5 included), no join/reshape shuffles."""
    w = tl.load(w_ptrs, mask=is_w, other=0)
    s_bits = tl.load(s_ptrs, mask=is_w, other=0)
    # fl(s * scale_2) as the reference rounds it; the 2^14 of the fp16 bit trick is exact on top.
    s_eff = s_bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc2 * F16_SHIFT
    p0 = word_plane(w, 0, s_eff, HW)
    p1 = word_plane(w, 1, s_eff, HW)
    p2 = word_plane(w, 2, s_eff, HW)
    p3 = word_plane(w, 3, s_eff, HW)
    p4 = word_plane(w, 4, s_eff, HW)
    p5 = word_plane(w, 5, s_eff, HW)
    p6 = word_plane(w, 6, s_eff, HW)
    p7 = word_plane(w, 7, s_eff, HW)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def word_plane(w, NIB: tl.constexpr, s_eff, HW: tl.constexpr):
    """Nibble NIB of every word -> bf16(e2m1 * s_eff * 2^-14): magnitude bits to fp16 bits 9-11, sign
    to bit 15 (fp16 value = e2m1 * 2^-14, exact)."""
    if NIB < 3:
        mag = (w << (9 - 4 * NIB)) & 0xE00
    else:
        mag = (w >> (4 * NIB - 9)) & 0xE00
    sgn = (w >> (4 * NIB - 12)) & 0x8000 if NIB > 3 else (w << (12 - 4 * NIB)) & 0x8000
    h = (mag | sgn).to(tl.int16).to(tl.float16, bitcast=True)
    return f32_to_bf16(h.to(tl.float32) * s_eff, HW)


@triton.jit
def split_planes(x, ROWS: tl.constexpr, BW: tl.constexpr):
    """[ROWS, 8 * BW] -> the 8 planes [ROWS, BW] of the NVFP4 word decode (plane i = columns
    8 * word + i); register renames when each thread holds whole 8-element groups."""
    x = tl.reshape(x, (ROWS, BW, 2, 2, 2))
    xa0, xa1 = tl.split(tl.permute(x, (0, 1, 3, 4, 2)))  # i = 4a + 2b + c: split a, then b, then c
    xb00, xb01 = tl.split(tl.permute(xa0, (0, 1, 3, 2)))
    xb10, xb11 = tl.split(tl.permute(xa1, (0, 1, 3, 2)))
    x0, x1 = tl.split(xb00)
    x2, x3 = tl.split(xb01)
    x4, x5 = tl.split(xb10)
    x6, x7 = tl.split(xb11)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _x_planes(x_rows, is_row, k0, is_k8, BM: tl.constexpr, BW: tl.constexpr):
    """Activation tile x[:, k0:k0+8*BW], loaded contiguously (16-byte vectors), as 8 planes."""
    offs_k = tl.arange(0, 8 * BW)
    x = tl.load(x_rows[:, None] + k0 + offs_k[None, :], mask=is_row[:, None] & is_k8[None, :], other=0.0)
    return split_planes(x, BM, BW)


@triton.jit
def _tile_dot(acc, x_rows, is_row, w_ptrs, s_ptrs, is_w, sc2, k0, is_k8, BM: tl.constexpr, BW: tl.constexpr,
              HW: tl.constexpr):  # fmt: skip
    """acc [BM, BN] += x[:, k0:k0+BK] @ W[:, k0:k0+BK].T as 8 plane dots of K = BK / 8."""
    p0, p1, p2, p3, p4, p5, p6, p7 = _w_planes(w_ptrs, s_ptrs, is_w, sc2, HW)
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(x_rows, is_row, k0, is_k8, BM, BW)
    acc = acc + dot_bf16(x0, tl.trans(p0), HW)
    acc = acc + dot_bf16(x1, tl.trans(p1), HW)
    acc = acc + dot_bf16(x2, tl.trans(p2), HW)
    acc = acc + dot_bf16(x3, tl.trans(p3), HW)
    acc = acc + dot_bf16(x4, tl.trans(p4), HW)
    acc = acc + dot_bf16(x5, tl.trans(p5), HW)
    acc = acc + dot_bf16(x6, tl.trans(p6), HW)
    acc = acc + dot_bf16(x7, tl.trans(p7), HW)
    return acc


@triton.jit
def _tile_dot_bytes(acc, x_rows, is_row, w_rows, s_rows, sc2, k0, BK: tl.constexpr, BN: tl.constexpr,
                    HW: tl.constexpr):  # fmt: skip
    """v1's tile: acc [BM, BN] += x[:, k0:k0+BK] @ W.T with W [BN, BK] decoded byte by byte (low /
    high nibbles interleaved by join + reshape) into one bf16 dot of K = BK. No K-tail masking."""
    NB: tl.constexpr = BK // 16
    offs_g = tl.arange(0, NB)
    offs_j = tl.arange(0, 8)
    offs_k = tl.arange(0, BK)
    x_mk = tl.load(x_rows[:, None] + k0 + offs_k[None, :], mask=is_row[:, None], other=0.0)
    packed = tl.load(w_rows[:, None, None] + k0 // 2 + offs_g[None, :, None] * 8 + offs_j[None, None, :])
    s_bits = tl.load(s_rows[:, None] + k0 // 16 + offs_g[None, :])
    # fl(s * scale_2) as the reference rounds it; the 2^6 of the fp8 bit trick is exact on top of it.
    s_eff = s_bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc2 * E2M1_FP8_SHIFT
    lo = e2m1_to_f32_x64(packed & 0xF) * s_eff[:, :, None]
    hi = e2m1_to_f32_x64(packed >> 4) * s_eff[:, :, None]
    w_nk = f32_to_bf16(tl.reshape(tl.join(lo, hi), (BN, BK)), HW)
    return acc + dot_bf16(x_mk, tl.trans(w_nk), HW)


# Legend: T tokens, D model dim, F expert ffn dim, E experts, K top-k, S = T*K slots, MB row blocks,
# BM/BN/BK tile sizes (rows, output features, reduction).
#
# Grouping (`_group_by_expert`): the T*K slots sorted by expert, each group padded to a multiple of
# BM rows; `rows` [MB * BM] holds every padded row's slot (-1 = padding), `block_expert` [MB] every
# block's expert (-1 = unused; MB = S // BM + min(S, E) bounds what any routing needs).
# `_nvfp4_moe_kernel`, grid (MB, N / BN), K in BK steps, two weight decodes:
# - PLANES=0 (v1): packed bytes [BN, BK/16, 8] and e4m3 scales in stored order, nibbles decoded by the
#   fp8 bit trick (docs/FACTS.md, "Kernel facts") and interleaved by join + reshape; one bf16 dot per
#   K step. Needs BK | in.
# - PLANES=1 (v2): int32 words [BN, BK / 8] decoded into 8 planes (plane i = elements 8 * word + i)
#   through an fp16 bit pattern worth e2m1 * 2^-14; x split into the same planes; 8 bf16 dots of
#   K = BK / 8 per step; K tails masked.
# Compiled decode-sized launches autotune both decodes and BN / warps / stages per shape; elsewhere
# (interpreter, small shapes) PLANES=0 unless in is not a multiple of 128. FUSE_GLU: w1 and w3 tiles
# share the x tile; epilogue act = swigluoai(bf16(gate), bf16(up)) -> bf16 rows of `act` (padded
# order). Routed down: y = bf16(acc) * router weight (fp32) at the slot's row. LINEAR: one matrix,
# rows in order, bf16 output, no grouping tensors (a single launch).
@triton.jit
def _nvfp4_moe_kernel(
    x_ptr, stride_xm,
    rows_ptr, block_expert_ptr, router_w_ptr,
    wa_ptr, sa_ptr, sc2a_ptr, wb_ptr, sb_ptr, sc2b_ptr,
    stride_we, stride_wn, stride_se, stride_sn,
    out_ptr, stride_om,
    n_rows, n_out, n_in, n_mblocks, swiglu_alpha, swiglu_limit, tune_class,
    TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    FUSE_GLU: tl.constexpr, GATHER_X: tl.constexpr, LINEAR: tl.constexpr, HW: tl.constexpr,
    PLANES: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    if LINEAR:  # one weight matrix, rows taken in order: no grouping tensors, no router weights
        e = pid_m.to(tl.int64) * 0
        n_k = tl.cdiv(n_in, BK)
        slot_m = tl.where(offs_m < n_rows, offs_m, -1)
    else:
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        n_k = tl.where(e >= 0, tl.cdiv(n_in, BK), 0)  # unused blocks read nothing
        e = tl.maximum(e, 0)
        slot_m = tl.load(rows_ptr + offs_m)
    is_row = slot_m >= 0
    if GATHER_X:
        x_rows = x_ptr + (tl.maximum(slot_m, 0) // TOPK).to(tl.int64) * stride_xm
    else:
        x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    BW: tl.constexpr = BK // 8
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_w = tl.arange(0, BW)
    offs_k8 = tl.arange(0, BK)
    # Word pointers (stride_wn in words) and the scale byte of each word (block = word // 2).
    wa_ptrs = wa_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_w[None, :]
    sa_ptrs = sa_ptr + e * stride_se + offs_n[:, None] * stride_sn + offs_w[None, :] // 2
    sc2a = tl.load(sc2a_ptr + e)
    acc_a = tl.zeros((BM, BN), tl.float32)
    if FUSE_GLU:
        wb_ptrs = wb_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_w[None, :]
        sb_ptrs = sb_ptr + e * stride_se + offs_n[:, None] * stride_sn + offs_w[None, :] // 2
        sc2b = tl.load(sc2b_ptr + e)
        acc_b = tl.zeros((BM, BN), tl.float32)
    # Byte view of the same rows for the v1 decode (PLANES=0).
    wa_rows = (wa_ptr + e * stride_we + offs_n * stride_wn).to(tl.pointer_type(tl.uint8), bitcast=True)
    sa_rows = sa_ptr + e * stride_se + offs_n * stride_sn
    if FUSE_GLU:
        wb_rows = (wb_ptr + e * stride_we + offs_n * stride_wn).to(tl.pointer_type(tl.uint8), bitcast=True)
        sb_rows = sb_ptr + e * stride_se + offs_n * stride_sn
    for i in range(0, n_k):
        k0 = i * BK
        if PLANES:
            is_w = (k0 + offs_w * 8 < n_in)[None, :]  # K tails (n_in not a multiple of BK) read zeros
            is_k8 = k0 + offs_k8 < n_in
            acc_a = _tile_dot(acc_a, x_rows, is_row, wa_ptrs + i * BW, sa_ptrs + i * (BW // 2), is_w, sc2a,
                              k0, is_k8, BM, BW, HW)  # fmt: skip
            if FUSE_GLU:
                acc_b = _tile_dot(acc_b, x_rows, is_row, wb_ptrs + i * BW, sb_ptrs + i * (BW // 2), is_w,
                                  sc2b, k0, is_k8, BM, BW, HW)  # fmt: skip
        else:
            acc_a = _tile_dot_bytes(acc_a, x_rows, is_row, wa_rows, sa_rows, sc2a, k0, BK, BN, HW)
            if FUSE_GLU:
                acc_b = _tile_dot_bytes(acc_b, x_rows, is_row, wb_rows, sb_rows, sc2b, k0, BK, BN, HW)

    if FUSE_GLU:
        # swigluoai on the bf16-rounded projections, as the reference sees them.
        gate = tl.minimum(f32_to_bf16(acc_a, HW).to(tl.float32), swiglu_limit)
        up = tl.minimum(tl.maximum(f32_to_bf16(acc_b, HW).to(tl.float32), -swiglu_limit), swiglu_limit)
        act = gate * tl.sigmoid(swiglu_alpha * gate) * (up + 1.0)
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, f32_to_bf16(act, HW), mask=is_row[:, None])
    elif LINEAR:
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, f32_to_bf16(acc_a, HW), mask=is_row[:, None])
    else:
        w_m = tl.load(router_w_ptr + tl.maximum(slot_m, 0), mask=is_row, other=0.0).to(tl.float32)
        y = f32_to_bf16(acc_a, HW).to(tl.float32) * w_m[:, None]
        o_ptrs = out_ptr + tl.maximum(slot_m, 0)[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, y, mask=is_row[:, None])


# Compiled (GPU) launches pick the output tile width and pipeline depth per shape by timing (first
# call per (n_out, n_in, row blocks) only); the interpreter runs the fixed `_block_n` choice.
# Both decodes are candidates: on the H200 (v2 run) the plane decode took 103 us for the 6144^2 GEMV
# and 11.6 ms for the routed T=64 layer, where v1's byte decode had measured 7.4 ms.
_TUNED_CONFIGS = [
    triton.Config({"BN": bn, "PLANES": planes, "BK": bk}, num_warps=w, num_stages=st)
    for bn, planes, bk, w, st in [
        (16, 0, 128, 4, 3), (32, 0, 128, 4, 3), (64, 0, 128, 4, 3), (64, 0, 128, 8, 3),
        (16, 1, 256, 4, 3), (32, 1, 256, 4, 4), (64, 1, 256, 4, 3),
    ]
]  # fmt: skip
_nvfp4_moe_tuned = triton.autotune(
    _TUNED_CONFIGS, key=["n_out", "n_in", "tune_class"], do_bench=safe_do_bench
)(_nvfp4_moe_kernel)


GROUP_MAX_SLOTS = 4096  # slots the one-program grouping kernel sorts (more: the torch twin)


@triton.jit
def _max_i32(a, b):
    return tl.maximum(a, b)


# `_group_kernel`, grid (1,): `group_by_expert_torch`'s result in one launch (the torch twin is ~30
# kernels per MoE layer, a third of a compiled decode step's launches at `small`). The S slots, keyed
# expert * S_P2 + slot, are sorted (bitonic, in registers: the stable order); a slot's rank in its
# expert's group is its sorted position p minus the group's first position (a running max of group
# starts); padding rows before p are the summed (RB - count % RB) % RB of the groups ending before p,
# so its row is dest = p + that. Neighbours in sorted order are read back through `scratch` (a
# register tensor cannot be shifted), hence the barriers; `rows` / `block_expert` are filled with -1
# first, then each slot writes its row and each group block's first slot writes its expert.
@triton.jit
def _group_kernel(ids_ptr, scratch_ptr, rows_ptr, block_expert_ptr, S, n_rows, n_blocks, E,
                  S_P2: tl.constexpr, RB: tl.constexpr, FILL: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, S_P2)
    valid = offs < S
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    ids = tl.where(valid, ids, E)  # padding sorts last, in an expert of its own
    key = tl.sort(ids * S_P2 + offs)
    e_s = key // S_P2
    slot_s = key % S_P2
    tl.store(scratch_ptr + offs, e_s)
    tl.debug_barrier()
    prev = tl.load(scratch_ptr + offs - 1, mask=offs > 0, other=-1)
    nxt = tl.load(scratch_ptr + offs + 1, mask=offs < S_P2 - 1, other=-1)
    start = tl.associative_scan(tl.where(e_s != prev, offs, 0), 0, _max_i32)
    rank = offs - start
    is_real = e_s < E
    pad_end = tl.where(is_real & (e_s != nxt), (RB - (rank + 1) % RB) % RB, 0)
    dest = offs + tl.cumsum(pad_end, 0) - pad_end
    for i in range(0, n_rows, FILL):
        f = i + tl.arange(0, FILL)
        tl.store(rows_ptr + f, tl.full((FILL,), -1, tl.int32), mask=f < n_rows)
    for i in range(0, n_blocks, FILL):
        f = i + tl.arange(0, FILL)
        tl.store(block_expert_ptr + f, tl.full((FILL,), -1, tl.int32), mask=f < n_blocks)
    tl.debug_barrier()
    tl.store(rows_ptr + dest, slot_s, mask=is_real)
    tl.store(block_expert_ptr + dest // RB, e_s, mask=is_real & (rank % RB == 0))


def _group_by_expert(
    ids_S: torch.Tensor, n_experts: int, *, block_rows: int = BM
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [MB * block_rows] int32 slot or -1, block_expert [MB] int32 expert or -1), on device, no
    sync. block_rows: rows per block (BM here; 8 for the mma kernel of `cuda_moe`). Where
    Triton runs (CUDA, the interpreter) up to GROUP_MAX_SLOTS slots: `_group_kernel` (one launch,
    equal to the torch twin)."""
    S = ids_S.numel()
    if not triton_available(ids_S) or not 0 < S <= GROUP_MAX_SLOTS:
        return group_by_expert_torch(ids_S, n_experts, block_rows=block_rows)
    return group_by_expert_triton(ids_S, n_experts, block_rows=block_rows)


def group_by_expert_triton(
    ids_S: torch.Tensor, n_experts: int, *, block_rows: int = BM
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_group_kernel` on any device Triton runs on (the interpreter in tests)."""
    S = ids_S.numel()
    if not 0 < S <= GROUP_MAX_SLOTS:
        raise ValueError(f"group_by_expert_triton: 1 to {GROUP_MAX_SLOTS} slots, got {S}")
    n_blocks = S // block_rows + min(S, n_experts)
    s_p2 = triton.next_power_of_2(S)
    rows = torch.empty(n_blocks * block_rows, dtype=torch.int32, device=ids_S.device)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=ids_S.device)
    scratch = torch.empty(s_p2, dtype=torch.int32, device=ids_S.device)
    _group_kernel[(1,)](ids_S.contiguous(), scratch, rows, block_expert, S, rows.numel(), n_blocks, n_experts,
                        S_P2=s_p2, RB=block_rows, FILL=1024, num_warps=4 if s_p2 <= 1024 else 8)  # fmt: skip
    return rows, block_expert


def group_by_expert_torch(
    ids_S: torch.Tensor, n_experts: int, *, block_rows: int = BM
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouping in torch ops (CPU, and CUDA beyond GROUP_MAX_SLOTS): `_group_by_expert`'s spec."""
    S = ids_S.numel()
    n_blocks = S // block_rows + min(S, n_experts)
    ids_S = ids_S.long()
    order_S = torch.argsort(ids_S, stable=True)
    # scatter_add, not bincount: CUDA bincount reads the max id on the host (a sync per call).
    counts_E = torch.zeros(n_experts, dtype=torch.long, device=ids_S.device)
    counts_E.scatter_add_(0, ids_S, torch.ones_like(ids_S))
    padded_E = (counts_E + block_rows - 1) // block_rows * block_rows
    pad_start_E = torch.cumsum(padded_E, 0) - padded_E
    start_E = torch.cumsum(counts_E, 0) - counts_E
    e_sorted = ids_S[order_S]
    dest = pad_start_E[e_sorted] + torch.arange(S, device=ids_S.device) - start_E[e_sorted]
    rows = torch.full((n_blocks * block_rows,), -1, dtype=torch.int32, device=ids_S.device)
    rows[dest] = order_S.to(torch.int32)
    blocks_cum_E = torch.cumsum(padded_E // block_rows, 0)
    block_expert = torch.searchsorted(blocks_cum_E, torch.arange(n_blocks, device=ids_S.device), right=True)
    block_expert = torch.where(block_expert < n_experts, block_expert, -1).to(torch.int32)
    return rows, block_expert


def _block_n(n_out: int, active_blocks: int, device: torch.device) -> int:
    """Widest output tile that still gives PROGRAMS_PER_SM waves of programs (decode GEMVs need
    narrow tiles: one 6144-row matrix at BN = 16 is 384 programs)."""
    target = PROGRAMS_PER_SM * num_sms(device)
    for bn in (64, 32, 16):
        if n_out % bn == 0 and active_blocks * (n_out // bn) >= target:
            return bn
    return 16 if n_out % 16 == 0 else n_out


def _launch(x, rows, block_expert, router_w, wa, wb, out, topk, fuse_glu, gather_x, alpha, limit,
            n_rows=0, linear=False):  # fmt: skip
    (wa_p, wa_s, wa_2), (wb_p, wb_s, wb_2) = wa, wb
    E, N, KW = wa_p.shape  # KW int32 words per row = in / 8
    n_in = 8 * KW
    n_mblocks = triton.cdiv(n_rows, BM) if linear else block_expert.numel()
    args = (
        x, x.stride(0), rows, block_expert, router_w,
        wa_p, wa_s, wa_2, wb_p, wb_s, wb_2,
        wa_p.stride(0), wa_p.stride(1), wa_s.stride(0), wa_s.stride(1),
        out, out.stride(0), n_rows, N, n_in, n_mblocks, alpha, limit, tune_class(n_mblocks, n_rows),
    )  # fmt: skip
    meta = dict(TOPK=topk, BM=BM, FUSE_GLU=fuse_glu, GATHER_X=gather_x, LINEAR=linear)
    if use_hw_casts() and N % 64 == 0 and n_in % 256 == 0 and N * n_in >= 1 << 20:  # small: one compile
        _nvfp4_moe_tuned[lambda m: (n_mblocks, N // m["BN"])](*args, **meta, HW=True)
    else:
        # Fixed choice: v1's byte decode where K tiles are whole, the masked plane decode otherwise
        # (both paths therefore run in the interpreter tests).
        active = n_mblocks if linear else min(rows.numel() // BM, E)
        bn = _block_n(N, active, x.device)
        planes = n_in % 128 != 0
        _nvfp4_moe_kernel[(n_mblocks, N // bn)](
            *args, **meta, BN=bn, BK=128, PLANES=planes, HW=use_hw_casts()
        )


def _parts(packed, scales, scale_2):
    """(packed viewed as int32 words [E, N, in / 8], scales as bytes, fp32 scale_2 [E])."""
    packed = packed.contiguous()
    if packed.storage_offset() % 4:
        packed = packed.clone()
    return packed.view(torch.int32), scales.view(torch.uint8), scale_2.reshape(-1).float().contiguous()


MoeVariant = Literal["v2", "v7"]
"""v2: this module's tile kernel, every size. v7 (the default): the CUDA tensor-core kernel of
`model.kernels.cuda_moe` (`use_moe_mma`: CUDA, <= 8 slots per expert on average; D, F multiples of
64), the tile kernel otherwise (the interpreter, larger batches, other shapes). On the H200 at M3
widths, 128 experts top-4, the routed part is 2.0-4.5x v6 (the FMA GEMV it replaced) at T = 1-64 and
9.5x at 256 (3.78 TB/s at T = 64; benchmarks/RESULTS.md, session 12)."""


@opaque_to_compile
def moe_nvfp4_triton(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
    w1: tuple, w3: tuple, w2: tuple, *, swiglu_alpha: float, swiglu_limit: float,
    out_TD: torch.Tensor | None = None, variant: MoeVariant = "v7", shared_TD: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) for bf16 x_TD [T, D]; each w* = (packed uint8
    [E, out, in/2], scales e4m3 [E, out, in/16], scale_2 fp32 [E]). No host syncs. variant: see
    `MoeVariant`. shared_TD (bf16 [T, D], the shared expert): added after the sum's rounding, as
    `out + shared` (`model.kernels.triton_moe_combine`)."""
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    E, F = w1[0].shape[0], w1[0].shape[1]
    if variant == "v7":
        from model.kernels.cuda_moe import moe_mma_supported, moe_nvfp4_mma, use_moe_mma

        if use_moe_mma(T * K, E) and moe_mma_supported(x_TD, w1[0]):
            return moe_nvfp4_mma(x_TD, topk_ids_TK, topk_weights_TK, w1, w3, w2, swiglu_alpha=swiglu_alpha,
                                 swiglu_limit=swiglu_limit, out_TD=out_TD, shared_TD=shared_TD)  # fmt: skip
    elif variant != "v2":
        raise ValueError(f"moe_nvfp4_triton: variant must be one of {MoeVariant.__args__}, got {variant!r}")
    if out_TD is None:
        out_TD = torch.empty_like(x_TD)
    rows, block_expert = _group_by_expert(topk_ids_TK.reshape(-1), E)
    act = torch.empty((rows.numel(), F), dtype=torch.bfloat16, device=x_TD.device)
    weights_S = topk_weights_TK.reshape(-1).contiguous()
    glu = (_parts(*w1), _parts(*w3))
    _launch(x_TD, rows, block_expert, weights_S, *glu, act, K, True, True, swiglu_alpha, swiglu_limit)
    y_SD = torch.empty((T * K, D), dtype=torch.float32, device=x_TD.device)
    down = _parts(*w2)
    _launch(act, rows, block_expert, weights_S, down, down, y_SD, K, False, False, swiglu_alpha, swiglu_limit)
    return moe_combine(y_SD, K, out_TD, shared_TD)


@opaque_to_compile
def nvfp4_mlp_triton(x_TD: torch.Tensor, w1: tuple, w3: tuple, w2: tuple, *, swiglu_alpha: float,
                     swiglu_limit: float) -> torch.Tensor:  # fmt: skip
    """One NVFP4 swigluoai MLP (the shared expert) on every token: two linear-mode launches (fused
    gate/up, then down), no grouping tensors."""
    T = x_TD.shape[0]
    F = w1[0].shape[0]
    one = [
        _parts(*(t.unsqueeze(0) if i < 2 else t.reshape(1) for i, t in enumerate(w))) for w in (w1, w3, w2)
    ]
    act = torch.empty((T, F), dtype=torch.bfloat16, device=x_TD.device)
    out = torch.empty_like(x_TD)
    _launch(x_TD, x_TD, x_TD, x_TD, one[0], one[1], act, 1, True, False, swiglu_alpha, swiglu_limit,
            n_rows=T, linear=True)  # fmt: skip
    _launch(act, act, act, act, one[2], one[2], out, 1, False, False, 0.0, 0.0, n_rows=T, linear=True)
    return out


def triton_moe_supported(x_TD: torch.Tensor, w1_packed: torch.Tensor, w2_packed: torch.Tensor) -> bool:
    """bf16 activations and D, F multiples of 16 (whole scale blocks; K tails are masked, output
    tiles are 16-wide at least)."""
    D, F = 2 * w1_packed.shape[2], w1_packed.shape[1]
    return (
        x_TD.dtype == torch.bfloat16
        and D % 16 == 0
        and F % 16 == 0
        and x_TD.stride(-1) == 1
        and w2_packed.shape[1] == D
    )

"""Triton NVFP4 MoE for training shapes: grouped GEMMs forward and backward, expert LoRA included.

Why: the learner runs forward + backward through the frozen NVFP4 routed experts on ~100-1000 slots
per expert; the torch path dequantizes each expert to bf16 in memory first. Here every weight tile is
decoded from its packed bytes in registers straight into a tensor-core dot, for the forward (x @ W^T)
and the input-gradient backward (dy @ W, the same tile decode used transposed). Slots are grouped by
expert on device (`group_rows`); intermediates live in padded-row order.

Invariants: the bank is read, never written, never given a gradient; no host sync; no atomics (a
token's K slots are summed by the caller: deterministic); every output written completely; fp32
accumulation; bf16 operands are exactly `ExpertBank.dequantized(e, bf16)` (`F32=True`: all fp32).
"""

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import E2M1_FP8_SHIFT, e2m1_to_f32_x64, f32_to_bf16, use_hw_casts

# Legend: T tokens, D model dim, F expert ffn dim, E experts, K top-k, S = T*K slots, MP = MB*BM
# padded rows, R LoRA rank (RP: padded to a power of two >= 16), BM/BN/BK tile sizes.
#
# Grouping (`group_rows`): slots sorted by expert, each group padded to a multiple of BM rows; `rows`
# [MB*BM] each padded row's slot (-1 padding), `block_expert` [MB] each block's expert (-1 unused;
# MB = S // BM + min(S, E)), `dest` [S] each slot's padded row, `blk_start_E` / `blk_count_E` each
# expert's block range (for the LoRA weight gradients). x and dy are read through the row -> token
# map (no gather copy). Weight tiles: E2M1 -> fp32 by the fp8 bit trick of `triton_common`, times
# fl(block scale * scale_2). Kernels, one program per [BM, BN] output tile:
# - `_glu_fwd_kernel`: gate = x W1^T (+ s u1 B1^T), up = x W3^T (+ s u3 B3^T), act = swigluoai(gate, up);
# - `_down_fwd_kernel`: y = act W2^T (+ s u2 B2^T) times the router weight, stored by slot (fp32);
# - `_down_bwd_kernel`: g = dy_token W2 (+ s v2 A2), swigluoai backward -> dgate, dup; partial
#   router-weight grads sum(g * act) per tile;
# - `_glu_bwd_kernel`: dx_slot = dgate W1 + dup W3 (+ s v1 A1 + s v3 A3), by slot (fp32);
# - `_dense_mm_kernel`: the rank-R LoRA products u = x A^T, v = dy B per row block;
# - `_expert_outer_kernel`: per expert, sum over its rows of P^T Q (the LoRA A/B gradients).

BM_TRAIN = 64  # padded rows per block: tl.dot M of every kernel; ~100+ rows per expert in training
POISON_INTERMEDIATES = False  # tests set True: every scratch buffer starts as NaN (complete writes)


# ------------------------------------------------------------------------------------------ device
@triton.jit
def _cast(x, F32: tl.constexpr, HW: tl.constexpr):
    """fp32 tile -> the dot operand dtype (fp32 kept, or bf16 with round-to-nearest-even)."""
    if F32:
        out = x
    else:
        out = f32_to_bf16(x, HW)
    return out


@triton.jit
def _dot(a, b, F32: tl.constexpr, HW: tl.constexpr):
    """a @ b in fp32. bf16 operands use the tensor cores; fp32 ones an exact (ieee) product. The
    interpreter multiplies bf16 storage wrongly, so there both go through fp32 (the same products)."""
    if F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif HW:
        out = tl.dot(a, b)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    return out


@triton.jit
def _nvfp4_tile(w_rows, s_rows, is_row, sc2, col0, ROWS: tl.constexpr, COLS: tl.constexpr):
    """fp32 [ROWS, COLS] = W[rows, col0:col0+COLS] = e2m1 * fl(block scale * scale_2), decoded from
    the packed row bytes `w_rows` (uint8 pointers) and e4m3 scale bytes `s_rows`. Bytes load in their
    stored order ([ROWS, COLS/16, 8], 8 contiguous bytes per scale block); low / high nibbles decode
    separately and interleave by join + reshape (element 2i low, 2i + 1 high)."""
    NB: tl.constexpr = COLS // 16
    offs_g = tl.arange(0, NB)
    offs_j = tl.arange(0, 8)
    byte_ptrs = w_rows[:, None, None] + col0 // 2 + offs_g[None, :, None] * 8 + offs_j[None, None, :]
    packed = tl.load(byte_ptrs, mask=is_row[:, None, None], other=0)
    s_bits = tl.load(s_rows[:, None] + col0 // 16 + offs_g[None, :], mask=is_row[:, None], other=0)
    # fl(s * scale_2), then the exact 2^6 of the fp8 bit trick: the reference's per-element product.
    s_eff = s_bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc2 * E2M1_FP8_SHIFT
    lo = e2m1_to_f32_x64(packed & 0xF) * s_eff[:, :, None]
    hi = e2m1_to_f32_x64(packed >> 4) * s_eff[:, :, None]
    return tl.reshape(tl.join(lo, hi), (ROWS, COLS))


@triton.jit
def _rows_of_block(rows_ptr, block_expert_ptr, pid_m, TOPK: tl.constexpr, BM: tl.constexpr):
    """(offs_m padded rows, slot of each row (-1 pad), token of each row (0 for pads), row valid,
    expert (>= 0), whether the block is used)."""
    offs_m = pid_m * BM + tl.arange(0, BM)
    e = tl.load(block_expert_ptr + pid_m)
    slot = tl.load(rows_ptr + offs_m)
    is_row = slot >= 0
    tok = tl.maximum(slot, 0) // TOPK
    return offs_m.to(tl.int64), slot, tok.to(tl.int64), is_row, tl.maximum(e, 0).to(tl.int64), e >= 0


@triton.jit
def _w_rows(w_ptr, s_ptr, e, offs_r, stride_we, stride_wr, stride_se, stride_sr):
    """Byte pointers to the packed rows `offs_r` of expert e and to their scale rows."""
    w_rows = w_ptr + e * stride_we + offs_r.to(tl.int64) * stride_wr
    s_rows = s_ptr + e * stride_se + offs_r.to(tl.int64) * stride_sr
    return w_rows, s_rows


@triton.jit
def _nt_loop(acc, x_rows, is_row, w_rows, s_rows, sc2, n_k, F32: tl.constexpr, HW: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """acc [BM, BN] += x[:, :n_k*BK] @ W[rows, :n_k*BK]^T (reduction along the packed dim)."""
    offs_k = tl.arange(0, BK)
    is_w = tl.full((BN,), 1, tl.int1)  # all output rows exist (N is a multiple of BN)
    for i in range(0, n_k):
        k0 = i * BK
        x_mk = tl.load(x_rows[:, None] + k0 + offs_k[None, :], mask=is_row[:, None], other=0.0)
        w_nk = _nvfp4_tile(w_rows, s_rows, is_w, sc2, k0, BN, BK)
        acc += _dot(_cast(x_mk.to(tl.float32), F32, HW), tl.trans(_cast(w_nk, F32, HW)), F32, HW)
    return acc


@triton.jit
def _nn_loop(acc, x_rows, is_row, w_ptr, s_ptr, e, col0, sc2, n_k, stride_we, stride_wr, stride_se,
             stride_sr, F32: tl.constexpr, HW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """acc [BM, BN] += x[:, :n_k*BK] @ W[:n_k*BK, col0:col0+BN] (transposed use: the reduction runs
    over W's rows; each K step decodes a [BK, BN] tile of BK rows x BN packed columns)."""
    offs_k = tl.arange(0, BK)
    is_w = offs_k >= 0
    for i in range(0, n_k):
        k0 = i * BK
        x_mk = tl.load(x_rows[:, None] + k0 + offs_k[None, :], mask=is_row[:, None], other=0.0)
        w_rows, s_rows = _w_rows(w_ptr, s_ptr, e, k0 + offs_k, stride_we, stride_wr, stride_se, stride_sr)
        w_kn = _nvfp4_tile(w_rows, s_rows, is_w, sc2, col0, BK, BN)
        acc += _dot(_cast(x_mk.to(tl.float32), F32, HW), _cast(w_kn, F32, HW), F32, HW)
    return acc


@triton.jit
def _lora_epilogue(acc, u_ptr, stride_um, offs_m, l_ptr, e, stride_le, stride_lr, stride_ln, offs_n, R,
                   scale, F32: tl.constexpr, HW: tl.constexpr, RP: tl.constexpr):  # fmt: skip
    """acc += scale * u[rows, :R] @ L_e[:R, offs_n] (L_e[r, n] at r * stride_lr + n * stride_ln)."""
    offs_r = tl.arange(0, RP)
    is_r = offs_r < R
    u = tl.load(u_ptr + offs_m[:, None] * stride_um + offs_r[None, :], mask=is_r[None, :], other=0.0)
    lt = tl.load(
        l_ptr + e * stride_le + offs_r[:, None] * stride_lr + offs_n[None, :] * stride_ln,
        mask=is_r[:, None], other=0.0,
    )  # fmt: skip
    return acc + scale * _dot(_cast(u, F32, HW), _cast(lt.to(tl.float32), F32, HW), F32, HW)


@triton.jit
def _glu_fwd_kernel(
    x_ptr, stride_xm, rows_ptr, block_expert_ptr,
    w1_ptr, s1_ptr, sc21_ptr, w3_ptr, s3_ptr, sc23_ptr, stride_we, stride_wr, stride_se, stride_sr,
    u1_ptr, u3_ptr, stride_um, b1_ptr, b3_ptr, stride_le, stride_lr, stride_ln, R, lora_scale,
    gate_ptr, up_ptr, act_ptr, stride_om, n_in, swiglu_alpha, swiglu_limit,
    TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr,
    HAS_LORA: tl.constexpr, F32: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m, _slot, tok, is_row, e, used = _rows_of_block(rows_ptr, block_expert_ptr, pid_m, TOPK, BM)
    n_k = tl.where(used, n_in // BK, 0)  # unused blocks read nothing and store zeros
    offs_n = pid_n * BN + tl.arange(0, BN)
    x_rows = x_ptr + tok * stride_xm
    w1_rows, s1_rows = _w_rows(w1_ptr, s1_ptr, e, offs_n, stride_we, stride_wr, stride_se, stride_sr)
    w3_rows, s3_rows = _w_rows(w3_ptr, s3_ptr, e, offs_n, stride_we, stride_wr, stride_se, stride_sr)
    acc_g = _nt_loop(tl.zeros((BM, BN), tl.float32), x_rows, is_row, w1_rows, s1_rows, tl.load(sc21_ptr + e),
                     n_k, F32, HW, BN, BK)  # fmt: skip
    acc_u = _nt_loop(tl.zeros((BM, BN), tl.float32), x_rows, is_row, w3_rows, s3_rows, tl.load(sc23_ptr + e),
                     n_k, F32, HW, BN, BK)  # fmt: skip
    if HAS_LORA:
        acc_g = _lora_epilogue(acc_g, u1_ptr, stride_um, offs_m, b1_ptr, e, stride_le, stride_lr, stride_ln,
                               offs_n, R, lora_scale, F32, HW, RP)  # fmt: skip
        acc_u = _lora_epilogue(acc_u, u3_ptr, stride_um, offs_m, b3_ptr, e, stride_le, stride_lr, stride_ln,
                               offs_n, R, lora_scale, F32, HW, RP)  # fmt: skip
    # swigluoai on the projections rounded to the activation dtype, as the reference sees them.
    gate = _cast(acc_g, F32, HW)
    up = _cast(acc_u, F32, HW)
    g = tl.minimum(gate.to(tl.float32), swiglu_limit)
    u = tl.minimum(tl.maximum(up.to(tl.float32), -swiglu_limit), swiglu_limit)
    act = g * tl.sigmoid(swiglu_alpha * g) * (u + 1.0)
    o = offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(gate_ptr + o, gate)
    tl.store(up_ptr + o, up)
    tl.store(act_ptr + o, _cast(act, F32, HW))


@triton.jit
def _down_fwd_kernel(
    act_ptr, stride_am, rows_ptr, block_expert_ptr, router_w_ptr,
    w2_ptr, s2_ptr, sc22_ptr, stride_we, stride_wr, stride_se, stride_sr,
    u2_ptr, stride_um, b2_ptr, stride_le, stride_lr, stride_ln, R, lora_scale,
    y_ptr, stride_ys, n_in,
    TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr,
    HAS_LORA: tl.constexpr, F32: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m, slot, _tok, is_row, e, used = _rows_of_block(rows_ptr, block_expert_ptr, pid_m, TOPK, BM)
    n_k = tl.where(used, n_in // BK, 0)
    offs_n = pid_n * BN + tl.arange(0, BN)
    w2_rows, s2_rows = _w_rows(w2_ptr, s2_ptr, e, offs_n, stride_we, stride_wr, stride_se, stride_sr)
    acc = _nt_loop(tl.zeros((BM, BN), tl.float32), act_ptr + offs_m * stride_am, is_row, w2_rows, s2_rows,
                   tl.load(sc22_ptr + e), n_k, F32, HW, BN, BK)  # fmt: skip
    if HAS_LORA:
        acc = _lora_epilogue(acc, u2_ptr, stride_um, offs_m, b2_ptr, e, stride_le, stride_lr, stride_ln,
                             offs_n, R, lora_scale, F32, HW, RP)  # fmt: skip
    w_m = tl.load(router_w_ptr + tl.maximum(slot, 0), mask=is_row, other=0.0).to(tl.float32)
    y = _cast(acc, F32, HW).to(tl.float32) * w_m[:, None]
    tl.store(y_ptr + tl.maximum(slot, 0).to(tl.int64)[:, None] * stride_ys + offs_n[None, :], y,
             mask=is_row[:, None])  # fmt: skip


@triton.jit
def _down_bwd_kernel(
    dy_ptr, stride_dm, rows_ptr, block_expert_ptr, router_w_ptr,
    w2_ptr, s2_ptr, sc22_ptr, stride_we, stride_wr, stride_se, stride_sr,
    v2_ptr, stride_vm, a2_ptr, stride_le, stride_lr, stride_ln, R, lora_scale,
    gate_ptr, up_ptr, act_ptr, stride_gm, dgate_ptr, dup_ptr, dw_part_ptr, n_mp, n_red,
    swiglu_alpha, swiglu_limit,
    TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr,
    HAS_LORA: tl.constexpr, F32: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m, slot, tok, is_row, e, used = _rows_of_block(rows_ptr, block_expert_ptr, pid_m, TOPK, BM)
    n_k = tl.where(used, n_red // BK, 0)
    offs_n = pid_n * BN + tl.arange(0, BN)
    g = _nn_loop(tl.zeros((BM, BN), tl.float32), dy_ptr + tok * stride_dm, is_row, w2_ptr, s2_ptr, e,
                 pid_n * BN, tl.load(sc22_ptr + e), n_k, stride_we, stride_wr, stride_se, stride_sr,
                 F32, HW, BN, BK)  # fmt: skip
    if HAS_LORA:
        g = _lora_epilogue(g, v2_ptr, stride_vm, offs_m, a2_ptr, e, stride_le, stride_lr, stride_ln, offs_n,
                           R, lora_scale, F32, HW, RP)  # fmt: skip
    o = offs_m[:, None] * stride_gm + offs_n[None, :]
    act = tl.load(act_ptr + o).to(tl.float32)
    # d(router weight of the slot) = <dy_token, y_slot> = <g, act>: partial sum over this tile's columns.
    tl.store(dw_part_ptr + pid_n * n_mp + offs_m, tl.sum(g * act, axis=1))
    w_m = tl.load(router_w_ptr + tl.maximum(slot, 0), mask=is_row, other=0.0).to(tl.float32)
    dact = g * w_m[:, None]
    # swigluoai backward; the clamp masks are inclusive, as torch's clamp backward.
    gate = tl.load(gate_ptr + o).to(tl.float32)
    up = tl.load(up_ptr + o).to(tl.float32)
    gc = tl.minimum(gate, swiglu_limit)
    uc = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
    sig = tl.sigmoid(swiglu_alpha * gc)
    d_gc = dact * (uc + 1.0) * sig * (1.0 + swiglu_alpha * gc * (1.0 - sig))
    d_uc = dact * gc * sig
    dgate = tl.where(gate <= swiglu_limit, d_gc, 0.0)
    dup = tl.where((up >= -swiglu_limit) & (up <= swiglu_limit), d_uc, 0.0)
    tl.store(dgate_ptr + o, _cast(dgate, F32, HW))
    tl.store(dup_ptr + o, _cast(dup, F32, HW))


@triton.jit
def _glu_bwd_kernel(
    dgate_ptr, dup_ptr, stride_gm, rows_ptr, block_expert_ptr,
    w1_ptr, s1_ptr, sc21_ptr, w3_ptr, s3_ptr, sc23_ptr, stride_we, stride_wr, stride_se, stride_sr,
    v1_ptr, v3_ptr, stride_vm, a1_ptr, a3_ptr, stride_le, stride_lr, stride_ln, R, lora_scale,
    dx_ptr, stride_ds, n_red,
    TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr,
    HAS_LORA: tl.constexpr, F32: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m, slot, _tok, is_row, e, used = _rows_of_block(rows_ptr, block_expert_ptr, pid_m, TOPK, BM)
    n_k = tl.where(used, n_red // BK, 0)
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    acc = _nn_loop(acc, dgate_ptr + offs_m * stride_gm, is_row, w1_ptr, s1_ptr, e, pid_n * BN,
                   tl.load(sc21_ptr + e), n_k, stride_we, stride_wr, stride_se, stride_sr,
                   F32, HW, BN, BK)  # fmt: skip
    acc = _nn_loop(acc, dup_ptr + offs_m * stride_gm, is_row, w3_ptr, s3_ptr, e, pid_n * BN,
                   tl.load(sc23_ptr + e), n_k, stride_we, stride_wr, stride_se, stride_sr,
                   F32, HW, BN, BK)  # fmt: skip
    if HAS_LORA:
        acc = _lora_epilogue(acc, v1_ptr, stride_vm, offs_m, a1_ptr, e, stride_le, stride_lr, stride_ln,
                             offs_n, R, lora_scale, F32, HW, RP)  # fmt: skip
        acc = _lora_epilogue(acc, v3_ptr, stride_vm, offs_m, a3_ptr, e, stride_le, stride_lr, stride_ln,
                             offs_n, R, lora_scale, F32, HW, RP)  # fmt: skip
    tl.store(dx_ptr + tl.maximum(slot, 0).to(tl.int64)[:, None] * stride_ds + offs_n[None, :], acc,
             mask=is_row[:, None])  # fmt: skip


@triton.jit
def _dense_mm_kernel(
    x_ptr, stride_xm, rows_ptr, block_expert_ptr, l_ptr, stride_le, stride_lk, stride_ln,
    out_ptr, stride_om, n_red, R,
    GATHER: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr,
    F32: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """out[row, :R] = x[row] @ L_e[:, :R] (L_e[k, r] at k * stride_lk + r * stride_ln): u = x A^T or
    v = dy B, the rank-R half of a LoRA product (x read through the row -> token map when GATHER)."""
    pid_m = tl.program_id(0)
    offs_m, _slot, tok, is_row, e, used = _rows_of_block(rows_ptr, block_expert_ptr, pid_m, TOPK, BM)
    n_k = tl.where(used, tl.cdiv(n_red, BK), 0)
    src = tok if GATHER else offs_m
    x_rows = x_ptr + src * stride_xm
    offs_k = tl.arange(0, BK)
    offs_r = tl.arange(0, RP)
    acc = tl.zeros((BM, RP), tl.float32)
    for i in range(0, n_k):
        k = i * BK + offs_k
        x_mk = tl.load(x_rows[:, None] + k[None, :], mask=is_row[:, None] & (k < n_red)[None, :], other=0.0)
        l_kr = tl.load(l_ptr + e * stride_le + k[:, None] * stride_lk + offs_r[None, :] * stride_ln,
                       mask=(k < n_red)[:, None] & (offs_r < R)[None, :], other=0.0)  # fmt: skip
        acc += _dot(_cast(x_mk.to(tl.float32), F32, HW), _cast(l_kr.to(tl.float32), F32, HW), F32, HW)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_r[None, :], acc, mask=(offs_r < R)[None, :])


@triton.jit
def _expert_outer_kernel(
    p_ptr, stride_pm, q_ptr, stride_qm, rows_ptr, router_w_ptr, blk_start_ptr, blk_count_ptr,
    out_ptr, stride_oe, stride_oa, n_a, n_b, scale,
    GATHER_P: tl.constexpr, GATHER_Q: tl.constexpr, WEIGHT_P: tl.constexpr, TOPK: tl.constexpr,
    BM: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, F32: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """out[e] = scale * sum over expert e's rows of P[row, :n_a]^T Q[row, :n_b] (P times the slot's
    router weight when WEIGHT_P): the LoRA factor gradients, one program per [BA, BB] tile of one
    expert, walking that expert's row blocks (no atomics, deterministic)."""
    e = tl.program_id(0)
    offs_a = tl.program_id(1) * BA + tl.arange(0, BA)
    offs_b = tl.program_id(2) * BB + tl.arange(0, BB)
    start = tl.load(blk_start_ptr + e)
    count = tl.load(blk_count_ptr + e)
    acc = tl.zeros((BA, BB), tl.float32)
    for i in range(0, count):
        offs_m = ((start + i) * BM + tl.arange(0, BM)).to(tl.int64)
        slot = tl.load(rows_ptr + offs_m)
        is_row = slot >= 0
        tok = (tl.maximum(slot, 0) // TOPK).to(tl.int64)
        p_src = tok if GATHER_P else offs_m
        q_src = tok if GATHER_Q else offs_m
        p = tl.load(p_ptr + p_src[:, None] * stride_pm + offs_a[None, :],
                    mask=is_row[:, None] & (offs_a < n_a)[None, :], other=0.0).to(tl.float32)  # fmt: skip
        q = tl.load(q_ptr + q_src[:, None] * stride_qm + offs_b[None, :],
                    mask=is_row[:, None] & (offs_b < n_b)[None, :], other=0.0).to(tl.float32)  # fmt: skip
        if WEIGHT_P:
            w_m = tl.load(router_w_ptr + tl.maximum(slot, 0), mask=is_row, other=0.0).to(tl.float32)
            p = p * w_m[:, None]
        acc += _dot(tl.trans(_cast(p, F32, HW)), _cast(q, F32, HW), F32, HW)
    o = out_ptr + e.to(tl.int64) * stride_oe + offs_a[:, None] * stride_oa + offs_b[None, :]
    tl.store(o, acc * scale, mask=(offs_a < n_a)[:, None] & (offs_b < n_b)[None, :])


# -------------------------------------------------------------------------------------------- host
# 8 warps: at BM = BN = BK = 64 the fused kernels need ~200-220 registers per thread (ptxas, sm_90);
# at 4 warps they hit the 255 cap and spill.
_LAUNCH = {"num_warps": 8, "num_stages": 3}


def _empty(shape, dtype, device) -> torch.Tensor:
    if POISON_INTERMEDIATES:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def group_rows(ids_S: torch.Tensor, n_experts: int, bm: int) -> dict[str, torch.Tensor]:
    """Slots sorted by expert and padded to bm-row blocks, on device, no host sync (module notes)."""
    S = ids_S.numel()
    n_blocks = S // bm + min(S, n_experts)
    dev = ids_S.device
    ids_S = ids_S.long()
    order_S = torch.argsort(ids_S, stable=True)
    # scatter_add, not bincount: CUDA bincount reads the max id on the host (a sync per call).
    counts_E = torch.zeros(n_experts, dtype=torch.long, device=dev).scatter_add_(
        0, ids_S, torch.ones_like(ids_S)
    )
    blocks_E = (counts_E + bm - 1) // bm
    blk_start_E = torch.cumsum(blocks_E, 0) - blocks_E
    start_E = torch.cumsum(counts_E, 0) - counts_E
    e_sorted = ids_S[order_S]
    dest_sorted = blk_start_E[e_sorted] * bm + torch.arange(S, device=dev) - start_E[e_sorted]
    rows = torch.full((n_blocks * bm,), -1, dtype=torch.int32, device=dev)
    rows[dest_sorted] = order_S.to(torch.int32)
    dest_S = torch.empty_like(dest_sorted).scatter_(0, order_S, dest_sorted)
    block_expert = torch.searchsorted(
        torch.cumsum(blocks_E, 0), torch.arange(n_blocks, device=dev), right=True
    )
    block_expert = torch.where(block_expert < n_experts, block_expert, -1).to(torch.int32)
    return {"rows": rows, "block_expert": block_expert, "dest": dest_S,
            "blk_start": blk_start_E.to(torch.int32), "blk_count": blocks_E.to(torch.int32)}  # fmt: skip


def _tile(n: int) -> int:
    return 64 if n % 64 == 0 else 32 if n % 32 == 0 else 16


def _rp(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def _w(parts):
    """(packed uint8 [E, N, in/2], scale bytes [E, N, in/16], fp32 scale_2 [E])."""
    packed, scales, scale_2 = parts
    return (
        packed.contiguous(),
        scales.contiguous().view(torch.uint8),
        scale_2.reshape(-1).float().contiguous(),
    )


def _w_strides(w) -> tuple[int, int, int, int]:
    return w[0].stride(0), w[0].stride(1), w[1].stride(0), w[1].stride(1)


def _f32(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32


def _dense_mm(x, g, l_t, strides, R, gather, topk, bm, f32):
    """u/v [MP, R] fp32 = x rows @ L_e (see `_dense_mm_kernel`); strides = (le, lk, ln)."""
    MP = g["rows"].numel()
    out = _empty((MP, R), torch.float32, x.device)
    n_red = x.shape[1]
    _dense_mm_kernel[(MP // bm,)](
        x, x.stride(0), g["rows"], g["block_expert"], l_t, *strides, out, out.stride(0), n_red, R,
        GATHER=gather, TOPK=topk, BM=bm, BK=_tile(n_red), RP=_rp(R), F32=f32, HW=use_hw_casts(),
    )  # fmt: skip
    return out


def _outer(p, q, g, router_w, n_experts, scale, gather_p, gather_q, weight_p, topk, bm, f32, dtype):
    """[E, n_a, n_b] per-expert sum of P^T Q over the expert's rows (`_expert_outer_kernel`)."""
    n_a, n_b = p.shape[1], q.shape[1]
    ba, bb = min(64, _rp(n_a)), min(64, _rp(n_b))
    out = _empty((n_experts, n_a, n_b), torch.float32, p.device)
    grid = (n_experts, triton.cdiv(n_a, ba), triton.cdiv(n_b, bb))
    _expert_outer_kernel[grid](
        p, p.stride(0), q, q.stride(0), g["rows"], router_w, g["blk_start"], g["blk_count"],
        out, out.stride(0), out.stride(1), n_a, n_b, scale,
        GATHER_P=gather_p, GATHER_Q=gather_q, WEIGHT_P=weight_p, TOPK=topk, BM=bm, BA=ba, BB=bb,
        F32=f32, HW=use_hw_casts(),
    )  # fmt: skip
    return out.to(dtype)


class _NVFP4MoETrain(torch.autograd.Function):
    """y_TD = sum_k w[t, k] * expert_{ids[t, k]}(x[t]) with optional per-expert LoRA; gradients to x,
    the router weights and the LoRA factors. `frozen` (ids, NVFP4 parts, options) is a plain tuple:
    autograd never sees the NVFP4 buffers, so no gradient can reach them."""

    @staticmethod
    def forward(ctx, x_TD, weights_TK, a1, b1, a3, b3, a2, b2, frozen):
        ids_TK, w1, w3, w2, lora_scale, alpha, limit, bm = frozen
        T, D = x_TD.shape
        K = ids_TK.shape[1]
        E, F = w1[0].shape[0], w1[0].shape[1]
        dev, dt, f32, hw = x_TD.device, x_TD.dtype, _f32(x_TD), use_hw_casts()
        x_TD = x_TD.contiguous()
        g = group_rows(ids_TK.reshape(-1), E, bm)
        MP = g["rows"].numel()
        router_w = weights_TK.reshape(-1).float().contiguous()
        has_lora = a1 is not None
        R = a1.shape[1] if has_lora else 1
        dummy = router_w
        if has_lora:
            a_str = (a1.stride(0), a1.stride(2), a1.stride(1))  # u = x A^T: L[k, r] = A[r, k]
            u1 = _dense_mm(x_TD, g, a1, a_str, R, True, K, bm, f32)
            u3 = _dense_mm(x_TD, g, a3, a_str, R, True, K, bm, f32)
        else:
            u1 = u3 = dummy
        bn, bk = _tile(F), _tile(D)
        gate, up, act = (_empty((MP, F), dt, dev) for _ in range(3))
        # Epilogue factor L[r, n] = B[n, r].
        b_str = (b1.stride(0), b1.stride(2), b1.stride(1)) if has_lora else (0, 0, 0)
        _glu_fwd_kernel[(MP // bm, F // bn)](
            x_TD, x_TD.stride(0), g["rows"], g["block_expert"], *w1, *w3[:3], *_w_strides(w1),
            u1, u3, u1.stride(0), b1 if has_lora else dummy, b3 if has_lora else dummy, *b_str, R, lora_scale,
            gate, up, act, gate.stride(0), D, alpha, limit,
            TOPK=K, BM=bm, BN=bn, BK=bk, RP=_rp(R), HAS_LORA=has_lora, F32=f32, HW=hw, **_LAUNCH,
        )  # fmt: skip
        if has_lora:
            u2 = _dense_mm(act, g, a2, (a2.stride(0), a2.stride(2), a2.stride(1)), R, False, K, bm, f32)
            b2_str = (b2.stride(0), b2.stride(2), b2.stride(1))
        else:
            u2, b2_str = dummy, (0, 0, 0)
        y_SD = _empty((T * K, D), torch.float32, dev)
        _down_fwd_kernel[(MP // bm, D // _tile(D))](
            act, act.stride(0), g["rows"], g["block_expert"], router_w, *w2, *_w_strides(w2),
            u2, u2.stride(0), b2 if has_lora else dummy, *b2_str, R, lora_scale, y_SD, y_SD.stride(0), F,
            TOPK=K, BM=bm, BN=_tile(D), BK=_tile(F), RP=_rp(R), HAS_LORA=has_lora, F32=f32, HW=hw, **_LAUNCH,
        )  # fmt: skip
        ctx.save_for_backward(x_TD, router_w, gate, up, act, u1, u3, u2, a1, b1, a3, b3, a2, b2)
        ctx.frozen, ctx.g, ctx.has_lora, ctx.R, ctx.weights_dtype = frozen, g, has_lora, R, weights_TK.dtype
        return y_SD.view(T, K, D).sum(1).to(dt)

    @staticmethod
    def backward(ctx, grad_TD):
        x_TD, router_w, gate, up, act, u1, u3, u2, a1, b1, a3, b3, a2, b2 = ctx.saved_tensors
        ids_TK, w1, w3, w2, s, alpha, limit, bm = ctx.frozen
        g, has_lora, R = ctx.g, ctx.has_lora, ctx.R
        T, D = x_TD.shape
        K = ids_TK.shape[1]
        E, F = w1[0].shape[0], w1[0].shape[1]
        MP = g["rows"].numel()
        dev, dt, f32, hw = x_TD.device, x_TD.dtype, _f32(x_TD), use_hw_casts()
        dy_TD = grad_TD.to(dt).contiguous()
        dummy = router_w
        if has_lora:
            v2 = _dense_mm(dy_TD, g, b2, (b2.stride(0), b2.stride(1), b2.stride(2)), R, True, K, bm, f32)
            a_ep = (a2.stride(0), a2.stride(1), a2.stride(2))  # epilogue L[r, n] = A[r, n]
        else:
            v2, a_ep = dummy, (0, 0, 0)
        bn_f = _tile(F)
        n_pn = F // bn_f
        dgate, dup = _empty((MP, F), dt, dev), _empty((MP, F), dt, dev)
        dw_part = _empty((n_pn, MP), torch.float32, dev)
        _down_bwd_kernel[(MP // bm, n_pn)](
            dy_TD, dy_TD.stride(0), g["rows"], g["block_expert"], router_w, *w2, *_w_strides(w2),
            v2, v2.stride(0), a2 if has_lora else dummy, *a_ep, R, s,
            gate, up, act, gate.stride(0), dgate, dup, dw_part, MP, D, alpha, limit,
            TOPK=K, BM=bm, BN=bn_f, BK=_tile(D), RP=_rp(R), HAS_LORA=has_lora, F32=f32, HW=hw, **_LAUNCH,
        )  # fmt: skip
        dweights_TK = dw_part.sum(0)[g["dest"]].view(T, K).to(ctx.weights_dtype)
        if has_lora:
            b_str = (b1.stride(0), b1.stride(1), b1.stride(2))  # v = dgate B: L[k, r] = B[k, r]
            v1 = _dense_mm(dgate, g, b1, b_str, R, False, K, bm, f32)
            v3 = _dense_mm(dup, g, b3, b_str, R, False, K, bm, f32)
            a_ep = (a1.stride(0), a1.stride(1), a1.stride(2))
        else:
            v1 = v3 = dummy
        dx_SD = _empty((T * K, D), torch.float32, dev)
        _glu_bwd_kernel[(MP // bm, D // _tile(D))](
            dgate, dup, dgate.stride(0), g["rows"], g["block_expert"], *w1, *w3, *_w_strides(w1),
            v1, v3, v1.stride(0), a1 if has_lora else dummy, a3 if has_lora else dummy, *a_ep, R, s,
            dx_SD, dx_SD.stride(0), F,
            TOPK=K, BM=bm, BN=_tile(D), BK=_tile(F), RP=_rp(R), HAS_LORA=has_lora, F32=f32, HW=hw, **_LAUNCH,
        )  # fmt: skip
        dx_TD = dx_SD.view(T, K, D).sum(1).to(dt)
        grads = [None] * 6
        if has_lora:
            o = dict(n_experts=E, topk=K, bm=bm, f32=f32)
            # A gradients: s * v^T [x | act]; B gradients: s * [dgate | dup | w*dy]^T u (module notes).
            grads = [
                _outer(v1, x_TD, g, router_w, scale=s, gather_p=False, gather_q=True, weight_p=False,
                       dtype=a1.dtype, **o),
                _outer(dgate, u1, g, router_w, scale=s, gather_p=False, gather_q=False, weight_p=False,
                       dtype=b1.dtype, **o),
                _outer(v3, x_TD, g, router_w, scale=s, gather_p=False, gather_q=True, weight_p=False,
                       dtype=a3.dtype, **o),
                _outer(dup, u3, g, router_w, scale=s, gather_p=False, gather_q=False, weight_p=False,
                       dtype=b3.dtype, **o),
                _outer(v2, act, g, router_w, scale=s, gather_p=False, gather_q=False, weight_p=True,
                       dtype=a2.dtype, **o),
                _outer(dy_TD, u2, g, router_w, scale=s, gather_p=True, gather_q=False, weight_p=True,
                       dtype=b2.dtype, **o),
            ]  # fmt: skip
        return (dx_TD, dweights_TK, *grads, None)


def moe_nvfp4_train(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
    w1: tuple, w3: tuple, w2: tuple, lora: tuple | None = None, *,
    swiglu_alpha: float, swiglu_limit: float, block_m: int = BM_TRAIN,
) -> torch.Tensor:  # fmt: skip
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) for x_TD [T, D] (bf16, or fp32 for exact checks),
    differentiable w.r.t. x, the router weights and the LoRA factors. Each w* = (packed uint8
    [E, out, in/2], scales e4m3 [E, out, in/16], scale_2 fp32 [E]); lora = (A1, B1, A3, B3, A2, B2,
    scaling) with A [E, R, in], B [E, out, R] (ExpertLoRA's stacked factors) or None. No host sync."""
    if not triton_moe_train_supported(x_TD, w1[0], w2[0]):
        raise ValueError(
            f"moe_nvfp4_train: unsupported x {x_TD.dtype} {tuple(x_TD.shape)} / weights "
            f"{tuple(w1[0].shape)}, {tuple(w2[0].shape)} (see triton_moe_train_supported)"
        )
    if block_m not in (16, 32, 64, 128):
        raise ValueError(f"moe_nvfp4_train: block_m must be 16, 32, 64 or 128, got {block_m}")
    factors = (None,) * 6 if lora is None else tuple(t.contiguous() for t in lora[:6])
    scale = 1.0 if lora is None else float(lora[6])
    frozen = (topk_ids_TK, _w(w1), _w(w3), _w(w2), scale, float(swiglu_alpha), float(swiglu_limit), block_m)
    return _NVFP4MoETrain.apply(x_TD, topk_weights_TK, *factors, frozen)


def triton_moe_train_supported(x_TD: torch.Tensor, w1_packed: torch.Tensor, w2_packed: torch.Tensor) -> bool:
    """bf16 activations (fp32 too: exact ieee dots, for tests), D and F multiples of 32."""
    D, F = 2 * w1_packed.shape[2], w1_packed.shape[1]
    return (
        x_TD.dim() == 2
        and x_TD.dtype in (torch.bfloat16, torch.float32)
        and x_TD.shape[1] == D
        and D % 32 == 0
        and F % 32 == 0
        and tuple(w2_packed.shape[1:]) == (D, F // 2)
    )

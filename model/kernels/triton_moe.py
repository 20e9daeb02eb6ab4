"""Triton NVFP4 MoE decode: W4A16 grouped GEMV/GEMM, fused gate/up + swigluoai, then down x router weight.

Why: at decode a layer's routed experts are nearly all touched (batch 64, top-4 of 128 experts:
~2 tokens per expert), so the layer streams every expert's weights once per step; NVFP4 (0.5625
B/value) moves 3.56x fewer bytes than bf16 if the weights are decoded in registers and never
written back. The torch path dequantizes each expert's weights to bf16 in memory first.

Layout (built on device by `_group_by_expert`, no host sync): the T*K token-slots sorted by expert,
each expert's group padded to a multiple of BM rows; `rows` [MB * BM] holds the slot of every padded
row (-1 = padding) and `block_expert` [MB] the expert of every BM-row block (-1 = unused block;
MB = S // BM + min(S, E) bounds the blocks any routing can need).

Kernel `_nvfp4_moe_kernel`, grid (MB, N / BN), one [BM, BN] output tile per program, K in BK steps:
- x tile [BM, BK] bf16 (token rows gathered through `rows`, or the padded act rows);
- weight tile(s) [BN, BK]: packed bytes and e4m3 block scales loaded in stored order, E2M1 decoded
  by bit manipulation (FACTS 6, no lookup table), value = e2m1 * (float(s) * scale_2) in fp32 then
  rounded to bf16: the exact weights `nvfp4_linear` / `ExpertBank.dequantized` multiply with;
- bf16 tensor-core dots, fp32 accumulation.
FUSE_GLU: w1 and w3 tiles share the x tile; epilogue act = swigluoai(bf16(gate), bf16(up)) -> bf16
rows of `act` (padded order). Otherwise (down / plain linear): y = bf16(acc) * router weight (fp32)
stored at the slot's row; the K slots of a token are summed by the caller in fp32.

The shared expert runs through the same kernels as a one-expert bank with weight 1 for every token
(`nvfp4_mlp_triton`); the plain W4A16 linear (`nvfp4_linear_triton`) is the non-GLU pass alone.

Legend: T tokens, D model dim, F expert ffn dim, E experts, K top-k, S = T*K slots, MB row blocks,
BM/BN/BK tile sizes (rows, output features, reduction).
"""

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import (
    E2M1_FP8_SHIFT,
    dot_bf16,
    e2m1_to_f32_x64,
    f32_to_bf16,
    num_sms,
    use_hw_casts,
)

BM = 16  # tokens per row block: the smallest tl.dot M; decode groups hold ~1-4 tokens
PROGRAMS_PER_SM = 4


@triton.jit
def _load_w_tile(w_ptr, s_ptr, offs_n, k0, stride_wn, stride_sn, sc2, BK: tl.constexpr, BN: tl.constexpr,
                 HW: tl.constexpr):  # fmt: skip
    """Weight rows offs_n, columns [k0, k0 + BK) -> bf16 [BN, BK] = bf16(e2m1 * (float(s) * scale_2))."""
    NB: tl.constexpr = BK // 16
    offs_g = tl.arange(0, NB)
    offs_j = tl.arange(0, 8)
    packed = tl.load(w_ptr + offs_n[:, None, None] * stride_wn + k0 // 2 + offs_g[None, :, None] * 8
                     + offs_j[None, None, :])  # fmt: skip
    s_bits = tl.load(s_ptr + offs_n[:, None] * stride_sn + k0 // 16 + offs_g[None, :])
    # fl(s * scale_2) as the reference rounds it; the 2^6 of the bit trick is exact on top of it.
    s_eff = s_bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc2 * E2M1_FP8_SHIFT
    lo = e2m1_to_f32_x64(packed & 0xF) * s_eff[:, :, None]
    hi = e2m1_to_f32_x64(packed >> 4) * s_eff[:, :, None]
    return f32_to_bf16(tl.reshape(tl.join(lo, hi), (BN, BK)), HW)


@triton.jit
def _nvfp4_moe_kernel(
    x_ptr, stride_xm,
    rows_ptr, block_expert_ptr, router_w_ptr,
    wa_ptr, sa_ptr, sc2a_ptr, wb_ptr, sb_ptr, sc2b_ptr,
    stride_we, stride_wn, stride_se, stride_sn,
    out_ptr, stride_om,
    n_in, swiglu_alpha, swiglu_limit,
    TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    FUSE_GLU: tl.constexpr, GATHER_X: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    n_k = tl.where(e >= 0, n_in // BK, 0)  # unused blocks read nothing
    e = tl.maximum(e, 0)
    offs_m = pid_m * BM + tl.arange(0, BM)
    slot_m = tl.load(rows_ptr + offs_m)
    is_row = slot_m >= 0
    if GATHER_X:
        x_rows = x_ptr + (tl.maximum(slot_m, 0) // TOPK).to(tl.int64) * stride_xm
    else:
        x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    sc2a = tl.load(sc2a_ptr + e)
    wa = wa_ptr + e * stride_we
    sa = sa_ptr + e * stride_se
    acc_a = tl.zeros((BM, BN), tl.float32)
    if FUSE_GLU:
        sc2b = tl.load(sc2b_ptr + e)
        wb = wb_ptr + e * stride_we
        sb = sb_ptr + e * stride_se
        acc_b = tl.zeros((BM, BN), tl.float32)
    for i in range(0, n_k):
        k0 = i * BK
        x_mk = tl.load(x_rows[:, None] + k0 + offs_k[None, :], mask=is_row[:, None], other=0.0)
        w_nk = _load_w_tile(wa, sa, offs_n, k0, stride_wn, stride_sn, sc2a, BK, BN, HW)
        acc_a += dot_bf16(x_mk, tl.trans(w_nk), HW)
        if FUSE_GLU:
            w_nk = _load_w_tile(wb, sb, offs_n, k0, stride_wn, stride_sn, sc2b, BK, BN, HW)
            acc_b += dot_bf16(x_mk, tl.trans(w_nk), HW)

    if FUSE_GLU:
        # swigluoai on the bf16-rounded projections, as the reference sees them.
        gate = tl.minimum(f32_to_bf16(acc_a, HW).to(tl.float32), swiglu_limit)
        up = tl.minimum(tl.maximum(f32_to_bf16(acc_b, HW).to(tl.float32), -swiglu_limit), swiglu_limit)
        act = gate * tl.sigmoid(swiglu_alpha * gate) * (up + 1.0)
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, f32_to_bf16(act, HW), mask=is_row[:, None])
    else:
        w_m = tl.load(router_w_ptr + tl.maximum(slot_m, 0), mask=is_row, other=0.0).to(tl.float32)
        y = f32_to_bf16(acc_a, HW).to(tl.float32) * w_m[:, None]
        o_ptrs = out_ptr + tl.maximum(slot_m, 0)[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, y, mask=is_row[:, None])


def _group_by_expert(ids_S: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [MB * BM] int32 slot or -1, block_expert [MB] int32 expert or -1), on device, no sync."""
    S = ids_S.numel()
    n_blocks = S // BM + min(S, n_experts)
    ids_S = ids_S.long()
    order_S = torch.argsort(ids_S, stable=True)
    counts_E = torch.bincount(ids_S, minlength=n_experts)[:n_experts]
    padded_E = (counts_E + BM - 1) // BM * BM
    pad_start_E = torch.cumsum(padded_E, 0) - padded_E
    start_E = torch.cumsum(counts_E, 0) - counts_E
    e_sorted = ids_S[order_S]
    dest = pad_start_E[e_sorted] + torch.arange(S, device=ids_S.device) - start_E[e_sorted]
    rows = torch.full((n_blocks * BM,), -1, dtype=torch.int32, device=ids_S.device)
    rows[dest] = order_S.to(torch.int32)
    blocks_cum_E = torch.cumsum(padded_E // BM, 0)
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


def _launch(x, rows, block_expert, router_w, wa, wb, out, topk, fuse_glu, gather_x, alpha, limit):
    (wa_p, wa_s, wa_2), (wb_p, wb_s, wb_2) = wa, wb
    E, N, KH = wa_p.shape
    n_in = 2 * KH
    bk = min(128, n_in)
    active = min(rows.numel() // BM, E)
    bn = _block_n(N, active, x.device)
    grid = (block_expert.numel(), N // bn)
    _nvfp4_moe_kernel[grid](
        x, x.stride(0), rows, block_expert, router_w,
        wa_p, wa_s, wa_2, wb_p, wb_s, wb_2,
        wa_p.stride(0), wa_p.stride(1), wa_s.stride(0), wa_s.stride(1),
        out, out.stride(0), n_in, alpha, limit,
        TOPK=topk, BM=BM, BN=bn, BK=bk, FUSE_GLU=fuse_glu, GATHER_X=gather_x, HW=use_hw_casts(),
    )  # fmt: skip


def _parts(packed, scales, scale_2):
    return packed, scales.view(torch.uint8), scale_2.reshape(-1).float().contiguous()


def moe_nvfp4_triton(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
    w1: tuple, w3: tuple, w2: tuple, *, swiglu_alpha: float, swiglu_limit: float,
    out_TD: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) for bf16 x_TD [T, D]; each w* = (packed uint8
    [E, out, in/2], scales e4m3 [E, out, in/16], scale_2 fp32 [E]). No host syncs."""
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    E, F = w1[0].shape[0], w1[0].shape[1]
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
    out_TD.copy_(y_SD.view(T, K, D).sum(1))
    return out_TD


def nvfp4_mlp_triton(x_TD: torch.Tensor, w1: tuple, w3: tuple, w2: tuple, *, swiglu_alpha: float,
                     swiglu_limit: float) -> torch.Tensor:  # fmt: skip
    """One NVFP4 swigluoai MLP (the shared expert) on every token: a one-expert bank, weight 1."""
    T = x_TD.shape[0]
    ids = torch.zeros((T, 1), dtype=torch.int32, device=x_TD.device)
    ones = torch.ones((T, 1), dtype=torch.float32, device=x_TD.device)
    one = [tuple(t.unsqueeze(0) if i < 2 else t.reshape(1) for i, t in enumerate(w)) for w in (w1, w3, w2)]
    return moe_nvfp4_triton(x_TD, ids, ones, *one, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)


def nvfp4_linear_triton(x_TK: torch.Tensor, packed_NK2: torch.Tensor, scales_NK16: torch.Tensor,
                        scale_2: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """W4A16 y [T, N] = x @ dequant(W).T (bf16 x, fp32 accumulation, bf16 out): the GEMV pass alone."""
    T = x_TK.shape[0]
    N = packed_NK2.shape[0]
    rows, block_expert = _group_by_expert(torch.zeros(T, dtype=torch.long, device=x_TK.device), 1)
    ones = torch.ones(T, dtype=torch.float32, device=x_TK.device)
    y = torch.empty((T, N), dtype=torch.float32, device=x_TK.device)
    w = _parts(packed_NK2.unsqueeze(0), scales_NK16.unsqueeze(0), scale_2)
    _launch(x_TK, rows, block_expert, ones, w, w, y, 1, False, True, 0.0, 0.0)
    return y.to(x_TK.dtype)


def triton_moe_supported(x_TD: torch.Tensor, w1_packed: torch.Tensor, w2_packed: torch.Tensor) -> bool:
    """bf16 activations and dims the tiles divide: D and F multiples of 16 with the K step
    (min(128, dim)) a power of two dividing them."""
    D, F = 2 * w1_packed.shape[2], w1_packed.shape[1]

    def ok(n: int) -> bool:
        bk = min(128, n)
        return n % 16 == 0 and bk & (bk - 1) == 0 and n % bk == 0

    return (
        x_TD.dtype == torch.bfloat16 and ok(D) and ok(F) and x_TD.stride(-1) == 1 and w2_packed.shape[1] == D
    )

"""Block-sparse MSA attention for full sequences (training): Triton forward/backward and a FlexAttention twin.

Why: the torch path builds dense [query chunk, S] scores and masks (O(S^2) at any sparsity); these
kernels visit only the key tiles some token of a query tile selected. A query tile is BQ tokens x the
G heads of one KV group (GQA heads share a selection, hence every key tile); full tiles skip the mask;
the backward is FlashAttention-2 style, deterministic without atomics (dQ per query tile, dK/dV per
key tile). `model.kernels.msa_train_flex` is the FlexAttention twin; `sparse_attention_train` picks.

Invariants: semantics are `sparse_attention_train_ref`'s (same `seq_ids` sequence, -1 padding never
attends nor is attended, causal in index order, key block among the selected; rows with no allowed
key output 0); fp32 softmax statistics, output in q's dtype; no host sync in tile planning.
Timed on the H200: benchmarks/RESULTS.md, "MSA training kernels v2" (v1: "training kernels on the H200").
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import use_hw_casts

# Legend: B batch, S sequence, H query heads, N KV heads, G = H / N, C head dim, K selected blocks,
# NB key blocks, BQ tokens per query tile, M = BQ * G rows, TK keys per key tile, NQT / NT query / key
# tiles, W list width.
#
# Tiling (`plan_tiles`, torch on device): a key tile is TK consecutive key indices (TK divides
# block_size). Per (query tile, key tile) the plan counts the allowed (token, key) pairs: > 0 means
# visit, == BQ * TK means full (no mask). Lists hold tile * 2 + is_full in tile order (the causal
# diagonal last); the transposed lists (per key tile, the query tiles that see it) drive dK/dV. dQ
# also writes delta = rowsum(dO * O); dK/dV compute scores transposed and recompute P from the saved
# log-sum-exp. Partial tiles build the mask from keep[b, n, t, block] (uint8 [B, N, S, NB + 1], the
# selection as a bitmap), three loads per row (`_allowed`).
LOG2E = 1.4426950408889634
POISON_OUTPUTS = False  # tests set True: outputs and gradients start as NaN (complete writes)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class MSATrainConfig:
    """Tile shape and launch options of the three kernels.

    m_rows: dot rows per query tile (BQ = m_rows // G tokens); tk: keys per key tile (capped at
    block_size); dkv_keys: keys per dK/dV program, a multiple of tk (its lists merge tk-tiles; capped
    at block_size; None = tk); dkv_rows: rows per dK/dV step, each listed query tile walked in
    sub-tiles (None = m_rows). 128 keys x 32 rows at 8 warps is the shape whose [keys, rows] scores
    feed the dK / dV dots from registers (two warp groups split the keys); at 64 keys the two warp
    groups split the rows and P^T, dS^T go through shared memory every step (sm_90 TTGIR).
    skip_full_tiles: tiles whose every pair is allowed skip the mask; gather_mask: the mask gathers
    keep[t, block(j)] per element (v1; slower, see `_allowed`)."""

    m_rows: int = 128
    tk: int = 64
    dkv_keys: int | None = 128
    dkv_rows: int | None = 32
    skip_full_tiles: bool = True
    gather_mask: bool = False
    fwd_warps: int = 8
    fwd_stages: int = 3
    dq_warps: int = 8
    dq_stages: int = 2
    dkv_warps: int = 8
    dkv_stages: int = 2

    def __post_init__(self):
        for name in ("m_rows", "tk", "dkv_rows", "dkv_keys"):
            value = getattr(self, name)
            if value is not None and (not _pow2(value) or value < 16):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if (self.dkv_rows or 0) > self.m_rows or (self.dkv_keys or self.tk) < self.tk:
            raise ValueError(f"need dkv_rows <= m_rows and dkv_keys >= tk, got dkv_rows={self.dkv_rows}, "
                             f"m_rows={self.m_rows}, dkv_keys={self.dkv_keys}, tk={self.tk}")  # fmt: skip
        for name in ("fwd_warps", "dq_warps", "dkv_warps"):
            if getattr(self, name) not in (4, 8):
                raise ValueError(f"{name} must be 4 or 8, got {getattr(self, name)}")
        if min(self.fwd_stages, self.dq_stages, self.dkv_stages) < 1:
            raise ValueError("stages must be >= 1")


# v1: the 2026-11-30 kernels' tiles and mask (timed side by side); v2*: candidates, GPU_CONFIG the
# default on the GPU; the interpreter runs small tiles so CPU tests stay fast.
CONFIGS = {
    "v1": MSATrainConfig(
        m_rows=64, tk=64, dkv_keys=None, dkv_rows=None, skip_full_tiles=False, gather_mask=True, fwd_stages=2
    ),
    "v2-m64": MSATrainConfig(m_rows=64, dkv_keys=None, dkv_rows=None),
    "v2-k64": MSATrainConfig(dkv_keys=None, dkv_rows=64),
    "v2": MSATrainConfig(),
    "v2-tk128": MSATrainConfig(tk=128, fwd_stages=2),
}
GPU_CONFIG = "v2"
INTERPRETER_CONFIG = MSATrainConfig(m_rows=32, tk=16, dkv_keys=32, dkv_rows=16)


# ------------------------------------------------------------------------------------------ device
@triton.jit
def _mm(a, b, F32: tl.constexpr, HW: tl.constexpr):
    """a @ b with fp32 accumulation: bf16 tensor cores on the GPU, exact fp32 for fp32 inputs and in
    the interpreter (whose bf16 dot is wrong)."""
    if F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif HW:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    return out


@triton.jit
def _rows(pid_q, n, S, G: tl.constexpr, BQ: tl.constexpr):
    """Query rows of a tile: token t [M] and head h [M]; row m = token-in-tile * G + head-in-group."""
    offs_m = tl.arange(0, BQ * G)
    t = pid_q * BQ + offs_m // G
    return t, n * G + offs_m % G, t < S


@triton.jit
def _allowed(t, is_q, j0, j, is_k, seq_ptr, kblk_ptr, keep_ptr, keep_row, row_b, NBP,
             KEY_ROWS: tl.constexpr, GATHER: tl.constexpr):  # fmt: skip
    """Mask of a partial tile: same sequence (not padding), causal in index order, key block selected.
    [M, TK] (query rows) or, KEY_ROWS, [TK, M]. Built from 1-D loads: a 2-D gather (GATHER, v1) makes
    Triton lay the whole softmax out a second time in the gather's layout (sm_90 TTGIR: twice the
    exp2, a layout conversion through shared memory per tile, spills). A key of the row's own sequence
    lies in the tile's first block b0, in b0 + 1 (TK <= block_size), or, for a sequence that starts
    inside the tile (positions restart at 0), in block 0: three keep[b, n, t, .] columns per row
    cover every case; keys of other sequences fail the sequence test."""
    seq_q = tl.load(seq_ptr + row_b + t, mask=is_q, other=-1)
    seq_q = tl.where(seq_q >= 0, seq_q, -3)  # padding rows match no key (keys read -2 out of range)
    seq_k = tl.load(seq_ptr + row_b + j, mask=is_k, other=-2)
    blk_k = tl.load(kblk_ptr + row_b + j, mask=is_k, other=0)
    keep_t = keep_ptr + keep_row * NBP
    if GATHER:
        if KEY_ROWS:
            sel = tl.load(keep_t[None, :] + blk_k[:, None], mask=is_k[:, None] & is_q[None, :], other=0) != 0
        else:
            sel = tl.load(keep_t[:, None] + blk_k[None, :], mask=is_q[:, None] & is_k[None, :], other=0) != 0
    else:
        b0 = tl.load(kblk_ptr + row_b + j0)
        sel_b0 = tl.load(keep_t + b0, mask=is_q, other=0) != 0
        sel_b1 = tl.load(keep_t + b0 + 1, mask=is_q, other=0) != 0  # column NB (spare, zero) at most
        sel_z = tl.load(keep_t, mask=is_q, other=0) != 0
        in_b0 = blk_k == b0
        in_z = blk_k == 0
        if KEY_ROWS:
            sel = tl.where(
                in_b0[:, None], sel_b0[None, :], tl.where(in_z[:, None], sel_z[None, :], sel_b1[None, :])
            )
        else:
            sel = tl.where(
                in_b0[None, :], sel_b0[:, None], tl.where(in_z[None, :], sel_z[:, None], sel_b1[:, None])
            )
    if KEY_ROWS:
        ok = sel & (seq_k[:, None] == seq_q[None, :]) & (j[:, None] <= t[None, :])
    else:
        ok = sel & (seq_q[:, None] == seq_k[None, :]) & (j[None, :] <= t[:, None])
    return ok


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_ptr, kblk_ptr, keep_ptr, list_ptr, count_ptr,
    sq_b, sq_s, sk_b, sk_s, S, NBP, NQT, W, qk_scale,
    N: tl.constexpr, G: tl.constexpr, C: tl.constexpr, BQ: tl.constexpr, TK: tl.constexpr,
    FULL_BIT: tl.constexpr, GATHER: tl.constexpr, F32: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """Output and log2-domain LSE of one query tile over its listed key tiles (q, o share strides;
    head stride C: the host passes contiguous tensors)."""
    pid_q = tl.program_id(0)
    bn = tl.program_id(1)
    b64 = (bn // N).to(tl.int64)
    n = bn % N
    t, h, is_q = _rows(pid_q, n, S, G, BQ)
    offs_c = tl.arange(0, C)
    q_off = b64 * sq_b + t.to(tl.int64) * sq_s + h * C
    q = tl.load(q_ptr + q_off[:, None] + offs_c[None, :], mask=is_q[:, None], other=0.0)
    keep_row = bn.to(tl.int64) * S + t
    m_i = tl.full((BQ * G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BQ * G,), tl.float32)
    acc = tl.zeros((BQ * G, C), tl.float32)
    tile = bn.to(tl.int64) * NQT + pid_q
    count = tl.load(count_ptr + tile)
    offs_j = tl.arange(0, TK)
    for i in range(0, count):
        code = tl.load(list_ptr + tile * W + i)
        j0 = (code >> 1) * TK
        j = j0 + offs_j
        is_k = j < S
        kv_off = b64 * sk_b + j.to(tl.int64) * sk_s + n * C
        k = tl.load(k_ptr + kv_off[:, None] + offs_c[None, :], mask=is_k[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off[:, None] + offs_c[None, :], mask=is_k[:, None], other=0.0)
        s = _mm(q, tl.trans(k), F32, HW) * qk_scale  # log2 domain: softmax scale * log2(e) folded in
        if (code & FULL_BIT) == 0:  # a partial tile (FULL_BIT 0: every tile)
            ok = _allowed(
                t, is_q, j0, j, is_k, seq_ptr, kblk_ptr, keep_ptr, keep_row, b64 * S, NBP, False, GATHER
            )
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, F32, HW)
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(o_ptr + q_off[:, None] + offs_c[None, :], out.to(o_ptr.dtype.element_ty), mask=is_q[:, None])
    # lse [B, N, S, G] (a tile's rows are contiguous); +inf for empty rows: every recomputed P is 0.
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))
    tl.store(lse_ptr + bn.to(tl.int64) * S * G + pid_q * BQ * G + tl.arange(0, BQ * G), lse, mask=is_q)


@triton.jit
def _bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, seq_ptr, kblk_ptr, keep_ptr,
    list_ptr, count_ptr, sq_b, sq_s, sk_b, sk_s, S, NBP, NQT, W, qk_scale, sm_scale,
    N: tl.constexpr, G: tl.constexpr, C: tl.constexpr, BQ: tl.constexpr, TK: tl.constexpr,
    FULL_BIT: tl.constexpr, GATHER: tl.constexpr, F32: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile over its key tiles; first writes the tile's delta = rowsum(dO * O) for the
    dK/dV kernel (q, o, dO, dQ share q's strides)."""
    pid_q = tl.program_id(0)
    bn = tl.program_id(1)
    b64 = (bn // N).to(tl.int64)
    n = bn % N
    t, h, is_q = _rows(pid_q, n, S, G, BQ)
    offs_c = tl.arange(0, C)
    q_off = b64 * sq_b + t.to(tl.int64) * sq_s + h * C
    q = tl.load(q_ptr + q_off[:, None] + offs_c[None, :], mask=is_q[:, None], other=0.0)
    do = tl.load(do_ptr + q_off[:, None] + offs_c[None, :], mask=is_q[:, None], other=0.0)
    o = tl.load(o_ptr + q_off[:, None] + offs_c[None, :], mask=is_q[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    stat = bn.to(tl.int64) * S * G + pid_q * BQ * G + tl.arange(0, BQ * G)
    tl.store(delta_ptr + stat, delta, mask=is_q)
    lse = tl.load(lse_ptr + stat, mask=is_q, other=float("inf"))
    keep_row = bn.to(tl.int64) * S + t
    dq = tl.zeros((BQ * G, C), tl.float32)
    tile = bn.to(tl.int64) * NQT + pid_q
    count = tl.load(count_ptr + tile)
    offs_j = tl.arange(0, TK)
    for i in range(0, count):
        code = tl.load(list_ptr + tile * W + i)
        j0 = (code >> 1) * TK
        j = j0 + offs_j
        is_k = j < S
        kv_off = b64 * sk_b + j.to(tl.int64) * sk_s + n * C
        k = tl.load(k_ptr + kv_off[:, None] + offs_c[None, :], mask=is_k[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off[:, None] + offs_c[None, :], mask=is_k[:, None], other=0.0)
        p = tl.exp2(_mm(q, tl.trans(k), F32, HW) * qk_scale - lse[:, None])
        if (code & FULL_BIT) == 0:  # a partial tile (FULL_BIT 0: every tile)
            ok = _allowed(
                t, is_q, j0, j, is_k, seq_ptr, kblk_ptr, keep_ptr, keep_row, b64 * S, NBP, False, GATHER
            )
            p = tl.where(ok, p, 0.0)
        ds = p * (_mm(do, tl.trans(v), F32, HW) - delta[:, None])
        dq += _mm(ds.to(k.dtype), k, F32, HW)
    tl.store(dq_ptr + q_off[:, None] + offs_c[None, :], (dq * sm_scale).to(dq_ptr.dtype.element_ty),
             mask=is_q[:, None])  # fmt: skip


@triton.jit
def _bwd_dkv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, seq_ptr, kblk_ptr, keep_ptr,
    tlist_ptr, tcount_ptr, sq_b, sq_s, sk_b, sk_s, S, NBP, NT, WT, qk_scale, sm_scale,
    N: tl.constexpr, G: tl.constexpr, C: tl.constexpr, BQ: tl.constexpr, TK: tl.constexpr,
    QSUB: tl.constexpr, FULL_BIT: tl.constexpr, GATHER: tl.constexpr, F32: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key tile (TK keys: the plan's dK/dV tile) of one KV group, summed over every query
    tile (and all G heads) that sees it, walked in sub-tiles of QSUB tokens. Scores are computed
    transposed ([TK, rows] = K Q^T) so P^T and dS^T feed the dK / dV dots from registers."""
    pid_k = tl.program_id(0)
    bn = tl.program_id(1)
    b64 = (bn // N).to(tl.int64)
    n = bn % N
    offs_c = tl.arange(0, C)
    j0 = pid_k * TK
    j = j0 + tl.arange(0, TK)
    is_k = j < S
    kv_off = b64 * sk_b + j.to(tl.int64) * sk_s + n * C
    k = tl.load(k_ptr + kv_off[:, None] + offs_c[None, :], mask=is_k[:, None], other=0.0)
    v = tl.load(v_ptr + kv_off[:, None] + offs_c[None, :], mask=is_k[:, None], other=0.0)
    dk = tl.zeros((TK, C), tl.float32)
    dv = tl.zeros((TK, C), tl.float32)
    tile = bn.to(tl.int64) * NT + pid_k
    count = tl.load(tcount_ptr + tile)
    NSUB: tl.constexpr = BQ // QSUB
    for it in range(0, count * NSUB):  # one flat loop over (listed tile, sub-tile): pipelines as one
        code = tl.load(tlist_ptr + tile * WT + it // NSUB)
        pid_s = (code >> 1) * NSUB + it % NSUB
        t, h, is_q = _rows(pid_s, n, S, G, QSUB)
        q_off = b64 * sq_b + t.to(tl.int64) * sq_s + h * C
        q = tl.load(q_ptr + q_off[:, None] + offs_c[None, :], mask=is_q[:, None], other=0.0)
        do = tl.load(do_ptr + q_off[:, None] + offs_c[None, :], mask=is_q[:, None], other=0.0)
        stat = bn.to(tl.int64) * S * G + pid_s * QSUB * G + tl.arange(0, QSUB * G)
        lse = tl.load(lse_ptr + stat, mask=is_q, other=float("inf"))
        delta = tl.load(delta_ptr + stat, mask=is_q, other=0.0)
        p_t = tl.exp2(_mm(k, tl.trans(q), F32, HW) * qk_scale - lse[None, :])  # [TK, rows]
        if (code & FULL_BIT) == 0:  # a partial tile (FULL_BIT 0: every tile)
            keep_row = bn.to(tl.int64) * S + t
            ok = _allowed(
                t, is_q, j0, j, is_k, seq_ptr, kblk_ptr, keep_ptr, keep_row, b64 * S, NBP, True, GATHER
            )
            p_t = tl.where(ok, p_t, 0.0)
        dv += _mm(p_t.to(do.dtype), do, F32, HW)
        ds_t = p_t * (_mm(v, tl.trans(do), F32, HW) - delta[None, :])
        dk += _mm(ds_t.to(q.dtype), q, F32, HW)
    tl.store(dk_ptr + kv_off[:, None] + offs_c[None, :], (dk * sm_scale).to(dk_ptr.dtype.element_ty),
             mask=is_k[:, None])  # fmt: skip
    tl.store(dv_ptr + kv_off[:, None] + offs_c[None, :], dv.to(dv_ptr.dtype.element_ty), mask=is_k[:, None])


# -------------------------------------------------------------------------------------------- host
@torch.no_grad()
def tile_pairs(
    selected_BNSK: torch.Tensor, seq_ids_BS: torch.Tensor, positions_BS: torch.Tensor, *,
    block_size: int, bq: int, tk: int,
) -> torch.Tensor:  # fmt: skip
    """int32 [B, N, NQT, NT]: allowed (token, key) pairs per (query tile of bq tokens, key tile of tk
    keys); > 0 means visit, == bq * tk means every pair is allowed (a full tile)."""
    B, N, S, _ = selected_BNSK.shape
    dev = selected_BNSK.device
    NQT, NT = triton.cdiv(S, bq), triton.cdiv(S, tk)
    sel = selected_BNSK.long()
    t_S = torch.arange(S, device=dev)
    start_BS = t_S - positions_BS  # a packed sequence's first index (positions restart at 0)
    # Key index range [lo, hi] of each selected block of each token, clipped causally at the token
    # (inside the token's own sequence, so the sequence test needs no extra term).
    lo = start_BS[:, None, :, None] + block_size * sel
    hi = torch.minimum(lo + block_size - 1, t_S[None, None, :, None].expand_as(lo))
    ok = (sel >= 0) & (seq_ids_BS >= 0)[:, None, :, None] & (lo <= hi)
    n_off = block_size // tk + 1  # tiles one block can touch when it is not tile-aligned
    tiles = lo.clamp(min=0)[..., None] // tk + torch.arange(n_off, device=dev)
    pairs = torch.minimum(hi[..., None], tiles * tk + tk - 1) - torch.maximum(lo[..., None], tiles * tk) + 1
    pairs = torch.where(ok[..., None] & (pairs > 0), pairs, 0).to(torch.int32)
    tiles = torch.where(pairs > 0, tiles, NT)
    qt = (t_S // bq)[None, None, :, None, None]
    bn = torch.arange(B * N, device=dev).view(B, N, 1, 1, 1)
    flat = ((bn * NQT + qt) * (NT + 1) + tiles).reshape(-1)
    out = torch.zeros(B * N * NQT * (NT + 1), dtype=torch.int32, device=dev)
    out.scatter_add_(0, flat, pairs.reshape(-1))
    return out.view(B, N, NQT, NT + 1)[..., :NT]


def compact_lists(is_on: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values where is_on, packed to the front of the last dim in order (rest 0), and the counts;
    a cumsum + scatter, not a sort, and no host sync."""
    L = is_on.shape[-1]
    slot = torch.where(is_on, is_on.to(torch.int32).cumsum(-1, dtype=torch.int32) - 1, L).long()
    out = torch.zeros((*is_on.shape[:-1], L + 1), dtype=torch.int32, device=is_on.device)
    out.scatter_(-1, slot, values.to(torch.int32).expand_as(slot))  # extra slots land in column L
    return out[..., :L].contiguous(), is_on.sum(-1, dtype=torch.int32).contiguous()


@torch.no_grad()
def plan_tiles(
    selected_BNSK: torch.Tensor, seq_ids_BS: torch.Tensor, positions_BS: torch.Tensor, *,
    block_size: int, num_blocks: int, bq: int, tk: int, tkd: int | None = None,
) -> dict:  # fmt: skip
    """Selection -> the kernels' plan (module notes): keep bitmap, key blocks, per-query-tile key
    tile lists (tk keys) and per-key-tile query tile lists for dK/dV (tkd keys, a multiple of tk: its
    counts are sums of tk-tiles'), as tile * 2 + is_full, in order, with counts."""
    B, N, S, _ = selected_BNSK.shape
    NB = num_blocks
    pairs = tile_pairs(selected_BNSK, seq_ids_BS, positions_BS, block_size=block_size, bq=bq, tk=tk)
    NQT, NT = pairs.shape[-2:]
    visit, full = pairs > 0, (pairs == bq * tk).to(torch.int32)
    dev = pairs.device
    lists, counts = compact_lists(visit, torch.arange(NT, device=dev, dtype=torch.int32) * 2 + full)
    tkd = tkd or tk
    if tkd % tk:
        raise ValueError(f"the dK/dV key tile {tkd} must be a multiple of the key tile {tk}")
    r, NTD = tkd // tk, triton.cdiv(S, tkd)
    pairs_d = torch.nn.functional.pad(pairs, (0, NTD * r - NT)).view(B, N, NQT, NTD, r).sum(-1)
    qcode = torch.arange(NQT, device=dev, dtype=torch.int32)[:, None] * 2 + (pairs_d == bq * tkd).int()
    tlists, tcounts = compact_lists((pairs_d > 0).transpose(2, 3), qcode.transpose(2, 3))
    sel = selected_BNSK.long()
    keep = torch.zeros((B, N, S, NB + 1), dtype=torch.uint8, device=dev)
    keep.scatter_(-1, sel.masked_fill(sel < 0, NB), 1)
    keep[..., NB] = 0  # the spare column that absorbed the -1 slots
    kblk = torch.where(seq_ids_BS >= 0, positions_BS // block_size, 0).clamp(max=NB - 1).to(torch.int32)
    return {
        "keep": keep, "kblk": kblk.contiguous(), "seq": seq_ids_BS.to(torch.int32).contiguous(),
        "lists": lists, "counts": counts, "tlists": tlists, "tcounts": tcounts,
        "n_full": full.sum(), "bq": bq, "tk": tk, "tkd": tkd, "nqt": NQT, "nt": NT, "ntd": NTD,
    }  # fmt: skip


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan")) if POISON_OUTPUTS else torch.empty_like(t)


def _meta(q, k, plan, cfg: MSATrainConfig, which: str) -> dict:
    H, C, N = q.shape[2], q.shape[3], k.shape[2]
    G = H // N
    meta = dict(
        N=N, G=G, C=C, BQ=plan["bq"], TK=plan["tkd" if which == "dkv" else "tk"],
        FULL_BIT=int(cfg.skip_full_tiles), GATHER=cfg.gather_mask, F32=q.dtype == torch.float32,
        HW=use_hw_casts(),
        num_warps=getattr(cfg, f"{which}_warps"), num_stages=getattr(cfg, f"{which}_stages"),
    )  # fmt: skip
    if which == "dkv":
        meta["QSUB"] = min(plan["bq"], max(1, (cfg.dkv_rows or cfg.m_rows) // G))
    return meta


def msa_fwd(q, k, v, plan, softmax_scale, cfg: MSATrainConfig):
    """Forward launch on contiguous q [B, S, H, C], k / v [B, S, N, C] -> (out, lse [B, N, S, G])."""
    B, S, H, _ = q.shape
    N = k.shape[2]
    out = _empty_like(q)
    lse = _empty_like(torch.empty((B, N, S, H // N), dtype=torch.float32, device=q.device))
    _fwd_kernel[(plan["nqt"], B * N)](
        q, k, v, out, lse, plan["seq"], plan["kblk"], plan["keep"], plan["lists"], plan["counts"],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), S, plan["keep"].shape[-1], plan["nqt"],
        plan["lists"].shape[-1], softmax_scale * LOG2E, **_meta(q, k, plan, cfg, "fwd"),
    )  # fmt: skip
    return out, lse


def msa_bwd_dq(q, k, v, out, do, lse, plan, softmax_scale, cfg: MSATrainConfig):
    """dQ launch -> (dq, delta [B, N, S, G]); delta feeds `msa_bwd_dkv`."""
    S = q.shape[1]
    dq, delta = _empty_like(q), _empty_like(lse)
    _bwd_dq_kernel[(plan["nqt"], k.shape[0] * k.shape[2])](
        q, k, v, out, do, dq, lse, delta, plan["seq"], plan["kblk"], plan["keep"], plan["lists"],
        plan["counts"], q.stride(0), q.stride(1), k.stride(0), k.stride(1), S, plan["keep"].shape[-1],
        plan["nqt"], plan["lists"].shape[-1], softmax_scale * LOG2E, softmax_scale,
        **_meta(q, k, plan, cfg, "dq"),
    )  # fmt: skip
    return dq, delta


def msa_bwd_dkv(q, k, v, do, lse, delta, plan, softmax_scale, cfg: MSATrainConfig):
    """dK / dV launch -> (dk, dv)."""
    S = q.shape[1]
    dk, dv = _empty_like(k), _empty_like(v)
    meta = _meta(q, k, plan, cfg, "dkv")
    _bwd_dkv_kernel[(plan["ntd"], k.shape[0] * k.shape[2])](
        q, k, v, do, dk, dv, lse, delta, plan["seq"], plan["kblk"], plan["keep"], plan["tlists"],
        plan["tcounts"], q.stride(0), q.stride(1), k.stride(0), k.stride(1), S, plan["keep"].shape[-1],
        plan["ntd"], plan["tlists"].shape[-1], softmax_scale * LOG2E, softmax_scale, **meta,
    )  # fmt: skip
    return dk, dv


class _MSATrain(torch.autograd.Function):
    """out = block-sparse attention(q, k, v) under `plan`; gradients to q, k, v (none to the plan)."""

    @staticmethod
    def forward(ctx, q_BSHC, k_BSNC, v_BSNC, plan, softmax_scale, cfg):
        q, k, v = q_BSHC.contiguous(), k_BSNC.contiguous(), v_BSNC.contiguous()
        out, lse = msa_fwd(q, k, v, plan, softmax_scale, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.softmax_scale, ctx.cfg = plan, softmax_scale, cfg
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        do = grad_out.to(q.dtype).contiguous()
        dq, delta = msa_bwd_dq(q, k, v, out, do, lse, ctx.plan, ctx.softmax_scale, ctx.cfg)
        dk, dv = msa_bwd_dkv(q, k, v, do, lse, delta, ctx.plan, ctx.softmax_scale, ctx.cfg)
        return dq, dk, dv, None, None, None


def tile_sizes(cfg: MSATrainConfig, G: int, block_size: int) -> dict:
    """The plan's tile sizes for `cfg`: bq tokens, tk keys, tkd dK/dV keys (both <= block_size, which
    `_allowed` relies on)."""
    tk = min(block_size, cfg.tk)
    return dict(bq=max(1, cfg.m_rows // G), tk=tk, tkd=max(tk, min(block_size, cfg.dkv_keys or tk)))


def resolve_config(config: MSATrainConfig | str | None) -> MSATrainConfig:
    """A config, or a `CONFIGS` name; None = the environment's MSA_TRAIN_CONFIG (a name) if set, else
    GPU_CONFIG on the GPU and small tiles in the interpreter."""
    if config is None:
        config = os.environ.get("MSA_TRAIN_CONFIG") or (GPU_CONFIG if use_hw_casts() else INTERPRETER_CONFIG)
    if isinstance(config, str):
        if config not in CONFIGS:
            raise ValueError(f"unknown MSA train config {config!r}; known: {sorted(CONFIGS)}")
        return CONFIGS[config]
    return config


def msa_train_triton(
    q_BSHC: torch.Tensor, k_BSNC: torch.Tensor, v_BSNC: torch.Tensor, selected_BNSK: torch.Tensor,
    seq_ids_BS: torch.Tensor, positions_BS: torch.Tensor, *, block_size: int, num_blocks: int,
    softmax_scale: float, config: MSATrainConfig | str | None = None,
) -> torch.Tensor:  # fmt: skip
    """Block-sparse MSA attention [B, S, H, C] (Triton forward and backward); see the module docstring.
    `config`: tile shape / launch options (`MSATrainConfig` or a `CONFIGS` name; None = default)."""
    cfg = resolve_config(config)
    G = q_BSHC.shape[2] // k_BSNC.shape[2]
    plan = plan_tiles(selected_BNSK, seq_ids_BS, positions_BS, block_size=block_size, num_blocks=num_blocks,
                      **tile_sizes(cfg, G, block_size))  # fmt: skip
    return _MSATrain.apply(q_BSHC, k_BSNC, v_BSNC, plan, softmax_scale, cfg)


def triton_msa_train_supported(q_BSHC: torch.Tensor, k_BSNC: torch.Tensor, block_size: int) -> bool:
    """Power-of-two head dim >= 16 and block size >= 16, GQA group a power of two, float q/k/v."""
    C, H, N = q_BSHC.shape[-1], q_BSHC.shape[2], k_BSNC.shape[2]
    dtypes = (torch.bfloat16, torch.float16) if use_hw_casts() else (torch.bfloat16, torch.float32)
    return (
        q_BSHC.dtype in dtypes
        and k_BSNC.dtype == q_BSHC.dtype
        and _pow2(C) and C >= 16
        and _pow2(block_size) and block_size >= 16
        and H % N == 0 and _pow2(H // N) and H // N <= 64
    )  # fmt: skip

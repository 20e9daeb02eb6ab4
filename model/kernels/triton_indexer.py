"""Triton lightning-indexer decode: paged block-max QK scores, then top-k block selection.

Why: the indexer reads every cached index key at every decode step, so it is bound by HBM bytes
(NVFP4 keys are 72 B/token against FP8's 128 B). Keys are read once per query row (all index heads
together), dequantized in registers, and only per-block maxima leave the chip; the context is split
over programs so that batch 1 still fills the GPU. On CUDA, NVFP4 keys of head dim 128 in packed rows
take the CUDA kernel of `model.kernels.cuda_indexer` (v7, the default: 2.18x the FP8 keys at B = 64,
128K; the Triton keys-on-M v6 it replaced was 1.19x); every other format and shape, and NVFP4 keys
on the interpreter, run the tile kernel here (NVFP4 decoded byte-wise, "v2"), the selection always
the top-k kernel here. History: benchmarks/RESULTS.md.

Invariants: semantics are `model.kernels.indexer`'s (docs/FACTS.md, "MSA and the lightning
indexer"); scores equal the reference's up to fp32 summation order, selections equal it except at
exact near-ties.
"""

from typing import Literal

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import (
    dot_bf16,
    f32_to_bf16,
    load_nvfp4_tile,
    num_sms,
    opaque_to_compile,
    safe_do_bench,
    use_hw_casts,
)

FMT_FLOAT, FMT_FP8, FMT_NVFP4 = 0, 1, 2
_FMT = {"fp32": FMT_FLOAT, "bf16": FMT_FLOAT, "fp8": FMT_FP8, "nvfp4": FMT_NVFP4, "nvfp4_4over6": FMT_NVFP4}
PROGRAMS_PER_SM = 4
DecodeVariant = Literal["v7", "v2"]
"""v7: the CUDA kernel of `model.kernels.cuda_indexer` where `cuda_indexer.v7_applies` (NVFP4 keys of
head dim 128 on CUDA; the default), else the tile kernel, autotuned at decode size; v2: the tile
kernel untuned, NVFP4 keys byte-wise (tests and benchmarks compare with it)."""


@triton.jit
def load_key_tile(row_ptrs, is_row, C: tl.constexpr, ROWS: tl.constexpr, FMT: tl.constexpr):
    """Stored key rows -> fp32 [ROWS, C] without the global scale (exact in bf16 unless fp32 cache)."""
    if FMT == 2:
        vals = load_nvfp4_tile(row_ptrs, is_row, C, ROWS)
    else:
        offs_c = tl.arange(0, C)
        raw = tl.load(row_ptrs[:, None] + offs_c[None, :], mask=is_row[:, None], other=0)
        if FMT == 1:
            vals = raw.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            vals = raw.to(tl.float32)
    return vals


# Legend: T query rows, N index heads, C index head dim, B sequences, P block-table width (max
# blocks), K top-k blocks, BPS blocks per split.
#
# `_index_scores_kernel`, grid (T, SPLITS): query row t (all N heads, so each key is read once per
# row) walks its blocks [split * BPS, ...) up to its own block pos // page; per page an [N, C] x
# [C, page] dot, keys after pos masked, max over the page -> scores [T, N, P] fp32. SPLITS makes
# T * SPLITS cover ~4 waves of SMs. `_index_topk_kernel`, grid (T, N): forced blocks first (local
# ones nearest first, then init blocks), then `topk - forced` rounds of argmax (ties to the lower
# block id), -1 padding.
#
# Numerics: NVFP4 keys become e2m1 * block_scale (exact in bf16 and fp16) and the global scale
# multiplies the score after the block max (it is positive); FP8 keys their e4m3 value times the
# scale; bf16 keys as stored. bf16 queries use a bf16 dot with fp32 accumulation; fp32 / fp16 queries
# or an fp32 cache use an IEEE fp32 dot.
@triton.jit
def _index_scores_kernel(
    q_ptr, stride_qt, stride_qn,
    pages_ptr, stride_pp, stride_ps,
    bt_ptr, stride_bb, seq_ptr, pos_ptr, scale_ptr,
    out_ptr, stride_ot, stride_on,
    BPS, tune_class,
    N: tl.constexpr, N_P2: tl.constexpr, C: tl.constexpr, PAGE: tl.constexpr,
    FMT: tl.constexpr, DOT_F32: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    blk0 = tl.program_id(1) * BPS
    seq = tl.load(seq_ptr + pid_t).to(tl.int64)
    pos = tl.load(pos_ptr + pid_t).to(tl.int64)
    n_iter = tl.minimum(BPS, pos // PAGE + 1 - blk0)  # blocks past the query's own are not candidates

    offs_n = tl.arange(0, N_P2)
    offs_c = tl.arange(0, C)
    offs_s = tl.arange(0, PAGE)
    is_head = offs_n < N
    q_nc = tl.load(q_ptr + pid_t * stride_qt + offs_n[:, None] * stride_qn + offs_c[None, :],
                   mask=is_head[:, None], other=0.0)  # fmt: skip
    g = 1.0
    if FMT != 0:
        g = tl.load(scale_ptr).to(tl.float32)
    g_n = tl.full((N_P2,), 1.0, tl.float32) * g
    if DOT_F32:
        q_nc = q_nc.to(tl.float32)
    else:
        q_nc = q_nc.to(tl.bfloat16)
    for i in range(0, n_iter):
        blk = blk0 + i
        page = tl.load(bt_ptr + seq * stride_bb + blk).to(tl.int64)
        tok_s = blk * PAGE + offs_s
        is_vis = tok_s <= pos
        keys_sc = load_key_tile(pages_ptr + page * stride_pp + offs_s * stride_ps, is_vis, C, PAGE, FMT)
        if DOT_F32:
            scores_ns = tl.dot(q_nc, tl.trans(keys_sc), input_precision="ieee")
        else:
            scores_ns = dot_bf16(q_nc, tl.trans(f32_to_bf16(keys_sc, HW)), HW)
        # The scale (> 0) is applied after the max: the same value, one multiply per head per block.
        best_n = tl.max(tl.where(is_vis[None, :], scores_ns, float("-inf")), axis=1) * g_n
        tl.store(out_ptr + pid_t * stride_ot + offs_n * stride_on + blk, best_n, mask=is_head)


@triton.jit
def _index_topk_kernel(
    scores_ptr, stride_st, stride_sn, pos_ptr, out_ptr, stride_ot, stride_on,
    PAGE: tl.constexpr, NB_P2: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr,
    LOCAL: tl.constexpr, INIT: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    qb = tl.load(pos_ptr + pid_t).to(tl.int32) // PAGE
    offs_b = tl.arange(0, NB_P2)
    is_cand = offs_b <= qb
    n_local = tl.minimum(LOCAL, qb + 1)
    n_init = tl.maximum(0, tl.minimum(INIT, qb - LOCAL + 1))  # init blocks not already local
    is_forced = ((qb - offs_b) < LOCAL) | (offs_b < n_init)
    score_b = tl.load(scores_ptr + pid_t * stride_st + pid_n * stride_sn + offs_b, mask=is_cand,
                      other=float("-inf"))  # fmt: skip
    # Available candidates keep finite keys (a -inf score becomes the lowest float) so that
    # argmax never prefers a forced / non-candidate block, whose key is -inf.
    key_b = tl.where(is_cand & ~is_forced, tl.maximum(score_b, -3.4028234663852886e38), float("-inf"))

    offs_k = tl.arange(0, K_P2)
    n_forced = n_local + n_init
    sel_k = tl.where(offs_k < n_local, qb - offs_k, tl.where(offs_k < n_forced, offs_k - n_local, -1))
    n_pick = tl.minimum(K - n_forced, qb + 1 - n_forced)
    for i in range(0, n_pick):
        best = tl.argmax(key_b, axis=0, tie_break_left=True)
        sel_k = tl.where(offs_k == n_forced + i, best, sel_k)
        key_b = tl.where(offs_b == best, float("-inf"), key_b)
    tl.store(out_ptr + pid_t * stride_ot + pid_n * stride_on + offs_k, sel_k.to(tl.int64), mask=offs_k < K)


# Keyed by format, page shape and `tune_class` (log2 of the pages a launch walks, an argument the
# kernel ignores), not by BPS: a decode engine retunes when its work doubles, not at every new width.
_index_scores_tuned = triton.autotune(
    [triton.Config({}, num_warps=w, num_stages=st) for w, st in [(4, 3), (4, 1), (8, 3)]],
    key=["tune_class", "N", "C", "PAGE", "FMT", "DOT_F32"],
    do_bench=safe_do_bench,
)(_index_scores_kernel)


def plan_splits(n_rows: int, n_blocks: int, device: torch.device, per_sm: int = PROGRAMS_PER_SM,
                min_bps: int = 1) -> tuple[int, int]:  # fmt: skip
    """(splits, blocks per split): enough programs for `per_sm` waves even at n_rows = 1, each split
    at least `min_bps` blocks."""
    target = per_sm * num_sms(device)
    splits = max(1, min(-(-n_blocks // min_bps), -(-target // max(1, n_rows))))
    bps = -(-n_blocks // splits)
    return -(-n_blocks // bps), bps


@opaque_to_compile
def index_block_scores_triton(
    index_q_TNC: torch.Tensor, pages: torch.Tensor, dtype: str, scale: torch.Tensor,
    block_tables_BP: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor,
    variant: DecodeVariant = "v7",
) -> torch.Tensor:  # fmt: skip
    """Block scores [T, N, P] fp32 (entries of blocks past a row's own block are left unwritten), by
    the kernel `variant` names (`DecodeVariant`)."""
    if variant not in DecodeVariant.__args__:
        raise ValueError(f"indexer: variant must be one of {DecodeVariant.__args__}, got {variant!r}")
    T, N, C = index_q_TNC.shape
    P = block_tables_BP.shape[1]
    page = pages.shape[1]
    scores_TNP = torch.empty((T, N, P), dtype=torch.float32, device=index_q_TNC.device)
    if T == 0:
        return scores_TNP
    if variant == "v7" and index_q_TNC.is_cuda:
        from model.kernels.cuda_indexer import index_block_scores_cuda, v7_applies

        if v7_applies(index_q_TNC, pages, dtype):
            return index_block_scores_cuda(
                index_q_TNC, pages, scale, block_tables_BP, seq_idx_T, positions_T, out_TNP=scores_TNP
            )
    splits, bps = plan_splits(T, P, index_q_TNC.device)
    dot_f32 = index_q_TNC.dtype != torch.bfloat16 or dtype == "fp32"
    # Launches big enough to matter pick warps / pipeline depth by timing on first use; v2 keeps its
    # single default configuration (4 warps, 3 stages) so that `variant="v2"` times v2 as it was.
    is_tuned = variant != "v2" and use_hw_casts() and T * splits >= 256
    kernel = _index_scores_tuned if is_tuned else _index_scores_kernel
    kernel[(T, splits)](
        index_q_TNC, index_q_TNC.stride(0), index_q_TNC.stride(1),
        pages, pages.stride(0), pages.stride(1),
        block_tables_BP, block_tables_BP.stride(0), seq_idx_T, positions_T, scale,
        scores_TNP, scores_TNP.stride(0), scores_TNP.stride(1), bps, (T * P).bit_length(),
        N=N, N_P2=max(16, triton.next_power_of_2(N)), C=C, PAGE=page,
        FMT=_FMT[dtype], DOT_F32=dot_f32, HW=use_hw_casts(),
    )  # fmt: skip
    return scores_TNP


@opaque_to_compile
def index_select_blocks_triton(
    index_q_TNC: torch.Tensor, pages: torch.Tensor, dtype: str, scale: torch.Tensor,
    block_tables_BP: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor,
    *, topk: int, local_blocks: int, init_blocks: int, out_TNK: torch.Tensor | None = None,
    variant: DecodeVariant = "v7",
) -> torch.Tensor:  # fmt: skip
    """Selected blocks [T, N, topk] int64 (into `out_TNK` if given); no host syncs."""
    T, N, _ = index_q_TNC.shape
    scores_TNP = index_block_scores_triton(
        index_q_TNC, pages, dtype, scale, block_tables_BP, seq_idx_T, positions_T, variant
    )
    if out_TNK is None:
        out_TNK = torch.empty((T, N, topk), dtype=torch.long, device=index_q_TNC.device)
    if T == 0:
        return out_TNK
    _index_topk_kernel[(T, N)](
        scores_TNP, scores_TNP.stride(0), scores_TNP.stride(1), positions_T,
        out_TNK, out_TNK.stride(0), out_TNK.stride(1),
        PAGE=pages.shape[1], NB_P2=triton.next_power_of_2(block_tables_BP.shape[1]),
        K=topk, K_P2=triton.next_power_of_2(topk), LOCAL=local_blocks, INIT=init_blocks,
    )  # fmt: skip
    return out_TNK


def triton_index_supported(index_q_TNC: torch.Tensor, pages: torch.Tensor, dtype: str) -> bool:
    """Shapes the kernels handle: power-of-two head dim >= 16 (C/16 a power of two for NVFP4) and
    page >= 16 (tl.dot minimum), contiguous rows."""
    C, page = index_q_TNC.shape[-1], pages.shape[1]
    is_pow2 = C >= 16 and C & (C - 1) == 0 and page >= 16 and page & (page - 1) == 0
    return is_pow2 and index_q_TNC.stride(-1) == 1 and pages.is_contiguous() and dtype in _FMT

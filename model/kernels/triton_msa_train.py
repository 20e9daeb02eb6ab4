"""Block-sparse MSA attention for full sequences (training): Triton forward/backward and a FlexAttention twin.

Why: the learner's sparse layers attend, per (token, KV group), to at most top-k key blocks of
`block_size` tokens (FACTS 2, MSA), but the torch path builds dense [query chunk, S] score and mask
tensors: O(S^2) work and memory at any sparsity. These kernels only visit the key tiles some token
of a query tile selected, so work grows with S * top-k * block_size instead of S^2.

Semantics (as `model.kernels.sparse_attention.sparse_attention_train_ref`, the spec): query t of
row b, head h (KV group n = h // G) may attend key j iff both belong to the same sequence
(`seq_ids`, -1 = padding, never attended nor attending), j <= t (index order: a packed sequence is
contiguous and its positions restart at 0), and key j's block positions[j] // block_size is one of
the blocks selected for (b, n, t) (`selected_BNSK`, -1 padded; computed by the indexer without
gradient). Rows with no allowed key output 0. fp32 softmax statistics, output in q's dtype.

Tiling (built by `plan_tiles` in torch on device, no host sync): a query tile is BQ consecutive
tokens x the G heads of one KV group (M = BQ * G dot rows: GQA heads share the token's selection, so
they share every key tile); a key tile is TK consecutive key indices (TK divides block_size). For each
(b, n, query tile) the sorted list of key tiles holding a key some token of the tile may see; the
transposed lists (for each key tile, the query tiles that see it) drive the dK/dV kernel, so the
backward is two deterministic kernels without atomics (FlashAttention-2 style: dQ per query tile,
dK/dV per key tile, P recomputed from the saved log-sum-exp). The per-element mask inside a tile reads
keep[b, n, t, block(j)] (uint8 [B, N, S, NB + 1]: the selection as a dense bitmap).

`msa_train_flex` runs the same mask through torch's FlexAttention with a BlockMask built from the
same tile lists (Q blocks of `flex_block` tokens x all H heads); the benchmark decides which is faster.

Legend: B batch, S sequence, H query heads, N KV heads, G = H / N, C head dim, K selected blocks,
NB key blocks, BQ tokens per query tile, M = BQ * G rows, TK keys per key tile, NQT / NT query / key
tiles, W list width.
"""

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import use_hw_casts

LOG2E = 1.4426950408889634
M_ROWS = 64  # dot rows per query tile on the GPU (BQ = M_ROWS // G tokens)
# 8 warps: at M = TK = 64, C = 128 ptxas (sm_90) reports 255 registers with 0.8-2.6 KB of spills per
# thread at 4 warps; 8 warps remove them in the forward and cut them to ~0.3-0.45 KB in the backward.
_LAUNCH = {"num_warps": 8, "num_stages": 2}
POISON_OUTPUTS = False  # tests set True: outputs and gradients start as NaN (complete writes)


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
def _rows(pid_q, bn, N: tl.constexpr, S, G: tl.constexpr, BQ: tl.constexpr):
    """Query rows of a tile: (batch, group, token t [M], head h [M]); m = token-in-tile * G + head."""
    b = bn // N
    n = bn % N
    offs_m = tl.arange(0, BQ * G)
    t = pid_q * BQ + offs_m // G
    h = n * G + offs_m % G
    return b, n, t, h, t < S


@triton.jit
def _allowed(t, seq_q, is_q, j, seq_k, blk_k, keep_ptr, keep_row, S, NBP):
    """[M, TK] mask: same sequence (not padding), causal in index order, key block selected."""
    is_k = j < S
    sel = tl.load(
        keep_ptr + keep_row[:, None] * NBP + blk_k[None, :], mask=is_q[:, None] & is_k[None, :], other=0
    )
    return (
        (sel != 0) & (seq_q[:, None] == seq_k[None, :]) & (seq_q[:, None] >= 0) & (j[None, :] <= t[:, None])
    )


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_ptr, kblk_ptr, keep_ptr, list_ptr, count_ptr,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_n, so_b, so_s, so_h,
    S, NBP, NQT, W, qk_scale,
    N: tl.constexpr, G: tl.constexpr, C: tl.constexpr, BQ: tl.constexpr, TK: tl.constexpr,
    F32: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    pid_q = tl.program_id(0)
    bn = tl.program_id(1)
    b, n, t, h, is_q = _rows(pid_q, bn, N, S, G, BQ)
    b64 = b.to(tl.int64)
    offs_c = tl.arange(0, C)
    q_rows = q_ptr + b64 * sq_b + t.to(tl.int64) * sq_s + h * sq_h
    q = tl.load(q_rows[:, None] + offs_c[None, :], mask=is_q[:, None], other=0.0)
    seq_q = tl.load(seq_ptr + b64 * S + t, mask=is_q, other=-1)
    keep_row = bn.to(tl.int64) * S + t
    m_i = tl.full((BQ * G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BQ * G,), tl.float32)
    acc = tl.zeros((BQ * G, C), tl.float32)
    tile = bn.to(tl.int64) * NQT + pid_q
    count = tl.load(count_ptr + tile)
    offs_j = tl.arange(0, TK)
    for i in range(0, count):
        kt = tl.load(list_ptr + tile * W + i)
        j = kt * TK + offs_j
        is_k = j < S
        kv_off = b64 * sk_b + j.to(tl.int64) * sk_s + n * sk_n
        k = tl.load(k_ptr + kv_off[:, None] + offs_c[None, :], mask=is_k[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off[:, None] + offs_c[None, :], mask=is_k[:, None], other=0.0)
        seq_k = tl.load(seq_ptr + b64 * S + j, mask=is_k, other=-2)
        blk_k = tl.load(kblk_ptr + b64 * S + j, mask=is_k, other=0)
        ok = _allowed(t, seq_q, is_q, j, seq_k, blk_k, keep_ptr, keep_row, S, NBP)
        s = _mm(q, tl.trans(k), F32, HW) * qk_scale  # log2 domain: softmax scale * log2(e) folded in
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _mm(p, v, F32, HW)
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    o_rows = o_ptr + b64 * so_b + t.to(tl.int64) * so_s + h * so_h
    tl.store(o_rows[:, None] + offs_c[None, :], out.to(o_ptr.dtype.element_ty), mask=is_q[:, None])
    # lse in the log2 domain; +inf for empty rows makes every recomputed probability 0 in backward.
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))
    tl.store(lse_ptr + (bn.to(tl.int64) * G + h % G) * S + t, lse, mask=is_q)


@triton.jit
def _bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, seq_ptr, kblk_ptr, keep_ptr, list_ptr, count_ptr,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_n,
    S, NBP, NQT, W, qk_scale, sm_scale,
    N: tl.constexpr, G: tl.constexpr, C: tl.constexpr, BQ: tl.constexpr, TK: tl.constexpr,
    F32: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile over its key tiles (q, dO, dQ share q's strides)."""
    pid_q = tl.program_id(0)
    bn = tl.program_id(1)
    b, n, t, h, is_q = _rows(pid_q, bn, N, S, G, BQ)
    b64 = b.to(tl.int64)
    offs_c = tl.arange(0, C)
    q_off = b64 * sq_b + t.to(tl.int64) * sq_s + h * sq_h
    q = tl.load(q_ptr + q_off[:, None] + offs_c[None, :], mask=is_q[:, None], other=0.0)
    do = tl.load(do_ptr + q_off[:, None] + offs_c[None, :], mask=is_q[:, None], other=0.0)
    stat = (bn.to(tl.int64) * G + h % G) * S + t
    lse = tl.load(lse_ptr + stat, mask=is_q, other=float("inf"))
    delta = tl.load(delta_ptr + stat, mask=is_q, other=0.0)
    seq_q = tl.load(seq_ptr + b64 * S + t, mask=is_q, other=-1)
    keep_row = bn.to(tl.int64) * S + t
    dq = tl.zeros((BQ * G, C), tl.float32)
    tile = bn.to(tl.int64) * NQT + pid_q
    count = tl.load(count_ptr + tile)
    offs_j = tl.arange(0, TK)
    for i in range(0, count):
        kt = tl.load(list_ptr + tile * W + i)
        j = kt * TK + offs_j
        is_k = j < S
        kv_off = b64 * sk_b + j.to(tl.int64) * sk_s + n * sk_n
        k = tl.load(k_ptr + kv_off[:, None] + offs_c[None, :], mask=is_k[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off[:, None] + offs_c[None, :], mask=is_k[:, None], other=0.0)
        seq_k = tl.load(seq_ptr + b64 * S + j, mask=is_k, other=-2)
        blk_k = tl.load(kblk_ptr + b64 * S + j, mask=is_k, other=0)
        ok = _allowed(t, seq_q, is_q, j, seq_k, blk_k, keep_ptr, keep_row, S, NBP)
        s = _mm(q, tl.trans(k), F32, HW) * qk_scale
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        dp = _mm(do, tl.trans(v), F32, HW)
        ds = p * (dp - delta[:, None])
        dq += _mm(ds, k, F32, HW)
    tl.store(dq_ptr + q_off[:, None] + offs_c[None, :], (dq * sm_scale).to(dq_ptr.dtype.element_ty),
             mask=is_q[:, None])  # fmt: skip


@triton.jit
def _bwd_dkv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, seq_ptr, kblk_ptr, keep_ptr,
    tlist_ptr, tcount_ptr,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_n,
    S, NBP, NT, WT, qk_scale, sm_scale,
    N: tl.constexpr, G: tl.constexpr, C: tl.constexpr, BQ: tl.constexpr, TK: tl.constexpr,
    F32: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key tile of one KV group, summed over every query tile (and all G heads) that
    sees it; the transposed tile list keeps this free of atomics (k, v, dK, dV share k's strides)."""
    pid_k = tl.program_id(0)
    bn = tl.program_id(1)
    b = bn // N
    n = bn % N
    b64 = b.to(tl.int64)
    offs_c = tl.arange(0, C)
    j = pid_k * TK + tl.arange(0, TK)
    is_k = j < S
    kv_off = b64 * sk_b + j.to(tl.int64) * sk_s + n * sk_n
    k = tl.load(k_ptr + kv_off[:, None] + offs_c[None, :], mask=is_k[:, None], other=0.0)
    v = tl.load(v_ptr + kv_off[:, None] + offs_c[None, :], mask=is_k[:, None], other=0.0)
    seq_k = tl.load(seq_ptr + b64 * S + j, mask=is_k, other=-2)
    blk_k = tl.load(kblk_ptr + b64 * S + j, mask=is_k, other=0)
    dk = tl.zeros((TK, C), tl.float32)
    dv = tl.zeros((TK, C), tl.float32)
    tile = bn.to(tl.int64) * NT + pid_k
    count = tl.load(tcount_ptr + tile)
    for i in range(0, count):
        pid_q = tl.load(tlist_ptr + tile * WT + i)
        _b, _n, t, h, is_q = _rows(pid_q, bn, N, S, G, BQ)
        q_off = b64 * sq_b + t.to(tl.int64) * sq_s + h * sq_h
        q = tl.load(q_ptr + q_off[:, None] + offs_c[None, :], mask=is_q[:, None], other=0.0)
        do = tl.load(do_ptr + q_off[:, None] + offs_c[None, :], mask=is_q[:, None], other=0.0)
        stat = (bn.to(tl.int64) * G + h % G) * S + t
        lse = tl.load(lse_ptr + stat, mask=is_q, other=float("inf"))
        delta = tl.load(delta_ptr + stat, mask=is_q, other=0.0)
        seq_q = tl.load(seq_ptr + b64 * S + t, mask=is_q, other=-1)
        ok = _allowed(t, seq_q, is_q, j, seq_k, blk_k, keep_ptr, bn.to(tl.int64) * S + t, S, NBP)
        s = _mm(q, tl.trans(k), F32, HW) * qk_scale  # [M, TK]
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        dv += _mm(tl.trans(p), do, F32, HW)
        dp = _mm(do, tl.trans(v), F32, HW)
        ds = p * (dp - delta[:, None])
        dk += _mm(tl.trans(ds), q, F32, HW)
    tl.store(dk_ptr + kv_off[:, None] + offs_c[None, :], (dk * sm_scale).to(dk_ptr.dtype.element_ty),
             mask=is_k[:, None])  # fmt: skip
    tl.store(dv_ptr + kv_off[:, None] + offs_c[None, :], dv.to(dv_ptr.dtype.element_ty), mask=is_k[:, None])


# -------------------------------------------------------------------------------------------- host
@torch.no_grad()
def plan_tiles(
    selected_BNSK: torch.Tensor, seq_ids_BS: torch.Tensor, positions_BS: torch.Tensor, *,
    block_size: int, num_blocks: int, bq: int, tk: int,
) -> dict:  # fmt: skip
    """Selection -> the kernels' plan (module docstring): keep bitmap, key blocks, per-query-tile key
    tile lists and per-key-tile query tile lists (sorted, with counts). On device, no host sync."""
    B, N, S, _ = selected_BNSK.shape
    dev = selected_BNSK.device
    NB, NQT, NT = num_blocks, triton.cdiv(S, bq), triton.cdiv(S, tk)
    sel = selected_BNSK.long()
    keep = torch.zeros((B, N, S, NB + 1), dtype=torch.uint8, device=dev)
    keep.scatter_(-1, sel.masked_fill(sel < 0, NB), 1)
    keep[..., NB] = 0  # the spare column that absorbed the -1 slots
    is_tok_BS = seq_ids_BS >= 0
    t_S = torch.arange(S, device=dev)
    start_BS = t_S - positions_BS  # a packed sequence's first index (positions restart at 0)
    # Key index range of each selected block of each token, clipped causally at the token.
    lo = start_BS[:, None, :, None] + block_size * sel
    hi = torch.minimum(lo + block_size - 1, t_S[None, None, :, None].expand_as(lo))
    ok = (sel >= 0) & is_tok_BS[:, None, :, None] & (lo <= hi)
    n_off = block_size // tk + 1  # tiles one block can touch when it is not tile-aligned
    tiles = lo.clamp(min=0)[..., None] // tk + torch.arange(n_off, device=dev)
    ok = ok[..., None] & (tiles * tk <= hi[..., None])
    tiles = torch.where(ok, tiles, NT)
    qt = (t_S // bq)[None, None, :, None, None]
    bn = torch.arange(B * N, device=dev).view(B, N, 1, 1, 1)
    flat = ((bn * NQT + qt) * (NT + 1) + tiles).reshape(-1)
    mask = torch.zeros(B * N * NQT * (NT + 1), dtype=torch.bool, device=dev)
    mask[flat] = True
    mask = mask.view(B, N, NQT, NT + 1)[..., :NT]
    lists = torch.sort(mask.to(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)
    mask_t = mask.transpose(2, 3)
    tlists = torch.sort(mask_t.to(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)
    kblk = torch.where(is_tok_BS, positions_BS // block_size, 0).clamp(max=NB - 1).to(torch.int32)
    return {
        "keep": keep, "kblk": kblk.contiguous(), "seq": seq_ids_BS.to(torch.int32).contiguous(),
        "lists": lists.contiguous(), "counts": mask.sum(-1, dtype=torch.int32).contiguous(),
        "tlists": tlists.contiguous(), "tcounts": mask_t.sum(-1, dtype=torch.int32).contiguous(),
        "bq": bq, "tk": tk, "nqt": NQT, "nt": NT,
    }  # fmt: skip


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan")) if POISON_OUTPUTS else torch.empty_like(t)


class _MSATrain(torch.autograd.Function):
    """out = block-sparse attention(q, k, v) under `plan`; gradients to q, k, v (none to the plan)."""

    @staticmethod
    def forward(ctx, q_BSHC, k_BSNC, v_BSNC, plan, softmax_scale):
        B, S, H, C = q_BSHC.shape
        N = k_BSNC.shape[2]
        G = H // N
        q, k, v = q_BSHC.contiguous(), k_BSNC.contiguous(), v_BSNC.contiguous()
        out = _empty_like(q)
        lse = _empty_like(torch.empty((B, N, G, S), dtype=torch.float32, device=q.device))
        NBP = plan["keep"].shape[-1]
        _fwd_kernel[(plan["nqt"], B * N)](
            q, k, v, out, lse, plan["seq"], plan["kblk"], plan["keep"], plan["lists"], plan["counts"],
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            S, NBP, plan["nqt"], plan["lists"].shape[-1], softmax_scale * LOG2E,
            N=N, G=G, C=C, BQ=plan["bq"], TK=plan["tk"], F32=q.dtype == torch.float32, HW=use_hw_casts(),
            **_LAUNCH,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.softmax_scale = plan, softmax_scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan, sm = ctx.plan, ctx.softmax_scale
        B, S, H, C = q.shape
        N = k.shape[2]
        G = H // N
        do = grad_out.to(q.dtype).contiguous()
        # delta = rowsum(dO * O) per (row, head), laid out like lse [B, N, G, S].
        delta = (do.float() * out.float()).sum(-1).permute(0, 2, 1).contiguous()
        dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
        NBP = plan["keep"].shape[-1]
        meta = dict(
            N=N,
            G=G,
            C=C,
            BQ=plan["bq"],
            TK=plan["tk"],
            F32=q.dtype == torch.float32,
            HW=use_hw_casts(),
            **_LAUNCH,
        )
        strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
        _bwd_dq_kernel[(plan["nqt"], B * N)](
            q, k, v, do, dq, lse, delta, plan["seq"], plan["kblk"], plan["keep"], plan["lists"],
            plan["counts"], *strides, S, NBP, plan["nqt"], plan["lists"].shape[-1], sm * LOG2E, sm, **meta,
        )  # fmt: skip
        _bwd_dkv_kernel[(plan["nt"], B * N)](
            q, k, v, do, dk, dv, lse, delta, plan["seq"], plan["kblk"], plan["keep"], plan["tlists"],
            plan["tcounts"], *strides, S, NBP, plan["nt"], plan["tlists"].shape[-1], sm * LOG2E, sm, **meta,
        )  # fmt: skip
        return dq, dk, dv, None, None


def _tile_sizes(G: int, block_size: int, m_rows: int | None) -> tuple[int, int]:
    m = m_rows or (M_ROWS if use_hw_casts() else 16)
    return max(1, m // G), min(block_size, 64)


def msa_train_triton(
    q_BSHC: torch.Tensor, k_BSNC: torch.Tensor, v_BSNC: torch.Tensor, selected_BNSK: torch.Tensor,
    seq_ids_BS: torch.Tensor, positions_BS: torch.Tensor, *, block_size: int, num_blocks: int,
    softmax_scale: float, m_rows: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Block-sparse MSA attention [B, S, H, C] (Triton forward and backward); see the module docstring.
    `m_rows`: dot rows per query tile (BQ = m_rows // G tokens; default 64 on the GPU, 16 interpreted)."""
    G = q_BSHC.shape[2] // k_BSNC.shape[2]
    bq, tk = _tile_sizes(G, block_size, m_rows)
    plan = plan_tiles(selected_BNSK, seq_ids_BS, positions_BS, block_size=block_size, num_blocks=num_blocks,
                      bq=bq, tk=tk)  # fmt: skip
    return _MSATrain.apply(q_BSHC, k_BSNC, v_BSNC, plan, softmax_scale)


_compiled_flex = None


def msa_train_flex(
    q_BSHC: torch.Tensor, k_BSNC: torch.Tensor, v_BSNC: torch.Tensor, selected_BNSK: torch.Tensor,
    seq_ids_BS: torch.Tensor, positions_BS: torch.Tensor, *, block_size: int, num_blocks: int,
    softmax_scale: float, flex_block: int = 128,
) -> torch.Tensor:  # fmt: skip
    """The same attention through torch's FlexAttention: a BlockMask from the same tile lists (Q and KV
    blocks of `flex_block`) plus the per-element mask as mask_mod. Compiled on CUDA, eager elsewhere."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    global _compiled_flex
    S, H = q_BSHC.shape[1:3]
    N = k_BSNC.shape[2]
    G = H // N
    plan = plan_tiles(selected_BNSK, seq_ids_BS, positions_BS, block_size=block_size, num_blocks=num_blocks,
                      bq=flex_block, tk=flex_block)  # fmt: skip
    keep, kblk, seq = plan["keep"], plan["kblk"].long(), plan["seq"].long()

    def mask_mod(b, h, q_idx, kv_idx):
        s_q, s_k = seq[b, q_idx], seq[b, kv_idx]
        return (s_q == s_k) & (s_k >= 0) & (kv_idx <= q_idx) & (keep[b, h // G, q_idx, kblk[b, kv_idx]] != 0)

    block_mask = BlockMask.from_kv_blocks(
        plan["counts"].repeat_interleave(G, dim=1), plan["lists"].repeat_interleave(G, dim=1),
        BLOCK_SIZE=(flex_block, flex_block), mask_mod=mask_mod, seq_lengths=(S, S),
    )  # fmt: skip
    if q_BSHC.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    else:
        fn = flex_attention
    out_BHSC = fn(
        q_BSHC.transpose(1, 2), k_BSNC.transpose(1, 2), v_BSNC.transpose(1, 2),
        block_mask=block_mask, scale=softmax_scale, enable_gqa=True,
    )  # fmt: skip
    # Rows with no allowed key (padding) are 0, as in the reference.
    return out_BHSC.transpose(1, 2) * (seq_ids_BS >= 0)[:, :, None, None].to(q_BSHC.dtype)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


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

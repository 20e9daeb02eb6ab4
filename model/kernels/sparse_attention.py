"""Paged block-sparse attention op (MSA), dense causal attention as its special case.

What: T varlen query tokens (prefill, decode or verify tokens of several sequences), each attending to
its own sequence's cached keys at positions <= its own within its KV group's selected blocks
(`selected_TNK=None`: every block, the full-attention layers' op). `sparse_attention_ref` is the spec,
`sparse_attention_torch` the batched path, `sparse_attention` validates and dispatches (Triton on CUDA
or under TRITON_INTERPRET=1, torch elsewhere and for fp32 caches; `variant="v7"`, opt-in: the CUDA kernel
of `model.kernels.cuda_attention` where it applies, NVFP4 pages of head dim 128). The training twins
(`sparse_attention_train_ref` / `_train`) pick `backend=`, else MSA_TRAIN_BACKEND, else the measured
`AUTO_TRAIN_BACKEND`; an optional KV simulation rounds K/V as the cache does (straight-through).

Invariants: pages dequantized exactly as `model.kv_cache` defines; fp32 scores, softmax and P.V; output
in q's dtype; a query with no allowed key gets zeros (the Triton FP8 path rounds q and P to e4m3).
"""

import os
from typing import Literal

import torch

from model.kernels.cuda_attention import AttentionVariant, sparse_attention_cuda, v7_applies
from model.kernels.indexer import check_varlen_args

try:  # Triton is optional on CPU machines: without it every call takes the torch path.
    from model.kernels.msa_train_flex import msa_train_flex
    from model.kernels.triton_common import triton_available
    from model.kernels.triton_msa_train import msa_train_triton, triton_msa_train_supported
    from model.kernels.triton_sparse_attention import sparse_attention_triton, triton_attention_supported
except ImportError:  # pragma: no cover - depends on the install
    triton_available = None
from model.kv_cache import (
    GATHER_CHUNK_BYTES,
    KVDtype,
    PagedKV,
    dequantize_kv,
    gather_pages,
    gather_sequences,
    kv_quant_dequant,
    max_len_bound,
)

# Legend: T tokens, H query heads, N kv heads, G = H / N, C head dim, B sequences, P block-table
# width, S keys of one sequence, NB key blocks (= pages), K selected blocks.
ATTENTION_VARIANTS = AttentionVariant.__args__  # decode kernels: "v6" Triton (default), "v7" CUDA (opt-in)
TrainBackend = Literal["auto", "triton", "flex", "torch"]
TRAIN_BACKENDS = ("auto", "triton", "flex", "torch")
# (needs grad, G >= 16) -> the measured-faster kernel on CUDA: `benchmarks/training_kernels.py --attn`
# (B = 1, 16K-32K tokens, top-16 of 128-token blocks); which run and why: benchmarks/RESULTS.md,
# "MSA training kernels v2" and "Moved from module docstrings". Update it from each new run.
AUTO_TRAIN_BACKEND: dict[tuple[bool, bool], TrainBackend] = {
    (False, False): "triton",
    (False, True): "triton",
    (True, False): "triton",
    (True, True): "triton",  # flex 2-7% faster, but recompiles per length
}


def sparse_attention_ref(
    q_THC: torch.Tensor,
    kv_cache: PagedKV,
    block_tables_BP: torch.Tensor,
    seq_idx_T: torch.Tensor,
    positions_T: torch.Tensor,
    seq_lens_B: torch.Tensor,
    selected_TNK: torch.Tensor | None = None,
    *,
    softmax_scale: float,
) -> torch.Tensor:
    """Torch spec of the paged (block-sparse) attention op. Returns [T, H, C] in q's dtype."""
    _, H, C = q_THC.shape
    N = kv_cache.pages.shape[1] // 2
    G = H // N
    page = kv_cache.pages.shape[2]
    out_THC = torch.zeros_like(q_THC)
    for b in torch.unique(seq_idx_T).tolist():  # SYNC: reference only, one step per sequence
        rows = (seq_idx_T == b).nonzero()[:, 0]
        length = int(seq_lens_B[b])
        pos_t = positions_T[rows]
        stored_S2NX = gather_pages(kv_cache.pages.transpose(1, 2), block_tables_BP[b], length)
        k_SNC = dequantize_kv(stored_S2NX[:, 0::2], kv_cache.dtype, kv_cache.k_scale, C)
        v_SNC = dequantize_kv(stored_S2NX[:, 1::2], kv_cache.dtype, kv_cache.v_scale, C)
        q_tNGC = q_THC[rows].float().view(len(rows), N, G, C)
        scores_tNGS = torch.einsum("tngc,snc->tngs", q_tNGC, k_SNC) * softmax_scale
        allowed_tNS = (torch.arange(length, device=pos_t.device) <= pos_t[:, None])[:, None, :]
        if selected_TNK is not None:
            NB = -(-length // page)
            sel_tNK = selected_TNK[rows]
            # -1 slots scatter into a spare column NB that is dropped.
            keep_tNB = torch.zeros((len(rows), N, NB + 1), dtype=torch.bool, device=q_THC.device)
            keep_tNB.scatter_(-1, sel_tNK.masked_fill(sel_tNK < 0, NB), True)
            allowed_tNS = allowed_tNS & keep_tNB[..., :NB].repeat_interleave(page, dim=-1)[..., :length]
        scores_tNGS = scores_tNGS.masked_fill(~allowed_tNS[:, :, None, :], float("-inf"))
        probs_tNGS = torch.softmax(scores_tNGS, dim=-1).nan_to_num(0.0)  # empty rows -> 0
        out_tNGC = torch.einsum("tngs,snc->tngc", probs_tNGS, v_SNC)
        out_THC[rows] = out_tNGC.reshape(len(rows), H, C).to(q_THC.dtype)
    return out_THC


def sparse_attention_torch(
    q_THC: torch.Tensor,
    kv_cache: PagedKV,
    block_tables_BP: torch.Tensor,
    seq_idx_T: torch.Tensor,
    positions_T: torch.Tensor,
    seq_lens_B: torch.Tensor,
    selected_TNK: torch.Tensor | None = None,
    *,
    softmax_scale: float,
) -> torch.Tensor:
    """Batched torch path (CPU, and GPU until the Triton kernel lands): every sequence's pages are
    gathered and dequantized once, then all tokens attend in chunks with per-token masks, instead
    of the reference's Python loop over sequences. Equal to `sparse_attention_ref` up to fp32
    summation order (tested)."""
    T, H, C = q_THC.shape
    N = kv_cache.pages.shape[1] // 2
    G, page = H // N, kv_cache.pages.shape[2]
    S = max_len_bound(seq_lens_B, block_tables_BP, page)
    stored_BS2NX, valid_BS = gather_sequences(kv_cache.pages.transpose(1, 2), block_tables_BP, seq_lens_B, S)
    keep = valid_BS[..., None, None]
    k_BSNC = dequantize_kv(stored_BS2NX[:, :, 0::2], kv_cache.dtype, kv_cache.k_scale, C).where(keep, 0.0)
    v_BSNC = dequantize_kv(stored_BS2NX[:, :, 1::2], kv_cache.dtype, kv_cache.v_scale, C).where(keep, 0.0)
    NB = -(-S // page)
    key_block_S = torch.arange(S, device=q_THC.device) // page
    out_THC = torch.empty_like(q_THC)
    chunk = max(1, GATHER_CHUNK_BYTES // max(1, S * N * C * 4))
    for t0 in range(0, T, chunk):
        rows = slice(t0, min(T, t0 + chunk))
        seq_t = seq_idx_T[rows].long()
        k_tSNC, v_tSNC = k_BSNC[seq_t], v_BSNC[seq_t]
        q_tNGC = q_THC[rows].float().view(-1, N, G, C)
        scores_tNGS = torch.einsum("tngc,tsnc->tngs", q_tNGC, k_tSNC) * softmax_scale
        allowed_tNS = (torch.arange(S, device=q_THC.device) <= positions_T[rows, None])[:, None, :]
        if selected_TNK is not None:
            sel_tNK = selected_TNK[rows]
            keep_tNB = torch.zeros((sel_tNK.shape[0], N, NB + 1), dtype=torch.bool, device=q_THC.device)
            keep_tNB.scatter_(-1, sel_tNK.masked_fill(sel_tNK < 0, NB), True)
            allowed_tNS = allowed_tNS & keep_tNB[..., key_block_S]
        scores_tNGS = scores_tNGS.masked_fill(~allowed_tNS[:, :, None, :], float("-inf"))
        probs_tNGS = torch.softmax(scores_tNGS, dim=-1).nan_to_num(0.0)  # empty rows -> 0
        out_tNGC = torch.einsum("tngs,tsnc->tngc", probs_tNGS, v_tSNC)
        out_THC[rows] = out_tNGC.reshape(-1, H, C).to(q_THC.dtype)
    return out_THC


def sparse_attention(
    q_THC: torch.Tensor,
    kv_cache: PagedKV,
    block_tables_BP: torch.Tensor,
    seq_idx_T: torch.Tensor,
    positions_T: torch.Tensor,
    seq_lens_B: torch.Tensor,
    selected_TNK: torch.Tensor | None = None,
    *,
    softmax_scale: float,
    variant: AttentionVariant = "v6",
) -> torch.Tensor:
    """Attention of T varlen tokens over their sequences' paged K/V -> [T, H, C].

    q_THC: normed + roped queries; kv_cache: the layer's K/V pages (already holding these
    tokens' keys); selected_TNK: the indexer's blocks per KV group, left-packed and -1 padded, never
    past the query's block (None = all blocks, dense; the Triton kernel stops at slot pos // page + 1).
    variant: "v6" (the default) the Triton kernels; "v7" the CUDA kernel where `cuda_attention.v7_applies`
    (CUDA, NVFP4 pages of head dim 128, bf16 q, G <= 16), else as "v6".
    """
    if variant not in ATTENTION_VARIANTS:
        raise ValueError(f"sparse_attention: variant must be one of {ATTENTION_VARIANTS}, got {variant!r}")
    if q_THC.ndim != 3 or not q_THC.is_floating_point():
        raise ValueError(f"q_THC must be a float [T, H, C] tensor, got {tuple(q_THC.shape)} {q_THC.dtype}")
    T, H, C = q_THC.shape
    if kv_cache.pages.ndim != 4 or kv_cache.pages.shape[1] % 2:
        raise ValueError(f"K/V pages must be [P, 2N, page, X], got {tuple(kv_cache.pages.shape)}")
    N = kv_cache.pages.shape[1] // 2
    if kv_cache.head_dim != C:
        raise ValueError(f"q_THC head dim {C} != K/V cache head dim {kv_cache.head_dim}")
    if H % N:
        raise ValueError(f"q heads H={H} must be a multiple of the cache's kv heads N={N}")
    check_varlen_args(T, block_tables_BP, seq_idx_T, positions_T, seq_lens_B)
    if selected_TNK is not None and (
        selected_TNK.ndim != 3 or tuple(selected_TNK.shape[:2]) != (T, N) or selected_TNK.is_floating_point()
    ):
        raise ValueError(f"selected_TNK must be an integer [T={T}, N={N}, K] tensor, got "
                         f"{tuple(selected_TNK.shape)} {selected_TNK.dtype}")  # fmt: skip
    if variant == "v7" and v7_applies(q_THC, kv_cache):
        return sparse_attention_cuda(
            q_THC, kv_cache, block_tables_BP, seq_idx_T, positions_T, selected_TNK,
            softmax_scale=softmax_scale,
        )  # fmt: skip
    if (
        triton_available is not None
        and triton_available(q_THC)
        and triton_attention_supported(q_THC, kv_cache)
    ):
        return sparse_attention_triton(
            q_THC, kv_cache, block_tables_BP, seq_idx_T, positions_T, selected_TNK,
            softmax_scale=softmax_scale,
        )  # fmt: skip
    return sparse_attention_torch(
        q_THC, kv_cache, block_tables_BP, seq_idx_T, positions_T, seq_lens_B, selected_TNK,
        softmax_scale=softmax_scale,
    )  # fmt: skip


# ------------------------------------------------------------------------------ training (full sequences)
def sparse_attention_train_ref(
    q_BSHC: torch.Tensor,
    k_BSNC: torch.Tensor,
    v_BSNC: torch.Tensor,
    selected_BNSK: torch.Tensor,
    seq_ids_BS: torch.Tensor,
    positions_BS: torch.Tensor,
    *,
    block_size: int,
    num_blocks: int,
    softmax_scale: float,
) -> torch.Tensor:
    """The spec, dense: query t may attend key j iff same sequence (seq_ids >= 0), j <= t and key j's
    block (positions[j] // block_size) is selected for (b, group, t). fp32 scores; empty rows -> 0.
    Memory O(B * H * S^2): tests and small shapes only."""
    B, S, H, _ = q_BSHC.shape
    N = k_BSNC.shape[2]
    G = H // N
    sel = selected_BNSK.long()
    keep_BNSB = torch.zeros((B, N, S, num_blocks + 1), dtype=torch.bool, device=q_BSHC.device)
    keep_BNSB.scatter_(-1, sel.masked_fill(sel < 0, num_blocks), True)
    is_tok_BS = seq_ids_BS >= 0
    kblk_BS = torch.where(is_tok_BS, positions_BS // block_size, 0)
    chosen_BNSS = keep_BNSB[..., :num_blocks].gather(-1, kblk_BS[:, None, None, :].expand(B, N, S, S))
    t_S = torch.arange(S, device=q_BSHC.device)
    same_BSS = (seq_ids_BS[:, :, None] == seq_ids_BS[:, None, :]) & is_tok_BS[:, None, :]
    allowed_BNSS = chosen_BNSS & (same_BSS & (t_S[None, :] <= t_S[:, None]))[:, None]
    allowed_BHSS = allowed_BNSS.repeat_interleave(G, dim=1)
    k_BSHC = k_BSNC.float().repeat_interleave(G, dim=2)
    v_BSHC = v_BSNC.float().repeat_interleave(G, dim=2)
    scores_BHSS = torch.einsum("bshc,bjhc->bhsj", q_BSHC.float(), k_BSHC) * softmax_scale
    has_BHS = allowed_BHSS.any(-1)
    scores_BHSS = scores_BHSS.masked_fill(~allowed_BHSS, float("-inf")).masked_fill(~has_BHS[..., None], 0.0)
    probs_BHSS = torch.softmax(scores_BHSS, dim=-1) * has_BHS[..., None]  # empty rows: 0, finite grads
    return torch.einsum("bhsj,bjhc->bshc", probs_BHSS, v_BSHC).to(q_BSHC.dtype)


def sparse_attention_train_supported(q_BSHC: torch.Tensor, k_BSNC: torch.Tensor, block_size: int) -> bool:
    """Whether `sparse_attention_train(backend="auto")` runs a kernel (not the dense reference) here."""
    return (
        triton_available is not None
        and triton_available(q_BSHC)
        and triton_msa_train_supported(q_BSHC, k_BSNC, block_size)
    )


def resolve_train_backend(
    backend: TrainBackend, q_BSHC: torch.Tensor, k_BSNC: torch.Tensor, block_size: int, needs_grad: bool
) -> TrainBackend:
    """The backend `sparse_attention_train` runs: `backend` unless "auto", then MSA_TRAIN_BACKEND, then
    the measured table (CUDA) / Triton (interpreter) / the reference (module docstring)."""
    if backend == "auto":
        backend = os.environ.get("MSA_TRAIN_BACKEND", "auto")
        if backend not in TRAIN_BACKENDS:
            raise ValueError(f"MSA_TRAIN_BACKEND must be one of {TRAIN_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if not sparse_attention_train_supported(q_BSHC, k_BSNC, block_size):
        return "torch"
    if not q_BSHC.is_cuda:  # the interpreter: FlexAttention has no CPU backward
        return "triton"
    return AUTO_TRAIN_BACKEND[(needs_grad, q_BSHC.shape[2] // k_BSNC.shape[2] >= 16)]


def sparse_attention_train(
    q_BSHC: torch.Tensor,
    k_BSNC: torch.Tensor,
    v_BSNC: torch.Tensor,
    selected_BNSK: torch.Tensor,
    seq_ids_BS: torch.Tensor,
    positions_BS: torch.Tensor,
    *,
    block_size: int,
    num_blocks: int,
    softmax_scale: float,
    kv_sim_dtype: KVDtype | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: TrainBackend = "auto",
) -> torch.Tensor:
    """MSA attention of full sequences -> [B, S, H, C]; differentiable w.r.t. q, k, v.

    q_BSHC: normed + roped queries; k_BSNC / v_BSNC: keys / values; selected_BNSK: the indexer's
    blocks per (row, KV group, token), -1 padded (no gradient); seq_ids_BS: sequence id per token
    (-1 padding); positions_BS: positions restarting at 0 per packed sequence; num_blocks: an upper
    bound on positions // block_size + 1. kv_sim_dtype: round K/V as a cache of that dtype would
    (with k_scale / v_scale), straight-through. backend: see `resolve_train_backend` ("auto": the
    measured-faster kernel here, else the dense reference).
    """
    if q_BSHC.ndim != 4 or k_BSNC.ndim != 4 or k_BSNC.shape != v_BSNC.shape:
        raise ValueError(f"q must be [B, S, H, C] and k, v [B, S, N, C] alike, got {tuple(q_BSHC.shape)}, "
                         f"{tuple(k_BSNC.shape)}, {tuple(v_BSNC.shape)}")  # fmt: skip
    B, S, H, C = q_BSHC.shape
    N = k_BSNC.shape[2]
    if k_BSNC.shape[:2] != (B, S) or k_BSNC.shape[3] != C or H % N:
        raise ValueError(
            f"k/v {tuple(k_BSNC.shape)} do not fit q {tuple(q_BSHC.shape)} (need [B, S, N, C], H % N == 0)"
        )
    if (
        selected_BNSK.ndim != 4
        or tuple(selected_BNSK.shape[:3]) != (B, N, S)
        or selected_BNSK.is_floating_point()
    ):
        raise ValueError(f"selected_BNSK must be an integer [B={B}, N={N}, S={S}, K] tensor, got "
                         f"{tuple(selected_BNSK.shape)} {selected_BNSK.dtype}")  # fmt: skip
    if tuple(seq_ids_BS.shape) != (B, S) or tuple(positions_BS.shape) != (B, S):
        raise ValueError(f"seq_ids_BS and positions_BS must be [B={B}, S={S}], got "
                         f"{tuple(seq_ids_BS.shape)}, {tuple(positions_BS.shape)}")  # fmt: skip
    if backend not in TRAIN_BACKENDS:
        raise ValueError(f"backend must be one of {TRAIN_BACKENDS}, got {backend!r}")
    if kv_sim_dtype is not None:
        if k_scale is None or v_scale is None:
            raise ValueError("kv_sim_dtype needs k_scale and v_scale (the cache's dequant scales)")
        k_BSNC = k_BSNC + (kv_quant_dequant(k_BSNC.detach(), kv_sim_dtype, k_scale) - k_BSNC).detach()
        v_BSNC = v_BSNC + (kv_quant_dequant(v_BSNC.detach(), kv_sim_dtype, v_scale) - v_BSNC).detach()
    args = (q_BSHC, k_BSNC, v_BSNC, selected_BNSK, seq_ids_BS, positions_BS)
    kw = dict(block_size=block_size, num_blocks=num_blocks, softmax_scale=softmax_scale)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_BSHC, k_BSNC, v_BSNC))
    backend = resolve_train_backend(backend, q_BSHC, k_BSNC, block_size, needs_grad)
    if backend == "triton":
        if triton_available is None or not triton_msa_train_supported(q_BSHC, k_BSNC, block_size):
            raise ValueError(f"backend='triton' does not support q {q_BSHC.dtype} {tuple(q_BSHC.shape)}, "
                             f"block_size {block_size} here (see triton_msa_train_supported)")  # fmt: skip
        return msa_train_triton(*args, **kw)
    if backend == "flex":
        if triton_available is None:
            raise ValueError("backend='flex' needs torch's FlexAttention (and Triton to build its inputs)")
        return msa_train_flex(*args, **kw)
    return sparse_attention_train_ref(*args, **kw)

"""Paged block-sparse attention op (MSA), dense causal attention as its special case.

What: T varlen query tokens (prefill chunk, decode or verify tokens of several sequences), each
attending to its own sequence's cached keys at positions <= its own position, restricted to the
KV group's selected blocks when `selected_TNK` is given. `selected_TNK=None` selects every block:
that is the full-attention layers' op (no separate dense kernel, no duplicated code).

Numerics: K/V pages are dequantized (fp8 / NVFP4 -> fp32) exactly as `model.kv_cache` defines;
scores, softmax and the P.V product run in fp32; the output has q's dtype. A query with no
allowed key (only possible with index_local_blocks = 0) gets a zero output.

Kernel-module layout: `sparse_attention_ref` is the torch spec (gathers each sequence's pages,
one host sync per call to loop over sequences); `sparse_attention_torch` the batched torch path;
`sparse_attention` validates and dispatches: on CUDA (or under TRITON_INTERPRET=1) the Triton
kernel of `model.kernels.triton_sparse_attention` (only the selected pages read, dequantized tile
by tile; FP8 dots for FP8 / NVFP4 caches, bf16 dots for bf16; split over blocks with an LSE merge),
elsewhere (and for fp32 caches) the torch path. The FP8 path rounds q and P to e4m3: its output
differs from this module's fp32 numerics by FP8 rounding (see that module).

Legend: T tokens, H query heads, N kv heads, G = H / N, C head dim, B sequences, P block-table
width, S keys of one sequence, NB key blocks (= pages), K selected blocks.
"""

import torch

from model.kernels.indexer import check_varlen_args

try:  # Triton is optional on CPU machines: without it every call takes the torch path.
    from model.kernels.triton_common import triton_available
    from model.kernels.triton_sparse_attention import sparse_attention_triton, triton_attention_supported
except ImportError:  # pragma: no cover - depends on the install
    triton_available = None
from model.kv_cache import GATHER_CHUNK_BYTES, PagedKV, dequantize_kv, gather_pages, gather_sequences


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
    S = int(seq_lens_B.max())  # SYNC: sizes the gathered keys, once per call
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
) -> torch.Tensor:
    """Attention of T varlen tokens over their sequences' paged K/V -> [T, H, C].

    q_THC: normed + roped queries; kv_cache: the layer's K/V pages (already holding these
    tokens' keys); selected_TNK: the indexer's blocks per KV group (None = all blocks, dense).
    """
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

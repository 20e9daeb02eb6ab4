"""Lightning indexer op: MSA block selection from the paged index-key cache.

What: for T varlen query tokens (prefill chunk, decode or verify tokens of several sequences), score
every causally visible key block of the token's sequence with each index head and return the selected
blocks [T, N, K] (left-packed, -1 padded). The rule (docs/FACTS.md, "MSA and the lightning indexer"):
block score = max raw dot over visible keys; forced blocks first (own block, then the
`local_blocks - 1` preceding ones nearest first, then init blocks), then highest scores, ties to the
lower block id; no block repeated. `index_select_blocks_ref` is the torch spec,
`index_select_blocks_torch` the batched path, `index_select_blocks` validates and dispatches
(`model.kernels.triton_indexer` on CUDA or under TRITON_INTERPRET=1, torch elsewhere).

Invariant: `select_blocks`, the pure rule on a block-score tensor, is shared with the training forward
(model/layers/attention.py), so training and the engine choose identically.
"""

import torch

# Legend: T tokens, N index heads (= KV heads), C index head dim, B sequences, P block-table width
# (pages per sequence), S keys of one sequence, NB key blocks, K top-k blocks.

try:  # Triton is optional on CPU machines: without it every call takes the torch path.
    from model.kernels.triton_common import triton_available
    from model.kernels.triton_indexer import index_select_blocks_triton, triton_index_supported
except ImportError:  # pragma: no cover - depends on the install
    triton_available = None

from model.kv_cache import (
    GATHER_CHUNK_BYTES,
    PagedIndex,
    dequantize_kv,
    gather_pages,
    gather_sequences,
    max_len_bound,
)


def select_blocks(
    block_scores: torch.Tensor, q_block: torch.Tensor, *, topk: int, local_blocks: int, init_blocks: int
) -> torch.Tensor:
    """Selected block ids [..., topk] (int64, left-packed, -1 padded).

    block_scores [..., NB]: per-block scores (entries of non-candidate blocks are ignored);
    q_block [...] (broadcastable to block_scores.shape[:-1]): the query's block, pos // block_size.
    """
    if topk <= 0 or local_blocks < 0 or init_blocks < 0:
        raise ValueError(
            f"need topk > 0 and local/init blocks >= 0, got {topk=} {local_blocks=} {init_blocks=}"
        )
    NB = block_scores.shape[-1]
    q_block = q_block.expand(block_scores.shape[:-1])[..., None]  # [..., 1]
    block_id = torch.arange(NB, device=block_scores.device)
    is_cand = block_id <= q_block
    dist = q_block - block_id
    is_local = is_cand & (dist < local_blocks)
    is_init = is_cand & (block_id < init_blocks) & ~is_local
    # Priority rank: local blocks by distance, then init blocks by id, then scored candidates,
    # then non-candidates. A stable sort on rank after a stable sort on score yields exactly
    # "forced first, then highest score, ties to the lower block id".
    n_forced = local_blocks + init_blocks
    rank = torch.where(is_local, dist, torch.where(is_init, local_blocks + block_id, n_forced))
    rank = torch.where(is_cand, rank, n_forced + 1)
    score = block_scores.float().masked_fill(~is_cand, float("-inf"))
    by_score = torch.argsort(score, dim=-1, descending=True, stable=True)
    by_rank = torch.argsort(rank.gather(-1, by_score), dim=-1, stable=True)
    order = by_score.gather(-1, by_rank)[..., :topk]
    chosen = torch.where(is_cand.gather(-1, order), order, -1)
    if chosen.shape[-1] < topk:  # fewer blocks than slots: pad with -1
        pad = chosen.new_full((*chosen.shape[:-1], topk - chosen.shape[-1]), -1)
        chosen = torch.cat([chosen, pad], dim=-1)
    return chosen


def index_select_blocks_ref(
    index_q_TNC: torch.Tensor,
    index_cache: PagedIndex,
    block_tables_BP: torch.Tensor,
    seq_idx_T: torch.Tensor,
    positions_T: torch.Tensor,
    seq_lens_B: torch.Tensor,
    *,
    topk: int,
    local_blocks: int,
    init_blocks: int,
) -> torch.Tensor:
    """Torch spec of the indexer op (see the module docstring). Returns [T, N, topk] int64."""
    T, N, _ = index_q_TNC.shape
    page = index_cache.pages.shape[1]
    selected_TNK = torch.full((T, N, topk), -1, dtype=torch.long, device=index_q_TNC.device)
    for b in torch.unique(seq_idx_T).tolist():  # SYNC: reference only, one step per sequence
        rows = (seq_idx_T == b).nonzero()[:, 0]
        length = int(seq_lens_B[b])
        pos_t = positions_T[rows]
        stored_S1X = gather_pages(index_cache.pages, block_tables_BP[b], length)[:, None]
        keys_SC = dequantize_kv(stored_S1X, index_cache.dtype, index_cache.scale, index_cache.head_dim)[:, 0]
        scores_tNS = torch.einsum("tnc,sc->tns", index_q_TNC[rows].float(), keys_SC)
        is_visible_tS = torch.arange(length, device=pos_t.device) <= pos_t[:, None]
        scores_tNS = scores_tNS.masked_fill(~is_visible_tS[:, None, :], float("-inf"))
        NB = -(-length // page)
        scores_tNS = torch.nn.functional.pad(scores_tNS, (0, NB * page - length), value=float("-inf"))
        block_scores = scores_tNS.view(len(rows), N, NB, page).amax(dim=-1)
        selected_TNK[rows] = select_blocks(
            block_scores,
            (pos_t // page)[:, None],
            topk=topk,
            local_blocks=local_blocks,
            init_blocks=init_blocks,
        )
    return selected_TNK


def index_select_blocks_torch(
    index_q_TNC: torch.Tensor,
    index_cache: PagedIndex,
    block_tables_BP: torch.Tensor,
    seq_idx_T: torch.Tensor,
    positions_T: torch.Tensor,
    seq_lens_B: torch.Tensor,
    *,
    topk: int,
    local_blocks: int,
    init_blocks: int,
) -> torch.Tensor:
    """Batched torch path: all sequences' index keys gathered and dequantized once, every token
    scored in chunks (no Python loop over sequences). Same selection as the reference (tested)."""
    T, N, C = index_q_TNC.shape
    page = index_cache.pages.shape[1]
    S = max_len_bound(seq_lens_B, block_tables_BP, page)
    stored_BSX, valid_BS = gather_sequences(index_cache.pages, block_tables_BP, seq_lens_B, S)
    keys_BSC = dequantize_kv(
        stored_BSX[:, :, None], index_cache.dtype, index_cache.scale, index_cache.head_dim
    )
    keys_BSC = keys_BSC[:, :, 0].where(valid_BS[..., None], 0.0)
    NB = -(-S // page)
    out_TNK = torch.empty((T, N, topk), dtype=torch.long, device=index_q_TNC.device)
    chunk = max(1, GATHER_CHUNK_BYTES // max(1, S * C * 4))
    for t0 in range(0, T, chunk):
        rows = slice(t0, min(T, t0 + chunk))
        pos_t = positions_T[rows]
        scores_tNS = torch.einsum("tnc,tsc->tns", index_q_TNC[rows].float(), keys_BSC[seq_idx_T[rows].long()])
        is_visible_tS = torch.arange(S, device=pos_t.device) <= pos_t[:, None]
        scores_tNS = scores_tNS.masked_fill(~is_visible_tS[:, None, :], float("-inf"))
        scores_tNS = torch.nn.functional.pad(scores_tNS, (0, NB * page - S), value=float("-inf"))
        block_scores = scores_tNS.view(-1, N, NB, page).amax(dim=-1)
        out_TNK[rows] = select_blocks(
            block_scores,
            (pos_t // page)[:, None],
            topk=topk,
            local_blocks=local_blocks,
            init_blocks=init_blocks,
        )
    return out_TNK


def check_varlen_args(
    T: int, block_tables_BP: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor, seq_lens_B
) -> None:
    """Shape/dtype checks shared by the paged ops (no host syncs)."""
    if block_tables_BP.ndim != 2 or block_tables_BP.is_floating_point():
        raise ValueError(f"block_tables_BP must be a 2-D integer tensor [B, P], got "
                         f"{tuple(block_tables_BP.shape)} {block_tables_BP.dtype}")  # fmt: skip
    for name, t in (("seq_idx_T", seq_idx_T), ("positions_T", positions_T)):
        if t.ndim != 1 or t.shape[0] != T or t.is_floating_point():
            raise ValueError(f"{name} must be a 1-D integer tensor of T={T} tokens, got "
                             f"{tuple(t.shape)} {t.dtype}")  # fmt: skip
    B = block_tables_BP.shape[0]
    if seq_lens_B.ndim != 1 or seq_lens_B.shape[0] != B or seq_lens_B.is_floating_point():
        raise ValueError(f"seq_lens_B must be a 1-D integer tensor of B={B} sequences (rows of "
                         f"block_tables_BP), got {tuple(seq_lens_B.shape)} {seq_lens_B.dtype}")  # fmt: skip


def index_select_blocks(
    index_q_TNC: torch.Tensor,
    index_cache: PagedIndex,
    block_tables_BP: torch.Tensor,
    seq_idx_T: torch.Tensor,
    positions_T: torch.Tensor,
    seq_lens_B: torch.Tensor,
    *,
    topk: int,
    local_blocks: int,
    init_blocks: int,
) -> torch.Tensor:
    """Selected key blocks [T, N, topk] (int64, -1 padded) for T varlen query tokens.

    index_q_TNC: normed + roped index queries; index_cache: the layer's index pages (already
    holding these tokens' keys); block_tables_BP / seq_lens_B: per-sequence pages and cached
    lengths; seq_idx_T: row of block_tables_BP per token; positions_T: token positions
    (< its sequence's length).
    """
    if index_q_TNC.ndim != 3 or not index_q_TNC.is_floating_point():
        raise ValueError(f"index_q_TNC must be a float [T, N, C] tensor, got {tuple(index_q_TNC.shape)} "
                         f"{index_q_TNC.dtype}")  # fmt: skip
    T, _, C = index_q_TNC.shape
    if index_cache.head_dim != C:
        raise ValueError(f"index_q_TNC head dim {C} != index cache head dim {index_cache.head_dim}")
    if index_cache.pages.ndim != 3:
        raise ValueError(f"index cache pages must be [P, page, X], got {tuple(index_cache.pages.shape)}")
    check_varlen_args(T, block_tables_BP, seq_idx_T, positions_T, seq_lens_B)
    if topk <= 0:
        raise ValueError(f"topk must be positive, got {topk}")
    if (
        triton_available is not None
        and triton_available(index_q_TNC)
        and triton_index_supported(index_q_TNC, index_cache.pages, index_cache.dtype)
    ):
        return index_select_blocks_triton(
            index_q_TNC, index_cache.pages, index_cache.dtype, index_cache.scale, block_tables_BP,
            seq_idx_T, positions_T, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
        )  # fmt: skip
    return index_select_blocks_torch(
        index_q_TNC, index_cache, block_tables_BP, seq_idx_T, positions_T, seq_lens_B,
        topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
    )  # fmt: skip

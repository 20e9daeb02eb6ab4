"""Decode-context parallel (DCP) MSA: a sequence's pages interleaved over ranks, exact merges.

What: block (= page) b of every sequence lives on rank b % W as local block b // W (`DCPLayout`);
every rank holds all query tokens. The indexer (`dcp_index_select_blocks`) scores only owned blocks,
all-gathers each rank's local top-k candidates and merges them; attention (`dcp_sparse_attention`)
attends over owned selected blocks and merges the partial outputs by log-sum-exp. `DCPKVCache` is a
rank's share of a DCP engine replica's paged cache. Why: at long context decode is bound by reading
index keys and selected K/V; W GPUs divide those bytes and the KV memory per GPU by W.

Invariants: selections equal the single-rank `select_blocks` exactly, outputs up to fp32 summation
order; every rank calls each function with the same tokens (queries, positions, global `seq_lens_B`)
and its own pages; a world of 1 runs no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.config import ModelConfig
from model.kv_cache import (
    GATHER_CHUNK_BYTES,
    KVCache,
    KVDtype,
    PagedIndex,
    PagedKV,
    dequantize_kv,
    gather_sequences,
)
from model.parallel.groups import group_rank, group_size

__all__ = [
    "DCPKVCache",
    "DCPLayout",
    "dcp_index_local_topk",
    "dcp_index_select_blocks",
    "dcp_sparse_attention",
    "dcp_sparse_attention_partial",
    "merge_attention_partials",
    "merge_topk_candidates",
    "shard_pages",
]


@dataclass(frozen=True)
class DCPLayout:
    """Where a sequence's blocks live: block b on rank b % world, local block b // world."""

    rank: int
    world: int
    page_size: int

    def __post_init__(self) -> None:
        if self.world <= 0 or not 0 <= self.rank < self.world or self.page_size <= 0:
            raise ValueError(f"DCPLayout: need 0 <= rank < world and page_size > 0, got {self}")

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None, page_size: int) -> DCPLayout:
        return cls(group_rank(group), group_size(group), page_size)

    def local_seq_lens(self, seq_lens_B: torch.Tensor) -> torch.Tensor:
        """Tokens of each sequence held by this rank (full blocks, plus the partial last block if owned)."""
        page, W, r = self.page_size, self.world, self.rank
        nb_B = (seq_lens_B + page - 1) // page
        local_nb_B = ((nb_B - r + W - 1) // W).clamp(min=0)
        owns_last_B = (nb_B > 0) & ((nb_B - 1) % W == r)
        return local_nb_B * page - torch.where(owns_last_B, nb_B * page - seq_lens_B, 0)

    def key_positions(self, n_keys: int, device) -> torch.Tensor:
        """Global position of each local key slot 0..n_keys-1."""
        j = torch.arange(n_keys, device=device)
        return ((j // self.page_size) * self.world + self.rank) * self.page_size + j % self.page_size


# Legend: T tokens, H query heads, N kv / index heads, G = H / N, C head dim, B sequences, W ranks,
# Pl local block-table width, Sl local keys of one sequence, NBl local blocks, K top-k, X gathered
# candidates (W * K).
#
# Why the indexer merge is exact: each rank keeps its local top-k non-forced candidates (score,
# global block id); the merge puts forced blocks first (own block and its local predecessors, then
# init blocks), then the highest scores, ties to the lower block id, -1 padded. Every globally
# selected block is in its owner's local top-k (the local order is the global order restricted to
# the owner's blocks), and a rank that truncates its candidates alone supplies enough to fill every
# free slot. Attention: a query whose selected blocks all live elsewhere contributes weight 0 to the
# LSE merge; one with no key at all gets 0, as the single-rank op. Per-rank compute is the batched
# torch path (pages via `model.kv_cache.dequantize_kv`, fp32 scores / softmax / P.V): the Triton
# kernels fuse top-k and the LSE merge and do not expose scores or LSEs.
#
# Engine cache: one block-table entry (a scheduler page) covers W * page_size tokens: entry e names
# local page table[e] on every rank, which holds block e * W + rank there. So the engine's block
# table is the `DCPLayout` local table as is; page allocation, prefix sharing and copy-on-write stay
# rank-agnostic (every rank runs the same scheduler), and W ranks of M pages hold W times the
# context of one M-page cache. `attend_cached` is the attention layers' DCP engine path: append the
# owned tokens, select blocks, attend.
def shard_pages(
    pages: torch.Tensor, block_tables_BP: torch.Tensor, seq_lens_B: torch.Tensor, layout: DCPLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of a single-rank paged cache: (local pages [Pl_total, ...] holding only the
    pages of the blocks it owns, local block tables [B, Pl]). For tests and benchmarks: an engine
    would allocate pages directly on their owners."""
    W, r, page = layout.world, layout.rank, layout.page_size
    nb = [-(-int(n) // page) for n in seq_lens_B.tolist()]  # SYNC: setup helper, not a hot path
    width = max([len(range(r, n, W)) for n in nb] + [1])
    table = torch.zeros((len(nb), width), dtype=torch.long)
    ids: list[int] = []
    for b, n in enumerate(nb):
        for lb, gb in enumerate(range(r, n, W)):
            table[b, lb] = len(ids)
            ids.append(int(block_tables_BP[b, gb]))
    src = torch.tensor(ids or [0], dtype=torch.long, device=pages.device)
    return pages[src].clone(), table.to(pages.device)


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[W, *x.shape] of every rank's x (rank order); no collective for a group of one."""
    if group_size(group) == 1:
        return x[None]
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


# ------------------------------------------------------------------------------------ indexer
def dcp_index_local_topk(
    index_q_TNC: torch.Tensor,
    local_index: PagedIndex,
    local_block_tables_BP: torch.Tensor,
    seq_idx_T: torch.Tensor,
    positions_T: torch.Tensor,
    seq_lens_B: torch.Tensor,
    layout: DCPLayout,
    *,
    topk: int,
    local_blocks: int,
    init_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's best `topk` non-forced candidate blocks per (token, head): (scores fp32 [T, N, K],
    global block ids int64 [T, N, K]), by score descending then id ascending; (-inf, -1) padded."""
    T, N, C = index_q_TNC.shape
    page, device = layout.page_size, index_q_TNC.device
    local_lens_B = layout.local_seq_lens(seq_lens_B)
    out_scores = torch.full((T, N, topk), float("-inf"), device=device)
    out_ids = torch.full((T, N, topk), -1, dtype=torch.long, device=device)
    Sl = int(local_lens_B.max()) if local_lens_B.numel() else 0  # SYNC: sizes the gathered keys
    if Sl == 0 or T == 0:
        return out_scores, out_ids
    stored_BSX, valid_BS = gather_sequences(local_index.pages, local_block_tables_BP, local_lens_B, Sl)
    keys_BSC = dequantize_kv(
        stored_BSX[:, :, None], local_index.dtype, local_index.scale, local_index.head_dim
    )
    keys_BSC = keys_BSC[:, :, 0].where(valid_BS[..., None], 0.0)
    NBl = -(-Sl // page)
    gpos_S = layout.key_positions(Sl, device)
    gid_L = torch.arange(NBl, device=device) * layout.world + layout.rank  # global id of local block
    k = min(topk, NBl)
    chunk = max(1, GATHER_CHUNK_BYTES // max(1, Sl * C * 4))
    for t0 in range(0, T, chunk):
        rows = slice(t0, min(T, t0 + chunk))
        seq_t, pos_t = seq_idx_T[rows].long(), positions_T[rows]
        scores_tNS = torch.einsum("tnc,tsc->tns", index_q_TNC[rows].float(), keys_BSC[seq_t])
        is_visible_tS = valid_BS[seq_t] & (gpos_S <= pos_t[:, None])
        scores_tNS = scores_tNS.masked_fill(~is_visible_tS[:, None, :], float("-inf"))
        scores_tNS = torch.nn.functional.pad(scores_tNS, (0, NBl * page - Sl), value=float("-inf"))
        block_tNL = scores_tNS.view(-1, N, NBl, page).amax(dim=-1)
        q_block_t1 = (pos_t // page)[:, None]
        dist_tL = q_block_t1 - gid_L
        is_forced_tL = (dist_tL < local_blocks) | (gid_L < init_blocks)
        is_eligible_tL = (gid_L <= q_block_t1) & ~is_forced_tL  # a candidate block has a visible key
        block_tNL = block_tNL.masked_fill(~is_eligible_tL[:, None, :], float("-inf"))
        # Stable sort over local blocks in global-id order: ties go to the lower id, as select_blocks.
        order_tNk = torch.argsort(block_tNL, dim=-1, descending=True, stable=True)[..., :k]
        keep_tNk = is_eligible_tL[:, None, :].expand_as(block_tNL).gather(-1, order_tNk)
        out_scores[rows, :, :k] = block_tNL.gather(-1, order_tNk).masked_fill(~keep_tNk, float("-inf"))
        out_ids[rows, :, :k] = torch.where(keep_tNk, gid_L[order_tNk], -1)
    return out_scores, out_ids


def merge_topk_candidates(
    scores_TNX: torch.Tensor,
    ids_TNX: torch.Tensor,
    positions_T: torch.Tensor,
    page_size: int,
    *,
    topk: int,
    local_blocks: int,
    init_blocks: int,
) -> torch.Tensor:
    """Selected blocks [T, N, topk] from gathered non-forced candidates (id -1 = none): forced
    blocks first (local by distance, then init by id), then candidates by score descending and id
    ascending, -1 padded. The priority keys are those of `model.kernels.indexer.select_blocks`."""
    T, N, _ = ids_TNX.shape
    device = ids_TNX.device
    q_block_T1 = (positions_T // page_size).long()[:, None]
    local_TL = q_block_T1 - torch.arange(local_blocks, device=device)  # own block, then predecessors
    init_TI = torch.arange(init_blocks, device=device).expand(T, init_blocks)
    is_local_ok = local_TL >= 0
    is_init_ok = (init_TI <= q_block_T1) & (q_block_T1 - init_TI >= local_blocks)  # not already local
    n_forced = local_blocks + init_blocks
    forced_rank_TF = torch.cat(
        [
            torch.where(is_local_ok, torch.arange(local_blocks, device=device), n_forced + 1),
            torch.where(is_init_ok, local_blocks + init_TI, n_forced + 1),
        ],
        dim=1,
    )
    forced_ids_TF = torch.cat([local_TL, init_TI], dim=1)
    ids_all = torch.cat([forced_ids_TF[:, None].expand(T, N, -1), ids_TNX], dim=-1)
    rank_all = torch.cat(
        [forced_rank_TF[:, None].expand(T, N, -1), torch.where(ids_TNX >= 0, n_forced, n_forced + 1)], dim=-1
    )
    score_all = torch.cat([scores_TNX.new_zeros((T, N, n_forced)), scores_TNX.float()], dim=-1)
    # Three stable sorts, least significant key first: id ascending, score descending, rank ascending.
    order = torch.argsort(ids_all, dim=-1, stable=True)
    order = order.gather(-1, torch.argsort(score_all.gather(-1, order), dim=-1, descending=True, stable=True))
    order = order.gather(-1, torch.argsort(rank_all.gather(-1, order), dim=-1, stable=True))[..., :topk]
    chosen = torch.where(rank_all.gather(-1, order) <= n_forced, ids_all.gather(-1, order), -1)
    if chosen.shape[-1] < topk:
        chosen = torch.cat([chosen, chosen.new_full((T, N, topk - chosen.shape[-1]), -1)], dim=-1)
    return chosen


def dcp_index_select_blocks(
    index_q_TNC: torch.Tensor,
    local_index: PagedIndex,
    local_block_tables_BP: torch.Tensor,
    seq_idx_T: torch.Tensor,
    positions_T: torch.Tensor,
    seq_lens_B: torch.Tensor,
    *,
    topk: int,
    local_blocks: int,
    init_blocks: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Selected global blocks [T, N, topk] (int64, -1 padded), identical on every rank of `group`
    and to `model.kernels.indexer.index_select_blocks` on the unsharded cache. Collective."""
    if topk <= 0 or local_blocks < 0 or init_blocks < 0:
        raise ValueError(
            f"need topk > 0 and local/init blocks >= 0, got {topk=} {local_blocks=} {init_blocks=}"
        )
    layout = DCPLayout.for_group(group, local_index.pages.shape[1])
    scores_TNK, ids_TNK = dcp_index_local_topk(
        index_q_TNC, local_index, local_block_tables_BP, seq_idx_T, positions_T, seq_lens_B, layout,
        topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
    )  # fmt: skip
    scores_WTNK, ids_WTNK = _all_gather(scores_TNK, group), _all_gather(ids_TNK, group)
    T, N = ids_TNK.shape[:2]
    return merge_topk_candidates(
        scores_WTNK.permute(1, 2, 0, 3).reshape(T, N, -1), ids_WTNK.permute(1, 2, 0, 3).reshape(T, N, -1),
        positions_T, layout.page_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
    )  # fmt: skip


# ---------------------------------------------------------------------------------- attention
def dcp_sparse_attention_partial(
    q_THC: torch.Tensor,
    local_kv: PagedKV,
    local_block_tables_BP: torch.Tensor,
    seq_idx_T: torch.Tensor,
    positions_T: torch.Tensor,
    seq_lens_B: torch.Tensor,
    selected_TNK: torch.Tensor | None,
    layout: DCPLayout,
    *,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over this rank's allowed keys: (normalised partial output fp32 [T, H, C],
    log-sum-exp of the scaled scores fp32 [T, H], -inf where the rank holds no allowed key)."""
    T, H, C = q_THC.shape
    N = local_kv.pages.shape[1] // 2
    G, page, device = H // N, layout.page_size, q_THC.device
    out_THC = torch.zeros((T, H, C), dtype=torch.float32, device=device)
    lse_TH = torch.full((T, H), float("-inf"), device=device)
    local_lens_B = layout.local_seq_lens(seq_lens_B)
    Sl = int(local_lens_B.max()) if local_lens_B.numel() else 0  # SYNC: sizes the gathered keys
    if Sl == 0 or T == 0:
        return out_THC, lse_TH
    stored, valid_BS = gather_sequences(
        local_kv.pages.transpose(1, 2), local_block_tables_BP, local_lens_B, Sl
    )
    keep = valid_BS[..., None, None]
    k_BSNC = dequantize_kv(stored[:, :, 0::2], local_kv.dtype, local_kv.k_scale, C).where(keep, 0.0)
    v_BSNC = dequantize_kv(stored[:, :, 1::2], local_kv.dtype, local_kv.v_scale, C).where(keep, 0.0)
    NBl = -(-Sl // page)
    gpos_S = layout.key_positions(Sl, device)
    local_block_S = torch.arange(Sl, device=device) // page
    chunk = max(1, GATHER_CHUNK_BYTES // max(1, Sl * N * C * 4))
    for t0 in range(0, T, chunk):
        rows = slice(t0, min(T, t0 + chunk))
        seq_t = seq_idx_T[rows].long()
        k_tSNC, v_tSNC = k_BSNC[seq_t], v_BSNC[seq_t]
        q_tNGC = q_THC[rows].float().view(-1, N, G, C)
        scores_tNGS = torch.einsum("tngc,tsnc->tngs", q_tNGC, k_tSNC) * softmax_scale
        allowed_tNS = (valid_BS[seq_t] & (gpos_S <= positions_T[rows, None]))[:, None, :]
        if selected_TNK is not None:
            sel_tNK = selected_TNK[rows]
            is_mine = (sel_tNK >= 0) & (sel_tNK % layout.world == layout.rank)
            # Blocks owned elsewhere (and -1 slots) scatter into a spare column NBl that is dropped.
            local_tNK = torch.where(is_mine, sel_tNK // layout.world, NBl).clamp(max=NBl)
            keep_tNB = torch.zeros((sel_tNK.shape[0], N, NBl + 1), dtype=torch.bool, device=device)
            keep_tNB.scatter_(-1, local_tNK, True)
            allowed_tNS = allowed_tNS & keep_tNB[..., local_block_S]
        scores_tNGS = scores_tNGS.masked_fill(~allowed_tNS[:, :, None, :], float("-inf"))
        lse_tNG = torch.logsumexp(scores_tNGS, dim=-1)
        probs_tNGS = torch.exp(scores_tNGS - lse_tNG[..., None]).nan_to_num(0.0)  # no key: -inf - -inf
        out_THC[rows] = torch.einsum("tngs,tsnc->tngc", probs_tNGS, v_tSNC).reshape(-1, H, C)
        lse_TH[rows] = lse_tNG.reshape(-1, H)
    return out_THC, lse_TH


def merge_attention_partials(out_WTHC: torch.Tensor, lse_WTH: torch.Tensor) -> torch.Tensor:
    """Exact softmax merge of W partial attentions over disjoint key sets -> fp32 [T, H, C]:
    sum_w exp(lse_w - m) out_w / sum_w exp(lse_w - m), m = max_w lse_w; 0 where no rank had a key."""
    m_TH = lse_WTH.amax(dim=0)
    m_TH = torch.where(torch.isfinite(m_TH), m_TH, 0.0)  # all -inf: every weight below is exp(-inf) = 0
    w_WTH = torch.exp(lse_WTH - m_TH)
    den_TH = w_WTH.sum(dim=0)
    num_THC = (w_WTH[..., None] * out_WTHC.float()).sum(dim=0)
    return torch.where(den_TH[..., None] > 0, num_THC / den_TH.clamp(min=1e-30)[..., None], 0.0)


def dcp_sparse_attention(
    q_THC: torch.Tensor,
    local_kv: PagedKV,
    local_block_tables_BP: torch.Tensor,
    seq_idx_T: torch.Tensor,
    positions_T: torch.Tensor,
    seq_lens_B: torch.Tensor,
    selected_TNK: torch.Tensor | None = None,
    *,
    softmax_scale: float,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """[T, H, C] in q's dtype, identical on every rank of `group` and equal to
    `model.kernels.sparse_attention.sparse_attention` on the unsharded cache. Collective."""
    if q_THC.ndim != 3 or local_kv.pages.ndim != 4 or q_THC.shape[1] % (local_kv.pages.shape[1] // 2):
        raise ValueError(
            f"dcp_sparse_attention: need q [T, H, C] and pages [P, 2N, page, X] with N | H, got "
            f"{tuple(q_THC.shape)} and {tuple(local_kv.pages.shape)}"
        )
    layout = DCPLayout.for_group(group, local_kv.pages.shape[2])
    out_THC, lse_TH = dcp_sparse_attention_partial(
        q_THC, local_kv, local_block_tables_BP, seq_idx_T, positions_T, seq_lens_B, selected_TNK, layout,
        softmax_scale=softmax_scale,
    )  # fmt: skip
    merged = merge_attention_partials(_all_gather(out_THC, group), _all_gather(lse_TH, group))
    return merged.to(q_THC.dtype)


# --------------------------------------------------------------------------------- engine cache
class DCPKVCache(KVCache):
    """This rank's share of a DCP replica's paged cache (layout in the notes at the top of the module).

    `num_pages` local pages are the scheduler's to hand out; one more, `trash_page`, never in a
    block table, takes the appends of tokens whose block another rank owns, so an append stays one
    fixed-shape scatter with no host sync (its contents are garbage and never read)."""

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        dtype: KVDtype | None = None,
        index_dtype: KVDtype | None = None,
    ):
        super().__init__(config, num_pages + 1, device=device, dtype=dtype, index_dtype=index_dtype)
        self.group = group
        self.layout = DCPLayout.for_group(group, self.page_size)
        self.table_page_size = self.page_size * self.layout.world
        self.trash_page = num_pages

    def local_slots(
        self, block_tables_BP: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor
    ) -> torch.Tensor:
        """Local cache slot of every token: its block's local page if this rank owns the block,
        else a slot of `trash_page`."""
        W, page = self.layout.world, self.page_size
        block_T = positions_T // page
        page_T = block_tables_BP[seq_idx_T, block_T // W].long()
        page_T = torch.where(block_T % W == self.layout.rank, page_T, self.trash_page)
        return page_T * page + positions_T % page

    def attend_cached(
        self,
        layer: int,
        q_THC: torch.Tensor,
        k_TNC: torch.Tensor,
        v_TNC: torch.Tensor,
        index_q_TNC: torch.Tensor | None,
        index_k_TC: torch.Tensor | None,
        *,
        block_tables_BP: torch.Tensor,
        seq_idx_T: torch.Tensor,
        positions_T: torch.Tensor,
        seq_lens_B: torch.Tensor,
        softmax_scale: float,
    ) -> torch.Tensor:
        """One attention layer's engine step in DCP mode -> [T, H, C] (q's dtype), equal on every
        rank and to the single-rank `Attention.forward_cached` core: append this step's owned K/V
        and index keys, select blocks (sparse layers: index_q given) and attend. Collective."""
        slots_T = self.local_slots(block_tables_BP, seq_idx_T, positions_T)
        self.append(layer, slots_T, k_TNC, v_TNC, index_k_TC)
        selected_TNK = None
        if index_q_TNC is not None:
            cfg = self.config
            selected_TNK = dcp_index_select_blocks(
                index_q_TNC, self.index_view(layer), block_tables_BP, seq_idx_T, positions_T, seq_lens_B,
                topk=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks,
                init_blocks=cfg.index_init_blocks, group=self.group,
            )  # fmt: skip
        return dcp_sparse_attention(
            q_THC, self.kv_view(layer), block_tables_BP, seq_idx_T, positions_T, seq_lens_B, selected_TNK,
            softmax_scale=softmax_scale, group=self.group,
        )  # fmt: skip

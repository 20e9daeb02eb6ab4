"""MiniMax-M3 attention: GQA with per-head QK norm and partial RoPE, dense or MSA-sparse.

What: one `Attention` per layer with two entry points: `forward` (training / scoring: full [B, S]
sequences, padding and packing through `seq_ids_BS`, optional simulation of the KV cache's rounding)
and `forward_cached` (the engine: varlen tokens appended to the paged `KVCache` or a `DCPKVCache`,
then the paged ops of `model.kernels`). Sparse layers run the lightning indexer and attend only to
their KV group's selected blocks (docs/FACTS.md, "MSA and the lightning indexer").

Invariants: blocks are anchored to positions (block = position // index_block_size), so training and
the paged cache select identical blocks when a sequence starts at position 0 of its row; the KV
simulation is straight-through; the index projections get no gradient through the output (top-k is
discrete); the cache must get the module's scales: `cache.set_scales(i, *attn.kv_scales())`.
"""

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.kernels.indexer import index_select_blocks, select_blocks
from model.kernels.sparse_attention import (
    sparse_attention,
    sparse_attention_train,
    sparse_attention_train_supported,
)
from model.kv_cache import DEFAULT_KV_SCALE, KVCache, KVDtype, check_kv_dtype, kv_quant_dequant, slot_mapping
from model.layers.norm import RMSNorm
from model.layers.rope import norm_rope, rope_cos_sin
from model.parallel.context_parallel import DCPKVCache

# Legend: B batch, S sequence, T flattened tokens, D model dim, H query heads, N kv heads (= index
# heads), G = H / N, C head dim, I index head dim, NB key blocks, K selected blocks.
#
# `forward` computes dense scores + a block mask over query chunks (memory O(B * H * chunk * S),
# compute O(S^2)); sparse layers on CUDA (or under TRITON_INTERPRET=1) run `sparse_attention_train`'s
# block-sparse kernels instead (same selection, same result up to summation order). A sequence not
# starting at position 0 of its row would keep the absent prefix's blocks as candidates and forced
# init blocks. `k_scale`, `v_scale`, `index_k_scale` are fp32 dequant-side buffers (default
# DEFAULT_KV_SCALE = 1.0, not in state_dict: a loader or calibration sets them). Training the index
# projections would need an auxiliary indexer loss, which this module does not have.

__all__ = ["Attention", "select_blocks"]

# Queries per chunk of the training forward: bounds the masks and scores to O(B * H * chunk * S).
TRAIN_QUERY_CHUNK = 1024


def _straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """`rounded` in the forward pass, identity gradient to `x` in the backward pass."""
    return x + (rounded - x).detach()


def masked_attention(
    q_BQHC: torch.Tensor,
    k_BSNC: torch.Tensor,
    v_BSNC: torch.Tensor,
    allowed_BNQS: torch.Tensor,
    scale: float,
    q_offset: int = 0,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the allowed (query, key) pairs of each KV group -> [B, Q, H, C].

    The Q queries are the sequence rows q_offset..q_offset+Q-1 (a query chunk). Rows with no
    allowed key (padding queries) output 0: they are given their own diagonal key so the
    softmax stays finite (no NaN gradients) and are zeroed afterwards.
    """
    B, Q, H, _ = q_BQHC.shape
    S, N = k_BSNC.shape[1], k_BSNC.shape[2]
    allowed_BNQS = allowed_BNQS.expand(B, N, Q, S)  # dense layers pass one mask for all groups
    is_empty_BNQ = ~allowed_BNQS.any(dim=-1)
    row_Q = torch.arange(q_offset, q_offset + Q, device=q_BQHC.device)
    diag_QS = row_Q[:, None] == torch.arange(S, device=q_BQHC.device)
    allowed_BNQS = allowed_BNQS | (is_empty_BNQ[..., None] & diag_QS)
    allowed_BHQS = allowed_BNQS[:, :, None].expand(B, N, H // N, Q, S).reshape(B, H, Q, S)
    out_BHQC = F.scaled_dot_product_attention(
        q_BQHC.transpose(1, 2),
        k_BSNC.transpose(1, 2),
        v_BSNC.transpose(1, 2),
        attn_mask=allowed_BHQS,
        scale=scale,
        enable_gqa=True,
    )
    is_empty_BHQ = is_empty_BNQ.repeat_interleave(H // N, dim=1)
    out_BHQC = out_BHQC.masked_fill(is_empty_BHQ[..., None], 0.0)
    return out_BHQC.transpose(1, 2)


def _selection_mask(selected_BNQK: torch.Tensor, block_BS: torch.Tensor, NB: int) -> torch.Tensor:
    """[B, N, Q, S] bool: key j lies in one of the blocks selected for (batch, group, query)."""
    B, N, Q, _ = selected_BNQK.shape
    keep_BNQB = torch.zeros((B, N, Q, NB + 1), dtype=torch.bool, device=selected_BNQK.device)
    keep_BNQB.scatter_(-1, selected_BNQK.masked_fill(selected_BNQK < 0, NB), True)  # -1 -> spare column
    return keep_BNQB.gather(-1, block_BS[:, None, None, :].expand(B, N, Q, block_BS.shape[1]))


def _once(shared: dict | None, key: str, compute):
    """`compute()`, kept in `shared` (one engine step's per-step tables) so later layers reuse it."""
    if shared is None:
        return compute()
    if key not in shared:
        shared[key] = compute()
    return shared[key]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        if not 0 <= layer_idx < config.num_hidden_layers:
            raise ValueError(f"layer_idx {layer_idx} out of range [0, {config.num_hidden_layers})")
        self.config = config
        self.layer_idx = layer_idx
        self.is_sparse = config.is_sparse_layer(layer_idx)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.index_head_dim = config.index_head_dim
        self.block_size = config.index_block_size
        self.rotary_dim = config.rotary_dim
        self.rope_theta = config.rope_theta
        self.softmax_scale = self.head_dim**-0.5
        self.query_chunk = TRAIN_QUERY_CHUNK  # plain attribute: tune per run, results do not change
        D, H, N, C = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        eps = config.rms_norm_eps
        self.q_proj = nn.Linear(D, H * C, bias=False)
        self.k_proj = nn.Linear(D, N * C, bias=False)
        self.v_proj = nn.Linear(D, N * C, bias=False)
        self.o_proj = nn.Linear(H * C, D, bias=False)
        self.q_norm = RMSNorm(C, eps)
        self.k_norm = RMSNorm(C, eps)
        if self.is_sparse:
            if config.index_n_heads != N:
                raise ValueError(f"index_n_heads={config.index_n_heads} must equal num_key_value_heads={N}")
            I = self.index_head_dim  # noqa: E741
            self.index_q_proj = nn.Linear(D, N * I, bias=False)
            self.index_k_proj = nn.Linear(D, I, bias=False)  # one key head shared by all index heads
            self.index_q_norm = RMSNorm(I, eps)
            self.index_k_norm = RMSNorm(I, eps)
        self.register_buffer("k_scale", torch.tensor(DEFAULT_KV_SCALE), persistent=False)
        self.register_buffer("v_scale", torch.tensor(DEFAULT_KV_SCALE), persistent=False)
        self.register_buffer("index_k_scale", torch.tensor(DEFAULT_KV_SCALE), persistent=False)

    @torch.no_grad()
    def reset_kv_scales(self) -> None:
        """Back to DEFAULT_KV_SCALE: needed after meta-device materialisation (`to_empty` leaves
        buffers uninitialised) before a loader sets calibrated values."""
        for scale in (self.k_scale, self.v_scale, self.index_k_scale):
            scale.fill_(DEFAULT_KV_SCALE)

    def kv_scales(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_scale, v_scale, index_k_scale): give them to `KVCache.set_scales` for this layer."""
        return self.k_scale, self.v_scale, self.index_k_scale

    def _project(self, x_LD: torch.Tensor, positions_L: torch.Tensor, shared: dict | None = None):
        """q [L.., H, C], k/v [L.., N, C], index q [L.., N, I] and index k [L.., I] (None on dense
        layers) for tokens with any leading shape L... `shared`: see `forward_cached`."""
        lead = x_LD.shape[:-1]
        cos, sin = _once(shared, "rope", lambda: rope_cos_sin(positions_L, self.rotary_dim, self.rope_theta))
        q = norm_rope(self.q_norm, self.q_proj(x_LD).view(*lead, self.num_heads, self.head_dim), cos, sin)
        k = norm_rope(self.k_norm, self.k_proj(x_LD).view(*lead, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x_LD).view(*lead, self.num_kv_heads, self.head_dim)
        if not self.is_sparse:
            return q, k, v, None, None
        N, I = self.num_kv_heads, self.index_head_dim  # noqa: E741
        index_q = norm_rope(self.index_q_norm, self.index_q_proj(x_LD).view(*lead, N, I), cos, sin)
        index_k = norm_rope(self.index_k_norm, self.index_k_proj(x_LD).view(*lead, 1, I), cos, sin)
        return q, k, v, index_q, index_k[..., 0, :]

    # ------------------------------------------------------------------ training forward
    def forward(
        self,
        x_BSD: torch.Tensor,
        positions_BS: torch.Tensor,
        seq_ids_BS: torch.Tensor | None = None,
        kv_sim_dtype: KVDtype | None = None,
        index_sim_dtype: KVDtype | None = None,
        *,
        kv_sim: bool = False,
    ) -> torch.Tensor:
        """Causal attention over full (padded / packed) sequences -> [B, S, D].

        positions_BS: position of each token in its sequence (restarting at 0 per packed
        sequence); seq_ids_BS: sequence id per token, -1 = padding (None = one sequence per
        row); kv_sim_dtype / index_sim_dtype: round K/V / index keys as a cache of that dtype
        would (None = no rounding); kv_sim=True fills the ones left None from the config
        (`kv_dtype_for_layer(i)`, `index_cache_dtype`): what a KVCache(config) stores. Padding
        rows output 0.
        """
        B, S, _ = self._check_batch(x_BSD, positions_BS, seq_ids_BS)
        if kv_sim:
            kv_sim_dtype = kv_sim_dtype or self.config.kv_dtype_for_layer(self.layer_idx)
            index_sim_dtype = index_sim_dtype or self.config.index_cache_dtype
        q, k, v, index_q, index_k = self._project(x_BSD, positions_BS)
        if kv_sim_dtype is not None:
            check_kv_dtype("kv_sim_dtype", kv_sim_dtype)
            k = _straight_through(k, kv_quant_dequant(k.detach(), kv_sim_dtype, self.k_scale))
            v = _straight_through(v, kv_quant_dequant(v.detach(), kv_sim_dtype, self.v_scale))
        if seq_ids_BS is None:
            seq_ids_BS = torch.zeros_like(positions_BS)
        block_BS = positions_BS.masked_fill(seq_ids_BS < 0, 0) // self.block_size
        if self.is_sparse:
            NB = int(block_BS.max()) + 1  # SYNC: sizes the block tensors, once per layer call
            index_k = self._round_index_keys(index_k.detach(), index_sim_dtype)
        if self.is_sparse and sparse_attention_train_supported(q, k, self.block_size):
            # Block-sparse kernels (CUDA, or the interpreter): only the selected key tiles are visited.
            chunks = [slice(q0, min(S, q0 + self.query_chunk)) for q0 in range(0, S, self.query_chunk)]
            with torch.no_grad():  # selection is discrete: nothing to differentiate
                selected_BNSK = torch.cat([
                    self._select(index_q[:, r], index_k, self._visibility(seq_ids_BS, r), block_BS, r, NB)
                    for r in chunks
                ], dim=2)  # fmt: skip
            out_BSHC = sparse_attention_train(q, k, v, selected_BNSK, seq_ids_BS, positions_BS,
                                              block_size=self.block_size, num_blocks=NB,
                                              softmax_scale=self.softmax_scale)  # fmt: skip
            return self.o_proj(out_BSHC.reshape(B, S, self.num_heads * self.head_dim))
        out_parts = []
        for q0 in range(0, S, self.query_chunk):  # memory O(B * H * chunk * S), not O(B * H * S^2)
            rows = slice(q0, min(S, q0 + self.query_chunk))
            visible_BQS = self._visibility(seq_ids_BS, rows)
            allowed_BNQS = visible_BQS[:, None]
            if self.is_sparse:
                with torch.no_grad():  # selection is discrete: nothing to differentiate
                    selected_BNQK = self._select(index_q[:, rows], index_k, visible_BQS, block_BS, rows, NB)
                    allowed_BNQS = allowed_BNQS & _selection_mask(selected_BNQK, block_BS, NB)
            out_parts.append(masked_attention(q[:, rows], k, v, allowed_BNQS, self.softmax_scale, q0))
        out_BSHC = torch.cat(out_parts, dim=1)
        return self.o_proj(out_BSHC.reshape(B, S, self.num_heads * self.head_dim))

    @torch.no_grad()
    def index_blocks(
        self,
        x_BSD: torch.Tensor,
        positions_BS: torch.Tensor,
        seq_ids_BS: torch.Tensor | None = None,
        index_sim_dtype: KVDtype | None = None,
    ) -> torch.Tensor:
        """The blocks `forward` lets each (batch, KV group, token) attend to: [B, N, S, K] int64,
        -1 padded (sparse layers only; for analysis and tests)."""
        if not self.is_sparse:
            raise ValueError(f"layer {self.layer_idx} is a full-attention layer: it selects no blocks")
        _, S, _ = self._check_batch(x_BSD, positions_BS, seq_ids_BS)
        if seq_ids_BS is None:
            seq_ids_BS = torch.zeros_like(positions_BS)
        _, _, _, index_q, index_k = self._project(x_BSD, positions_BS)
        block_BS = positions_BS.masked_fill(seq_ids_BS < 0, 0) // self.block_size
        NB = int(block_BS.max()) + 1  # SYNC: sizes the block-score tensor
        index_k = self._round_index_keys(index_k, index_sim_dtype)
        rows = slice(0, S)
        return self._select(index_q, index_k, self._visibility(seq_ids_BS, rows), block_BS, rows, NB)

    @staticmethod
    def _check_batch(x_BSD, positions_BS, seq_ids_BS) -> tuple[int, int, int]:
        if x_BSD.ndim != 3:
            raise ValueError(f"x_BSD must be [B, S, D], got {tuple(x_BSD.shape)}")
        B, S, D = x_BSD.shape
        if tuple(positions_BS.shape) != (B, S) or positions_BS.is_floating_point():
            raise ValueError(f"positions_BS must be an integer [B={B}, S={S}] tensor, got "
                             f"{tuple(positions_BS.shape)} {positions_BS.dtype}")  # fmt: skip
        if seq_ids_BS is not None and tuple(seq_ids_BS.shape) != (B, S):
            raise ValueError(f"seq_ids_BS must be [B={B}, S={S}], got {tuple(seq_ids_BS.shape)}")
        return B, S, D

    @staticmethod
    def _visibility(seq_ids_BS: torch.Tensor, rows: slice) -> torch.Tensor:
        """visible_BQS: key j is causally visible to query row t (same sequence, j <= t, not padding)."""
        S = seq_ids_BS.shape[1]
        t_Q = torch.arange(S, device=seq_ids_BS.device)[rows]
        causal_QS = torch.arange(S, device=seq_ids_BS.device) <= t_Q[:, None]
        same_BQS = seq_ids_BS[:, rows, None] == seq_ids_BS[:, None, :]
        return same_BQS & causal_QS & (seq_ids_BS >= 0)[:, None, :]

    def _round_index_keys(self, index_k_BSI: torch.Tensor, index_sim_dtype: KVDtype | None) -> torch.Tensor:
        if index_sim_dtype is None:
            return index_k_BSI
        check_kv_dtype("index_sim_dtype", index_sim_dtype)
        return kv_quant_dequant(index_k_BSI[..., None, :], index_sim_dtype, self.index_k_scale)[..., 0, :]

    def _select(self, index_q_BQNI, index_k_BSI, visible_BQS, block_BS, rows: slice, NB: int) -> torch.Tensor:
        """MSA selection [B, N, Q, K] for query rows `rows` from dense block scores (max over
        visible keys per block); block_BS: every token's block; NB: number of key blocks."""
        B, Q, N, _ = index_q_BQNI.shape
        S = index_k_BSI.shape[1]
        scores_BNQS = torch.einsum("bqni,bsi->bnqs", index_q_BQNI.float(), index_k_BSI.float())
        scores_BNQS = scores_BNQS.masked_fill(~visible_BQS[:, None], float("-inf"))
        key_block_BNQS = block_BS[:, None, None, :].expand(B, N, Q, S)
        block_scores_BNQB = scores_BNQS.new_full((B, N, Q, NB), float("-inf"))
        block_scores_BNQB = block_scores_BNQB.scatter_reduce(-1, key_block_BNQS, scores_BNQS, reduce="amax")
        return select_blocks(
            block_scores_BNQB,
            block_BS[:, None, rows],  # a query's own block, by the same rule as a key's
            topk=self.config.index_topk_blocks,
            local_blocks=self.config.index_local_blocks,
            init_blocks=self.config.index_init_blocks,
        )

    # ------------------------------------------------------------------ cached (engine) step
    def forward_cached(
        self,
        x_TD: torch.Tensor,
        positions_T: torch.Tensor,
        seq_idx_T: torch.Tensor,
        cache: KVCache,
        block_tables_BP: torch.Tensor,
        seq_lens_B: torch.Tensor,
        shared: dict | None = None,
    ) -> torch.Tensor:
        """One engine step for T flattened tokens -> [T, D].

        x_TD: the new tokens' hidden states (any mix of prefill chunks, decode and verify tokens);
        positions_T: their positions; seq_idx_T: their sequence's row in block_tables_BP;
        seq_lens_B: each sequence's length after this step (every position < it is cached once
        this step's tokens are appended). Appends before attending, so tokens of one step see
        each other causally. `shared`: a dict the step's layers share (the model's `forward_cached`
        passes one): RoPE cos / sin and slot mapping are computed by the first layer, reused after.
        """
        if x_TD.ndim != 2:
            raise ValueError(f"x_TD must be [T, D], got {tuple(x_TD.shape)}")
        if cache.page_size != self.block_size:
            raise ValueError(f"cache page size {cache.page_size} != sparse block size {self.block_size}")
        T = x_TD.shape[0]
        q, k, v, index_q, index_k = self._project(x_TD, positions_T, shared)
        if isinstance(cache, DCPKVCache):  # decode-context parallel: this rank holds 1/W of the pages
            out_THC = cache.attend_cached(
                self.layer_idx, q, k, v, index_q, index_k, block_tables_BP=block_tables_BP,
                seq_idx_T=seq_idx_T, positions_T=positions_T, seq_lens_B=seq_lens_B,
                softmax_scale=self.softmax_scale,
            )  # fmt: skip
            return self.o_proj(out_THC.reshape(T, self.num_heads * self.head_dim))
        slots_T = _once(
            shared, "slots", lambda: slot_mapping(block_tables_BP, seq_idx_T, positions_T, cache.page_size)
        )
        cache.append(self.layer_idx, slots_T, k, v, index_k)
        selected_TNK = None
        if self.is_sparse:
            selected_TNK = index_select_blocks(
                index_q,
                cache.index_view(self.layer_idx),
                block_tables_BP,
                seq_idx_T,
                positions_T,
                seq_lens_B,
                topk=self.config.index_topk_blocks,
                local_blocks=self.config.index_local_blocks,
                init_blocks=self.config.index_init_blocks,
            )
        out_THC = sparse_attention(
            q,
            cache.kv_view(self.layer_idx),
            block_tables_BP,
            seq_idx_T,
            positions_T,
            seq_lens_B,
            selected_TNK,
            softmax_scale=self.softmax_scale,
        )
        return self.o_proj(out_THC.reshape(T, self.num_heads * self.head_dim))

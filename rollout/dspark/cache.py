"""The drafter's context store and the target pass that fills it.

What: `DraftCache` holds per token every drafter layer's context K/V ([layers, 2, G, C]) in pages that
share the target cache's page ids, slots and page size, so everything the engine does to pages
(allocation, prefix sharing, copy-on-write, preemption, rollback) applies to both with only
`copy_pages` extra. `forward_cached_hidden` is the target's `forward_cached` run layer by layer
through the model's own modules (same ops, same logits) that also returns the residual stream after
the drafter's `target_layer_ids`; `target_hidden` is the same capture for the training forward.

Invariant (as model/kv_cache.py): a sequence's length is the only truth; entries are per token (no
cross-token scales), so truncating a length leaves every kept slot as a run that never wrote the
rejected tokens left it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.kv_cache import KVCache, gather_sequences, slot_mapping
from rollout.dspark.model import Drafter

# Legend: T flattened tokens, B sequences, S context length, P block-table width, L layers read,
# D hidden, V vocab.


class DraftCache:
    """Paged drafter context K/V: [num_pages, page_size, layers, 2, G, C]."""

    def __init__(self, drafter: Drafter, num_pages: int, page_size: int, device: torch.device | str):
        cfg = drafter.config
        shape = (num_pages, page_size, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
        self.pages = torch.zeros(shape, dtype=drafter.dtype, device=device)
        self.page_size = page_size

    def write(self, slots_T: torch.Tensor, ctx_kv_TL2GC: torch.Tensor) -> None:
        self.pages.view(-1, *self.pages.shape[2:])[slots_T] = ctx_kv_TL2GC.to(self.pages.dtype)

    def read(
        self, block_tables_BP: torch.Tensor, lens_B: torch.Tensor, S: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context K/V [B, S, layers, 2, G, C] of each sequence's first lens[b] tokens (padded to S)
        and the validity mask [B, S]."""
        rows, valid_BS = gather_sequences(self.pages, block_tables_BP, lens_B, max(S, 1))
        return rows, valid_BS

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        dev = self.pages.device
        self.pages[torch.as_tensor(dst, device=dev)] = self.pages[torch.as_tensor(src, device=dev)]


@torch.no_grad()
def forward_cached_hidden(
    model: torch.nn.Module,
    layer_ids: Sequence[int],
    input_ids_T: torch.Tensor,
    positions_T: torch.Tensor,
    seq_idx_T: torch.Tensor,
    cache: KVCache,
    block_tables_BP: torch.Tensor,
    seq_lens_B: torch.Tensor,
    logits_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`model.forward_cached(...)` (same arguments, same fp32 logits) plus the concatenated
    outputs of decoder layers `layer_ids` for every token: [T, L * D]."""
    wanted = set(layer_ids)
    captured: dict[int, torch.Tensor] = {}
    x_TD = model.model.embed_tokens(input_ids_T)
    shared: dict = {}  # the step's RoPE / slot tables, computed once (as model.forward_cached)
    pending_TD = None  # each layer's FFN output, added by the next norm's launch
    for i, layer in enumerate(model.model.layers):
        x_TD, pending_TD = layer.forward_cached_split(
            x_TD, pending_TD, positions_T, seq_idx_T, cache, block_tables_BP, seq_lens_B, shared
        )
        if i in wanted:
            captured[i] = x_TD + pending_TD  # the same add (and bits) the next norm makes
    hidden_TX = torch.cat([captured[i] for i in layer_ids], dim=-1)
    return model.cached_logits(x_TD, pending_TD, logits_indices), hidden_TX


def slots_of(
    block_tables_BP: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor, page_size: int
) -> torch.Tensor:
    return slot_mapping(block_tables_BP, seq_idx_T, positions_T, page_size)


@torch.no_grad()
def target_hidden(
    model: torch.nn.Module, layer_ids: Sequence[int], input_ids_BS: torch.Tensor, kv_sim: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-sequence target pass: (captured layer outputs [B, S, L * D], final-norm hidden
    [B, S, D]), the training-side twin of `forward_cached_hidden` (sequences start at position 0,
    right padding only)."""
    wanted = set(layer_ids)
    captured: dict[int, torch.Tensor] = {}
    positions_BS = torch.arange(input_ids_BS.shape[1], device=input_ids_BS.device).expand_as(input_ids_BS)
    x_BSD = model.model.embed_tokens(input_ids_BS)
    for i, layer in enumerate(model.model.layers):
        x_BSD = layer(x_BSD, positions_BS, None, kv_sim)
        if i in wanted:
            captured[i] = x_BSD
    return torch.cat([captured[i] for i in layer_ids], dim=-1), model.model.norm(x_BSD)

"""FlexAttention twin of the block-sparse MSA training attention (model/kernels/triton_msa_train.py).

What: `flex_block_mask` turns the MSA mask (same sequence, causal, key block among the token's
selected blocks) into a FlexAttention BlockMask built from the same tile lists as the Triton kernels
(`tile_pairs`): Q/KV blocks of `flex_block` tokens, fully allowed blocks listed as full (no mask_mod
there), the rest partial; `msa_train_flex` runs torch's flex_attention with it (compiled on CUDA with
dynamic=False, eager elsewhere). `model.kernels.sparse_attention` dispatches between the two.

Why kept: issue 10 asks to compare against FlexAttention and keep the faster; the H200 measurement
and why auto dispatch still prefers Triton (flex recompiles per sequence length) are in
benchmarks/RESULTS.md ("MSA training kernels v2", "Moved from module docstrings").

Legend: B batch, S sequence, H query heads, N KV heads, C head dim, K selected blocks.
"""

import torch

from model.kernels.triton_msa_train import compact_lists, tile_pairs


def flex_block_mask(
    selected_BNSK: torch.Tensor, seq_ids_BS: torch.Tensor, positions_BS: torch.Tensor, *, block_size: int,
    num_blocks: int, group: int, flex_block: int = 128, use_full_blocks: bool = True,
):  # fmt: skip
    """FlexAttention BlockMask of the MSA mask (H = N * group heads): Q/KV blocks of `flex_block`
    visited where some pair is allowed; with `use_full_blocks`, blocks whose every pair is allowed are
    listed as full (FlexAttention skips mask_mod there), the rest as partial (mask_mod decides)."""
    from torch.nn.attention.flex_attention import BlockMask

    B, N, S, _ = selected_BNSK.shape
    pairs = tile_pairs(selected_BNSK, seq_ids_BS, positions_BS, block_size=block_size, bq=flex_block,
                       tk=flex_block).repeat_interleave(group, dim=1)  # fmt: skip
    is_full = (pairs == flex_block * flex_block) & use_full_blocks
    kv_ids = torch.arange(pairs.shape[-1], device=pairs.device, dtype=torch.int32)
    partial, n_partial = compact_lists((pairs > 0) & ~is_full, kv_ids)
    full, n_full = compact_lists(is_full, kv_ids)
    sel = selected_BNSK.long()
    keep = torch.zeros((B, N, S, num_blocks + 1), dtype=torch.bool, device=sel.device)
    keep.scatter_(-1, sel.masked_fill(sel < 0, num_blocks), True)
    kblk = torch.where(seq_ids_BS >= 0, positions_BS // block_size, 0).clamp(max=num_blocks - 1)
    seq = seq_ids_BS.long()

    def mask_mod(b, h, q_idx, kv_idx):
        s_q, s_k = seq[b, q_idx], seq[b, kv_idx]
        return (s_q == s_k) & (s_k >= 0) & (kv_idx <= q_idx) & keep[b, h // group, q_idx, kblk[b, kv_idx]]

    return BlockMask.from_kv_blocks(
        n_partial, partial, n_full if use_full_blocks else None, full if use_full_blocks else None,
        BLOCK_SIZE=(flex_block, flex_block), mask_mod=mask_mod, seq_lengths=(S, S),
    )  # fmt: skip


_compiled_flex = None


def msa_train_flex(
    q_BSHC: torch.Tensor, k_BSNC: torch.Tensor, v_BSNC: torch.Tensor, selected_BNSK: torch.Tensor,
    seq_ids_BS: torch.Tensor, positions_BS: torch.Tensor, *, block_size: int, num_blocks: int,
    softmax_scale: float, flex_block: int = 128, use_full_blocks: bool = True,
) -> torch.Tensor:  # fmt: skip
    """The same attention through torch's FlexAttention with `flex_block_mask` (use_full_blocks=False:
    every visited block runs mask_mod, the 2026-11-30 version). Compiled on CUDA, eager elsewhere
    (eager applies mask_mod densely and ignores the block lists)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    block_mask = flex_block_mask(
        selected_BNSK, seq_ids_BS, positions_BS, block_size=block_size, num_blocks=num_blocks,
        group=q_BSHC.shape[2] // k_BSNC.shape[2], flex_block=flex_block, use_full_blocks=use_full_blocks,
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

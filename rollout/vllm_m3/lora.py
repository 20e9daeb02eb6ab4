"""vLLM LoRA layers for MiniMax-M3's fused attention projection, sharded as vLLM shards the base.

What: `M3QKVIndexerWithLoRA` wraps the sparse layers' `MinimaxM3QKVParallelLinearWithIndexer`
(one GEMM giving [q | k | v | index_q | index_k] per rank) with five LoRA slices;
`M3DenseQKVWithLoRA` wraps the dense layers' `QKVParallelLinear`, which shares the packed name
`qkv_proj` and so receives the same five-name list, with its three slices. `register_lora_layers`
puts both ahead of vLLM's own classes in the list `vllm.lora.utils.from_layer` tries.
Why: no vLLM 0.32 LoRA layer accepts the five-slice projection; vLLM skips it with a warning and the
q/k/v deltas of every sparse layer are lost.
Invariants, per tensor-parallel rank (vLLM's weight loader is the reference): q is sharded by query
heads (shard = rank); k, v and index_q by KV heads, replicated when tp > num_kv_heads (shard = rank //
replicas); index_k is one head replicated on every rank (shard 0, whole). A slice whose adapter is
absent (index_q / index_k unless trained) stays exactly zero. LoRA A is never sharded (no S-LoRA:
with fully_sharded_loras the layer is not wrapped and vLLM names it at start).
"""

from __future__ import annotations

import torch
from vllm.lora.layers import MergedQKVParallelLinearWithLoRA
from vllm.lora.layers.utils import _not_fully_sharded_can_replace
from vllm.model_executor.custom_op import maybe_get_oot_by_class
from vllm.model_executor.layers.linear import MinimaxM3QKVParallelLinearWithIndexer, QKVParallelLinear

FIVE_SLICES = ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj")
"""The adapter-visible modules packed into M3's `qkv_proj`, in the fused output's order."""


class M3QKVIndexerWithLoRA(MergedQKVParallelLinearWithLoRA):
    """LoRA on [q | k | v | index_q | index_k]: one (A, B) pair per slice, B sliced per rank."""

    def __init__(self, base_layer: MinimaxM3QKVParallelLinearWithIndexer) -> None:
        super().__init__(base_layer)
        b = base_layer
        kv_shard = self.tp_rank // b.num_kv_head_replicas
        self.n_slices = len(FIVE_SLICES)
        self.output_slices = (
            b.num_heads * b.head_size,
            b.num_kv_heads * b.head_size,
            b.num_kv_heads * b.head_size,
            b.num_index_heads * b.index_head_size,
            b.index_head_size,
        )
        self.output_ids = (self.tp_rank, kv_shard, kv_shard, kv_shard, 0)
        if sum(self.output_slices) != b.output_size_per_partition:
            raise ValueError(
                f"{b.prefix}: the five LoRA slices {self.output_slices} do not add up to the fused "
                f"projection's {b.output_size_per_partition} outputs on rank {self.tp_rank}"
            )

    @classmethod
    @_not_fully_sharded_can_replace
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return (
            type(source_layer) is MinimaxM3QKVParallelLinearWithIndexer
            and tuple(packed_modules_list) == FIVE_SLICES
        )


class M3DenseQKVWithLoRA(MergedQKVParallelLinearWithLoRA):
    """The dense layers' q|k|v under the five-name packed list: index_q / index_k have no slice here
    (a dense layer has no indexer), so an adapter for them is refused rather than dropped."""

    @classmethod
    @_not_fully_sharded_can_replace
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return (
            type(source_layer) is maybe_get_oot_by_class(QKVParallelLinear)
            and tuple(packed_modules_list) == FIVE_SLICES
        )

    def set_lora(self, index: int, lora_a, lora_b) -> None:
        if isinstance(lora_b, list) and len(lora_b) == len(FIVE_SLICES):
            if any(t is not None for t in lora_b[3:]):
                raise ValueError(
                    f"{self.base_layer.prefix}: the adapter has index_q_proj / index_k_proj factors for a "
                    "dense-attention layer, which has no indexer"
                )
            lora_a, lora_b = lora_a[:3], lora_b[:3]
        super().set_lora(index, lora_a, lora_b)


def register_lora_layers() -> None:
    """Put the M3 classes first in the list vLLM's `from_layer` tries (idempotent)."""
    import vllm.lora.utils as lora_utils

    mine = (M3QKVIndexerWithLoRA, M3DenseQKVWithLoRA)
    rest = tuple(c for c in lora_utils._all_lora_classes if c not in mine)
    lora_utils._all_lora_classes = mine + rest


def effective_delta(layer: MergedQKVParallelLinearWithLoRA, index: int = 0) -> list[torch.Tensor]:
    """Per slice, the rank's B @ A held in slot `index` (scaling already folded into B by vLLM)."""
    return [
        layer.lora_b_stacked[i][index, 0].float() @ layer.lora_a_stacked[i][index, 0].float()
        for i in range(layer.n_slices)
    ]

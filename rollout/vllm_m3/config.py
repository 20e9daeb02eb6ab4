"""vLLM config class for `model_type: minimax_m3_vl_text`, the flat text config of transformers' port.

What: `MiniMaxM3TextConfigForVLLM`, vLLM's own `MiniMaxM3TextConfig` (the schema its M3 model reads)
under the port's text model_type; keys the port writes flat are turned into the legacy ones vLLM
reads when a file has only the flat ones (`layer_types` -> `sparse_attention_config`,
`mlp_layer_types` -> `moe_layer_freq`, `rope_parameters` -> `rope_theta` / `partial_rotary_factor`,
`index_*` -> `sparse_*`). Why: the project writes float checkpoints in that layout so transformers'
AutoModelForCausalLM loads them; without this vLLM would parse them with transformers' class, which
drops the sparse/MoE layer pattern. Invariants: legacy keys present in the file win (the project
writes both, equal); the port's `hidden_act: "silu"` is its name for swigluoai and is read so.
"""

from __future__ import annotations

from typing import Any

from vllm.transformers_utils.configs.minimax_m3 import MiniMaxM3TextConfig

_FLAT_TO_SPARSE = {
    "index_n_heads": "sparse_num_index_heads",
    "index_head_dim": "sparse_index_dim",
    "index_block_size": "sparse_block_size",
    "index_topk_blocks": "sparse_topk_blocks",
    "index_local_blocks": "sparse_local_block",
    "index_init_blocks": "sparse_init_block",
}


def legacy_keys(kw: dict[str, Any]) -> dict[str, Any]:
    """The keys vLLM's M3 reads, derived from the flat ones where the dict lacks them."""
    kw = dict(kw)
    layer_types = kw.get("layer_types")
    if "sparse_attention_config" not in kw and layer_types is not None:
        freq = [int(t == "minimax_m3_sparse") for t in layer_types]
        sc = {"use_sparse_attention": any(freq), "sparse_attention_freq": freq,
              "sparse_disable_index_value": freq, "sparse_score_type": "max"}  # fmt: skip
        sc.update({legacy: kw[flat] for flat, legacy in _FLAT_TO_SPARSE.items() if flat in kw})
        kw["sparse_attention_config"] = sc
    if "moe_layer_freq" not in kw and kw.get("mlp_layer_types") is not None:
        kw["moe_layer_freq"] = [int(t == "sparse") for t in kw["mlp_layer_types"]]
    rope = kw.get("rope_parameters") or {}
    if "rope_theta" not in kw and "rope_theta" in rope:
        kw["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" not in kw and "partial_rotary_factor" in rope:
        kw["partial_rotary_factor"] = rope["partial_rotary_factor"]
    if kw.get("hidden_act", "silu") == "silu":
        kw["hidden_act"] = "swigluoai"
    return kw


class MiniMaxM3TextConfigForVLLM(MiniMaxM3TextConfig):
    model_type = "minimax_m3_vl_text"

    def __init__(self, **kwargs: Any):
        super().__init__(**legacy_keys(kwargs))

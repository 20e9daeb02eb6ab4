"""Model configuration for the MiniMax-M3 family (M3, M3.1-Flash) and its small test twins.

What: `ModelConfig` (architecture, cache dtypes, weight quantization) and `QuantConfig` (one weight
scheme per group of linear layers), both validated in `__post_init__`; presets; and loading /
saving the two config.json styles seen in the wild:
  (a) `minimax_m3_text` (vLLM's loader): expert width as `intermediate_size`, sparse attention as a
      `sparse_attention_config` dict with `sparse_*` keys and per-layer 0/1 lists, `moe_layer_freq`;
  (b) `minimax_m3_vl` (transformers port): a top-level dict holding `text_config` (flat keys
      `layer_types`, `mlp_layer_types`, `index_*`, `rope_parameters`) and `vision_config`.
The ModelOpt `quantization_config` (or `hf_quant_config.json`) is read into `QuantConfig`.

Why: every module builds itself from this one object, so a wrong or unknown key must fail here,
loudly, naming the field and the fix, rather than produce a silently different model.

Invariants: one entry per layer in `layer_types` / `mlp_layer_types`; one indexer head per KV
group (`index_n_heads == num_key_value_heads`); a weight group in NVFP4 (MXFP8) has every K dim a
multiple of 16 (32); a quantized group is quantized in every layer (no per-layer exceptions).
Defaults describe the full-size M3 architecture, unquantized with a bf16 KV cache; the presets
add the published quantization. `to_hf_dict` writes style (a)'s model_type "minimax_m3_text" with
the flat (b) keys plus the legacy mirrors vLLM reads; `from_hf_dict(cfg.to_hf_dict()) == cfg`.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

WeightDtype = Literal["bf16", "fp8", "mxfp8", "nvfp4"]
# "nvfp4_4over6": NVFP4 pages whose block scales the writer picks by the 4-over-6 rule (same bytes
# per token, same dequantization as "nvfp4"; see model/kv_cache.py).
CacheDtype = Literal["bf16", "fp8", "nvfp4", "nvfp4_4over6"]
LayerType = Literal["full_attention", "minimax_m3_sparse"]
MlpLayerType = Literal["dense", "sparse"]

QUANT_GROUPS = ("routed_experts", "shared_experts", "dense_mlp", "attention")
PRESETS = ("m3", "m3.1-flash", "small", "tiny", "tiny-vl")

# K-dim granularity each scheme's block scales need (NVFP4: 16-value blocks, MXFP8: 32).
_K_MULTIPLE = {"bf16": 1, "fp8": 1, "mxfp8": 32, "nvfp4": 16}
_ALGO_TO_DTYPE = {"FP8": "fp8", "MXFP8": "mxfp8", "NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4"}
_KV_ALGO_TO_DTYPE = {"FP8": "fp8", "NVFP4": "nvfp4"}

# HF keys that carry nothing this project's model uses (training knobs, bookkeeping, activation
# names: the swigluoai activation is fixed by swiglu_alpha / swiglu_limit). Dropped on load.
IGNORED_HF_KEYS = frozenset(
    {
        "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
        "initializer_range", "attention_dropout", "use_cache", "router_aux_loss_coef",
        "output_router_logits", "router_jitter_noise", "hidden_act", "auto_map", "_name_or_path",
        "name_or_path", "output_attentions", "output_hidden_states", "return_dict", "id2label",
        "label2id", "problem_type", "tokenizer_class", "chunk_size_feed_forward",
        "is_encoder_decoder", "_attn_implementation", "keys_to_ignore_at_inference",
    }
)  # fmt: skip
# Legacy (style a) keys that describe variants this project does not implement: accepted only
# with the value of the published models.
_PINNED_KEYS = {
    "use_gemma_norm": True,
    "attention_output_gate": False,
    "swiglu_beta": 1.0,
    "use_qk_norm": True,
    "qk_norm_type": "per_head",
    "n_shared_experts": 1,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
}
_SPARSE_KEYS = {  # style (a) sparse_attention_config key -> field
    "sparse_num_index_heads": "index_n_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "index_block_size",
    "sparse_topk_blocks": "index_topk_blocks",
    "sparse_local_block": "index_local_blocks",
    "sparse_init_block": "index_init_blocks",
}
_ALIASES = {"intermediate_size": "moe_intermediate_size", "num_experts": "num_local_experts"}
# Top level of a style (b) dict besides text_config / vision_config / quantization_config: kept
# verbatim in `vl_extras` (round-trip exact); `ModelConfig.vision` parses them with the vision part.
_VL_TOP_KEYS = frozenset(
    {"image_token_index", "video_token_index", "image_token_id", "video_token_id",
     "projector_hidden_size", "img_token_compression_config", "merged_hidden_size",
     # the released config.json's other multimodal keys (model/vision/config.py VISION_TOP_LEVEL_KEYS)
     "vision_start_token_id", "vision_end_token_id", "projector_hidden_act", "multimodal_projector_bias",
     "image_seq_length", "process_image_mode", "vision_feature_layer", "vision_feature_select_strategy"}
)  # fmt: skip


def _check_literal(name: str, value: Any, lit: Any) -> None:
    if value not in get_args(lit):
        raise ValueError(f"{name}={value!r} is invalid; choose one of {list(get_args(lit))}")


def _matches(name: str, patterns: list[str]) -> bool:
    """ModelOpt exclude semantics: a wildcard pattern, or a module prefix covering `name`."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in patterns)


@dataclass
class QuantConfig:
    """Storage scheme per group of linear weights. Embeddings, lm_head, norms and the (fp32)
    router are never quantized. Indexer projections follow `attention` unless `exclude_modules`
    matches them. `exclude_modules` holds ModelOpt patterns of modules kept in bf16."""

    routed_experts: WeightDtype = "bf16"
    shared_experts: WeightDtype = "bf16"
    dense_mlp: WeightDtype = "bf16"
    attention: WeightDtype = "bf16"
    exclude_modules: list[str] = field(default_factory=list)
    # NVFP4 groups also fake-quantize activations (ModelOpt "NVFP4" = W4A4) instead of weight-only
    # ("W4A16_NVFP4"); the H200 has no FP4 tensor cores, so weight-only is the default.
    nvfp4_act_quant: bool = False

    def __post_init__(self) -> None:
        for g in QUANT_GROUPS:
            _check_literal(f"QuantConfig.{g}", getattr(self, g), WeightDtype)
        if not all(isinstance(p, str) for p in self.exclude_modules):
            raise ValueError(f"QuantConfig.exclude_modules must be a list of str, got {self.exclude_modules}")
        self.exclude_modules = list(self.exclude_modules)

    @property
    def is_quantized(self) -> bool:
        return any(getattr(self, g) != "bf16" for g in QUANT_GROUPS)

    def default_excludes(self) -> list[str]:
        """Patterns that keep every bf16 part out of a single-algo ModelOpt reader's reach; written
        when `exclude_modules` is empty (and read back as empty)."""
        out = ["lm_head", "model.embed_tokens", "*.block_sparse_moe.gate"]
        pats = {
            "attention": "*.self_attn.*",
            "dense_mlp": "*.mlp.*",
            "shared_experts": "*.shared_experts.*",
            "routed_experts": "*.block_sparse_moe.experts.*",
        }
        return out + [pats[g] for g in QUANT_GROUPS if getattr(self, g) == "bf16"]


def _m3_layer_types() -> list[str]:
    return ["full_attention"] * 3 + ["minimax_m3_sparse"] * 57


def _m3_mlp_types() -> list[str]:
    return ["dense"] * 3 + ["sparse"] * 57


@dataclass
class ModelConfig:
    vocab_size: int = 200064
    hidden_size: int = 6144
    num_hidden_layers: int = 60
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    dense_intermediate_size: int = 12288
    moe_intermediate_size: int = 3072
    shared_intermediate_size: int = 3072
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    routed_scaling_factor: float = 2.0
    layer_types: list[LayerType] = field(default_factory=_m3_layer_types)
    mlp_layer_types: list[MlpLayerType] = field(default_factory=_m3_mlp_types)
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128  # also the KV page size: a page must equal one indexer block
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    index_init_blocks: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rope_theta: float = 5_000_000.0
    rotary_dim: int = 64  # NeoX rotation of the first rotary_dim dims of each head
    max_position_embeddings: int = 524288
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_mtp_modules: int = 1
    bos_token_id: int | None = 200034
    eos_token_id: int | list[int] | None = 200020
    pad_token_id: int | None = None
    kv_cache_dtype: CacheDtype = "bf16"
    index_cache_dtype: CacheDtype = "bf16"
    kv_cache_dtype_overrides: dict[int, CacheDtype] = field(default_factory=dict)
    quantization: QuantConfig = field(default_factory=QuantConfig)
    vision_config: dict | None = None  # style (b) vision tower, carried verbatim (not modelled)
    vl_extras: dict = field(default_factory=dict)  # style (b) top-level multimodal keys

    # ----------------------------------------------------------------------------- validation
    def __post_init__(self) -> None:
        if isinstance(self.quantization, dict):
            self.quantization = QuantConfig(**self.quantization)
        L = self.num_hidden_layers
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "index_n_heads", "index_head_dim",
                     "index_block_size", "index_topk_blocks", "max_position_embeddings"):  # fmt: skip
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        for name, lit in (("layer_types", LayerType), ("mlp_layer_types", MlpLayerType)):
            vals = list(getattr(self, name))
            if len(vals) != L:
                raise ValueError(
                    f"{name} has {len(vals)} entries but num_hidden_layers={L}; give one entry per "
                    f"layer (choices {list(get_args(lit))})"
                )
            for i, v in enumerate(vals):
                _check_literal(f"{name}[{i}]", v, lit)
            setattr(self, name, vals)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (GQA groups)"
            )
        if self.index_n_heads != self.num_key_value_heads:
            raise ValueError(
                f"index_n_heads={self.index_n_heads} must equal num_key_value_heads="
                f"{self.num_key_value_heads}: the indexer scores one block set per KV group"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= min(self.head_dim, self.index_head_dim):
            raise ValueError(
                f"rotary_dim={self.rotary_dim} must be even, > 0 and <= head_dim={self.head_dim} and "
                f"index_head_dim={self.index_head_dim}"
            )
        if self.index_local_blocks < 0 or self.index_init_blocks < 0:
            raise ValueError("index_local_blocks and index_init_blocks must be >= 0")
        if self.index_topk_blocks < self.index_local_blocks + self.index_init_blocks:
            raise ValueError(
                f"index_topk_blocks={self.index_topk_blocks} must be >= index_local_blocks="
                f"{self.index_local_blocks} + index_init_blocks={self.index_init_blocks} (forced blocks)"
            )
        if "sparse" in self.mlp_layer_types and not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_local_experts="
                f"{self.num_local_experts}]"
            )
        for name in ("dense_intermediate_size", "moe_intermediate_size", "shared_intermediate_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_mtp_modules < 0:
            raise ValueError(f"num_mtp_modules must be >= 0, got {self.num_mtp_modules}")
        _check_literal("kv_cache_dtype", self.kv_cache_dtype, CacheDtype)
        _check_literal("index_cache_dtype", self.index_cache_dtype, CacheDtype)
        self.kv_cache_dtype_overrides = dict(self.kv_cache_dtype_overrides)
        for layer, dt in self.kv_cache_dtype_overrides.items():
            if not isinstance(layer, int) or not 0 <= layer < L:
                raise ValueError(
                    f"kv_cache_dtype_overrides key {layer!r} must be an int layer id in [0, {L - 1}]"
                )
            _check_literal(f"kv_cache_dtype_overrides[{layer}]", dt, CacheDtype)
        kv_dtypes = [self.kv_cache_dtype, *self.kv_cache_dtype_overrides.values()]
        if any(d.startswith("nvfp4") for d in kv_dtypes) and self.head_dim % 16:
            raise ValueError(f"an nvfp4 KV cache needs head_dim % 16 == 0, got head_dim={self.head_dim}")
        if self.index_cache_dtype.startswith("nvfp4") and self.index_head_dim % 16:
            raise ValueError(
                f"an nvfp4 index cache needs index_head_dim % 16 == 0, got {self.index_head_dim}"
            )
        self._validate_quantization()

    def _validate_quantization(self) -> None:
        q = self.quantization
        inner_k = {  # besides hidden_size, the other reduction (K) dim of each group's linears
            "attention": ("num_attention_heads*head_dim", self.q_size),
            "dense_mlp": ("dense_intermediate_size", self.dense_intermediate_size),
            "shared_experts": ("shared_intermediate_size", self.shared_intermediate_size),
            "routed_experts": ("moe_intermediate_size", self.moe_intermediate_size),
        }
        for g in QUANT_GROUPS:
            scheme = getattr(q, g)
            mult = _K_MULTIPLE[scheme]
            for dim_name, dim in (("hidden_size", self.hidden_size), inner_k[g]):
                if dim % mult:
                    raise ValueError(
                        f"quantization.{g}={scheme!r} needs {dim_name} % {mult} == 0, got {dim}; "
                        f"pick a size that is a multiple of {mult} or keep {g} in bf16"
                    )
            if scheme == "bf16":
                continue
            if not self.group_modules(g):
                raise ValueError(f"quantization.{g}={scheme!r} but no layer has that part; set it to 'bf16'")
            hit = [m for m in self.group_modules(g) if _matches(m, q.exclude_modules)]
            if hit:
                raise ValueError(
                    f"quantization.{g}={scheme!r} but exclude_modules {q.exclude_modules} keeps "
                    f"{hit[0]} in bf16; per-layer exceptions are not supported: set {g}='bf16' or "
                    f"drop the pattern"
                )

    # ----------------------------------------------------------------------------- helpers
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_sparse_layer(self, i: int) -> bool:
        return self.layer_types[i] == "minimax_m3_sparse"

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"

    def kv_dtype_for_layer(self, i: int) -> CacheDtype:
        if not 0 <= i < self.num_hidden_layers:
            raise IndexError(f"layer {i} out of range [0, {self.num_hidden_layers})")
        return self.kv_cache_dtype_overrides.get(i, self.kv_cache_dtype)

    def group_modules(self, group: str) -> list[str]:
        """Representative linear-module names of a quantization group (expert 0 stands for all)."""
        names: list[str] = []
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            if group == "attention":
                names += [f"{p}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            elif group == "dense_mlp" and not self.is_moe_layer(i):
                names += [f"{p}.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
            elif group == "shared_experts" and self.is_moe_layer(i):
                names += [
                    f"{p}.block_sparse_moe.shared_experts.{n}" for n in ("gate_proj", "up_proj", "down_proj")
                ]
            elif group == "routed_experts" and self.is_moe_layer(i):
                names += [f"{p}.block_sparse_moe.experts.0.{n}" for n in ("w1", "w2", "w3")]
        return names

    def module_dtype(self, name: str) -> WeightDtype:
        """Storage scheme of the linear weight `name` (checkpoint naming, `mtp.*` included)."""
        q = self.quantization
        if _matches(name, q.exclude_modules):
            return "bf16"
        if ".block_sparse_moe.experts." in name:
            return q.routed_experts
        if ".shared_experts." in name:
            return q.shared_experts
        if ".mlp." in name:
            return q.dense_mlp
        if ".self_attn." in name and name.endswith("_proj"):
            return q.attention
        return "bf16"

    # ----------------------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        if name == "m3":
            # Published M3: MXFP8 routed experts, everything else bf16, FP8 KV. Checkpoint check
            # (model/capacity.py, no MTP): experts 413.1e9 params x (1 + 1/32) B = 426.0 GB, the
            # other 13.1e9 params at 2 B (router fp32) = 26.2 GB -> 452.2 GB vs 451.5 GB published
            # (+0.2%). All-MXFP8 except norms/router/embeddings/lm_head would give 441.9 GB (-2.1%).
            return cls(kv_cache_dtype="fp8", quantization=QuantConfig(routed_experts="mxfp8"))
        if name == "m3.1-flash":
            # ModelOpt MIXED_PRECISION: NVFP4 routed experts (232.4 GB), MXFP8 attention / dense /
            # shared (10.9 GB), bf16 embeddings + lm_head (4.9 GB), fp32 router (0.2 GB) -> 248.4 GB vs
            # 250.1 GB published (-0.7%).
            q = QuantConfig(
                routed_experts="nvfp4", shared_experts="mxfp8", dense_mlp="mxfp8", attention="mxfp8"
            )
            return cls(kv_cache_dtype="nvfp4", quantization=q)
        if name == "small":
            # ~0.39e9 params, ~0.1e9 active: the M3 structure at a size one GPU trains quickly.
            return cls(
                vocab_size=32768, hidden_size=1024, num_hidden_layers=12, num_attention_heads=8,
                num_key_value_heads=4, head_dim=128, dense_intermediate_size=3072,
                moe_intermediate_size=256, shared_intermediate_size=256, num_local_experts=32,
                num_experts_per_tok=4, layer_types=["full_attention"] * 2 + ["minimax_m3_sparse"] * 10,
                mlp_layer_types=["dense"] * 2 + ["sparse"] * 10, index_n_heads=4,
                max_position_embeddings=65536, rope_theta=1_000_000.0, num_mtp_modules=0,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                quantization=QuantConfig(routed_experts="nvfp4"),
            )  # fmt: skip
        if name == "tiny":
            # ~1.1e6 params, CPU-fast. rope_theta 1e4: with only 8 rotary frequencies and 4096
            # positions, M3's 5e6 would leave almost no usable positional signal.
            return cls(
                vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, dense_intermediate_size=256,
                moe_intermediate_size=64, shared_intermediate_size=64, num_local_experts=8,
                num_experts_per_tok=2, layer_types=["full_attention"] + ["minimax_m3_sparse"] * 3,
                mlp_layer_types=["dense"] + ["sparse"] * 3, index_n_heads=2, index_head_dim=32,
                index_block_size=16, index_topk_blocks=2, index_local_blocks=1, rotary_dim=16,
                rope_theta=10_000.0, max_position_embeddings=4096, num_mtp_modules=0,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                quantization=QuantConfig(routed_experts="nvfp4"),
            )  # fmt: skip
        if name == "tiny-vl":
            # `tiny` plus the tiny vision tower (model/vision/config.py), written as the released
            # minimax_m3_vl config.json spells it, so it saves and reloads like a real VL checkpoint.
            from model.vision.config import VisionConfig

            vision, top = VisionConfig.preset("tiny").to_hf_dict()
            return dataclasses.replace(cls.preset("tiny"), vision_config=vision, vl_extras=top)
        raise ValueError(f"unknown preset {name!r}; valid presets: {list(PRESETS)}")

    # ----------------------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        """Build from a config.json dict of style (a) or (b) (see the module docstring)."""
        d = copy.deepcopy(d)
        vision, extras, quant_raw = None, {}, d.pop("quantization_config", None)
        if "text_config" in d:
            text = d.pop("text_config")
            if not isinstance(text, dict):
                raise ValueError(f"text_config must be a dict, got {type(text).__name__}")
            vision = d.pop("vision_config", None)
            if "tie_word_embeddings" in d:
                text.setdefault("tie_word_embeddings", d["tie_word_embeddings"])
                if text["tie_word_embeddings"] != d.pop("tie_word_embeddings"):
                    raise ValueError("top-level and text_config tie_word_embeddings disagree")
            extras = {k: d.pop(k) for k in list(d) if k in _VL_TOP_KEYS}
            unknown = sorted(k for k in d if k not in IGNORED_HF_KEYS)
            if unknown:
                valid = sorted(
                    {"text_config", "vision_config", "quantization_config", "tie_word_embeddings"}
                    | _VL_TOP_KEYS
                )
                raise ValueError(f"unknown top-level config keys {unknown}; valid keys: {valid}")
        else:
            text = d
        if "quantization_config" in text:
            if quant_raw is not None:
                raise ValueError("quantization_config given both at top level and inside text_config")
            quant_raw = text.pop("quantization_config")
        kwargs = _parse_text_keys(text)
        cfg = cls(**kwargs, vision_config=vision, vl_extras=extras)
        if quant_raw is None:
            return cfg
        quant, kv_dtype = _quant_from_hf(quant_raw, cfg)
        if kv_dtype is not None and "kv_cache_dtype" in kwargs and kwargs["kv_cache_dtype"] != kv_dtype:
            raise ValueError(
                f"kv_cache_dtype={kwargs['kv_cache_dtype']!r} disagrees with the quantization_config's "
                f"kv_cache_quant_algo ({kv_dtype!r})"
            )
        return dataclasses.replace(cfg, quantization=quant, kv_cache_dtype=kv_dtype or cfg.kv_cache_dtype)

    @property
    def vision(self):
        """The vision tower's `model.vision.VisionConfig` parsed from `vision_config` + `vl_extras`
        (None for a text-only config); validated on every access, so a bad vision part is named."""
        if self.vision_config is None:
            return None
        from model.vision.config import VisionConfig

        return VisionConfig.from_hf_dict(
            self.vision_config, self.vl_extras, text_hidden_size=self.hidden_size
        )

    def to_hf_dict(self) -> dict:
        """Style (a) model_type "minimax_m3_text" with the flat style (b) keys, plus the legacy
        mirrors (`sparse_attention_config`, `moe_layer_freq`, `rope_theta`) that vLLM's loader
        reads; wrapped as style (b) (`text_config` + `vision_config`) when a vision part exists."""
        L = self.num_hidden_layers
        sparse_freq = [int(self.is_sparse_layer(i)) for i in range(L)]
        text: dict[str, Any] = {
            "model_type": "minimax_m3_text",
            "architectures": ["MiniMaxM3SparseForCausalLM"],
            "hidden_act": "swigluoai",
            **{
                f.name: copy.deepcopy(getattr(self, f.name))
                for f in dataclasses.fields(self)
                if f.name not in ("quantization", "vision_config", "vl_extras", "moe_intermediate_size",
                                  "kv_cache_dtype_overrides")
            },
            "intermediate_size": self.moe_intermediate_size,  # both styles' name for the expert width
            "kv_cache_dtype_overrides": {str(k): v for k, v in sorted(self.kv_cache_dtype_overrides.items())},
            "partial_rotary_factor": self.rotary_dim / self.head_dim,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.rotary_dim / self.head_dim,
            },
            "moe_layer_freq": [int(self.is_moe_layer(i)) for i in range(L)],
            "sparse_attention_config": {
                "use_sparse_attention": any(sparse_freq),
                "sparse_num_index_heads": self.index_n_heads,
                "sparse_index_dim": self.index_head_dim,
                "sparse_block_size": self.index_block_size,
                "sparse_topk_blocks": self.index_topk_blocks,
                "sparse_local_block": self.index_local_blocks,
                "sparse_init_block": self.index_init_blocks,
                "sparse_score_type": "max",
                "sparse_attention_freq": sparse_freq,
                "sparse_disable_index_value": sparse_freq,
            },
        }  # fmt: skip
        quant = _quant_to_hf(self, exclude_key="ignore")
        if self.vision_config is None and not self.vl_extras:
            return {**text, **({"quantization_config": quant} if quant else {})}
        out: dict[str, Any] = {"model_type": "minimax_m3_vl", "text_config": text}
        out["vision_config"] = copy.deepcopy(self.vision_config)
        out.update(copy.deepcopy(self.vl_extras))
        if quant:
            out["quantization_config"] = quant
        return out

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write config.json (and the legacy ModelOpt hf_quant_config.json when quantized)."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.to_hf_dict(), f, indent=2)
        quant = _quant_to_hf(self, exclude_key="exclude_modules")
        if quant:
            quant.pop("quant_method")
            with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
                json.dump({"producer": {"name": "modelopt"}, "quantization": quant}, f, indent=2)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            d = json.load(f)
        hq_path = os.path.join(path, "hf_quant_config.json")
        if not os.path.exists(hq_path):
            return cls.from_hf_dict(d)
        with open(hq_path) as f:
            hq = json.load(f)
        has_embedded = "quantization_config" in d or "quantization_config" in d.get("text_config", {})
        if not has_embedded:
            return cls.from_hf_dict({**d, "quantization_config": hq})
        cfg = cls.from_hf_dict(d)
        other, _ = _quant_from_hf(hq, cfg)
        if other != cfg.quantization:
            raise ValueError(
                f"{hq_path} ({other}) disagrees with config.json's quantization_config "
                f"({cfg.quantization}); delete the stale one"
            )
        return cfg


# --------------------------------------------------------------------------------- HF parsing
def _parse_text_keys(text: dict) -> dict[str, Any]:
    """Map a text-config dict (either style) to ModelConfig kwargs; disagreeing duplicates fail."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - {
        "quantization",
        "vision_config",
        "vl_extras",
    }
    out: dict[str, Any] = {}
    source: dict[str, str] = {}

    def put(key: str, value: Any, src: str) -> None:
        if key in out and out[key] != value:
            raise ValueError(
                f"config keys {source[key]!r} and {src!r} disagree on {key}: {out[key]!r} vs {value!r}"
            )
        out[key], source[key] = value, src

    rotary_factors: list[tuple[float, str]] = []
    unknown = []
    for k, v in text.items():
        if k in fields:
            if k == "kv_cache_dtype_overrides":
                v = {int(layer): dt for layer, dt in v.items()}
            put(k, v, k)
        elif k in _ALIASES:
            put(_ALIASES[k], v, k)
        elif k == "moe_layer_freq":
            put("mlp_layer_types", ["sparse" if f else "dense" for f in v], k)
        elif k == "partial_rotary_factor":
            rotary_factors.append((v, k))
        elif k == "rope_parameters":
            rope = dict(v or {})
            if rope.pop("rope_type", "default") != "default":
                raise ValueError(
                    f"rope_parameters {v} asks for RoPE scaling; only rope_type 'default' is supported"
                )
            if "rope_theta" in rope:
                put("rope_theta", rope.pop("rope_theta"), "rope_parameters.rope_theta")
            if "partial_rotary_factor" in rope:
                rotary_factors.append(
                    (rope.pop("partial_rotary_factor"), "rope_parameters.partial_rotary_factor")
                )
            if rope:
                raise ValueError(
                    f"unknown rope_parameters keys {sorted(rope)}; valid: rope_type, rope_theta, "
                    "partial_rotary_factor"
                )
        elif k == "sparse_attention_config":
            _parse_sparse(dict(v or {}), put)
        elif k in _PINNED_KEYS:
            if v != _PINNED_KEYS[k]:
                raise ValueError(f"{k}={v!r} is not supported (only {_PINNED_KEYS[k]!r}, as in MiniMax-M3)")
        elif k not in IGNORED_HF_KEYS:
            unknown.append(k)
    if unknown:
        valid = sorted(
            fields
            | set(_ALIASES)
            | set(_PINNED_KEYS)
            | IGNORED_HF_KEYS
            | {"moe_layer_freq", "partial_rotary_factor", "rope_parameters", "sparse_attention_config"}
        )
        raise ValueError(f"unknown config keys {sorted(unknown)}; valid keys: {valid}")
    head_dim = out.get("head_dim", ModelConfig.head_dim)
    for factor, src in rotary_factors:
        put("rotary_dim", round(head_dim * factor), src)
    return out


def _parse_sparse(sc: dict, put: Any) -> None:
    freq = sc.pop("sparse_attention_freq", None)
    use = sc.pop("use_sparse_attention", True)
    if freq is not None:
        put(
            "layer_types",
            ["minimax_m3_sparse" if f else "full_attention" for f in freq],
            "sparse_attention_freq",
        )
    if not use and freq is not None and any(freq):
        raise ValueError(
            "sparse_attention_config: use_sparse_attention is false but sparse_attention_freq has 1s"
        )
    if (score := sc.pop("sparse_score_type", "max")) != "max":
        raise ValueError(
            f"sparse_score_type={score!r} is not supported (only 'max': max over a block's tokens)"
        )
    # Per-layer "no value branch in the indexer"; the only variant implemented is the published one,
    # where every sparse layer has it set.
    disable = sc.pop("sparse_disable_index_value", None)
    if disable is not None and freq is not None and [bool(x) for x in disable] != [bool(x) for x in freq]:
        raise ValueError(
            "sparse_disable_index_value must equal sparse_attention_freq (indexer without values)"
        )
    for legacy, name in _SPARSE_KEYS.items():
        if legacy in sc:
            put(name, sc.pop(legacy), f"sparse_attention_config.{legacy}")
    if sc:
        valid = sorted(
            [
                *_SPARSE_KEYS,
                "sparse_attention_freq",
                "use_sparse_attention",
                "sparse_score_type",
                "sparse_disable_index_value",
            ]
        )
        raise ValueError(f"unknown sparse_attention_config keys {sorted(sc)}; valid keys: {valid}")


_QUANT_KEYS = frozenset(
    {"quant_method", "quant_algo", "kv_cache_quant_algo", "kv_cache_scheme", "group_size",
     "exclude_modules", "ignore", "quantized_layers", "producer"}
)  # fmt: skip


def _lookup_algo(name: str, layers: dict[str, dict]) -> str | None:
    """quant_algo of module `name` in a MIXED_PRECISION `quantized_layers` map (exact or parent key)."""
    for key, info in layers.items():
        if name == key or name.startswith(key + ".") or key.startswith(name + "."):
            return str(info.get("quant_algo", "")).upper()
    return None


def _check_algo(algo: str | None, group_size: Any, where: str) -> None:
    if algo is not None and algo not in _ALGO_TO_DTYPE:
        raise ValueError(
            f"{where}: unsupported quant_algo {algo!r}; supported: {sorted(_ALGO_TO_DTYPE)} "
            "and MIXED_PRECISION"
        )
    want = {"nvfp4": 16, "mxfp8": 32}.get(_ALGO_TO_DTYPE.get(algo or "", ""))
    if group_size is not None and want is not None and group_size != want:
        raise ValueError(f"{where}: {algo} needs group_size {want}, got {group_size}")


def _quant_from_hf(raw: dict, cfg: ModelConfig) -> tuple[QuantConfig, CacheDtype | None]:
    """ModelOpt quantization config (embedded or hf_quant_config.json) -> (QuantConfig, KV dtype)."""
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config must be a dict, got {type(raw).__name__}")
    q = raw
    if "quantization" in raw:
        if set(raw) - {"quantization", "producer", "quant_method"}:
            raise ValueError(
                f"unknown keys {sorted(set(raw) - {'quantization', 'producer', 'quant_method'})} "
                "beside 'quantization' in the ModelOpt config"
            )
        q = raw["quantization"]
    if unknown := sorted(set(q) - _QUANT_KEYS):
        raise ValueError(f"unknown quantization_config keys {unknown}; valid keys: {sorted(_QUANT_KEYS)}")
    method = str(raw.get("quant_method", q.get("quant_method", "modelopt"))).lower()
    if not method.startswith("modelopt"):
        raise ValueError(f"quant_method={method!r} is not supported; only ModelOpt ('modelopt') configs are")
    algo = str(q.get("quant_algo") or "").upper()
    if not algo:
        raise ValueError("quantization_config has no quant_algo")
    if "ignore" in q and "exclude_modules" in q and q["ignore"] != q["exclude_modules"]:
        raise ValueError("quantization_config 'ignore' and 'exclude_modules' disagree")
    excludes = list(q.get("exclude_modules", q.get("ignore", [])) or [])
    kv_algo = q.get("kv_cache_quant_algo")
    kv = None
    if kv_algo is not None:
        if str(kv_algo).upper() not in _KV_ALGO_TO_DTYPE:
            raise ValueError(
                f"kv_cache_quant_algo={kv_algo!r} unsupported; supported: {sorted(_KV_ALGO_TO_DTYPE)}"
            )
        kv = _KV_ALGO_TO_DTYPE[str(kv_algo).upper()]
    elif isinstance(scheme := q.get("kv_cache_scheme"), dict) and scheme.get("num_bits") == 8:
        kv = "fp8"
    groups: dict[str, str] = {}
    found_algos: set[str] = set()
    if algo == "MIXED_PRECISION":
        layers = q.get("quantized_layers") or {}
        if not isinstance(layers, dict) or not layers:
            raise ValueError("MIXED_PRECISION needs a non-empty 'quantized_layers' mapping")
        for key, info in layers.items():
            _check_algo(
                str(info.get("quant_algo", "")).upper(), info.get("group_size"), f"quantized_layers[{key!r}]"
            )
        for g in QUANT_GROUPS:
            algos = {_lookup_algo(m, layers) for m in cfg.group_modules(g)}
            if len(algos) > 1:
                raise ValueError(
                    f"quantized_layers mixes {sorted(map(str, algos))} within {g}; one scheme per group"
                )
            a = algos.pop() if algos else None
            groups[g] = _ALGO_TO_DTYPE[a] if a else "bf16"
            found_algos |= {a} if a else set()
        sparse_ids = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_layer(i)]
        idx = [f"model.layers.{i}.self_attn.index_{p}_proj" for i in sparse_ids for p in ("q", "k")]
        idx_algos = {_lookup_algo(m, layers) for m in idx}
        if groups["attention"] != "bf16" and idx:
            if idx_algos == {None} and not all(_matches(m, excludes) for m in idx):
                excludes.append("*.self_attn.index_*")  # indexer kept in bf16 while attention is not
            elif idx_algos not in ({None}, {_lookup_algo(cfg.group_modules("attention")[0], layers)}):
                raise ValueError(
                    f"indexer projections use {sorted(map(str, idx_algos))}, attention another scheme"
                )
    else:
        _check_algo(algo, q.get("group_size"), "quantization_config")
        found_algos.add(algo)
        for g in QUANT_GROUPS:
            hit = [_matches(m, excludes) for m in cfg.group_modules(g)]
            if any(hit) and not all(hit):
                raise ValueError(
                    f"exclude_modules {excludes} keep only part of {g} unquantized; "
                    "per-layer exceptions are not supported"
                )
            groups[g] = "bf16" if all(hit) else _ALGO_TO_DTYPE[algo]
    fp4 = {a for a in found_algos if _ALGO_TO_DTYPE[a] == "nvfp4"}
    if len(fp4) > 1:
        raise ValueError("mixing NVFP4 (W4A4) and W4A16_NVFP4 layers is not supported")
    quant = QuantConfig(**groups, exclude_modules=excludes, nvfp4_act_quant=fp4 == {"NVFP4"})
    if excludes == quant.default_excludes():  # what to_hf_dict writes for an empty list
        quant.exclude_modules = []
    return quant, kv


def _quant_to_hf(cfg: ModelConfig, exclude_key: str) -> dict | None:
    q = cfg.quantization
    if not q.is_quantized:
        return None

    def algo_of(dt: str) -> str:
        return {"fp8": "FP8", "mxfp8": "MXFP8", "nvfp4": "NVFP4" if q.nvfp4_act_quant else "W4A16_NVFP4"}[dt]

    def entry(dt: str) -> dict:
        gs = {"nvfp4": 16, "mxfp8": 32}.get(dt)
        return {"quant_algo": algo_of(dt), **({"group_size": gs} if gs else {})}

    kv = {"fp8": "FP8", "nvfp4": "NVFP4"}.get(cfg.kv_cache_dtype)
    excludes = q.exclude_modules or q.default_excludes()
    out: dict[str, Any] = {"quant_method": "modelopt", "kv_cache_quant_algo": kv, exclude_key: excludes}
    schemes = {getattr(q, g) for g in QUANT_GROUPS} - {"bf16"}
    always_bf16 = ["lm_head", "model.embed_tokens"] + [
        f"model.layers.{i}.block_sparse_moe.gate" for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)
    ]
    bf16_mods = always_bf16 + [
        m for g in QUANT_GROUPS if getattr(q, g) == "bf16" for m in cfg.group_modules(g)
    ]
    if len(schemes) == 1 and all(_matches(m, excludes) for m in bf16_mods):
        (dt,) = schemes
        return {**out, **entry(dt)}
    layers: dict[str, dict] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        names = [f"{p}.self_attn.{n}_proj" for n in ("q", "k", "v", "o")]
        if cfg.is_sparse_layer(i):
            names += [f"{p}.self_attn.index_q_proj", f"{p}.self_attn.index_k_proj"]
        if cfg.is_moe_layer(i):
            names += [f"{p}.block_sparse_moe.shared_experts.{n}_proj" for n in ("gate", "up", "down")]
        else:
            names += [f"{p}.mlp.{n}_proj" for n in ("gate", "up", "down")]
        for n in names:
            if (dt := cfg.module_dtype(n)) != "bf16":
                layers[n] = entry(dt)
        if cfg.is_moe_layer(i) and q.routed_experts != "bf16":
            layers[f"{p}.block_sparse_moe.experts"] = entry(q.routed_experts)
    return {**out, "quant_algo": "MIXED_PRECISION", "quantized_layers": layers}

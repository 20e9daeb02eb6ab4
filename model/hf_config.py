"""config.json I/O for `model.config.ModelConfig`: the MiniMax-M3 config styles seen in the wild, the
two layouts the project writes, and the ModelOpt quantization config.

What: `config_from_hf_dict` / `config_to_hf_dict` / `config_from_pretrained` / `save_config`, behind
the `ModelConfig` methods. Read: (a) legacy `minimax_m3_text` (expert width as `intermediate_size`, a
`sparse_attention_config` dict of `sparse_*` keys, `moe_layer_freq`), (b) the `minimax_m3_vl` wrapper
(`text_config` with flat `layer_types`, `mlp_layer_types`, `index_*`, `rope_parameters`, optionally
`vision_config`), (c) a flat `minimax_m3_vl_text` dict. Written (`checkpoint_layout`): a float text
model as (c), which transformers' AutoModelForCausalLM loads (with the port's tensor names,
model/hf_layout.py); a quantized or vision model as (b), the released checkpoints' layout, which
vLLM loads as is. The ModelOpt `quantization_config` / `hf_quant_config.json` becomes `QuantConfig`.

Invariants: unknown keys and disagreeing duplicates fail, naming the key and the fix; the round trip
is the identity; every text dict written carries both the flat keys (transformers) and the legacy
mirrors (`sparse_attention_config`, `moe_layer_freq`, `rope_theta`: vLLM's config class).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

from model.config import (
    QUANT_GROUPS,
    CacheDtype,
    ModelConfig,
    QuantConfig,
    modelopt_excludes,
)

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


def config_from_hf_dict(d: dict) -> ModelConfig:
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
                {"text_config", "vision_config", "quantization_config", "tie_word_embeddings"} | _VL_TOP_KEYS
            )
            raise ValueError(f"unknown top-level config keys {unknown}; valid keys: {valid}")
    else:
        text = d
    if "quantization_config" in text:
        if quant_raw is not None:
            raise ValueError("quantization_config given both at top level and inside text_config")
        quant_raw = text.pop("quantization_config")
    kwargs = _parse_text_keys(text)
    cfg = ModelConfig(**kwargs, vision_config=vision, vl_extras=extras)
    if quant_raw is None:
        return cfg
    quant, kv_dtype = _quant_from_hf(quant_raw, cfg)
    if kv_dtype is not None and "kv_cache_dtype" in kwargs and kwargs["kv_cache_dtype"] != kv_dtype:
        raise ValueError(
            f"kv_cache_dtype={kwargs['kv_cache_dtype']!r} disagrees with the quantization_config's "
            f"kv_cache_quant_algo ({kv_dtype!r})"
        )
    return dataclasses.replace(cfg, quantization=quant, kv_cache_dtype=kv_dtype or cfg.kv_cache_dtype)


TEXT_MODEL_TYPE = "minimax_m3_vl_text"  # transformers' model_type of the port's text model
WRAPPER_MODEL_TYPE = "minimax_m3_vl"  # the released checkpoints' (and vLLM's) top-level model_type
TEXT_ARCHITECTURE = "MiniMaxM3SparseForCausalLM"  # vLLM's text-model class
VL_ARCHITECTURE = "MiniMaxM3SparseForConditionalGeneration"


def checkpoint_layout(cfg: ModelConfig) -> str:
    """Either "text": a flat `minimax_m3_vl_text` config and the port's tensor names (float text models:
    transformers loads them); "wrapper": the released `minimax_m3_vl` layout with the checkpoint's
    tensor names (quantized or vision models: transformers has no NVFP4 / MXFP8 MoE path)."""
    return (
        "wrapper"
        if cfg.quantization.is_quantized or cfg.vision_config is not None or cfg.vl_extras
        else "text"
    )


def config_to_hf_dict(cfg: ModelConfig) -> dict:
    """The config.json of `checkpoint_layout(cfg)`: the text dict (model_type "minimax_m3_vl_text",
    the flat keys plus the legacy mirrors vLLM's config class reads) as is, or wrapped as the
    released checkpoints are (`text_config`, top-level `quantization_config`, `vision_config`)."""
    L = cfg.num_hidden_layers
    sparse_freq = [int(cfg.is_sparse_layer(i)) for i in range(L)]
    text: dict[str, Any] = {
        "model_type": TEXT_MODEL_TYPE,
        "architectures": [TEXT_ARCHITECTURE],
        "hidden_act": "swigluoai",
        **{
            f.name: copy.deepcopy(getattr(cfg, f.name))
            for f in dataclasses.fields(cfg)
            if f.name not in ("quantization", "vision_config", "vl_extras", "moe_intermediate_size",
                              "kv_cache_dtype_overrides")
        },
        "intermediate_size": cfg.moe_intermediate_size,  # both styles' name for the expert width
        "kv_cache_dtype_overrides": {str(k): v for k, v in sorted(cfg.kv_cache_dtype_overrides.items())},
        "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim,
        },
        "moe_layer_freq": [int(cfg.is_moe_layer(i)) for i in range(L)],
        "sparse_attention_config": {
            "use_sparse_attention": any(sparse_freq),
            "sparse_num_index_heads": cfg.index_n_heads,
            "sparse_index_dim": cfg.index_head_dim,
            "sparse_block_size": cfg.index_block_size,
            "sparse_topk_blocks": cfg.index_topk_blocks,
            "sparse_local_block": cfg.index_local_blocks,
            "sparse_init_block": cfg.index_init_blocks,
            "sparse_score_type": "max",
            "sparse_attention_freq": sparse_freq,
            "sparse_disable_index_value": sparse_freq,
        },
    }  # fmt: skip
    if checkpoint_layout(cfg) == "text":
        return text
    vision = cfg.vision_config is not None or bool(cfg.vl_extras)
    out: dict[str, Any] = {
        "model_type": WRAPPER_MODEL_TYPE,
        "architectures": [VL_ARCHITECTURE if vision else TEXT_ARCHITECTURE],
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "text_config": text,
    }
    if vision:
        out["vision_config"] = copy.deepcopy(cfg.vision_config)
        out.update(copy.deepcopy(cfg.vl_extras))
    if quant := _quant_to_hf(cfg, exclude_key="ignore"):
        out["quantization_config"] = quant
    return out


def save_config(cfg: ModelConfig, path: str | os.PathLike) -> None:
    """Write config.json (and the legacy ModelOpt hf_quant_config.json when quantized)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf_dict(cfg), f, indent=2)
    quant = _quant_to_hf(cfg, exclude_key="exclude_modules")
    if quant:
        quant.pop("quant_method")
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt"}, "quantization": quant}, f, indent=2)


def config_from_pretrained(path: str | os.PathLike) -> ModelConfig:
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    hq_path = os.path.join(path, "hf_quant_config.json")
    if not os.path.exists(hq_path):
        return config_from_hf_dict(d)
    with open(hq_path) as f:
        hq = json.load(f)
    has_embedded = "quantization_config" in d or "quantization_config" in d.get("text_config", {})
    if not has_embedded:
        return config_from_hf_dict({**d, "quantization_config": hq})
    cfg = config_from_hf_dict(d)
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
            if idx_algos == {None} and not all(modelopt_excludes(m, excludes) for m in idx):
                excludes.append("*.self_attn.index_*")  # indexer kept in bf16 while attention is not
            elif idx_algos not in ({None}, {_lookup_algo(cfg.group_modules("attention")[0], layers)}):
                raise ValueError(
                    f"indexer projections use {sorted(map(str, idx_algos))}, attention another scheme"
                )
    else:
        _check_algo(algo, q.get("group_size"), "quantization_config")
        found_algos.add(algo)
        for g in QUANT_GROUPS:
            hit = [modelopt_excludes(m, excludes) for m in cfg.group_modules(g)]
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
    if len(schemes) == 1 and all(modelopt_excludes(m, excludes) for m in bf16_mods):
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

"""LoRA adapters on disk in the PEFT format, and the Hugging Face-layout twin of the model.

What: `save_adapter` writes adapter_config.json (PEFT's fields), adapter_model.safetensors,
adapter_metadata.json (base fingerprint and config, step, metrics, tokenizer) and checksums.json;
`read_adapter` / `load_adapter` go back, checking rank, targets and base; `peft_config_dict` is the
one PEFT config every writer uses; `to_hf_twin` builds the transformers port with the same weights.
Invariants: save -> read is bit-identical; names are PEFT's (`base_model.model.<module>.lora_A.weight`,
routed experts per expert under the checkpoint's names); a misfit or a different base is refused.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from model.hf_layout import port_name
from model.integrity import MANIFEST_FILE, IntegrityError, fsync_path, verify_manifest, write_manifest
from model.layers.lora import (
    PROJECTOR_TARGETS,
    ExpertLoRA,
    LoRAConfig,
    OffsetExpertLoRA,
    apply_lora,
    load_lora_state_dict,
    lora_state_dict,
)

# Design notes (moved from the module docstring)
# What: `save_adapter(model, path, ...)` writes `adapter_config.json` (PEFT's LoraConfig fields:
# peft_type "LORA", r, lora_alpha, lora_dropout, target_modules, bias "none", task_type
# "CAUSAL_LM", base_model_name_or_path) + `adapter_model.safetensors` + `adapter_metadata.json`
# (this project's extras: base fingerprint and config, training step, metrics, routed-expert flag;
# kept out of adapter_config.json so PEFT and vLLM parse it unchanged). `read_adapter` /
# `load_adapter(model, path)` go back, checking rank, targets and base. `to_hf_twin(model)` builds
# the transformers port (`MiniMaxM3VLForCausalLM`, fp32, experts dequantized) with the same weights,
# so a saved adapter can be checked with `peft.PeftModel.from_pretrained`.
#
# Key naming (what PEFT saves, with no adapter name inside the key):
#   model tensor `model.layers.{i}.self_attn.q_proj.lora_A.weight`
#   -> `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`;
#   routed experts (stacked [E, R, I] / [E, O, R] in memory) are written per expert under the
#   checkpoint's expert names, `...block_sparse_moe.experts.{e}.w1.lora_A.weight` [R, I], the layout
#   vLLM reads for per-expert MoE LoRA.
# Module names are the checkpoint's (`self_attn.index_q_proj`, `mlp.gate_proj`), which is what vLLM
# loads by: vLLM stacks the per-projection factors itself into its fused layers (q/k/v into
# `qkv_proj`, gate/up into `gate_up_proj`, per-expert w1/w2/w3 into the MoE layer) through the
# model's packed-modules mapping, so no packed names are written. Attention q/k/v/o have the same
# names in the transformers port, so those adapters apply to the twin unchanged (the port fuses
# gate/up and moves the indexer under `self_attn.indexer`: see `to_hf_twin`). `target_modules` in
# adapter_config.json are dotted suffixes (`self_attn.q_proj`), so that PEFT does not also match the
# port's `self_attn.indexer.q_proj`.
#
# Invariants: save -> read gives bit-identical tensors in the adapter's own dtype; a loaded adapter
# whose rank, targets or tensor shapes do not fit the model, or whose recorded base fingerprint
# differs, is refused with an error naming the field. `save_adapter` writes `checksums.json`
# (model/integrity.py: sha256 of adapter_model.safetensors) after the weights; `read_adapter`
# verifies it before parsing the weights, so a truncated or bit-flipped file is refused by name
# (adapters without the manifest, e.g. from PEFT, load with one warning). The JSON files are not
# checksummed: they are human-editable and validated field by field instead.

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
METADATA_FILE = "adapter_metadata.json"
PEFT_PREFIX = "base_model.model."
_BANK_RE = re.compile(r"^(.*\.experts)\.lora\.(w[123])\.lora_([AB])$")
_PEFT_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter directory that is malformed or does not fit the model it is applied to."""


@dataclass
class AdapterMetadata:
    """Project extras stored beside the PEFT files (adapter_metadata.json)."""

    base_fingerprint: str | None = None  # model.checkpoint.base_fingerprint of the base it was trained on
    base_config: dict | None = None  # ModelConfig.to_hf_dict() of that base
    base_dtype: str | None = None  # float dtype the base was held in when fingerprinted ("bfloat16")
    routed_experts: bool = False
    adapter_dtype: str = "float32"
    tokenizer: str | None = None  # the spec it was trained with ("byte" or an HF directory): serving reads it
    step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------ key mapping
# Vision projector adapters: the model holds the projector under `vision.`, the released checkpoint
# (and so the PEFT file) at the top level (`multi_modal_projector.linear_1`, model/vision/tower.py).
_VISION_PREFIX = "vision."
_PROJECTOR_PREFIXES = tuple(f"{m}." for m in PROJECTOR_TARGETS)


def to_peft_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`lora_state_dict` names -> PEFT file names (stacked expert factors split per expert)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith(_VISION_PREFIX) and name[len(_VISION_PREFIX) :].startswith(_PROJECTOR_PREFIXES):
            name = name[len(_VISION_PREFIX) :]
        m = _BANK_RE.match(name)
        if m:
            bank, proj, ab = m.groups()
            for e in range(t.shape[0]):
                out[f"{PEFT_PREFIX}{bank}.{e}.{proj}.lora_{ab}.weight"] = t[e].contiguous()
        else:
            out[PEFT_PREFIX + name] = t.contiguous()
    return out


def from_peft_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT file names -> `lora_state_dict` names (per-expert factors restacked)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if not name.startswith(PEFT_PREFIX):
            raise AdapterError(
                f"adapter tensor {name!r} does not start with {PEFT_PREFIX!r}: not a PEFT file"
            )
        name = name[len(PEFT_PREFIX) :]
        if name.startswith(_PROJECTOR_PREFIXES):
            name = _VISION_PREFIX + name
        m = _PEFT_EXPERT_RE.match(name)
        if m:
            bank, e, proj, ab = m.groups()
            experts.setdefault(f"{bank}.lora.{proj}.lora_{ab}", {})[int(e)] = t
        else:
            out[name] = t
    for name, per_e in experts.items():
        if sorted(per_e) != list(range(len(per_e))):
            raise AdapterError(f"adapter expert tensors for {name} are not experts 0..E-1: {sorted(per_e)}")
        out[name] = torch.stack([per_e[e] for e in range(len(per_e))])
    return out


# ------------------------------------------------------------------------------ save / read
# Logical target -> the module-name suffixes PEFT matches. Qualified, so that `q_proj` does not also
# catch the transformers port's `self_attn.indexer.q_proj` (a suffix match on the bare name would).
_PEFT_SUFFIXES = {
    **{
        t: [f"self_attn.{t}"]
        for t in ("q_proj", "k_proj", "v_proj", "o_proj", "index_q_proj", "index_k_proj")
    },
    **{t: [f"mlp.{t}", f"shared_experts.{t}"] for t in ("gate_proj", "up_proj", "down_proj")},
}


def peft_target_modules(targets: list[str], projector_modules: list[str] = ()) -> list[str]:
    projector = [f"{m}.{leaf}" for m in projector_modules for leaf in ("linear_1", "linear_2")]
    return sorted([s for t in targets for s in _PEFT_SUFFIXES[t]] + projector)


def logical_targets(peft_targets: list[str]) -> list[str]:
    """Inverse of `peft_target_modules` for the text targets (projector entries are left to
    `projector_targets`); bare names (other tools' adapters) are accepted too."""
    out = []
    for s in peft_targets:
        if s.startswith(_PROJECTOR_PREFIXES):
            continue
        leaf = s.rpartition(".")[2]
        if leaf not in out:
            out.append(leaf)
    return out


def projector_targets(peft_targets: list[str]) -> list[str]:
    """The vision projector modules named by PEFT target entries (`multi_modal_projector.linear_1`...)."""
    return [m for m in PROJECTOR_TARGETS if any(s.startswith(f"{m}.") for s in peft_targets)]


def peft_config_dict(
    r: int,
    alpha: float,
    dropout: float,
    target_modules: list[str] | tuple[str, ...],
    base_model_name_or_path: str | None = None,
) -> dict[str, Any]:
    """adapter_config.json as PEFT's LoraConfig writes it (fields this adapter uses), for
    `target_modules` already in PEFT's spelling (`peft_target_modules`, or a Hugging Face model's
    own module names). The one writer of PEFT configs: saved adapters, vLLM's in-memory and
    RAM-directory adapters, and the Hugging Face export all use it."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dropout,
        "target_modules": list(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_adapter(
    model: nn.Module | None,
    path: str | os.PathLike,
    cfg: LoRAConfig,
    *,
    base_model_name_or_path: str | None = None,
    metadata: AdapterMetadata | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the adapter of `model` (or the given `lora_state_dict` tensors, e.g. a sync update) to
    `path`. Files are written to temporary names, fsynced and renamed, the config and then the
    checksum manifest last, so a reader never sees half an adapter."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        if model is None:
            raise ValueError("save_adapter: give a model with adapters or the adapter tensors")
        tensors = lora_state_dict(model)
    meta = metadata or AdapterMetadata()
    meta.routed_experts, meta.adapter_dtype = cfg.routed_experts, cfg.dtype
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if meta.base_dtype is None and embed is not None:
        meta.base_dtype = str(embed.weight.dtype).removeprefix("torch.")
    targets = peft_target_modules(cfg.target_modules, cfg.projector_modules)
    peft_cfg = peft_config_dict(cfg.r, cfg.alpha, cfg.dropout, targets, base_model_name_or_path)
    files = {
        WEIGHTS_FILE: None,
        METADATA_FILE: json.dumps(asdict(meta), indent=2),
        CONFIG_FILE: json.dumps(peft_cfg, indent=2),
    }
    (path / MANIFEST_FILE).unlink(missing_ok=True)  # an older adapter's: its weights are replaced now
    for fname, text in files.items():
        tmp = path / f".{fname}.tmp"
        if text is None:
            save_file({k: v.cpu() for k, v in to_peft_tensors(tensors).items()}, str(tmp), {"format": "pt"})
        else:
            tmp.write_text(text)
        fsync_path(tmp)
        os.replace(tmp, path / fname)
    write_manifest(path, [WEIGHTS_FILE])
    return path


def read_adapter(path: str | os.PathLike) -> tuple[LoRAConfig, dict[str, torch.Tensor], AdapterMetadata]:
    """(config, tensors under model names, metadata) of an adapter directory, checked for consistency:
    PEFT LoRA without unsupported features, and every tensor's rank equal to the config's r."""
    path = Path(path)
    for fname in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / fname).is_file():
            raise AdapterError(f"{path}: no {fname}; is this a PEFT adapter directory?")
    try:
        verify_manifest(path, [WEIGHTS_FILE], what="adapter")
    except IntegrityError as e:
        raise AdapterError(str(e)) from None
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{path / CONFIG_FILE}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{path / CONFIG_FILE}: must be a JSON object, got {type(raw).__name__}")
    if raw.get("peft_type") != "LORA":
        raise AdapterError(
            f"{path / CONFIG_FILE}: peft_type={raw.get('peft_type')!r}, only 'LORA' is supported"
        )
    for key, ok in (("bias", "none"), ("use_dora", False), ("use_rslora", False)):
        if raw.get(key, ok) != ok:
            raise AdapterError(f"{path / CONFIG_FILE}: {key}={raw[key]!r} is not supported (need {ok!r})")
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise AdapterError(f"{path / CONFIG_FILE}: rank_pattern / alpha_pattern are not supported")
    meta = _read_metadata(path / METADATA_FILE) if (path / METADATA_FILE).exists() else AdapterMetadata()
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        raise AdapterError(f"{path / CONFIG_FILE}: target_modules as a regex ({targets!r}) is not supported")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(
            f"{path / CONFIG_FILE}: target_modules must be a list of module names: {targets!r}"
        )
    try:
        cfg = LoRAConfig(
            r=raw.get("r"), alpha=raw.get("lora_alpha"), dropout=raw.get("lora_dropout", 0.0),
            target_modules=logical_targets(targets), routed_experts=meta.routed_experts,
            dtype=meta.adapter_dtype, projector_modules=projector_targets(targets),
        )  # fmt: skip
    except (ValueError, TypeError) as e:
        raise AdapterError(f"{path / CONFIG_FILE}: {e}") from None
    try:
        tensors = from_peft_tensors(load_file(str(path / WEIGHTS_FILE)))
    except AdapterError:
        raise
    except Exception as e:
        raise AdapterError(
            f"{path / WEIGHTS_FILE}: cannot read ({e}); the file is truncated or corrupt"
        ) from e
    for name, t in tensors.items():
        if t.dim() < 2 or not t.is_floating_point():
            raise AdapterError(
                f"{path}: {name} is a {t.dtype} tensor of shape {tuple(t.shape)}, not a LoRA factor"
            )
        rank = t.shape[-2] if name.endswith(("lora_A.weight", "lora_A")) else t.shape[-1]
        if rank != cfg.r:
            raise AdapterError(f"{path}: {name} has rank {rank} but adapter_config.json says r={cfg.r}")
    return cfg, tensors, meta


# Field -> accepted types of adapter_metadata.json (checked: the file may come from anywhere).
_METADATA_TYPES: dict[str, tuple[type, ...]] = {
    "base_fingerprint": (str, type(None)), "base_config": (dict, type(None)), "base_dtype": (str, type(None)),
    "routed_experts": (bool,), "adapter_dtype": (str,), "step": (int, type(None)), "metrics": (dict,),
    "extra": (dict,), "tokenizer": (str, type(None)),
}  # fmt: skip


def _read_metadata(file: Path) -> AdapterMetadata:
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{file}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{file}: must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_METADATA_TYPES))
    if unknown:
        raise AdapterError(f"{file}: unknown field(s) {unknown}; valid: {sorted(_METADATA_TYPES)}")
    for key, value in raw.items():
        if not isinstance(value, _METADATA_TYPES[key]) or (key == "step" and isinstance(value, bool)):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in _METADATA_TYPES[key])
            raise AdapterError(f"{file}: field {key!r} must be {names}, got {type(value).__name__}")
    return AdapterMetadata(**raw)


def load_adapter(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    expected: LoRAConfig | None = None,
    base_fingerprint: str | None = None,
    seed: int = 0,
) -> tuple[LoRAConfig, AdapterMetadata]:
    """Apply the adapter at `path` to `model` (adding LoRA layers if the model has none, else
    loading into the existing ones). `expected`: refuse an adapter whose r / alpha / targets differ
    (a learner resuming, an engine receiving sync); `base_fingerprint`: refuse an adapter recorded
    against another base."""
    cfg, tensors, meta = read_adapter(path)
    if expected is not None:
        for f in ("r", "alpha", "routed_experts", "projector_modules"):
            if getattr(cfg, f) != getattr(expected, f):
                raise AdapterError(
                    f"{path}: adapter {f}={getattr(cfg, f)!r} but {getattr(expected, f)!r} expected"
                )
        if sorted(cfg.target_modules) != sorted(expected.target_modules):
            raise AdapterError(
                f"{path}: adapter target_modules={sorted(cfg.target_modules)} but "
                f"{sorted(expected.target_modules)} expected"
            )
    if base_fingerprint is not None and meta.base_fingerprint not in (None, base_fingerprint):
        raise AdapterError(
            f"{path}: adapter was trained on base {meta.base_fingerprint[:12]}..., this model is "
            f"{base_fingerprint[:12]}...; load the base it was trained on"
        )
    has_lora = any("lora_" in n for n, _ in model.named_parameters())
    if not has_lora:
        apply_lora(model, cfg, seed=seed)
    try:
        load_lora_state_dict(model, tensors)
    except ValueError as e:
        raise AdapterError(f"{path}: {e}") from e
    return cfg, meta


# ------------------------------------------------------------------------------ HF twin
def hf_twin_config(config) -> Any:
    """The transformers port's text config for a `ModelConfig` (partial RoPE via rope_parameters)."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLTextConfig

    return MiniMaxM3VLTextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
        num_experts_per_tok=config.num_experts_per_tok, num_local_experts=config.num_local_experts,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta,
                         "partial_rotary_factor": config.rotary_dim / config.head_dim},
        dense_intermediate_size=config.dense_intermediate_size,
        shared_intermediate_size=config.shared_intermediate_size,
        routed_scaling_factor=config.routed_scaling_factor, rotary_dim=config.rotary_dim,
        swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit,
        mlp_layer_types=list(config.mlp_layer_types), layer_types=list(config.layer_types),
        index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim,
        index_block_size=config.index_block_size, index_topk_blocks=config.index_topk_blocks,
        index_local_blocks=config.index_local_blocks, pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
    )  # fmt: skip


def hf_twin_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's base weights (adapters excluded) under the transformers port's names, fp32:
    gate/up fused into `gate_up_proj` (gate rows first), experts stacked into `gate_up_proj`
    [E, 2F, D] / `down_proj` [E, D, F] and dequantized, indexer under `self_attn.indexer`."""
    out: dict[str, torch.Tensor] = {}
    pending_gate: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if "lora_" in name or ".block_sparse_moe.experts." in name or name.endswith(("_scale", "inv_freq")):
            continue
        name = port_name(name)
        if name.endswith((".gate_proj.weight", ".up_proj.weight")):
            module, _, leaf = name.rpartition(".")[0].rpartition(".")
            pending_gate.setdefault(module, {})[leaf] = t.float()
            continue
        out[name] = t.float()
    for module, parts in pending_gate.items():
        out[f"{module}.gate_up_proj.weight"] = torch.cat([parts["gate_proj"], parts["up_proj"]])
    for name, m in model.named_modules():
        if name.endswith(".block_sparse_moe.experts"):
            w1_EFD, w3_EFD, w2_EDF = m.dequantized_all(torch.float32)
            hf = port_name(name)
            out[f"{hf}.gate_up_proj"] = torch.cat([w1_EFD, w3_EFD], dim=1)
            out[f"{hf}.down_proj"] = w2_EDF
    return out


def to_hf_twin(model: nn.Module) -> nn.Module:
    """`MiniMaxM3VLForCausalLM` (transformers port, fp32, eager attention) holding this model's base
    weights: the dequantized Hugging Face-layout twin that PEFT adapters are checked against."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    hf_cfg = hf_twin_config(model.config)
    hf_cfg._attn_implementation = "eager"
    twin = MiniMaxM3VLForCausalLM(hf_cfg).float().eval()
    missing, unexpected = twin.load_state_dict(hf_twin_state_dict(model), strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise AdapterError(
            f"to_hf_twin: name mapping incomplete: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return twin


def has_expert_lora(model: nn.Module) -> bool:
    return any(isinstance(m, ExpertLoRA | OffsetExpertLoRA) for m in model.modules())

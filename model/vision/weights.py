"""Vision weights in and out of safetensors, under the released checkpoint's names.

What: `load_vision_weights` copies `vision_tower.*`, `multi_modal_projector.*` and `patch_merge_mlp.*`
tensors into a `VisionModel`; `load_vision_checkpoint` reads only those from a (sharded) safetensors
directory or file; `vision_state_for_save` gives the tensors to write (linears as
`config.weight_dtype` says). The release stores bf16 except the fp32 patch embedding; linears may be
MXFP8 or, when configured, ModelOpt NVFP4 (docs/FACTS.md, "NVFP4 format" / "MXFP8"), dequantized once
at load (exact in fp32) into the module's dtype; norms, biases and the patch embedding stay float.

Invariants: errors (`VisionWeightError`, a ValueError) name the tensor and the fix: missing or
unexpected tensor, shape mismatch, a storage format other than the configured one.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from model import nvfp4
from model.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from model.vision.tower import VisionModel

VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale")


class VisionWeightError(ValueError):
    """Vision tensors that do not match the VisionModel they are loaded into."""


def is_vision_tensor(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def _quantized_linears(model: VisionModel) -> set[str]:
    """Module names whose `.weight` may be stored quantized (every nn.Linear but LoRA factors)."""
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n}


def _dequantize(module: str, parts: dict[str, torch.Tensor], scheme: str, dtype: torch.dtype) -> torch.Tensor:
    w = parts["weight"]
    is_float = w.is_floating_point() and w.dtype != torch.float8_e4m3fn
    if is_float and len(parts) == 1:
        stored = "bf16"
    elif w.dtype == torch.float8_e4m3fn and len(parts) == 2:
        stored = "mxfp8"
    elif w.dtype == torch.uint8 and "weight_scale_2" in parts:
        stored = "nvfp4"
    else:
        raise VisionWeightError(
            f"{module}: unsupported weight storage (weight {w.dtype}, extra tensors "
            f"{sorted(k for k in parts if k != 'weight')}); expected float, MXFP8 or NVFP4 (ModelOpt)"
        )
    if stored != scheme:
        raise VisionWeightError(
            f"{module}: stored as {stored} but the vision config says weight_dtype={scheme!r}; set "
            f"vision weight_dtype={stored!r} (NVFP4 vision weights are used only when configured)"
        )
    if stored == "bf16":
        return w.to(dtype)
    if stored == "mxfp8":
        scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
        if scale is None or scale.dtype != torch.uint8:
            raise VisionWeightError(
                f"{module}: MXFP8 weight needs an E8M0 uint8 weight_scale_inv / weight_scale"
            )
        return dequantize_mxfp8(w, scale, dtype)
    try:
        return nvfp4.dequantize(nvfp4.from_modelopt(parts, ""), dtype)
    except (KeyError, ValueError, TypeError) as e:
        raise VisionWeightError(f"{module}: bad NVFP4 tensors ({e})") from e


def load_vision_weights(
    model: VisionModel, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Copy checkpoint-named vision tensors into `model` (strict: every parameter, nothing else
    under the vision prefixes; tensors outside them are ignored, so a whole checkpoint can stream by)."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    # Projector adapters (model/vision/lora.py) are not base weights: model/adapter.py saves them.
    params = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    linears = _quantized_linears(model)
    grouped: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    loaded: set[str] = set()
    for name, t in items:
        if not is_vision_tensor(name):
            continue
        module, _, leaf = name.rpartition(".")
        if module in linears and (leaf == "weight" or leaf in _SCALE_SUFFIXES):
            grouped[module][leaf] = t  # quantized weights arrive as several tensors
            continue
        if name not in params:
            raise VisionWeightError(f"unexpected vision tensor {name!r}: the model has no such parameter")
        _copy(params[name], t, name)
        loaded.add(name)
    scheme = model.config.weight_dtype
    for module, parts in grouped.items():
        if "weight" not in parts:
            raise VisionWeightError(f"{module}: scale tensors {sorted(parts)} without a weight")
        p = params[f"{module}.weight"]
        _copy(p, _dequantize(module, parts, scheme, torch.float32), f"{module}.weight")
        loaded.add(f"{module}.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise VisionWeightError(
            f"{len(missing)} vision parameters missing from the checkpoint, e.g. {missing[:3]}; is this a "
            "minimax_m3_vl checkpoint with the vision tower?"
        )


def _copy(param: torch.Tensor, t: torch.Tensor, name: str) -> None:
    if tuple(t.shape) != tuple(param.shape):
        raise VisionWeightError(
            f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(param.shape)}; the vision "
            "config does not describe this checkpoint"
        )
    with torch.no_grad():
        param.copy_(t.to(device=param.device, dtype=param.dtype))


# ------------------------------------------------------------------------------- files
def _vision_files(path: Path) -> dict[Path, list[str]]:
    """Shard file -> vision tensor names in it (index file, single file, or a .safetensors path)."""
    if path.is_file():
        files = {path: None}
    elif (path / "model.safetensors.index.json").exists():
        try:
            weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise VisionWeightError(f"{path}: invalid model.safetensors.index.json ({e})") from e
        out: dict[Path, list[str]] = defaultdict(list)
        for name, f in weight_map.items():
            if is_vision_tensor(name):
                out[path / f].append(name)
        return out
    elif (path / "model.safetensors").exists():
        files = {path / "model.safetensors": None}
    else:
        raise VisionWeightError(f"{path}: no safetensors file or index found")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                out[f] = [n for n in h.keys() if is_vision_tensor(n)]  # noqa: SIM118 (not a dict)
        except Exception as e:  # safetensors raises its own error type for bad headers
            raise VisionWeightError(f"{f}: cannot read safetensors header ({e}); truncated or corrupt") from e
    return out


def iter_vision_tensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream only the vision tensors of a checkpoint (the text model's shards are not read)."""
    for f, names in sorted(_vision_files(Path(path)).items()):
        if not f.exists():
            raise VisionWeightError(f"{f}: shard listed in the index is missing")
        try:
            with safe_open(str(f), framework="pt") as h:
                for n in sorted(names):
                    yield n, h.get_tensor(n)
        except VisionWeightError:
            raise
        except Exception as e:
            raise VisionWeightError(
                f"{f}: cannot read tensors ({e}); the file is truncated or corrupt"
            ) from e


def load_vision_checkpoint(model: VisionModel, path: str | os.PathLike) -> VisionModel:
    load_vision_weights(model, iter_vision_tensors(path))
    return model


def vision_state_for_save(model: VisionModel) -> dict[str, torch.Tensor]:
    """Checkpoint tensors: linear weights in `config.weight_dtype` (MXFP8 scales spelled
    `weight_scale_inv` as in M3 checkpoints), everything else as held."""
    scheme = model.config.weight_dtype
    linears = _quantized_linears(model)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue  # adapters are never base weights
        t = p.detach().cpu().contiguous()
        module, _, leaf = name.rpartition(".")
        if module not in linears or leaf != "weight" or scheme == "bf16":
            out[name] = t
        elif scheme == "mxfp8":
            values, scales = quantize_mxfp8(t.float())
            out[name], out[f"{module}.weight_scale_inv"] = values, scales
        else:
            out.update(nvfp4.to_modelopt(f"{module}.", nvfp4.quantize(t.float())))
    return out

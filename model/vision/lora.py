"""LoRA on the vision projector: the one part of the frozen vision side an adapter may change.

What: `apply_projector_lora(model, r, alpha, ...)` wraps the projector linears
(`multi_modal_projector.linear_{1,2}` and/or `patch_merge_mlp.linear_{1,2}`) in `LoRALinear`; the tower
stays frozen. Why a separate step (after `apply_lora`): the text `apply_lora` targets plain
`nn.Linear`s by leaf name, and the vision linears are `VisionLinear`s precisely so it never touches them.

Invariants: the adapter tensors are ordinary LoRA tensors (`...linear_1.lora_A.weight`), so sync,
checkpoints and `set_adapter` move them with the rest; B starts at zero, A is drawn on the CPU from
`seed`; with a projector adapter, image features depend on the adapter version (`encode_images` runs
with autograd and the native engine drops its feature cache on every `set_adapter`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model.layers.lora import PROJECTOR_TARGETS, LoRALinear
from model.vision.tower import VisionModel


def _vision_of(model: nn.Module) -> VisionModel:
    vision = model if isinstance(model, VisionModel) else getattr(model, "vision", None)
    if not isinstance(vision, VisionModel):
        raise ValueError(
            "apply_projector_lora: the model has no vision tower (its config has no vision_config); "
            "use a minimax_m3_vl checkpoint or the tiny-vl preset"
        )
    return vision


def apply_projector_lora(
    model: nn.Module,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    seed: int = 0,
    modules: Sequence[str] = PROJECTOR_TARGETS,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Wrap both linears of each named projector module in a LoRALinear (in place); only the new
    adapter parameters require grad among the vision parameters. Returns `model`."""
    vision = _vision_of(model)
    unknown = [m for m in modules if m not in PROJECTOR_TARGETS]
    if unknown or not modules:
        raise ValueError(
            f"apply_projector_lora: modules must be a non-empty subset of {list(PROJECTOR_TARGETS)}, "
            f"got {list(modules)}"
        )
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name in PROJECTOR_TARGETS:  # canonical order: the same A draws whatever order was given
        if name not in modules:
            continue
        block = getattr(vision, name)
        for leaf in ("linear_1", "linear_2"):
            lin = getattr(block, leaf)
            if isinstance(lin, LoRALinear):
                raise ValueError(f"apply_projector_lora: vision.{name}.{leaf} already has an adapter")
            block.register_module(leaf, LoRALinear(lin, r, alpha, dropout, dtype, gen))
    for pname, p in vision.named_parameters():
        p.requires_grad_("lora_" in pname)
    return model


def has_projector_lora(vision: VisionModel | None) -> bool:
    """True when image features depend on adapter tensors (a projector adapter is installed)."""
    return vision is not None and any(isinstance(m, LoRALinear) for m in vision.modules())

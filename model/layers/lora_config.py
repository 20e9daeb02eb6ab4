"""The LoRA adapter's configuration: which linears get an adapter, rank, alpha, dropout, dtype.

Why a module of its own, without torch: `LoRAConfig` is also the `lora:` section of a training
recipe (rl/config.py), and loading a config must not import torch; the adapter layers that use it
are model/layers/lora.py.

Invariants: a `LoRAConfig` that exists is valid (checked in `__post_init__`, messages name the
recipe key `lora.<field>`); `target_modules` / `projector_modules` are kept in canonical order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

TargetModule = Literal[
    "q_proj", "k_proj", "v_proj", "o_proj", "index_q_proj", "index_k_proj",
    "gate_proj", "up_proj", "down_proj",
]  # fmt: skip
"""Logical linears an adapter may target. Attention: q/k/v/o; the lightning indexer: index_q/index_k
(off by default: selection is discrete, they get no gradient through the attention output);
MLP: gate/up/down of the dense prefix MLP *and* of every MoE layer's shared expert. Routed experts
are chosen separately (`LoRAConfig.routed_experts`): they are a stacked bank, not nn.Linears."""
TARGET_MODULES: tuple[str, ...] = get_args(TargetModule)
DEFAULT_TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
ProjectorTarget = Literal["multi_modal_projector", "patch_merge_mlp"]
"""Vision projector modules an adapter may target (both linears of each; model/vision/lora.py). The
vision tower itself is never adapted; text targets never reach it."""
PROJECTOR_TARGETS: tuple[str, ...] = get_args(ProjectorTarget)
AdapterDtype = Literal["float32", "bfloat16"]
ADAPTER_DTYPES: tuple[str, ...] = get_args(AdapterDtype)


@dataclass
class LoRAConfig:
    """Adapter shape. `alpha` defaults to 2 * r (scaling alpha / r = 2.0), the usual choice for RL
    fine-tuning with rank-32 adapters; keep alpha fixed when sweeping r to keep the update scale.
    `dtype` is the adapter parameters' dtype (fp32 by default: the optimizer state is tiny and fp32
    avoids bf16 rounding of small updates); the delta is cast to the activation dtype when added."""

    r: int = 32
    alpha: float = 64.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    routed_experts: bool = False
    dtype: AdapterDtype = "float32"
    projector_modules: list[str] = field(default_factory=list)  # vision models only

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            raise ValueError(f"lora.r must be a positive int, got {self.r!r}")
        if not isinstance(self.alpha, int | float) or not self.alpha > 0:
            raise ValueError(f"lora.alpha must be a positive number, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        experts = " (routed experts: set lora.routed_experts=true)"
        self.target_modules = _canonical(self.target_modules, TARGET_MODULES, "target_modules", experts)
        self.projector_modules = _canonical(
            self.projector_modules, PROJECTOR_TARGETS, "projector_modules", ""
        )
        if not self.target_modules and not self.routed_experts and not self.projector_modules:
            raise ValueError(
                "lora: no adapter target (target_modules and projector_modules are empty and "
                "routed_experts is false): give lora.target_modules, or set lora.routed_experts=true"
            )
        if self.dtype not in ADAPTER_DTYPES:
            raise ValueError(f"lora.dtype must be one of {list(ADAPTER_DTYPES)}, got {self.dtype!r}")
        self.alpha = float(self.alpha)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    @property
    def torch_dtype(self):
        """`dtype` as a torch.dtype (imported here: the config itself stays torch-free)."""
        import torch

        return getattr(torch, self.dtype)


def _canonical(names, valid: tuple[str, ...], key: str, hint: str) -> list[str]:
    """`names` checked against `valid` (a list, no duplicates) and put in `valid`'s order."""
    if isinstance(names, str):
        raise ValueError(f"lora.{key} must be a list of names, got {names!r}")
    names = list(names)
    unknown = [t for t in names if t not in valid]
    if unknown:
        raise ValueError(f"lora.{key}: unknown module(s) {unknown}; valid: {list(valid)}{hint}")
    if len(set(names)) != len(names):
        raise ValueError(f"lora.{key} has duplicates: {names}")
    return [t for t in valid if t in names]

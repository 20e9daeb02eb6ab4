"""Versioned adapter-only sync from the learner to the rollout engines.

What: after each optimizer step the learner publishes an `AdapterUpdate`: the LoRA tensors
(`lora_state_dict`, nothing else) tagged with version v+1. Engines apply it with
`Engine.set_adapter(tensors, version)` before their next `generate`; every completion then carries
the version that produced it.

Why: the base is hundreds of GB and identical everywhere (fingerprinted at start-up); the adapter
is well under 1% of it. Moving only the adapter is what makes a GRPO step cheap to sync.

Invariants: an update holds only adapter tensors (`check_adapter_only` refuses anything else, so a
bug cannot silently ship base weights); versions increase by one per step; `bytes` is exactly what
crosses the process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADAPTER_MARKERS = ("lora_A", "lora_B", "lora_")


@dataclass(frozen=True)
class AdapterUpdate:
    version: int
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def check_adapter_only(tensors: dict[str, torch.Tensor]) -> None:
    """Raise if any tensor is not an adapter tensor: sync must never move base weights."""
    bad = [name for name in tensors if not any(m in name for m in ADAPTER_MARKERS)]
    if bad:
        raise ValueError(
            f"adapter sync refused {len(bad)} non-adapter tensors, e.g. {bad[:3]}: only LoRA tensors "
            "may cross after start-up (the base is loaded once per worker and fingerprinted)"
        )


def make_update(tensors: dict[str, torch.Tensor], version: int) -> AdapterUpdate:
    """Detached CPU copies, so the learner can keep training while the update travels."""
    check_adapter_only(tensors)
    return AdapterUpdate(
        version, {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    )

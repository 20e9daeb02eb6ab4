"""DSpark speculative decoding: drafter, proposer, lossless verifier, drafter training.

The package's names load on first use (PEP 562), so that a torch-free submodule such as
`rollout.dspark.cotrain_config` (a training recipe's section) can be imported without torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.dspark.model import Draft, Drafter, DSparkConfig, load_drafter, save_drafter
    from rollout.dspark.schedule import SpecConfig

_HOMES = {
    "DSparkConfig": "rollout.dspark.model",
    "Draft": "rollout.dspark.model",
    "Drafter": "rollout.dspark.model",
    "load_drafter": "rollout.dspark.model",
    "save_drafter": "rollout.dspark.model",
    "SpecConfig": "rollout.dspark.schedule",
}
__all__ = ["DSparkConfig", "Draft", "Drafter", "SpecConfig", "load_drafter", "save_drafter"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'rollout.dspark' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)

"""The DSpark drafter co-trainer's configuration (rollout/dspark/cotrain.py uses it).

Why a module of its own, without torch: `CoTrainConfig` is also the `rollout.dspark.cotrain` section
of a training recipe (rl/config_sections.py), and loading a config must not import torch.

Invariants: a `CoTrainConfig` that exists is valid; messages name the recipe key.
"""

from __future__ import annotations

from dataclasses import dataclass

KEY = "rollout.dspark.cotrain"  # where recipes set these fields


@dataclass
class CoTrainConfig:
    """`enabled`: co-train during RL (the trainer's switch; the co-trainer itself ignores it). A
    round of `steps` distillation steps at `lr` runs every `every` policy steps on the rollouts of
    the last `replay_steps` steps; `focus` > 0 weights the positions whose drafts verification would
    reject more."""

    enabled: bool = False
    steps: int = 20  # drafter optimizer steps per training round
    lr: float = 5e-4
    every: int = 1  # a training round every `every` policy steps
    replay_steps: int = 4  # a round trains on the rollouts of the last `replay_steps` policy steps
    batch_size: int = 32
    anchors_per_seq: int = 4
    focus: float = 0.0  # loss weight x (position TV / mean TV) ** focus; 0 = the offline loss
    max_seqs_per_step: int = 256  # a random subset beyond this (bounds the buffer and the features pass)
    eval_seqs: int = 64  # sequences of each step the held-out acceptance is measured on

    def __post_init__(self) -> None:
        for name in ("steps", "every", "replay_steps", "batch_size", "anchors_per_seq", "max_seqs_per_step",
                     "eval_seqs"):  # fmt: skip
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{KEY}.{name} must be an int >= 1, got {v!r}")
        if not self.lr > 0:
            raise ValueError(f"{KEY}.lr must be > 0, got {self.lr}")
        if not self.focus >= 0:
            raise ValueError(f"{KEY}.focus must be >= 0, got {self.focus}")

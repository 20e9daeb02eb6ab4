"""A run's state in and out of checkpoints: what the step loop saves, which checkpoint a run resumes
from, and how the state is put back (the format itself is rl/checkpointing.py).

Why apart from the loop: a resumed run must continue exactly as an uninterrupted one, so the list of
what is saved (learner adapter + optimizer, step, data cursor, driver RNG, W&B run id, base
fingerprint) and its restore sit side by side, where a missing entry shows.

Invariants: a checkpoint trained on another base (fingerprint mismatch) is refused; restore puts
back every entry `save_run_state` writes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rl.checkpointing import (
    capture_rng_state,
    find_latest,
    restore_rng_state,
    resume_checkpoint,
    save_checkpoint,
)
from rl.faults import maybe_fail


def resume_hint(run_dir: Path) -> str:
    """How to continue a stopped run, for error messages."""
    found = find_latest(run_dir)
    where = f"the last complete checkpoint is {found}" if found else "no checkpoint was written yet"
    return f"{where}; rerun the same command with resume=auto to continue"


def save_run_state(trainer) -> Path:
    """Checkpoint `trainer` (rl.trainer.Trainer) at its current step; keeps trainer.keep_checkpoints."""
    cfg = trainer.cfg
    learner_state = trainer.topology.from_learners("state_dict")
    maybe_fail(cfg.trainer.fault_injection, str(trainer.run_dir), "driver.save", trainer.step)
    return save_checkpoint(trainer.run_dir, trainer.step, keep_last=cfg.trainer.keep_checkpoints, state={
        "learner": learner_state, "step": trainer.step, "data": trainer.train_stream.state_dict(),
        "rng": capture_rng_state(), "wandb_run_id": trainer.tracker.run_id,
        "base_fingerprint": trainer.topology.base_fingerprint,
    })  # fmt: skip


def find_resume(resume: str | None, run_dir: Path) -> dict[str, Any] | None:
    """State of the newest checkpoint that verifies (`resume=auto`: corrupted ones are skipped
    with a warning), of the given checkpoint (`resume=PATH`: corruption is an error), or None."""
    if not resume:
        return None
    found = resume_checkpoint(run_dir, resume)
    if found is None:
        return None
    path, state = found
    print(f"resuming from {path} (step {state['step']})", file=sys.stderr)
    return state


def kept_log_step(resume: str | None, state: dict[str, Any] | None) -> int | None:
    """The last step whose metrics / samples rows a (re)started run keeps (`Tracker(resume_step=)`):
    the checkpoint's step; -1 (none) when a resume found no checkpoint, since the run starts over and
    re-logs what an attempt killed before its first checkpoint wrote (step-0 evals included); None
    (append) without a resume."""
    if state is not None:
        return state["step"]
    return -1 if resume else None


def restore_run_state(trainer, state: dict[str, Any]) -> None:
    """Put a checkpoint's state back into `trainer`: learners, step, data cursor, driver RNG."""
    import ray

    recorded = state.get("base_fingerprint")
    if recorded and recorded != trainer.topology.base_fingerprint:
        raise RuntimeError(
            "the checkpoint was trained on a different base (fingerprint mismatch): resume it with the "
            "model.checkpoint and model.dtype it was trained with, or start a new output_dir"
        )
    ray.get([lrn.load_state_dict.remote(state["learner"]) for lrn in trainer.topology.learners])
    trainer.step = state["step"]
    trainer.train_stream.load_state_dict(state["data"])
    restore_rng_state(state["rng"])

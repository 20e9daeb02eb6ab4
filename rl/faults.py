"""Deterministic fault injection for the reliability suite: real process deaths and real bad
numbers at named points, switched on by `trainer.fault_injection` (never set in recipes).

Spec: comma-separated `point@step[:kind]`, e.g. `rollout.generate@2,learner.loss@3:nan`.
Points: `rollout.generate`, `reward.score`, `learner.train_step`, `learner.loss`,
`driver.rollout`, `driver.save`. Kinds: `exit` (default: `os._exit(1)`, as a SIGKILL or OOM kill
would end the process, no cleanup), `raise` (a Python exception), `nan` (only `learner.loss`: the
loss becomes NaN). Each entry fires once per run directory: a marker file in
`<output_dir>/faults/` is written before the fault, so a restarted actor or a resumed run does
not fail again at the same point.

Why a config key and not an environment variable: Ray actors receive the config, not the
driver's environment, so the same spec reaches every process without extra plumbing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

FaultKind = Literal["exit", "raise", "nan"]
POINTS = (
    "rollout.generate",
    "reward.score",
    "learner.train_step",
    "learner.loss",
    "driver.rollout",
    "driver.save",
)


class InjectedFault(RuntimeError):
    """Raised by `kind=raise` faults."""


@dataclass(frozen=True)
class Fault:
    point: str
    step: int
    kind: FaultKind = "exit"


def parse(spec: str | None) -> list[Fault]:
    """The entries of `spec`; ValueError naming a malformed one."""
    out = []
    for entry in (spec or "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        head, _, kind = entry.partition(":")
        point, _, step = head.partition("@")
        kind = kind or "exit"
        if point not in POINTS or not step.isdigit() or kind not in ("exit", "raise", "nan"):
            raise ValueError(
                f"trainer.fault_injection entry {entry!r}: expected point@step[:exit|raise|nan] with point "
                f"one of {list(POINTS)}"
            )
        out.append(Fault(point, int(step), kind))  # type: ignore[arg-type]
    return out


def should_fire(spec: str | None, output_dir: str | None, point: str, step: int) -> FaultKind | None:
    """The kind of the fault due at (point, step), marking it fired; None if none is due."""
    for f in parse(spec):
        if f.point == point and f.step == step:
            marker = Path(output_dir or ".") / "faults" / f"{point}@{step}"
            if marker.exists():
                return None
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(f.kind)
            return f.kind
    return None


def maybe_fail(spec: str | None, output_dir: str | None, point: str, step: int) -> bool:
    """Die or raise if a fault is due here; returns True for a due `nan` fault (the caller poisons
    its loss), else False."""
    kind = should_fire(spec, output_dir, point, step)
    if kind == "exit":
        os._exit(1)
    if kind == "raise":
        raise InjectedFault(f"injected fault at {point} step {step}")
    return kind == "nan"

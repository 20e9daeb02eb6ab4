"""Training checkpoints: atomic, checksummed, resumable.

What: `save_checkpoint` writes `checkpoints/step-<N>/` (adapter tensors as safetensors, JSON data in
state.json, optimizer / RNG state with torch.save) and keeps the last K; `load_checkpoint` verifies
and reads one; `resume_checkpoint` implements `resume=auto|PATH`; `capture_rng_state` /
`restore_rng_state` cover python, numpy and torch generators.
Invariants: files go to a temporary directory, the manifest last, then one rename publishes the step;
a checkpoint is valid iff every file matches the manifest; load(save(state)) == state.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import CheckpointError  # one error for model and run checkpoints
from model.integrity import describe_mismatch, file_sha256, fsync_path

# Design notes (moved from the module docstring)
# What: `save_checkpoint(run_dir, step, state)` writes `run_dir/checkpoints/step-<N>/` and keeps the
# last K; `load_checkpoint(path)` verifies and reads one back; `resume_checkpoint(run_dir, resume)`
# implements `resume=auto|PATH` (auto: newest checkpoint that verifies, falling back past corrupted
# ones with a warning); `find_latest` / `list_checkpoints` locate them; `capture_rng_state` /
# `restore_rng_state` cover python, numpy, torch CPU and (when present) CUDA generators.
#
# What goes in is the caller's choice (adapter, optimizer, scheduler, RNG, data cursor, step, W&B run
# id, metrics); each top-level entry of `state` is stored by its kind:
# - a non-empty `dict[str, Tensor]` (adapter tensors) -> `<name>.safetensors`;
# - JSON data (str-keyed dicts, lists, str, int, float, bool, None; no tuples, which JSON would turn
#   into lists) -> one `state.json` holding all such entries;
# - anything else (optimizer / scheduler state dicts, RNG states) -> `<name>.pt` with `torch.save`,
#   read back with `torch.load(weights_only=True)`: such values may hold only tensors, numbers, str,
#   None and lists / tuples / dicts of those (checked at save time, so a bad value fails then, not at
#   resume).
#
# Invariants:
# - Atomic: files go to `checkpoints/.tmp-step-<N>/`, each is fsynced, `manifest.json` (sha256 and
#   size of every file) is written last, then one rename publishes `step-<N>`. A crash leaves at most
#   a `.tmp-step-*` directory, which readers ignore and the next save deletes.
# - A checkpoint is valid iff its manifest exists and every listed file matches its checksum;
#   `load_checkpoint` raises `CheckpointError` naming the first file that does not.
# - `load_checkpoint(save_checkpoint(..., state))` == state (tensors bit-identical, tuples kept).

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
JSON_FILE = "state.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_PLAIN = (int, float, bool, str, type(None))
_KINDS = ("safetensors", "json", "torch")


# ------------------------------------------------------------------------------------ encoding
def _is_json(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, list):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return False


def _is_tensor_dict(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()
    )  # fmt: skip


def _check_loadable(value: Any, where: str) -> None:
    """Raise unless `torch.load(weights_only=True)` can read `value` back."""
    if isinstance(value, (torch.Tensor, *_PLAIN)):
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_loadable(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_plain_key(k, where)
            _check_loadable(v, f"{where}[{k!r}]")
    else:
        raise TypeError(
            f"checkpoint entry {where} is a {type(value).__name__}: store only tensors, numbers, str, "
            "None and lists/tuples/dicts of those (e.g. obj.state_dict(), not obj)"
        )


def _check_plain_key(key: Any, where: str) -> None:
    if not isinstance(key, _PLAIN):
        raise TypeError(f"checkpoint entry {where} has a {type(key).__name__} dict key {key!r}")


# ---------------------------------------------------------------------------------------- save
def save_checkpoint(
    run_dir: str | Path, step: int, state: Mapping[str, Any], keep_last: int | None = 3
) -> Path:
    """Write `state` as `run_dir/checkpoints/step-<step>` atomically; keep the newest `keep_last`
    checkpoints (None = all). Returns the checkpoint directory."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):  # left by a crashed save: never valid, never read
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step}"
    tmp.mkdir()

    entries: dict[str, dict[str, str]] = {}
    json_state: dict[str, Any] = {}
    for name, value in state.items():
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (MANIFEST, JSON_FILE):
            raise ValueError(f"checkpoint entry name {name!r} must be a plain file-name stem")
        if _is_tensor_dict(value):
            fname = f"{name}.safetensors"
            save_file({k: v.detach().to("cpu").contiguous() for k, v in value.items()}, str(tmp / fname))
            entries[name] = {"kind": "safetensors", "file": fname}
        elif _is_json(value):
            json_state[name] = value
            entries[name] = {"kind": "json", "file": JSON_FILE}
        else:
            _check_loadable(value, repr(name))
            fname = f"{name}.pt"
            torch.save(value, tmp / fname)
            entries[name] = {"kind": "torch", "file": fname}
    if json_state:
        (tmp / JSON_FILE).write_text(json.dumps(json_state, indent=1, sort_keys=True))

    files = {}
    for p in sorted(tmp.iterdir()):
        fsync_path(p)
        files[p.name] = {"sha256": file_sha256(p), "bytes": p.stat().st_size}
    manifest = {"format": FORMAT_VERSION, "step": int(step), "time": time.time(), "entries": entries}
    manifest["files"] = files
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    fsync_path(tmp / MANIFEST)

    final = root / f"step-{step}"
    if final.exists():  # re-saving a step (e.g. after a resume): swap, then drop the old one
        old = root / f".tmp-step-{step}-old"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fsync_path(root)  # make the rename itself durable
    if keep_last is not None:
        for old_ckpt in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old_ckpt)
    return final


# ---------------------------------------------------------------------------------------- find
def checkpoint_step(path: str | Path) -> int:
    m = _STEP_DIR.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not a checkpoint directory (expected a name like step-12)")
    return int(m.group(1))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Published checkpoints (with a manifest), oldest first; `.tmp-step-*` leftovers are ignored."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=checkpoint_step)


def find_latest(run_dir: str | Path) -> Path | None:
    """Newest published checkpoint (not verified: `load_checkpoint` does that)."""
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


# ---------------------------------------------------------------------------------------- load
def read_manifest(path: str | Path) -> dict[str, Any]:
    """The parsed manifest of a checkpoint directory, its structure checked (a damaged manifest
    that still parses as JSON is as unusable as one that does not)."""
    mpath = Path(path) / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST}: not a checkpoint, or an unfinished one")
    try:
        manifest = json.loads(mpath.read_text())
        files, entries = manifest["files"], manifest["entries"]
        ok = isinstance(files, dict) and all(isinstance(v, dict) for v in files.values())
        ok = ok and isinstance(entries, dict) and all(
            isinstance(e, dict) and e.get("kind") in _KINDS and e.get("file") in files
            for e in entries.values()
        )  # fmt: skip
        if not ok:
            raise ValueError("'files' / 'entries' do not have the written structure")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({type(e).__name__}: {e})") from None
    return manifest


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file listed in the manifest; return the manifest or raise CheckpointError."""
    path = Path(path)
    manifest = read_manifest(path)
    for name, info in manifest["files"].items():
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: file {name} listed in the manifest is missing")
        problem = describe_mismatch(path / name, info)
        if problem is not None:
            raise CheckpointError(f"{path}: file {name} {problem}; the checkpoint is truncated or corrupt")
    return manifest


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Verify checksums, then return the state exactly as it was saved."""
    path = Path(path)
    manifest = verify_checkpoint(path)
    state: dict[str, Any] = {}
    name = JSON_FILE
    try:  # verified bytes that still fail to parse mean a bug or a forged manifest: report, never crash
        json_state = json.loads((path / JSON_FILE).read_text()) if (path / JSON_FILE).is_file() else {}
        for name, entry in manifest["entries"].items():
            kind, f = entry["kind"], path / entry["file"]
            if kind == "safetensors":
                state[name] = load_file(str(f), device=str(map_location))
            elif kind == "torch":
                state[name] = torch.load(f, map_location=map_location, weights_only=True)
            else:
                state[name] = json_state[name]
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read entry {name!r} ({type(e).__name__}: {e})") from e
    return state


def resume_checkpoint(run_dir: str | Path, resume: str | None) -> tuple[Path, dict[str, Any]] | None:
    """`resume` None: no resume. A checkpoint directory (holding manifest.json): load it, strictly.
    "auto" (or a run directory): the newest checkpoint of `run_dir` (or of that directory) that
    verifies, warning about each corrupted one skipped; None if there is none."""
    if resume is None:
        return None
    if resume != "auto" and (Path(resume) / MANIFEST).is_file():
        return Path(resume), load_checkpoint(resume)
    where = Path(run_dir) if resume == "auto" else Path(resume)
    if resume != "auto" and not where.is_dir():
        raise CheckpointError(f"resume={resume!r}: no such checkpoint or run directory")
    for ckpt in reversed(list_checkpoints(where)):
        try:
            return ckpt, load_checkpoint(ckpt)
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s; falling back to the previous one", ckpt.name, e)
    log.warning("resume=%s: no valid checkpoint under %s, starting from scratch", resume, where)
    return None


# ----------------------------------------------------------------------------------------- RNG
def capture_rng_state() -> dict[str, Any]:
    """Python, numpy (global), torch CPU and, if CUDA is initialised, every CUDA device's generator.
    Stored as plain tuples / lists / tensors so it round-trips through weights_only loading."""
    name, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (name, key.tolist(), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of `capture_rng_state`; a saved CUDA state without CUDA now is skipped with a warning."""
    random.setstate(_tuples(state["python"]))
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            log.warning("checkpoint holds CUDA RNG states but CUDA is not available: not restored")


def _tuples(value: Any) -> Any:
    """random.setstate needs tuples all the way down (a JSON round trip would give lists)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list | tuple) else value

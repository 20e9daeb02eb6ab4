"""rl/checkpointing.py: atomic publish, checksums, resume=auto fallback, RNG capture/restore."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch

from rl.checkpointing import (
    CheckpointError,
    capture_rng_state,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    resume_checkpoint,
    save_checkpoint,
)


def _train_state(seed: int = 0) -> dict:
    """What the trainer stores: adapter, optimizer, scheduler, RNG, cursor, step, run id, metrics."""
    torch.manual_seed(seed)
    lin = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    for _ in range(2):
        lin(torch.randn(3, 8)).square().sum().backward()
        opt.step()
        sched.step()
    return {
        "adapter": {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 8, dtype=torch.bfloat16),
                    "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 4)},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": capture_rng_state(),
        "data_cursor": {"epoch": 1, "index": 48, "order_seed": 7},
        "step": 12,
        "wandb_run_id": "abc123xy",
        "metrics": {"reward/mean": 0.25, "eval/acc": float("nan")},
    }  # fmt: skip


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b and type(a) is type(b)


def test_save_then_load_returns_the_state_bit_identical(tmp_path):
    state = _train_state()
    path = save_checkpoint(tmp_path, 12, state)
    assert path == tmp_path / "checkpoints" / "step-12"
    assert {p.name for p in path.iterdir()} == {
        "adapter.safetensors", "optimizer.pt", "rng.pt", "state.json", "manifest.json",
    }  # fmt: skip
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 12 and set(manifest["files"]) == {p.name for p in path.iterdir()} - {
        "manifest.json"
    }
    _assert_same(state, load_checkpoint(path))


def test_leftover_tmp_dir_from_a_crash_is_ignored_and_cleaned(tmp_path):
    save_checkpoint(tmp_path, 1, {"step": 1})
    crashed = tmp_path / "checkpoints" / ".tmp-step-2"
    crashed.mkdir()
    (crashed / "adapter.safetensors").write_bytes(b"half written")
    assert find_latest(tmp_path) == tmp_path / "checkpoints" / "step-1"
    assert resume_checkpoint(tmp_path, "auto")[1] == {"step": 1}
    save_checkpoint(tmp_path, 2, {"step": 2})
    assert not crashed.exists()
    assert find_latest(tmp_path).name == "step-2"


def test_step_dir_without_manifest_is_not_a_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 3, {"step": 3})
    (tmp_path / "checkpoints" / "step-9").mkdir()  # e.g. copied by hand, partially
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-3"]
    with pytest.raises(CheckpointError, match=r"step-9: no manifest.json"):
        load_checkpoint(tmp_path / "checkpoints" / "step-9")


def test_keep_last_k_deletes_older_checkpoints_in_step_order(tmp_path):
    for step in (2, 10, 4, 6):
        save_checkpoint(tmp_path, step, {"step": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-6", "step-10"]


def test_resaving_a_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 5, {"step": 5, "v": 1})
    save_checkpoint(tmp_path, 5, {"step": 5, "v": 2})
    assert load_checkpoint(find_latest(tmp_path)) == {"step": 5, "v": 2}
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-5"]


def test_corrupted_file_is_named_and_auto_resume_falls_back_with_a_warning(tmp_path, caplog):
    save_checkpoint(tmp_path, 1, _train_state(1))
    save_checkpoint(tmp_path, 2, _train_state(2))
    bad = tmp_path / "checkpoints" / "step-2" / "optimizer.pt"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step-2: file optimizer.pt is corrupted"):
        load_checkpoint(tmp_path / "checkpoints" / "step-2")
    with caplog.at_level(logging.WARNING, logger="rl.checkpointing"):
        path, state = resume_checkpoint(tmp_path, "auto")
    assert path.name == "step-1" and "skipping checkpoint step-2" in caplog.text
    _assert_same(state["adapter"], _train_state(1)["adapter"])
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is corrupted"):  # an explicit PATH is strict
        resume_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "step-2"))


def test_missing_file_is_named(tmp_path):
    path = save_checkpoint(tmp_path, 1, _train_state())
    (path / "rng.pt").unlink()
    with pytest.raises(CheckpointError, match=r"file rng.pt listed in the manifest is missing"):
        load_checkpoint(path)


def test_one_checkpoint_error_covers_model_and_run_checkpoints(tmp_path):
    from model.checkpoint import CheckpointError as ModelCheckpointError
    from model.checkpoint import load_model
    from model.config import ModelConfig

    assert CheckpointError is ModelCheckpointError
    ModelConfig.preset("tiny").save_pretrained(tmp_path / "model")  # a config without weights
    for bad in (lambda: load_checkpoint(tmp_path), lambda: load_model(tmp_path / "model")):
        with pytest.raises(CheckpointError, match=str(tmp_path)):
            bad()


def test_resume_none_or_empty_run_dir(tmp_path):
    assert resume_checkpoint(tmp_path, None) is None
    assert resume_checkpoint(tmp_path, "auto") is None
    with pytest.raises(CheckpointError, match="no such checkpoint or run directory"):
        resume_checkpoint(tmp_path, str(tmp_path / "nowhere"))


def test_unloadable_value_is_refused_at_save_time(tmp_path):
    with pytest.raises(TypeError, match=r"entry 'optimizer' is a AdamW.*state_dict\(\)"):
        save_checkpoint(tmp_path, 1, {"optimizer": torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])})
    assert list_checkpoints(tmp_path) == []


def test_rng_capture_restore_reproduces_draws_through_a_checkpoint(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(2), np.random.randn()  # has_gauss state too
    save_checkpoint(tmp_path, 1, {"rng": capture_rng_state()})

    def draws():
        return (random.random(), random.getrandbits(64), np.random.rand(3).tolist(), np.random.randn(),
                torch.rand(4).tolist(), torch.randint(0, 1000, (3,)).tolist())  # fmt: skip

    expected = draws()
    draws()  # move every generator on
    restore_rng_state(load_checkpoint(find_latest(tmp_path))["rng"])
    assert draws() == expected


@pytest.mark.parametrize(
    "damage",
    ["truncate_adapter", "flip_state_json", "garble_manifest", "manifest_without_files", "empty_pt"],
)
def test_auto_resume_skips_every_kind_of_damaged_latest_checkpoint(tmp_path, damage, caplog):
    save_checkpoint(tmp_path, 1, _train_state(1))
    latest = save_checkpoint(tmp_path, 2, _train_state(2))
    if damage == "truncate_adapter":
        f = latest / "adapter.safetensors"
        f.write_bytes(f.read_bytes()[:-3])
    elif damage == "flip_state_json":
        f = latest / "state.json"
        f.write_bytes(f.read_bytes().replace(b"12", b"13", 1))
    elif damage == "garble_manifest":
        (latest / "manifest.json").write_text('{"files": {"rng.pt": ')
    elif damage == "manifest_without_files":
        (latest / "manifest.json").write_text(json.dumps({"format": 1, "entries": {}}))
    else:
        (latest / "optimizer.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"step-2"):
        load_checkpoint(latest)
    with caplog.at_level(logging.WARNING, logger="rl.checkpointing"):
        path, state = resume_checkpoint(tmp_path, "auto")
    assert path.name == "step-1" and "skipping checkpoint step-2" in caplog.text
    _assert_same(state["adapter"], _train_state(1)["adapter"])


def test_half_written_checkpoint_is_never_picked_and_is_cleaned_by_the_next_save(tmp_path):
    save_checkpoint(tmp_path, 1, _train_state(1))
    done = save_checkpoint(tmp_path, 2, _train_state(2))
    # A save killed before its manifest and rename: a complete-looking .tmp directory without manifest,
    # and a published-name directory whose manifest never landed (e.g. copied by hand mid-write).
    half = tmp_path / "checkpoints" / ".tmp-step-3"
    half.mkdir()
    (half / "adapter.safetensors").write_bytes((done / "adapter.safetensors").read_bytes())
    no_manifest = tmp_path / "checkpoints" / "step-4"
    no_manifest.mkdir()
    (no_manifest / "state.json").write_text("{}")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-1", "step-2"]
    assert resume_checkpoint(tmp_path, "auto")[0].name == "step-2"
    save_checkpoint(tmp_path, 5, {"step": 5})
    assert not half.exists()


def test_every_checkpoint_corrupt_starts_from_scratch_with_a_warning(tmp_path, caplog):
    for step in (1, 2):
        p = save_checkpoint(tmp_path, step, _train_state(step))
        (p / "rng.pt").write_bytes(b"\0" * 10)
    with caplog.at_level(logging.WARNING, logger="rl.checkpointing"):
        assert resume_checkpoint(tmp_path, "auto") is None
    assert "no valid checkpoint" in caplog.text

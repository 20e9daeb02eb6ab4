"""Corruption: random bit flips and truncations anywhere in run checkpoints, model shards and adapters
are detected by the checksum manifests (never loaded as wrong weights); resume=auto falls back to the
newest intact run checkpoint; a half-written checkpoint is never picked."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from model.adapter import AdapterError, read_adapter, save_adapter
from model.checkpoint import CheckpointError as ModelCheckpointError
from model.checkpoint import load_model, save_model
from model.config import ModelConfig
from model.layers.lora import LoRAConfig, apply_lora
from model.modeling import MiniMaxM3ForCausalLM
from rl.checkpointing import CheckpointError, load_checkpoint, resume_checkpoint, save_checkpoint

pytestmark = pytest.mark.reliability
N_DAMAGES = 24  # per artefact kind: half bit flips, half truncations, at random offsets


def _damage(path, rng: random.Random, i: int) -> str:
    data = bytearray(path.read_bytes())
    if i % 2 == 0:
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return f"flip byte {at} of {path.name}"
    keep = rng.randrange(len(data))
    path.write_bytes(bytes(data[:keep]))
    return f"truncate {path.name} to {keep}"


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    lin = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(2, 16, generator=g)).sum().backward()
    opt.step()
    return {"adapter": {"a": torch.randn(8, 16, generator=g)}, "optimizer": opt.state_dict(), "step": step}


def test_random_damage_to_run_checkpoints_is_detected_and_resume_falls_back(tmp_path):
    rng = random.Random(0)
    for i in range(N_DAMAGES):
        run = tmp_path / f"run{i}"
        save_checkpoint(run, 1, _state(1))
        latest = save_checkpoint(run, 2, _state(2))
        victim = rng.choice(sorted(p for p in latest.iterdir() if p.name != "manifest.json"))
        what = _damage(victim, rng, i)
        with pytest.raises(CheckpointError, match=victim.name):
            load_checkpoint(latest)
        path, state = resume_checkpoint(run, "auto")
        assert path.name == "step-1" and state["step"] == 1, what
        shutil.rmtree(run)


def test_random_damage_to_model_shards_and_adapters_is_named(tmp_path):
    rng = random.Random(1)
    model = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(std=0.05, seed=0).eval()
    good = tmp_path / "good"
    save_model(model, good, max_shard_bytes=300_000)
    lora = LoRAConfig(r=4, target_modules=["q_proj", "v_proj"])
    save_adapter(apply_lora(model, lora), good / "adapter", lora)
    for i in range(N_DAMAGES):
        d = tmp_path / f"d{i}"
        shutil.copytree(good, d)
        shard = rng.choice(sorted(d.glob("model-*.safetensors")))
        _damage(shard, rng, i)
        with pytest.raises(ModelCheckpointError, match=rf"{shard.name} is (corrupted|truncated)"):
            load_model(d)
        _damage(d / "adapter" / "adapter_model.safetensors", rng, i)
        with pytest.raises(AdapterError, match=r"adapter_model\.safetensors is (corrupted|truncated)"):
            read_adapter(d / "adapter")
        shutil.rmtree(d)
    load_model(good)  # the original still loads

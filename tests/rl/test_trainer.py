"""End-to-end GRPO through real Ray, real W&B (offline, read back), real parquet data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl.config import load_config
from rl.sync import check_adapter_only, make_update
from rl.tracking import read_wandb_offline
from rl.trainer import Trainer

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
TIMING = ("timing_s/", "perf/", "sync/seconds", "_runtime", "_timestamp")


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _run(recipe: str, out: Path, *overrides: str) -> tuple[Trainer, dict]:
    cfg = load_config(recipe, [f"output_dir={out}", *overrides])
    trainer = Trainer(cfg)
    try:
        return trainer, trainer.fit()
    finally:
        trainer.close()


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


TINY_DAPO = (
    "model.preset=tiny", "model.checkpoint=null", "model.tokenizer=byte", "model.dtype=fp32",
    f"data.train_path={DATA / 'dapo_math_17k.parquet'}", f"data.eval_path={DATA / 'aime_2024.parquet'}",
    "data.hub_train=null", "data.hub_eval=null", "data.max_prompt_tokens=400",
    "rollout.backend=native", "rollout.num_gpus=0", "rollout.num_workers=1", "rollout.n_samples=2",
    "rollout.max_tokens=6", "rollout.max_pages=512", "rollout.max_batch_tokens=4096",
    "rollout.max_num_seqs=64",
    "rollout.tensor_parallel_size=1", "reward.overlong_buffer=2", "algo.batch_prompts=2",
    "algo.mini_batch_prompts=null", "algo.dynamic_sampling=false", "trainer.total_steps=2",
    "trainer.eval_every=2", "trainer.eval_n_samples=1", "trainer.save_every=0", "trainer.device=cpu",
    "trainer.num_gpus=0", "trainer.num_learners=1", "trainer.learner_parallel=none",
    "trainer.micro_batch_size=4", "ray.num_cpus=2", "tracking.mode=offline",
)  # fmt: skip


@pytest.mark.skipif(not DATA.exists(), reason=f"real data not found at {DATA}")
def test_dapo_math_two_steps_on_real_parquet_logs_to_wandb_offline(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    _run("dapo_math", tmp_path / "run", *TINY_DAPO)
    run = tmp_path / "run"
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/acc" in rows[0] and "eval/acc" in rows[-1]
    for key in ("reward/mean", "acc/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "sync/bytes"):
        assert key in rows[1], key
    (wb,) = read_wandb_offline(run)
    history = {h["_step"]: h for h in wb["history"]}
    assert history[1]["reward/mean"] == pytest.approx(rows[1]["reward/mean"])
    assert history[2]["sync/bytes"] == rows[2]["sync/bytes"]
    # Only adapter bytes crossed: exactly the adapter's size, a tiny fraction of the base.
    adapter = load_file(run / "adapter" / "adapter_model.safetensors")
    assert rows[1]["sync/bytes"] == sum(t.numel() * t.element_size() for t in adapter.values())
    base_bytes = sum(f.stat().st_size for f in (run / "base").glob("*.safetensors"))
    assert rows[1]["sync/bytes"] < base_bytes
    assert (run / "plots" / "reward.png").stat().st_size > 0
    assert (run / "config.yaml").exists()


QUICK = (
    "model.checkpoint=null", "model.warmup=false", "data.num_train=64", "data.num_eval=8",
    "rollout.n_samples=4", "rollout.max_tokens=8", "algo.batch_prompts=4", "algo.max_regen_rounds=1",
    "trainer.eval_every=2", "trainer.save_every=2", "trainer.micro_batch_size=8", "tracking.mode=offline",
)  # fmt: skip


def test_resume_after_stop_is_bitwise_identical_to_uninterrupted_run(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    _run("quickstart", tmp_path / "full", *QUICK, "trainer.total_steps=4")
    _run("quickstart", tmp_path / "cut", *QUICK, "trainer.total_steps=2")  # "stops" after step 2
    _run("quickstart", tmp_path / "cut", *QUICK, "trainer.total_steps=4", "resume=auto")
    full, cut = _metrics(tmp_path / "full"), _metrics(tmp_path / "cut")
    assert [r["step"] for r in cut] == [0, 1, 2, 3, 4]
    assert cut == full
    a = load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "cut" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    runs = read_wandb_offline(tmp_path / "cut")
    assert len({r["run_id"] for r in runs}) == 1, "the resumed run continues the same W&B run"


def test_sync_refuses_base_tensors():
    with pytest.raises(ValueError, match="non-adapter"):
        make_update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}, 1)
    check_adapter_only({"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 2)})

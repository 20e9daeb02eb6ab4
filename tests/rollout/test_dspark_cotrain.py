"""Online drafter co-training: distillation on rollouts moves the drafter towards the policy
(accepted length up, loss down), never touches the policy, and its weights travel to other engines
exactly; wired into a GRPO run with two engines."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from model.config import ModelConfig
from model.modeling import MiniMaxM3ForCausalLM
from rollout.dspark import Drafter, DSparkConfig, save_drafter
from rollout.dspark.cotrain import CoTrainer, drafter_state, load_drafter_state


def _target(seed: int = 0) -> MiniMaxM3ForCausalLM:
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), num_mtp_modules=0)
    return MiniMaxM3ForCausalLM(cfg).init_weights(std=0.2, seed=seed).eval().requires_grad_(False)


def _drafter(target, seed: int = 0) -> Drafter:
    cfg = DSparkConfig.for_target(target.config, num_layers=1, block_size=4, markov_rank=16)
    return Drafter(cfg).init_weights(seed=seed).bind(target).eval().requires_grad_(False)


def _sequences(target, n: int = 24, length: int = 24) -> list[tuple[list[int], int]]:
    """Greedy continuations of random prompts (the policy's own samples)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 250, (n, 6), generator=gen)
    with torch.no_grad():
        for _ in range(length):
            ids = torch.cat([ids, target(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return [(row.tolist(), 6) for row in ids]


def test_cotraining_raises_acceptance_and_leaves_the_policy_untouched():
    target, seqs = _target(), None
    seqs = _sequences(target)
    drafter = _drafter(target)
    before_target = {k: v.clone() for k, v in target.state_dict().items()}
    trainer = CoTrainer(target, drafter, lr=3e-3, steps=30, batch_size=16)
    first = trainer.update(seqs)
    for _ in range(3):
        last = trainer.update(seqs)
    assert last["spec/cotrain_accept_len_before"] > first["spec/cotrain_accept_len_before"] + 0.2
    assert last["spec/cotrain_loss"] < first["spec/cotrain_loss"]
    assert last["spec/drafter_version"] == 4.0
    after = target.state_dict()
    assert all(torch.equal(before_target[k], after[k]) for k in before_target)
    assert all(p.grad is None for p in target.parameters())


def test_published_drafter_weights_load_exactly_and_bad_ones_are_refused():
    target = _target()
    a, b = _drafter(target, seed=0), _drafter(target, seed=1)
    CoTrainer(target, a, steps=2, batch_size=4).update(_sequences(target, n=4, length=8))
    state = drafter_state(a)
    assert not any(k.startswith(("embed", "lm_head")) for k in state)  # the shared target parts stay
    load_drafter_state(b, state)
    assert all(torch.equal(p, state[n]) for n, p in b.named_parameters())
    with pytest.raises(ValueError, match="lacks"):
        load_drafter_state(b, {"nope.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        load_drafter_state(b, {"fc.weight": torch.zeros(1, 1)})


def test_grpo_run_with_cotraining_logs_acceptance_and_publishes_to_every_engine(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    from rl.config import load_config
    from rl.trainer import Trainer, prepare_base

    monkeypatch.setenv("WANDB_SILENT", "true")
    quick = [
        f"output_dir={tmp_path / 'run'}", "model.checkpoint=null", "model.warmup=false", "data.num_train=64",
        "data.num_eval=4", "rollout.n_samples=2", "rollout.max_tokens=8", "algo.batch_prompts=2",
        "algo.max_regen_rounds=1", "trainer.eval_every=2", "trainer.total_steps=2", "trainer.save_every=100",
        "tracking.mode=offline", "rollout.num_workers=2", "rollout.dspark.cotrain=true",
        "rollout.dspark.cotrain_steps=3", "rollout.dspark.mode=fixed",
    ]  # fmt: skip
    cfg = load_config("quickstart", [*quick, f"rollout.dspark.drafter={tmp_path / 'drafter'}"])
    base = prepare_base(cfg, tmp_path / "run")
    from model.checkpoint import load_model

    target = load_model(base)
    save_drafter(_drafter(target), tmp_path / "drafter")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        trainer = Trainer(cfg)
        try:
            trainer.fit()
            versions = ray.get([w.__ray_call__.remote(lambda w: getattr(w, "drafter_version", None))
                                for w in trainer.rollout[1:]])  # fmt: skip
        finally:
            trainer.close()
    finally:
        ray.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert all(r["spec/accept_len"] >= 1.0 and r["spec/verify_steps"] > 0 for r in steps)
    assert [r["spec/drafter_version"] for r in steps] == [1.0, 2.0]
    assert "eval/accept_len" in rows[0]
    assert versions == [2]

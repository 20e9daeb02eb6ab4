"""Online drafter co-training: after the policy drifts, distillation on its rollouts recovers the
drafter's acceptance on held-out prompts, never touches the policy, trains every k steps on a
bounded replay buffer, and its weights travel to other engines exactly; wired into a GRPO run with
two engines."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from model.config import ModelConfig
from model.layers.lora import LoRAConfig, apply_lora
from model.modeling import MiniMaxM3ForCausalLM
from rollout.dspark import Drafter, DSparkConfig, load_drafter, save_drafter
from rollout.dspark.cotrain import (
    CoTrainConfig,
    CoTrainer,
    concat_features,
    drafter_state,
    load_drafter_state,
)
from rollout.dspark.train import build_features, distill_loss, estimate_accept_len, sample_anchors


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


def _bigram_policy() -> MiniMaxM3ForCausalLM:
    """A tiny target whose next-token distribution is mostly a function of the current token
    (weak decoder layers, strong embedding and lm_head), so a drafter can fit it in a few steps,
    with zero-initialised MLP LoRA adapters: the policy GRPO would start from."""
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), num_mtp_modules=0)
    target = MiniMaxM3ForCausalLM(cfg).init_weights(std=0.02, seed=0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        target.model.embed_tokens.weight.normal_(0.0, 1.0, generator=gen)
        target.lm_head.weight.normal_(0.0, 0.3, generator=gen)
    apply_lora(target, LoRAConfig(r=8, alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]))
    return target.eval().requires_grad_(False)


@torch.no_grad()
def _samples(target, n: int, seed: int, length: int = 16) -> list[tuple[list[int], int]]:
    """Temperature-1 continuations of random 6-token prompts (the policy's rollouts)."""
    gen = torch.Generator().manual_seed(seed)
    ids_BS = torch.randint(3, target.config.vocab_size, (n, 6), generator=gen)
    for _ in range(length):
        p_BV = torch.softmax(target(ids_BS)[:, -1], dim=-1)
        ids_BS = torch.cat([ids_BS, torch.multinomial(p_BV, 1, generator=gen)], 1)
    return [(row.tolist(), 6) for row in ids_BS]


def _held_out_accept_len(target, drafter, seqs) -> float:
    """Teacher-forced tokens per verification (sampling) on `seqs`, same anchors every call."""
    feats = build_features(target, seqs, drafter.config.target_layer_ids, drafter.dtype)
    return estimate_accept_len(drafter, feats, torch.Generator().manual_seed(123), anchors_per_seq=8)[
        "accept_len_sampled"
    ]


def test_cotraining_after_policy_drift_recovers_acceptance_on_held_out_prompts():
    target = _bigram_policy()
    drafter = _drafter(target, seed=0)
    # The fresh drafter already fits this policy: its anchor path (embedding -> norm -> lm_head) is
    # the target's bigram; the test checks that, then breaks it.
    fitted = _held_out_accept_len(target, drafter, _samples(target, 32, seed=2))
    # Drift: what a run of GRPO steps does to the adapter, in one jump (random MLP LoRA B).
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    held_out = _samples(target, 32, seed=4)
    frozen = _held_out_accept_len(target, drafter, held_out)
    assert frozen < fitted - 0.4, f"drift should hurt a frozen drafter: {fitted:.3f} -> {frozen:.3f}"
    before_target = {k: v.clone() for k, v in target.state_dict().items()}
    trainer = CoTrainer(target, drafter, CoTrainConfig(steps=30, lr=2e-3, batch_size=16, replay_steps=4))
    rollouts = _samples(target, 64, seed=3)
    for step in range(4):  # four policy steps' rollouts (16 each), none of them held out
        trainer.update(rollouts[16 * step : 16 * (step + 1)])
    cotrained = _held_out_accept_len(target, drafter, held_out)
    assert cotrained > frozen + 0.2, f"co-training should recover acceptance: {frozen:.3f} -> {cotrained:.3f}"
    after = target.state_dict()
    assert all(torch.equal(before_target[k], after[k]) for k in before_target)
    assert all(p.grad is None for p in target.parameters())


def test_cotrainer_trains_every_kth_step_on_a_bounded_replay_buffer():
    target = _target()
    drafter = _drafter(target)
    cfg = CoTrainConfig(steps=2, batch_size=4, every=2, replay_steps=2, max_seqs_per_step=6)
    trainer = CoTrainer(target, drafter, cfg)
    seqs = _sequences(target, n=8, length=6)
    start = {n: p.clone() for n, p in drafter.named_parameters()}
    rows = [trainer.update(seqs) for _ in range(5)]
    assert [r["spec/drafter_version"] for r in rows] == [0.0, 1.0, 1.0, 2.0, 2.0]
    assert ["spec/cotrain_loss" in r for r in rows] == [False, True, False, True, False]
    assert all("spec/cotrain_accept_len_before" in r for r in rows)  # measured every step
    assert len(trainer.buffer) == 2 and all(len(f) == 6 for f in trainer.buffer)  # bounded
    assert rows[3]["spec/cotrain_buffer_sequences"] == 12.0
    assert any(not torch.equal(start[n], p) for n, p in drafter.named_parameters())
    with pytest.raises(ValueError, match=r"rollout\.dspark\.cotrain\.every must be an int >= 1"):
        CoTrainConfig(every=0)
    with pytest.raises(ValueError, match=r"rollout\.dspark\.cotrain\.focus"):
        CoTrainConfig(focus=-1.0)


def test_concat_features_pads_shorter_steps_without_changing_their_blocks():
    target = _target()
    drafter = _drafter(target)
    layers = drafter.config.target_layer_ids
    short = build_features(target, _sequences(target, n=3, length=5), layers, drafter.dtype)
    long = build_features(target, _sequences(target, n=2, length=9), layers, drafter.dtype)
    both = concat_features([short, long])
    assert both.ids_BS.shape == (5, long.ids_BS.shape[1])
    anchors_BA = torch.tensor([[6, 7]] * 3)
    valid_BA = torch.ones(3, 2, dtype=torch.bool)
    alone, _ = distill_loss(drafter, short, anchors_BA, valid_BA)
    padded, _ = distill_loss(drafter, both.select(torch.arange(3)), anchors_BA, valid_BA)
    torch.testing.assert_close(padded, alone)


def test_published_drafter_weights_load_exactly_and_bad_ones_are_refused():
    target = _target()
    a, b = _drafter(target, seed=0), _drafter(target, seed=1)
    CoTrainer(target, a, CoTrainConfig(steps=2, batch_size=4)).update(_sequences(target, n=4, length=8))
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
    from rl.topology import prepare_base
    from rl.trainer import Trainer

    monkeypatch.setenv("WANDB_SILENT", "true")
    quick = [
        f"output_dir={tmp_path / 'run'}", "model.checkpoint=null", "model.warmup=false", "data.num_train=64",
        "data.num_eval=4", "rollout.n_samples=2", "rollout.max_tokens=8", "algo.batch_prompts=2",
        "algo.max_regen_rounds=1", "trainer.eval_every=2", "trainer.total_steps=2", "trainer.save_every=100",
        "tracking.mode=offline", "rollout.num_workers=2", "rollout.dspark.cotrain.enabled=true",
        "rollout.dspark.cotrain.steps=3", "rollout.dspark.cotrain.every=2", "rollout.dspark.mode=fixed",
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
    assert [r["spec/drafter_version"] for r in steps] == [0.0, 1.0]  # a round every 2nd step
    assert "eval/accept_len" in rows[0]
    assert versions == [1]  # published to the other engine on the round only
    saved = load_drafter(tmp_path / "run" / "drafter")  # the co-trained drafter, beside the adapter
    assert saved.config.metadata["cotrain_version"] == 1
    # A resumed run's engines start from that co-trained drafter, not from the shipped one.
    import dataclasses

    from rl.workers import RolloutWorker

    shipped = load_drafter(tmp_path / "drafter").state_dict()
    resumed = RolloutWorker(dataclasses.replace(cfg, resume="auto"), str(base), index=1).drafter.state_dict()
    assert all(torch.equal(resumed[k], v) for k, v in saved.state_dict().items())
    assert not all(torch.equal(resumed[k], v) for k, v in shipped.items())


def test_focus_weights_the_positions_the_drafter_gets_most_wrong():
    target = _target()
    drafter = _drafter(target)
    feats = build_features(
        target, _sequences(target, n=6, length=10), drafter.config.target_layer_ids, drafter.dtype
    )
    anchors_BA, valid_BA = sample_anchors(feats, 3, torch.Generator().manual_seed(0))
    plain, m0 = distill_loss(drafter, feats, anchors_BA, valid_BA)
    same, _ = distill_loss(drafter, feats, anchors_BA, valid_BA, focus=0.0)
    torch.testing.assert_close(same, plain)
    _, m2 = distill_loss(drafter, feats, anchors_BA, valid_BA, focus=2.0)
    # Weights growing with TV make the weighted mean TV larger (Chebyshev's sum inequality).
    assert m2["tv"] > m0["tv"]  # equal only if focus were ignored (or every TV were equal)

"""Multi-turn training without Ray: trajectories from the real rollout worker's native engine (LoRA
adapter, NVFP4 KV) through rollout/multiturn.py, trained by the real Learner. The engine's log-probs of
model tokens equal the learner's (kv_sim, fp32, 1e-4); environment tokens get exactly zero gradient,
count in no token mean, and whatever log-probs they carry do not change the update."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses

import pytest
import torch

from rl import grpo
from rl.config import load_config
from rl.learner import Learner, collate
from rl.sync import make_update
from rl.topology import prepare_base
from rl.workers import RolloutWorker, Sample
from rollout import multiturn
from rollout.engine import SamplingParams
from tests.rollout.test_multiturn import ReplyEnv


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiturn")
    overrides = [f"output_dir={out}", "model.checkpoint=null", "model.warmup=false",
                 "rollout.max_pages=256", "trainer.micro_batch_size=4", "rollout.torch_threads=1",
                 "trainer.torch_threads=1"]  # fmt: skip
    cfg = load_config("quickstart_tools", overrides)
    base = str(prepare_base(cfg, out))
    learner = Learner(cfg, base)
    g = torch.Generator().manual_seed(0)
    adapter = {
        k: 0.05 * torch.randn(v.shape, generator=g) for k, v in learner.adapter_update().tensors.items()
    }
    learner.load_state_dict({**learner.state_dict(), "adapter": adapter})
    worker = RolloutWorker(cfg, base)
    worker.set_adapter(make_update(adapter, 0))
    return cfg, base, learner, worker, adapter


def trajectories(worker: RolloutWorker, n_prompts: int = 2, n: int = 2) -> list[Sample]:
    """Three-turn episodes of a replying environment on the worker's engine, as the worker's Samples."""
    tok = worker.tokenizer
    params = SamplingParams(temperature=1.0, stop_token_ids=tok.stop_token_ids)
    groups = []
    for k in range(n_prompts):
        ids = tok.chat_prompt([{"role": "user", "content": f"{123 + k}*45="}])
        groups.append(
            multiturn.EpisodeGroup(f"u{k}", tuple(ids), [ReplyEnv() for _ in range(n)], params, 7 * k)
        )
    limits = multiturn.TurnLimits(max_turns=3, max_tokens_per_turn=6, max_context=200)
    with cf.ThreadPoolExecutor(4) as pool:
        trajs = multiturn.run_episodes(multiturn.NativeTurns(worker.engine), groups, tok, limits, pool)
    return [
        Sample(uid=t.request_id, prompt_ids=t.prompt_ids, response_ids=t.token_ids,
               rollout_logprobs=t.logprobs, finish_reason="stop", adapter_version=0,
               response_mask=t.is_model, advantage=(-1.0) ** i)
        for i, t in enumerate(trajs)
    ]  # fmt: skip


def test_native_multiturn_logprobs_equal_the_learners(run):
    cfg, _, learner, worker, _ = run
    samples = trajectories(worker)
    assert all(s.response_mask.count(0) > 0 and s.num_model_tokens == 18 for s in samples)
    batch = collate(samples)
    with torch.no_grad():
        logp = learner._logprobs(batch, with_entropy=False)[0]
    model = batch["mask"] > 0
    assert int(model.sum()) == sum(s.num_model_tokens for s in samples)
    assert (logp - batch["rollout_logp"])[model].abs().max() < 1e-4
    assert cfg.trainer.kv_sim and worker.model.config.kv_cache_dtype == "nvfp4"


def test_environment_tokens_get_zero_gradient_and_no_token_mean_weight(run):
    _, _, learner, worker, _ = run
    samples = trajectories(worker)
    batch = collate(samples)
    logp = learner._logprobs(batch, with_entropy=False)[0].detach().requires_grad_(True)
    loss, _ = grpo.policy_loss(logp, logp.detach(), batch["adv"], batch["mask"],
                               rollout_logp_BT=batch["rollout_logp"], tis_cap=2.0)  # fmt: skip
    loss.backward()
    response = torch.zeros_like(batch["mask"], dtype=torch.bool)
    for b, s in enumerate(samples):
        response[b, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.response_ids)] = True
    env = response & (batch["mask"] == 0)
    assert env.sum() > 0 and torch.all(logp.grad[env] == 0)
    assert torch.all(logp.grad[batch["mask"] > 0] != 0)
    # Token mean over the model's tokens only: d loss / d logp = -A * w / (number of model tokens).
    n_model = sum(s.num_model_tokens for s in samples)
    w = grpo.tis_weights(logp.detach(), batch["rollout_logp"], batch["mask"], 2.0)
    expect = -batch["adv"] * w / n_model
    torch.testing.assert_close(logp.grad[batch["mask"] > 0], expect[batch["mask"] > 0], atol=1e-7, rtol=1e-5)


def test_garbage_on_environment_tokens_leaves_the_update_unchanged(run):
    cfg, base, _, worker, adapter = run
    samples = trajectories(worker)
    noisy = [
        dataclasses.replace(s, rollout_logprobs=[lp if m else -37.0 for lp, m in zip(s.rollout_logprobs,
                                                                                    s.response_mask)])
        for s in samples
    ]  # fmt: skip
    updates, metrics = [], []
    for batch in (samples, noisy):
        learner = Learner(cfg, base)
        learner.load_state_dict({**learner.state_dict(), "adapter": adapter})
        metrics.append(learner.train_step(batch))
        updates.append(learner.adapter_update().tensors)
    assert all(torch.equal(updates[0][k], updates[1][k]) for k in updates[0])
    assert any(not torch.equal(updates[0][k], adapter[k]) for k in adapter), "the step must train"
    assert metrics[0]["actor/pg_loss"] == metrics[1]["actor/pg_loss"]
    assert metrics[0]["rollout_corr/abs_diff"] == metrics[1]["rollout_corr/abs_diff"] < 1e-4

"""rl/grpo.py against verl's core_algos on random ragged batches, plus the DAPO shaping rules."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rl import grpo

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is the reference implementation")
verl_F = pytest.importorskip("verl.utils.torch_functional")
rollout_corr = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")

SHAPES = [(1, 1), (3, 7), (8, 33), (16, 5)]


def _ragged_mask(b: int, t: int, gen: torch.Generator, allow_empty: bool = False) -> torch.Tensor:
    """Right-padded response mask with random lengths in [1, t] (or [0, t])."""
    lengths = torch.randint(0 if allow_empty else 1, t + 1, (b,), generator=gen)
    lengths[0] = t  # at least one full row so the batch always has tokens
    return (torch.arange(t)[None, :] < lengths[:, None]).float()


def _batch(b: int, t: int, seed: int, spread: float = 0.5):
    gen = torch.Generator().manual_seed(seed)
    mask = _ragged_mask(b, t, gen)
    logp_old = -torch.rand(b, t, generator=gen) * 3
    logp_new = logp_old + torch.randn(b, t, generator=gen) * spread
    rollout = logp_old + torch.randn(b, t, generator=gen) * spread
    adv = torch.randn(b, t, generator=gen) * mask
    return logp_new, logp_old, rollout, adv, mask


def _verl_actor_cfg(eps_low: float, eps_high: float):
    # The fields compute_policy_loss_vanilla reads from its ActorConfig.
    return OmegaConf.create(
        {"clip_ratio": 0.2, "clip_ratio_low": eps_low, "clip_ratio_high": eps_high, "clip_ratio_c": 3.0,
         "global_batch_info": {}}
    )  # fmt: skip


# --------------------------------------------------------------------------- advantages
@pytest.mark.parametrize("num_groups,group_size", [(1, 2), (4, 8), (7, 3), (5, 1)])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_group_advantages_equal_verl_grpo_outcome_advantage(num_groups, group_size, norm_by_std):
    gen = torch.Generator().manual_seed(num_groups * 100 + group_size)
    n, t = num_groups * group_size, 6
    scores = torch.randint(-1, 2, (n,), generator=gen).float() + 0.1 * torch.randn(n, generator=gen)
    # Groups shuffled through the batch, with arbitrary (non-dense) ids, as a driver might send them.
    perm = torch.randperm(n, generator=gen)
    ids = (torch.arange(n) // group_size * 17 + 3)[perm]
    mask = _ragged_mask(n, t, gen)
    token_rewards = torch.zeros(n, t)
    last = mask.sum(-1).long() - 1
    token_rewards[torch.arange(n), last] = scores  # outcome reward on the last response token
    ref, _ = core_algos.compute_grpo_outcome_advantage(
        token_rewards, mask, np.array(ids.tolist()), epsilon=1e-6, norm_adv_by_std_in_grpo=norm_by_std
    )
    ours = grpo.group_advantages(scores, ids, eps=1e-6, norm_by_std=norm_by_std, response_mask=mask)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_group_advantages_BG_layout_equals_flat_layout():
    gen = torch.Generator().manual_seed(1)
    r_BG = torch.randn(5, 4, generator=gen)
    flat = grpo.group_advantages(r_BG.reshape(-1), torch.arange(5).repeat_interleave(4))
    torch.testing.assert_close(grpo.group_advantages(r_BG), flat.reshape(5, 4))


def test_group_advantages_equal_rewards_give_zero_and_singleton_keeps_reward():
    adv = grpo.group_advantages(torch.tensor([1.0, 1.0, 1.0, -1.0]), torch.tensor([0, 0, 0, 1]))
    assert torch.all(adv[:3] == 0)
    # verl's convention for a group of one: mean 0, std 1.
    torch.testing.assert_close(adv[3], torch.tensor(-1.0 / (1 + 1e-6)))


def test_group_advantages_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="group_ids"):
        grpo.group_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        grpo.group_advantages(torch.zeros(4))


# --------------------------------------------------------------------------- policy loss
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("loss_agg", grpo.LOSS_AGG_MODES)
def test_policy_loss_equals_verl_vanilla_for_every_agg_mode(shape, loss_agg):
    logp_new, logp_old, _, adv, mask = _batch(
        *shape, seed=shape[0] * 31 + shape[1] + 1000 * grpo.LOSS_AGG_MODES.index(loss_agg)
    )
    eps_low, eps_high = 0.2, 0.28
    ref_loss, ref_m = core_algos.compute_policy_loss_vanilla(
        logp_old, logp_new, adv, mask, loss_agg_mode=loss_agg, config=_verl_actor_cfg(eps_low, eps_high)
    )
    loss, m = grpo.policy_loss(logp_new, logp_old, adv, mask, eps_low, eps_high, loss_agg)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert m[key].item() == pytest.approx(ref_m[key], abs=1e-6), key


@pytest.mark.parametrize("shape", SHAPES)
def test_policy_loss_gradient_equals_verl(shape):
    logp_new, logp_old, _, adv, mask = _batch(*shape, seed=7)
    a = logp_new.clone().requires_grad_(True)
    b = logp_new.clone().requires_grad_(True)
    ref_loss, _ = core_algos.compute_policy_loss_vanilla(
        logp_old, a, adv, mask, config=_verl_actor_cfg(0.2, 0.28)
    )
    loss, _ = grpo.policy_loss(b, logp_old, adv, mask, 0.2, 0.28)
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(b.grad, a.grad, atol=1e-7, rtol=1e-5)
    assert torch.all(b.grad[mask == 0] == 0), "padding must get no gradient"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cap", [2.0, 1.1])
def test_policy_loss_with_tis_equals_verl_rollout_correction(shape, cap):
    logp_new, logp_old, rollout, adv, mask = _batch(*shape, seed=11, spread=0.8)
    weights, ref_is_m = rollout_corr.compute_rollout_correction_weights(
        logp_old - rollout, mask, rollout_is="token", rollout_is_threshold=cap
    )
    ref_loss, _ = core_algos.compute_policy_loss_vanilla(
        logp_old, logp_new, adv, mask, config=_verl_actor_cfg(0.2, 0.28), rollout_is_weights=weights
    )
    loss, m = grpo.policy_loss(logp_new, logp_old, adv, mask, 0.2, 0.28, rollout_logp_BT=rollout, tis_cap=cap)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grpo.tis_weights(logp_old, rollout, mask, cap), weights)
    assert m["rollout_corr/tis_mean"].item() == pytest.approx(ref_is_m["rollout_is_mean"], abs=1e-6)
    assert m["rollout_corr/tis_clip_frac"].item() == pytest.approx(
        ref_is_m["rollout_is_ratio_fraction_high"], abs=1e-6
    )
    ref_off = rollout_corr.compute_offpolicy_metrics(logp_old, rollout, mask)
    assert m["rollout_corr/kl"].item() == pytest.approx(ref_off["kl"], abs=1e-6)
    assert m["rollout_corr/k3_kl"].item() == pytest.approx(ref_off["k3_kl"], abs=1e-5)


def test_policy_loss_tis_weights_carry_no_gradient_and_metrics_only_without_cap():
    logp_new, logp_old, rollout, adv, mask = _batch(4, 9, seed=3)
    roll = rollout.clone().requires_grad_(True)
    old = logp_old.clone().requires_grad_(True)
    loss, _ = grpo.policy_loss(logp_new, old, adv, mask, rollout_logp_BT=roll, tis_cap=2.0)
    loss.backward()
    assert roll.grad is None, "TIS weights must be detached"
    # logp_old enters only through the ratio: its gradient is minus logp_new's.
    new = logp_new.clone().requires_grad_(True)
    grpo.policy_loss(new, logp_old, adv, mask, rollout_logp_BT=rollout, tis_cap=2.0)[0].backward()
    torch.testing.assert_close(old.grad, -new.grad)
    plain, _ = grpo.policy_loss(logp_new, logp_old, adv, mask)
    no_cap, m = grpo.policy_loss(logp_new, logp_old, adv, mask, rollout_logp_BT=rollout, tis_cap=None)
    torch.testing.assert_close(no_cap, plain)
    assert "rollout_corr/kl" in m and "rollout_corr/tis_mean" not in m


def test_policy_loss_on_policy_equals_minus_token_mean_advantage_and_never_clips():
    _, logp, _, adv, mask = _batch(6, 10, seed=5)
    loss, m = grpo.policy_loss(logp, logp, adv, mask, 0.2, 0.28)
    torch.testing.assert_close(loss, -(adv * mask).sum() / mask.sum())
    assert m["actor/pg_clipfrac"].item() == 0 and m["actor/ppo_kl"].item() == 0


def test_policy_loss_clip_higher_is_asymmetric():
    # ratio 1.25 with A > 0: inside eps_high = 0.28 (unclipped), outside a symmetric 0.2 clip.
    logp_old = torch.zeros(1, 1)
    logp_new = torch.full((1, 1), float(np.log(1.25)))
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    _, m_high = grpo.policy_loss(logp_new, logp_old, adv, mask, 0.2, 0.28)
    _, m_sym = grpo.policy_loss(logp_new, logp_old, adv, mask, 0.2, 0.2)
    assert m_high["actor/pg_clipfrac"].item() == 0 and m_sym["actor/pg_clipfrac"].item() == 1


def test_policy_loss_accepts_per_sequence_advantages_and_empty_mask():
    logp_new, logp_old, _, adv, mask = _batch(3, 4, seed=2)
    adv_B = adv[:, 0]
    a, _ = grpo.policy_loss(logp_new, logp_old, adv_B, mask)
    b, _ = grpo.policy_loss(logp_new, logp_old, adv_B[:, None].expand(3, 4), mask)
    torch.testing.assert_close(a, b)
    for agg in grpo.LOSS_AGG_MODES:
        loss, m = grpo.policy_loss(logp_new, logp_old, adv, torch.zeros(3, 4), loss_agg=agg)
        assert torch.isfinite(loss) and loss.item() == 0 and all(torch.isfinite(v) for v in m.values())


def test_policy_loss_rejects_unknown_agg_and_bad_shapes():
    logp_new, logp_old, _, adv, mask = _batch(2, 3, seed=0)
    with pytest.raises(ValueError, match="token-mean"):
        grpo.policy_loss(logp_new, logp_old, adv, mask, loss_agg="mean")
    with pytest.raises(ValueError, match="shape mismatch"):
        grpo.policy_loss(logp_new, logp_old[:, :2], adv, mask)


# --------------------------------------------------------------------------- KL, entropy, masked mean
@pytest.mark.parametrize("shape", SHAPES)
def test_kl_k3_equals_verl_low_var_kl(shape):
    gen = torch.Generator().manual_seed(shape[1])
    logp = -torch.rand(*shape, generator=gen) * 5
    ref = logp + torch.randn(*shape, generator=gen) * 3
    torch.testing.assert_close(grpo.kl_k3(logp, ref), core_algos.kl_penalty(logp, ref, "low_var_kl"))
    assert torch.all(grpo.kl_k3(logp, ref) >= 0) and torch.all(grpo.kl_k3(logp, logp) == 0)


def test_entropy_from_logits_equals_verl_and_uniform_is_log_v():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen) * 4
    torch.testing.assert_close(grpo.entropy_from_logits(logits), verl_F.entropy_from_logits(logits))
    torch.testing.assert_close(
        grpo.entropy_from_logits(torch.zeros(1, 1, 11)), torch.full((1, 1), float(np.log(11)))
    )


def test_masked_mean_equals_verl_and_ignores_nan_padding():
    x, mask = torch.randn(4, 6), _ragged_mask(4, 6, torch.Generator().manual_seed(0))
    torch.testing.assert_close(grpo.masked_mean(x, mask), verl_F.masked_mean(x, mask))
    torch.testing.assert_close(grpo.masked_mean(x, mask, dim=-1), verl_F.masked_mean(x, mask, axis=-1))
    x_nan = torch.where(mask.bool(), x, torch.tensor(float("nan")))
    torch.testing.assert_close(grpo.masked_mean(x_nan, mask.bool()), grpo.masked_mean(x, mask))


# --------------------------------------------------------------------------- DAPO shaping
def test_dynamic_sampling_keeps_only_groups_with_distinct_rewards():
    r = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 1.0, -1.0], [-1.0, -1.0, -1.0], [0.5, 0.5, 0.25]])
    assert grpo.dynamic_sampling_keep(r).tolist() == [False, True, False, True]


def test_dynamic_sampling_keep_ragged_groups_equals_a_per_group_loop():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (40,), generator=gen) * 7  # any integer ids, groups of uneven size
    rewards = torch.randint(0, 2, (40,), generator=gen).float()
    rewards[ids == 0] = 1.0  # one group all equal, whatever the draw
    keep = grpo.dynamic_sampling_keep(rewards, ids)
    expected = [len(set(rewards[ids == g].tolist())) > 1 for g in ids.tolist()]
    assert keep.tolist() == expected and not keep[ids == 0].any()
    r_BG = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    flat = grpo.dynamic_sampling_keep(r_BG.flatten(), torch.tensor([0, 0, 1, 1]))
    assert flat.tolist() == grpo.dynamic_sampling_keep(r_BG).repeat_interleave(2).tolist()


def test_keep_varied_groups_drops_equal_reward_groups_of_flat_samples():
    uids = ["b", "b", "a", "a", "c", "c"]
    assert grpo.keep_varied_groups([1.0, -1.0, 1.0, 1.0, -1.0, -1.0], uids) == [True, True] + [False] * 4
    assert grpo.keep_varied_groups([], []) == []


def test_needs_another_round_until_enough_groups_or_no_regenerations_left():
    assert grpo.needs_another_round(kept_groups=3, batch_groups=8, rounds_done=1, max_regen_rounds=2)
    assert grpo.needs_another_round(3, 8, 3, 2) is False  # the step's round + 2 regenerations done
    assert grpo.needs_another_round(8, 8, 1, 2) is False  # enough groups
    assert grpo.needs_another_round(3, 8, 1, 0) is False  # regeneration off


def test_sample_advantages_of_flat_samples_equal_group_advantages_of_the_BG_layout():
    r_BG = torch.tensor([[1.0, -1.0, -1.0, 1.0], [1.0, 1.0, -1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]])
    uids = [u for u in ("z", "a", "m") for _ in range(4)]
    got = grpo.sample_advantages(r_BG.flatten().tolist(), uids)
    assert got == grpo.group_advantages(r_BG).flatten().tolist()


def test_mini_batch_index_keeps_groups_whole_in_first_appearance_order():
    uids = ["p", "p", "q", "q", "r", "r", "s"]
    assert grpo.mini_batch_index(uids, 2) == ([0, 0, 0, 0, 1, 1, 1], 2)
    assert grpo.mini_batch_index(uids, None) == ([0] * 7, 1)
    assert grpo.mini_batch_index([], None) == ([], 0)


def test_micro_batch_weights_make_the_token_mean_of_the_whole_mini_batch():
    gen = torch.Generator().manual_seed(0)
    loss_BT, mask = torch.randn(6, 5, generator=gen), _ragged_mask(6, 5, gen)
    total = float(mask.sum())
    parts = [(loss_BT[i : i + 2], mask[i : i + 2]) for i in range(0, 6, 2)]
    weighted = sum(
        grpo.agg_loss(lb, mb, "token-mean") * grpo.micro_batch_weight(float(mb.sum()), total)
        for lb, mb in parts
    )
    torch.testing.assert_close(weighted, grpo.agg_loss(loss_BT, mask, "token-mean"))
    assert grpo.micro_batch_weight(0.0, 0.0) == 0.0


def test_overlong_penalty_is_zero_then_linear_to_minus_penalty():
    lengths = torch.tensor([0, 10, 12, 14, 16, 20])
    out = grpo.overlong_penalty(lengths, max_tokens=16, buffer=4, penalty=1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 0.0, -0.5, -1.0, -2.0]))
    assert torch.all(grpo.overlong_penalty(lengths, 16, 0, 1.0) == 0)
    torch.testing.assert_close(grpo.overlong_penalty(torch.tensor([16]), 16, 8, 0.5), torch.tensor([-0.5]))
    with pytest.raises(ValueError, match="buffer"):
        grpo.overlong_penalty(lengths, 4, 8, 1.0)

"""GRPO / DAPO numerics: every algorithmic decision of a step as pure functions.

What: the driver's (group advantages, dynamic sampling's keep and refill, overlong shaping) and the
learner's (mini-batches, micro-batch weights, clipped policy loss, KL, entropy) decisions; tensors
in, tensors plus a dict of scalar tensors out. Why: the definitions are verl core_algos' (GRPO
arXiv:2402.03300, DAPO arXiv:2503.14476), tested equal to verl on ragged batches.
Invariants: no host syncs except `# SYNC`; padding never counts; advantages and weights detached.
Legend: B sequences, G samples per prompt, T response tokens, V vocab, N flattened samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch

# Design notes (moved from the module docstring)
# What: every algorithmic decision of a step, as pure functions the driver (advantages, dynamic
# sampling's keep and refill, overlong shaping) and the learner (mini-batches, micro-batch weights,
# policy loss, KL, entropy) only call. They take tensors (or flat per-sample lists) and scalars and
# return tensors plus, for the loss, a dict of scalar *tensors* (the caller decides when to sync).
#
# Why these definitions: they are the ones verl's `core_algos` uses, so a run here is comparable with
# a verl run; tests/rl/test_grpo.py checks equality against verl on random ragged batches.
#
# Papers:
# - GRPO (group-normalised outcome advantage): Shao et al. 2024, https://arxiv.org/abs/2402.03300
# - DAPO (clip-higher, dynamic sampling, token-level loss, overlong shaping): Yu et al. 2025,
#   https://arxiv.org/abs/2503.14476
# - PPO clipped objective: https://arxiv.org/abs/1707.06347; dual-clip: https://arxiv.org/abs/1912.09729
# - Truncated importance sampling against the rollout engine: Yao et al. 2025, "Your efficient RL
#   framework secretly brings you off-policy RL training" (https://fengyao.notion.site/off-policy-rl)
# - k3 KL estimator: J. Schulman, http://joschu.net/blog/kl-approx.html
#
# Shape legend: B sequences (= prompts x samples when flattened), G samples per prompt, T response
# tokens (right-padded), V vocabulary, N flattened samples. `mask_BT` is 1 on response tokens, 0 on
# padding; bool or float.
#
# Invariants: no host syncs (`.item()`, data-dependent shapes) except where marked `# SYNC`; padding
# never contributes to a loss or a metric; every function is differentiable where a gradient is
# meaningful (the policy loss w.r.t. `logp_new_BT`) and detached where it is not (advantages, TIS
# weights, metrics).

LossAgg = Literal[
    "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)

# exp() arguments are clamped to +-20 (e^20 ~ 5e8) before exponentiating log-ratios, as verl does,
# so one wildly off-policy token cannot overflow the loss.
LOG_RATIO_CLAMP = 20.0
# verl's masked_mean adds this to the denominator; kept identical so metrics match verl's.
MASKED_MEAN_EPS = 1e-8


# --------------------------------------------------------------------------- masked reductions
def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` where `mask` is set. Values under a zero mask are replaced by 0 first, so a NaN or
    inf in padding cannot leak into the sum."""
    m = mask.to(x.dtype)
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return (x * m).sum() if dim is None else (x * m).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over the set entries of `mask` (verl's definition: sum / (count + 1e-8), so an
    all-padding input gives 0, not NaN)."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / (count + MASKED_MEAN_EPS)


# --------------------------------------------------------------------------- advantages
def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO outcome advantage: each sample's reward minus its group's mean, divided by the group's
    (unbiased) standard deviation + eps when `norm_by_std` (Dr.GRPO, arXiv 2503.20783, drops it).

    Layouts: `rewards` [B, G] with `group_ids=None` (row b is one prompt's G samples), or `rewards`
    [N] with `group_ids` [N] (any integer ids; samples with equal ids form a group).
    Returns advantages of the same shape, or, given `response_mask` [..., T], the advantage
    broadcast over response tokens and zeroed on padding ([B, G, T] or [N, T]).

    Matches verl's `compute_grpo_outcome_advantage`, including its convention for a group of one
    sample: mean 0 and std 1, so that sample's advantage is its raw reward / (1 + eps). A group
    whose rewards are all equal gets advantage 0 (dynamic sampling drops those groups anyway).
    """
    with torch.no_grad():
        r = rewards.float()
        if group_ids is None:
            if r.dim() != 2:
                raise ValueError(f"rewards must be [B, G] when group_ids is None, got shape {tuple(r.shape)}")
            count_B1 = torch.full((r.shape[0], 1), float(r.shape[1]), device=r.device)
            mean_B1 = r.mean(dim=1, keepdim=True)
            sq_B1 = ((r - mean_B1) ** 2).sum(dim=1, keepdim=True)
            mean, sq, count = mean_B1, sq_B1, count_B1
        else:
            if r.dim() != 1 or group_ids.shape != r.shape:
                raise ValueError(
                    f"rewards [N] and group_ids [N] expected, got {tuple(r.shape)}, {tuple(group_ids.shape)}"
                )
            # SYNC: unique's output size is data-dependent; advantages are computed once per step.
            _, inv_N = torch.unique(group_ids, return_inverse=True)
            n = r.shape[0]
            count_N = torch.zeros(n, device=r.device).index_add_(0, inv_N, torch.ones_like(r))
            mean_N = torch.zeros(n, device=r.device).index_add_(0, inv_N, r) / count_N.clamp(min=1)
            sq_N = torch.zeros(n, device=r.device).index_add_(0, inv_N, (r - mean_N[inv_N]) ** 2)
            mean, sq, count = mean_N[inv_N], sq_N[inv_N], count_N[inv_N]
        is_single = count <= 1
        mean = torch.where(is_single, torch.zeros_like(mean), mean)
        std = torch.where(is_single, torch.ones_like(sq), (sq / (count - 1).clamp(min=1)).sqrt())
        adv = (r - mean) / (std + eps) if norm_by_std else r - mean
        if response_mask is not None:
            adv = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
        return adv


def sample_advantages(rewards: Sequence[float], uids: Sequence[str]) -> list[float]:
    """`group_advantages` of flat per-sample lists: sample i's GRPO advantage within the group of
    samples sharing its prompt id `uids[i]` (the driver's entry point: samples, not tensors)."""
    return group_advantages(torch.tensor(rewards, dtype=torch.float32), _group_ids(uids)).tolist()


def dynamic_sampling_keep(rewards: torch.Tensor, group_ids: torch.Tensor | None = None) -> torch.Tensor:
    """DAPO dynamic sampling: which groups carry a gradient. A group whose rewards are all equal has
    zero advantage everywhere and is dropped.

    Layouts as `group_advantages`: `rewards` [B, G] -> bool [B] per group; or `rewards` [N] with
    `group_ids` [N] (ragged groups) -> bool [N], True for samples whose group's rewards differ."""
    if group_ids is None:
        if rewards.dim() != 2:
            raise ValueError(f"rewards must be [B, G] without group_ids, got shape {tuple(rewards.shape)}")
        return rewards.amax(dim=1) > rewards.amin(dim=1)
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards [N] and group_ids [N] expected, got {tuple(rewards.shape)}, {tuple(group_ids.shape)}"
        )
    r = rewards.float()
    # SYNC: unique's output size is data-dependent; once per generation round.
    _, inv_N = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv_N.max()) + 1 if inv_N.numel() else 0
    hi = torch.full((n_groups,), -torch.inf).scatter_reduce(0, inv_N, r, "amax")
    lo = torch.full((n_groups,), torch.inf).scatter_reduce(0, inv_N, r, "amin")
    return (hi > lo)[inv_N]


def keep_varied_groups(rewards: Sequence[float], uids: Sequence[str]) -> list[bool]:
    """`dynamic_sampling_keep` of flat per-sample lists (groups = equal `uids`): keep sample i?"""
    if not rewards:
        return []
    return dynamic_sampling_keep(torch.tensor(rewards, dtype=torch.float32), _group_ids(uids)).tolist()


def needs_another_round(kept_groups: int, batch_groups: int, rounds_done: int, max_regen_rounds: int) -> bool:
    """DAPO dynamic sampling's refill: generate another round of prompts while fewer than
    `batch_groups` groups were kept and regenerations remain (round 1 is the step's generation,
    then up to `max_regen_rounds` more; a short batch is trained on as it is)."""
    return kept_groups < batch_groups and rounds_done <= max_regen_rounds


def _group_ids(uids: Sequence[str]) -> torch.Tensor:
    """Integer group id [N] of each sample: the rank of its uid among the sorted distinct uids."""
    index = {u: i for i, u in enumerate(sorted(set(uids)))}
    return torch.tensor([index[u] for u in uids], dtype=torch.long)


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO soft overlong punishment (float32, same shape as `lengths`): 0 for responses up to
    `max_tokens - buffer` tokens, then linear down to `-penalty` at `max_tokens` (and below, if a
    length exceeds it). `buffer == 0` disables shaping (all zeros)."""
    lengths = torch.as_tensor(lengths).float()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    if buffer > max_tokens:
        raise ValueError(f"overlong buffer ({buffer}) must be <= max_tokens ({max_tokens})")
    exceed = lengths - (max_tokens - buffer)
    return torch.clamp(-exceed / buffer * penalty, max=0.0)


# --------------------------------------------------------------------------- KL / entropy
def kl_k3(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, always >= 0,
    low variance (verl's 'low_var_kl'); the log-ratio is clamped to +-20 and the result to
    [-10, 10] for stability, as verl does."""
    log_ratio = torch.clamp(ref_logp_BT - logp_BT, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10.0, max=10.0)


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy [B, T] of softmax(logits) over the last dim: logsumexp(l) - sum(p * l)."""
    p = torch.softmax(logits_BTV, dim=-1)
    return torch.logsumexp(logits_BTV, dim=-1) - (p * logits_BTV).sum(dim=-1)


# --------------------------------------------------------------------------- policy loss
def agg_loss(
    loss_BT: torch.Tensor, mask_BT: torch.Tensor, loss_agg: LossAgg, loss_scale_factor: float | None = None
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar (verl's `agg_loss` for one data-parallel rank).

    token-mean: sum over all valid tokens / number of valid tokens (DAPO's token-level loss).
    token-sum: sum over valid tokens. seq-mean-token-mean: mean over sequences of each sequence's
    token mean. seq-mean-token-sum: mean over sequences of token sums; -norm divides that by
    `loss_scale_factor` (default: T, the padded length). Fully padded sequences are excluded.
    Counts are clamped to >= 1 so an all-padding micro-batch gives 0 rather than NaN.
    """
    m = mask_BT.to(loss_BT.dtype)
    if loss_agg == "token-mean":
        return masked_sum(loss_BT, mask_BT) / m.sum().clamp(min=1)
    if loss_agg == "token-sum":
        return masked_sum(loss_BT, mask_BT)
    tokens_B = m.sum(dim=-1)
    seq_sum_B = masked_sum(loss_BT, mask_BT, dim=-1)
    has_tokens_B = (tokens_B > 0).to(loss_BT.dtype)
    if loss_agg == "seq-mean-token-mean":
        seq_B = seq_sum_B / (tokens_B + MASKED_MEAN_EPS)
        return (seq_B * has_tokens_B).sum() / has_tokens_B.sum().clamp(min=1)
    if loss_agg in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = (seq_sum_B * has_tokens_B).sum() / has_tokens_B.sum().clamp(min=1)
        if loss_agg == "seq-mean-token-sum-norm":
            loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_BT.shape[-1])
        return loss
    raise ValueError(f"unknown loss_agg {loss_agg!r}; valid: {', '.join(LOSS_AGG_MODES)}")


def micro_batch_weight(tokens: float, total_tokens: float) -> float:
    """Weight of one micro-batch's token-mean loss in its mini-batch's: its response tokens over the
    mini-batch's (all data-parallel learners'), so the summed gradients are the token mean over the
    whole mini-batch (DAPO's token-level loss), however it is split. An empty mini-batch counts 1."""
    return tokens / max(1.0, total_tokens)


def mini_batch_index(uids: Sequence[str], groups_per_mini: int | None) -> tuple[list[int], int]:
    """Mini-batch of each sample and how many there are: groups (equal uids) in order of first
    appearance, `groups_per_mini` to a mini-batch (None: one mini-batch); a group is never split."""
    order = list(dict.fromkeys(uids))
    per_mini = groups_per_mini or max(1, len(order))
    of_uid = {u: i // per_mini for i, u in enumerate(order)}
    return [of_uid[u] for u in uids], -(-len(order) // per_mini)


def tis_weights(
    logp_old_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor, cap: float
) -> torch.Tensor:
    """Token-level truncated importance weights min(pi_learner / pi_rollout, cap), detached, 0 on
    padding. They correct for the learner and the engine disagreeing on the same policy (different
    kernels, KV-cache quantization, precision)."""
    log_ratio = torch.clamp(logp_old_BT - rollout_logp_BT, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    return (torch.exp(log_ratio) * mask_BT.to(log_ratio.dtype)).clamp(max=cap).detach()


def rollout_mismatch_metrics(
    logp_old_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor, cap: float | None
) -> dict[str, torch.Tensor]:
    """How far the rollout engine's token logprobs are from the learner's (verl's `rollout_corr/`
    names): kl = mean(rollout - learner) (direct estimator of KL(rollout || learner)), k3_kl,
    abs_diff = mean |learner - rollout|, and with a cap the TIS weight mean and clipped fraction."""
    with torch.no_grad():
        log_ratio_BT = logp_old_BT - rollout_logp_BT
        safe_BT = torch.clamp(log_ratio_BT, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
        out = {
            "rollout_corr/kl": masked_mean(-log_ratio_BT, mask_BT),
            "rollout_corr/k3_kl": masked_mean(torch.exp(safe_BT) - safe_BT - 1, mask_BT),
            "rollout_corr/abs_diff": masked_mean(log_ratio_BT.abs(), mask_BT),
        }
        if cap is not None:
            raw_BT = torch.exp(safe_BT)
            out["rollout_corr/tis_mean"] = masked_mean(raw_BT.clamp(max=cap), mask_BT)
            out["rollout_corr/tis_clip_frac"] = masked_mean((raw_BT > cap).to(raw_BT.dtype), mask_BT)
        return out


def policy_loss(
    logp_new_BT: torch.Tensor,
    logp_old_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    loss_agg: LossAgg = "token-mean",
    *,
    rollout_logp_BT: torch.Tensor | None = None,
    tis_cap: float | None = None,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO's clipped surrogate with clip-higher, as verl's `compute_policy_loss_vanilla` + `agg_loss`.

    ratio = exp(logp_new - logp_old) (log-ratio clamped to +-20); per token
    L = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)); for A < 0 additionally capped
    at -A * clip_ratio_c (dual-clip). With `rollout_logp_BT` and `tis_cap`, L is multiplied by the
    detached TIS weights min(exp(logp_old - rollout_logp), tis_cap); with `rollout_logp_BT` alone
    only the mismatch metrics are reported. `adv_BT` may be [B] (one advantage per sequence).

    Returns (loss, metrics): metrics are 0-dim detached tensors: actor/pg_loss, actor/pg_clipfrac
    (tokens where the clipped branch is active), actor/pg_clipfrac_lower (dual-clip active),
    actor/ppo_kl (mean logp_old - logp_new), and the rollout_corr/* metrics.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip lower bound), got {clip_ratio_c}")
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    if adv_BT.dim() == 1:
        adv_BT = adv_BT.unsqueeze(-1).expand_as(logp_new_BT)
    if not (logp_new_BT.shape == logp_old_BT.shape == adv_BT.shape == mask_BT.shape):
        raise ValueError(
            "shape mismatch: logp_new "
            f"{tuple(logp_new_BT.shape)}, logp_old {tuple(logp_old_BT.shape)}, adv {tuple(adv_BT.shape)}, "
            f"mask {tuple(mask_BT.shape)}"
        )
    adv_BT = adv_BT.to(logp_new_BT.dtype)
    neg_kl_BT = torch.clamp(logp_new_BT - logp_old_BT, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio_BT = torch.exp(neg_kl_BT)
    loss_unclipped_BT = -adv_BT * ratio_BT
    loss_clipped_BT = -adv_BT * torch.clamp(ratio_BT, 1 - eps_low, 1 + eps_high)
    loss_ppo_BT = torch.maximum(loss_unclipped_BT, loss_clipped_BT)
    loss_dual_BT = torch.minimum(loss_ppo_BT, -adv_BT * clip_ratio_c)
    is_neg_BT = adv_BT < 0
    loss_BT = torch.where(is_neg_BT, loss_dual_BT, loss_ppo_BT)

    metrics: dict[str, torch.Tensor] = {}
    if rollout_logp_BT is not None:
        if rollout_logp_BT.shape != logp_old_BT.shape:
            raise ValueError(
                f"rollout_logp {tuple(rollout_logp_BT.shape)} != logp_old {tuple(logp_old_BT.shape)} in shape"
            )
        rollout_logp_BT = rollout_logp_BT.to(logp_old_BT.dtype)
        metrics.update(rollout_mismatch_metrics(logp_old_BT.detach(), rollout_logp_BT, mask_BT, tis_cap))
        if tis_cap is not None:
            loss_BT = loss_BT * tis_weights(logp_old_BT.detach(), rollout_logp_BT, mask_BT, tis_cap)

    loss = agg_loss(loss_BT, mask_BT, loss_agg)
    with torch.no_grad():
        fmask_BT = mask_BT.to(loss_BT.dtype)
        metrics["actor/pg_loss"] = loss.detach()
        metrics["actor/pg_clipfrac"] = masked_mean(
            (loss_clipped_BT > loss_unclipped_BT).to(fmask_BT.dtype), mask_BT
        )
        metrics["actor/pg_clipfrac_lower"] = masked_mean(
            ((loss_ppo_BT > -adv_BT * clip_ratio_c) & is_neg_BT).to(fmask_BT.dtype), mask_BT
        )
        metrics["actor/ppo_kl"] = masked_mean(-neg_kl_BT, mask_BT)
    return loss, metrics

"""DEP in a learner: what a data-parallel learner group needs once its routed experts *and their
adapters* are sharded by `apply_expert_parallel(model, group, shard_lora=True)`.

What: `sharded_adapter_params` (the per-expert LoRA factors that live on one rank), `gather_ / slice_
expert_shards` and `gather_ / slice_optimizer_state` (between a rank's layout and the single-process
one), and `clip_grad_norm_` over the group's union of parameters. Why: each rank holds 1/W of the
expert adapters, gradients and optimizer state and never all-reduces them (the EP backward already
brought every token's gradient to the owner), yet what leaves the group (adapter, checkpoint) is the
single-process layout, so W DEP learners resume on one and vice versa.

Invariants: every function that takes a group is collective over it (same dicts, model order); every
rank gets the same gathered tensors; a group of one gives copies; gathered tensors move to `device`
one at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from model.parallel.expert_parallel import ExpertParallelMoE
from model.parallel.groups import group_size

# Legend: E experts (global), El experts on this rank, W ranks in the EP group.
# Optimizer state: per-element state (Adam's moments) is gathered / sliced along the expert dim;
# scalars such as `step` are the same on every rank. clip_grad_norm_ counts replicated gradients
# once and sums the shards over ranks.

__all__ = [
    "ExpertShard",
    "clip_grad_norm_",
    "gather_expert_shards",
    "gather_optimizer_state",
    "sharded_adapter_params",
    "slice_expert_shards",
    "slice_optimizer_state",
]


@dataclass(frozen=True)
class ExpertShard:
    """Rows [lo, hi) of a tensor whose dim 0 is the expert (E rows in all), held by this rank of
    `group`; `ranges` are every rank's rows, in group-rank order."""

    lo: int
    hi: int
    num_experts: int
    ranges: tuple[tuple[int, int], ...]
    group: dist.ProcessGroup | None


def sharded_adapter_params(model: nn.Module) -> dict[str, ExpertShard]:
    """Names (as `model.named_parameters` spells them) of the adapter parameters sharded by expert,
    in model order; empty when no `ExpertParallelMoE` shards its adapter."""
    out: dict[str, ExpertShard] = {}
    for name, m in model.named_modules():
        if not (isinstance(m, ExpertParallelMoE) and m.is_lora_sharded):
            continue
        shard = ExpertShard(m.expert_lo, m.expert_hi, m.num_experts, tuple(m.ranges), m.ep_group)
        prefix = f"{name}.experts.lora." if name else "experts.lora."
        for pname, _ in m.experts.lora.named_parameters():
            out[prefix + pname] = shard
    return out


def _all_gather_rows(t_local: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """[El, ...] on each rank -> [E, ...] on every rank (shards padded to the largest: all_gather
    needs equal sizes)."""
    if group_size(shard.group) == 1:
        return t_local.detach().clone()
    rows = max(hi - lo for lo, hi in shard.ranges)
    padded = t_local.new_zeros((rows, *t_local.shape[1:]))
    padded[: t_local.shape[0]] = t_local.detach()
    parts = [torch.empty_like(padded) for _ in shard.ranges]
    dist.all_gather(parts, padded, group=shard.group)
    return torch.cat([p[: hi - lo] for p, (lo, hi) in zip(parts, shard.ranges, strict=True)])


def gather_expert_shards(
    tensors: Mapping[str, torch.Tensor],
    shards: Mapping[str, ExpertShard],
    device: torch.device | str | None = "cpu",
) -> dict[str, torch.Tensor]:
    """`tensors` with every sharded entry replaced by the full tensor (other entries detached as
    they are); full tensors go to `device` (None: stay where the shard is). Collective."""
    out = {}
    for name, t in tensors.items():
        if name in shards:
            full = _all_gather_rows(t, shards[name])
            out[name] = full if device is None else full.to(device)
        else:
            out[name] = t.detach()
    return out


def _rows(t_full: torch.Tensor, shard: ExpertShard, what: str) -> torch.Tensor:
    if t_full.dim() == 0 or t_full.shape[0] != shard.num_experts:
        raise ValueError(
            f"{what}: expected {shard.num_experts} expert rows (the single-process layout), got shape "
            f"{tuple(t_full.shape)}; was it saved by a learner with another expert count?"
        )
    return t_full[shard.lo : shard.hi].clone()  # a copy: a view would keep the full tensor alive


def slice_expert_shards(
    tensors: Mapping[str, torch.Tensor], shards: Mapping[str, ExpertShard]
) -> dict[str, torch.Tensor]:
    """Full tensors -> this rank's rows for the sharded names; other entries unchanged."""
    return {n: _rows(t, shards[n], n) if n in shards else t for n, t in tensors.items()}


def gather_optimizer_state(state: dict, shards_by_index: Mapping[int, ExpertShard]) -> dict:
    """An optimizer `state_dict()` of this rank -> the single-process one: the per-element state
    (tensors of dim >= 1) of the parameters at the given indices is gathered along dim 0, on the
    CPU. Collective; every rank must hold state for the same indices (they step together)."""
    per_param = dict(state["state"])
    for idx in sorted(shards_by_index):
        if idx not in per_param:
            continue
        per_param[idx] = {
            k: _all_gather_rows(v, shards_by_index[idx]).cpu() if torch.is_tensor(v) and v.dim() > 0 else v
            for k, v in per_param[idx].items()
        }
    return {**state, "state": per_param}


def slice_optimizer_state(state: dict, shards_by_index: Mapping[int, ExpertShard]) -> dict:
    """The single-process optimizer state -> this rank's (the inverse of `gather_optimizer_state`)."""
    per_param = dict(state["state"])
    for idx, shard in shards_by_index.items():
        if idx in per_param:
            per_param[idx] = {
                k: _rows(v, shard, f"optimizer state {k} of parameter {idx}")
                if torch.is_tensor(v) and v.dim() > 0
                else v
                for k, v in per_param[idx].items()
            }
    return {**state, "state": per_param}


@torch.no_grad()
def clip_grad_norm_(
    replicated: Iterable[nn.Parameter],
    sharded: Iterable[nn.Parameter],
    max_norm: float,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Scale all gradients so that the global 2-norm is at most `max_norm`; returns the global norm
    before clipping (fp32, the same on every rank). The global squared norm is the replicated
    gradients' (identical on every rank after their all-reduce: counted once) plus every rank's
    shard gradients', summed in rank order so that every rank computes the same coefficient (the
    replicated parameters then stay bit-identical across ranks). Clip rule as torch's:
    coef = min(1, max_norm / (norm + 1e-6)); a non-finite norm poisons every gradient, as there."""
    grads_rep = [p.grad for p in replicated if p.grad is not None]
    grads_sh = [p.grad for p in sharded if p.grad is not None]
    # No early return for a rank without gradients: the all-gather below must run on every rank.
    device = (grads_rep or grads_sh)[0].device if grads_rep or grads_sh else torch.device("cpu")

    def sq(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=device)
        return torch.stack([torch.linalg.vector_norm(g.float()).square() for g in grads]).sum()

    sh_sq_W = sq(grads_sh).reshape(1)
    if group_size(group) > 1:
        parts = [torch.empty_like(sh_sq_W) for _ in range(group_size(group))]
        dist.all_gather(parts, sh_sq_W, group=group)
        sh_sq_W = torch.cat(parts)
    total = (sq(grads_rep) + sh_sq_W.sum()).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads_rep + grads_sh:
        g.mul_(coef.to(g.dtype))
    return total

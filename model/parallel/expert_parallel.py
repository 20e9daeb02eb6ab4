"""Expert-parallel MoE (EP) and DEP (data-parallel attention + EP MoE) for the MiniMax-M3 MoE block.

What: the routed experts of a `model.layers.moe.MoE` are sharded over an EP group in contiguous
ranges (`expert_ranges`); every rank keeps the router, the shared expert and its own tokens. One
forward: route locally (`MoE.route`, bit for bit), all-to-all the token-slots to their experts' ranks,
run them through `model.kernels.moe.moe_experts` one slot per row with weight 1, all-to-all back,
apply the router weights at the source. Why there: the expert rank returns exactly the single-process
per-slot output, and the router-weight gradient never crosses the network.

Invariants: a world of 1 runs no collective and gives the single-process MoE; every rank calls
forward (and backward) of every EP layer in the same order, with zero tokens if it has none; the fp32
output equals the single-process MoE up to fp32 summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from model.kernels.moe import moe_experts
from model.layers.lora import ExpertLoRA, OffsetExpertLoRA
from model.layers.moe import ExpertBank, MoE, RouterStats
from model.parallel.groups import group_rank, group_size

# Legend: T tokens, D hidden, E experts (global), El local experts, K top-k, S = T*K token-slots
# sent, R token-slots received, W ranks in the EP group.
#
# Dispatch: slots sorted by destination rank, send counts exchanged first (an all-to-all of W ints),
# then hidden rows and local expert ids. Combine: outputs return by the reverse all-to-all; router
# weights applied locally, accumulated in fp32 and rounded once (as `moe_experts_torch`); the shared
# expert added locally. The all-to-all is an autograd Function whose backward is the reverse
# all-to-all, so gradients reach activations, router and LoRA through the exchange. (Deduplicating a
# token sent twice to one rank would halve traffic at top-4 over few ranks: not done.)
#
# Shards come from a whole MoE (`shard_expert_bank` copies rows) or, for a model too large for one
# device, straight from the checkpoint (`load_model(..., expert_range=)`: partial banks with
# `ExpertBank.first_expert` / `total_experts`). Expert adapters are built for the whole layer
# (`apply_lora` draws every expert's factors, so a shard's equal the whole model's), then kept whole
# behind the local -> global offset (`OffsetExpertLoRA`, engines) or cut to the rank's experts
# (`shard_lora`, learners). Expert-adapter gradients appear only on the owning rank: with the adapter
# whole on every rank, summing LoRA gradients over the group gives the union-batch gradient; with
# `shard_lora` the owner's shard gradient already is.

__all__ = [
    "EPStats",
    "ExpertParallelMoE",
    "all_to_all",
    "apply_expert_parallel",
    "expert_ranges",
    "load_metrics",
    "shard_expert_bank",
]


def expert_ranges(num_experts: int, world: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) expert range of every rank; the first E % W ranks hold one more."""
    if world <= 0 or num_experts < world:
        raise ValueError(f"expert_ranges: need 0 < world ({world}) <= num_experts ({num_experts})")
    base, extra = divmod(num_experts, world)
    out, lo = [], 0
    for r in range(world):
        hi = lo + base + (r < extra)
        out.append((lo, hi))
        lo = hi
    return out


class _AllToAll(torch.autograd.Function):
    """Rows of x split by `in_splits` go to each rank; rows from each rank arrive per `out_splits`.
    Backward is the same exchange reversed (gradient rows travel back to where their rows came from)."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_empty((sum(in_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Differentiable uneven all-to-all over dim 0 (identity for a group of one)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _slice_expert_lora(lora: ExpertLoRA, local: ExpertBank, lo: int, hi: int) -> ExpertLoRA:
    """An `ExpertLoRA` of the local bank holding copies of experts [lo, hi) of `lora` (new trainable
    Parameters: the adapter of those experts now lives on this rank only)."""
    dropout = lora.lora_dropout.p if isinstance(lora.lora_dropout, nn.Dropout) else 0.0
    dtype = lora.w1.lora_A.dtype
    # A throwaway generator: the constructor's random A init is overwritten below, and drawing from
    # the global RNG would shift every later draw of this process against a single-process run.
    local_lora = ExpertLoRA(local, lora.r, lora.alpha, dropout, dtype, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in local_lora.named_parameters():
            p.copy_(lora.get_parameter(name)[lo:hi])
    return local_lora


def shard_expert_bank(bank: ExpertBank, lo: int, hi: int, shard_lora: bool = False) -> ExpertBank:
    """Experts [lo, hi) of a whole `bank` as a partial bank of their own (copies of the stored tensors,
    same format, same trainability, `first_expert` = lo). Its `lora` hook: with `shard_lora` and an
    `ExpertLoRA`, a sharded copy (factors [hi - lo, ...], indexed by local expert id); otherwise the
    whole adapter behind an `OffsetExpertLoRA` (every rank keeps every expert's factors)."""
    if bank.is_partial:
        raise ValueError(f"shard_expert_bank: the bank is already a shard ({bank.extra_repr()})")
    if not 0 <= lo < hi <= bank.num_experts:
        raise ValueError(f"shard_expert_bank: bad range [{lo}, {hi}) of {bank.num_experts} experts")
    local = ExpertBank.empty_shard(bank, lo, hi, device=bank.w1_weight.device)
    with torch.no_grad():
        for name, t in [*bank.named_parameters(recurse=False), *bank.named_buffers(recurse=False)]:
            getattr(local, name).copy_(t[lo:hi])
    local.lora = bank.lora
    _place_lora(local, shard_lora)
    return local


def _place_lora(local: ExpertBank, shard_lora: bool) -> None:
    """Give the partial bank `local` its adapter view: its hook holds, or will be given, the whole
    layer's adapter (global expert ids). `shard_lora`: keep a trainable copy of this shard's experts
    only (`ExpertLoRA` adapters); otherwise reach the whole adapter through the local -> global offset."""
    lo, hi = local.first_expert, local.first_expert + local.num_experts
    whole = local.lora.inner if isinstance(local.lora, OffsetExpertLoRA) else local.lora
    if shard_lora and isinstance(whole, ExpertLoRA):
        local.lora = _slice_expert_lora(whole, local, lo, hi)
    elif isinstance(whole, nn.Module):
        local.lora = OffsetExpertLoRA(whole, lo)
    elif whole is not None:  # a plain callable: shift the expert index in a closure
        local.lora = lambda e, proj, x, _fn=whole: _fn(e + lo, proj, x)


@dataclass
class EPStats:
    """Routing and load statistics of one EP forward (device tensors: reading them is a sync)."""

    router: RouterStats  # this rank's tokens: tokens_per_expert_E (local routing), router logits
    sent_per_rank_W: torch.Tensor  # int64 [W] token-slots this rank sent to each rank
    received_per_rank_W: torch.Tensor  # int64 [W] token-slots this rank received from each rank


def load_metrics(tokens_per_expert_E: torch.Tensor, ranges: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Load balance from per-expert token counts (sum them over the EP group first for the global
    view): max / mean tokens per expert and per rank (1.0 = perfectly balanced), and the counts."""
    counts_E = tokens_per_expert_E.float()
    per_rank_W = torch.stack([counts_E[lo:hi].sum() for lo, hi in ranges])
    eps = 1e-9  # an empty step reports balance 0, not NaN
    return {
        "tokens_per_expert": tokens_per_expert_E,
        "expert_max_over_mean": counts_E.max() / (counts_E.mean() + eps),
        "rank_max_over_mean": per_rank_W.max() / (per_rank_W.mean() + eps),
        "tokens_per_rank": per_rank_W,
    }


class ExpertParallelMoE(nn.Module):
    """Drop-in replacement of a `MoE` block with its routed experts sharded over `ep_group`.

    Keeps the MoE's `gate`, `e_score_correction_bias` and `shared_experts` (the same modules, so
    checkpoint names are unchanged) and replaces `experts` by this rank's shard.
    """

    def __init__(self, moe: MoE, ep_group: dist.ProcessGroup | None, shard_lora: bool = False):
        super().__init__()
        self.ep_group = ep_group
        bank = moe.experts
        self.ep_size, self.ep_rank = group_size(ep_group), group_rank(ep_group)
        self.num_experts = bank.total_experts
        self.ranges = expert_ranges(self.num_experts, self.ep_size)
        self.expert_lo, self.expert_hi = self.ranges[self.ep_rank]
        self.top_k, self.routed_scaling_factor = moe.top_k, moe.routed_scaling_factor
        self.gate = moe.gate
        self.register_buffer("e_score_correction_bias", moe.e_score_correction_bias)
        if not bank.is_partial:
            self.experts = shard_expert_bank(bank, self.expert_lo, self.expert_hi, shard_lora)
        elif (bank.first_expert, bank.first_expert + bank.num_experts) == (self.expert_lo, self.expert_hi):
            # Loaded as this rank's shard (load_model(..., expert_range=...)): used as it is.
            self.experts = bank
            _place_lora(bank, shard_lora)
        else:
            raise ValueError(
                f"ExpertParallelMoE: rank {self.ep_rank} of {self.ep_size} owns experts "
                f"[{self.expert_lo}, {self.expert_hi}) but its bank holds {bank.extra_repr()}; load it with "
                f"expert_range=model.parallel.expert_parallel.expert_ranges({self.num_experts}, "
                f"{self.ep_size})[{self.ep_rank}]"
            )
        self.shared_experts = moe.shared_experts
        # `_place_lora` cut the adapter to this shard's experts exactly when it was sharded.
        self.is_lora_sharded = isinstance(self.experts.lora, ExpertLoRA)
        # Exclusive upper expert bound of each rank: destination = searchsorted(bounds, id, right).
        # On the bank's device: a model moved before wrapping must not leave these behind on the CPU.
        dev = moe.e_score_correction_bias.device
        self.register_buffer(
            "_rank_hi_W", torch.tensor([hi for _, hi in self.ranges], device=dev), persistent=False
        )
        self.register_buffer(
            "_rank_lo_W", torch.tensor([lo for lo, _ in self.ranges], device=dev), persistent=False
        )

    # The router stays fp32 and the shard keeps its storage dtypes, exactly as in MoE.
    _apply = MoE._apply
    route = MoE.route

    def extra_repr(self) -> str:
        lo, hi, e = self.expert_lo, self.expert_hi, self.num_experts
        return f"experts=[{lo}, {hi}) of {e}, ep_rank={self.ep_rank}/{self.ep_size}"

    def _routed(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor):
        """Routed-expert output [T, D] (x's dtype) and the per-rank send/receive counts."""
        K = ids_TK.shape[1]
        W = self.ep_size
        ids_S = ids_TK.reshape(-1)
        dest_S = torch.searchsorted(self._rank_hi_W, ids_S, right=True)
        order_S = torch.argsort(dest_S, stable=True)  # slots grouped by destination, token order kept
        token_S = order_S // K
        send_W = torch.bincount(dest_S, minlength=W)
        local_ids_S = ids_S[order_S] - self._rank_lo_W[dest_S[order_S]]
        if W == 1:
            recv_W, x_RD, local_ids_R = send_W, x_TD[token_S], local_ids_S
        else:
            recv_W = torch.empty_like(send_W)
            dist.all_to_all_single(recv_W, send_W, group=self.ep_group)
            # SYNC: uneven all-to-all needs the split sizes on the host (2W ints per layer call).
            send, recv = send_W.tolist(), recv_W.tolist()
            local_ids_R = torch.empty(sum(recv), dtype=local_ids_S.dtype, device=x_TD.device)
            dist.all_to_all_single(local_ids_R, local_ids_S, recv, send, group=self.ep_group)
            x_RD = all_to_all(x_TD[token_S], recv, send, self.ep_group)
        if x_RD.shape[0] == 0:
            y_RD = self._no_rows(x_RD)
        else:
            # One slot per row with weight 1: moe_experts returns each row's expert output unweighted.
            ones_R1 = torch.ones((x_RD.shape[0], 1), dtype=torch.float32, device=x_TD.device)
            y_RD = moe_experts(x_RD, local_ids_R[:, None], ones_R1, self.experts)
        y_SD = y_RD if W == 1 else all_to_all(y_RD, send, recv, self.ep_group)
        contrib_SD = y_SD.float() * weights_TK.reshape(-1)[order_S].float().unsqueeze(1)
        y_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device).index_add(
            0, token_S, contrib_SD
        )
        return y_TD.to(x_TD.dtype), send_W, recv_W

    def _no_rows(self, x_RD: torch.Tensor) -> torch.Tensor:
        """The [0, D] expert output of a rank that received nothing. It must still depend on x_RD and
        on the trainable expert tensors: the backward all-to-alls are collective, and autograd only
        runs them here if this rank's graph reaches them as every other rank's does."""
        y_RD = x_RD * 0
        if torch.is_grad_enabled():
            for p in self.experts.parameters():
                if p.requires_grad:
                    y_RD = y_RD + p.reshape(-1)[:0].sum()  # an exact 0 wired to p (its gradient: zeros)
        return y_RD

    def forward_with_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, EPStats]:
        """x [..., D] -> (out [..., D], EPStats); collective over the EP group."""
        x_TD = x.reshape(-1, x.shape[-1])
        ids_TK, weights_TK, logits_TE = self.route(x_TD)
        out_TD, send_W, recv_W = self._routed(x_TD, ids_TK, weights_TK)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        router = RouterStats(
            tokens_per_expert_E=torch.bincount(ids_TK.reshape(-1), minlength=self.num_experts),
            router_logits_TE=logits_TE,
        )
        return out_TD.reshape(x.shape), EPStats(router, send_W, recv_W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with_stats(x)[0]

    def global_tokens_per_expert(self, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's per-expert counts (collective; for logging, not the hot path)."""
        total_E = tokens_per_expert_E.clone()
        if self.ep_size > 1:
            dist.all_reduce(total_E, group=self.ep_group)
        return total_E


def apply_expert_parallel(
    model: nn.Module, ep_group: dist.ProcessGroup | None, shard_lora: bool = False
) -> nn.Module:
    """DEP: replace, in place, every `MoE` module of `model` by an `ExpertParallelMoE` over
    `ep_group` (attention stays per rank: each rank feeds its own sequences). Apply after
    `apply_lora`. Per-expert adapters keep their names; `shard_lora=False` keeps every expert's
    factors on every rank (engines: a full adapter loads unchanged), `shard_lora=True` keeps only
    this rank's experts' factors (learners: adapter and optimizer memory / W; see
    model/parallel/dep_learner.py for gathering them back). Returns `model`."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not targets:
        raise ValueError("apply_expert_parallel: the model has no MoE block to shard")
    for name, moe in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, ExpertParallelMoE(moe, ep_group, shard_lora))
    return model

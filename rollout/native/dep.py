"""A DEP engine replica: data-parallel attention + expert-parallel MoE over W ranks, in lockstep.

What: each rank holds everything but its 1/W of the routed experts and runs its own NativeEngine
(own cache, scheduler and requests); `DEPEngine` splits requests over the ranks and steps them in
lockstep: a rank without work joins every MoE all-to-all with zero tokens (`idle_forward`).
Invariants: a request's tokens and log-probs do not depend on its rank or on the other ranks' work
(seeds drawn before the split from one generator seeded alike on every rank); DSpark is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

from model.modeling import MiniMaxM3ForCausalLM
from model.parallel.expert_parallel import ExpertParallelMoE, apply_expert_parallel
from model.parallel.groups import group_rank, group_size
from rollout.engine import Completion, EngineStats, Request
from rollout.native.engine import NativeEngine

# Design notes (moved from the module docstring)
# What: each rank of the replica's torch.distributed group (one process per rank: gloo on CPU, NCCL on
# GPUs) holds the whole model except the routed experts, of which it keeps its 1/W share
# (`model.parallel.expert_parallel.apply_expert_parallel`, after loading and `apply_lora`), and runs its
# OWN `NativeEngine`: its own KV cache, scheduler and requests (data-parallel attention). `DEPEngine`
# splits a request list over the ranks, steps every rank's engine in lockstep and returns every
# completion, in request order, on every rank.
#
# Why lockstep: an `ExpertParallelMoE` forward is collective (its all-to-alls need every rank of the
# group, in the same layer order, the same number of times). So every step starts with one all-reduce
# of "do I have work"; a rank with work runs `NativeEngine.step()` (exactly one `forward_cached`, i.e.
# one call of every MoE layer in layer order), a rank without runs `idle_forward`: every EP layer once,
# in layer order, on zero tokens. Attention, norms and lm_head hold no collective, so the idle rank
# skips them. The loop ends when no rank has work.
#
# Invariants: the tokens and log-probs of a request do not depend on the rank it lands on nor on what
# the other ranks run (the engine's numbers are batch-composition independent and the EP layer equals
# the single-process MoE up to fp32 summation order); requests without a seed get one drawn here from
# one generator seeded the same on every rank, before the split, so sampled output is split-independent
# too. DSpark speculation is refused (its draft and verify passes would need their own lockstep).
#
# Host syncs: one per step, the all-reduce's result (`# SYNC` below), plus the split-size exchange of
# every EP layer (model/parallel/expert_parallel.py).

Distribute = Literal["round_robin", "by_length"]

__all__ = ["DEPEngine", "Distribute", "idle_forward", "run_dep_replica", "split_requests"]


def split_requests(
    requests: list[Request], world: int, distribute: Distribute = "round_robin"
) -> list[list[int]]:
    """Indices of `requests` each rank serves. round_robin: request k -> rank k % W. by_length: longest
    work first (prompt tokens x samples), each to the rank with the least work so far (ties: lowest rank)."""
    if world <= 0:
        raise ValueError(f"split_requests: world must be positive, got {world}")
    if distribute == "round_robin":
        return [list(range(r, len(requests), world)) for r in range(world)]
    if distribute != "by_length":
        raise ValueError(
            f"split_requests: distribute must be 'round_robin' or 'by_length', got {distribute!r}"
        )
    load, out = [0] * world, [[] for _ in range(world)]
    work = [len(r.prompt_token_ids) * r.n for r in requests]
    for k in sorted(range(len(requests)), key=lambda k: (-work[k], k)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[r].append(k)
        load[r] += work[k]
    return [sorted(ks) for ks in out]


def ep_layers(model: torch.nn.Module) -> list[ExpertParallelMoE]:
    """The model's EP layers in the order `forward_cached` calls them (module registration order)."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]


@torch.inference_mode()
def idle_forward(model: MiniMaxM3ForCausalLM) -> None:
    """The collective part of one forward with zero tokens: every EP layer once, in layer order, on an
    empty [0, D] batch (it still joins the all-to-alls, sending and receiving zero rows)."""
    w_VD = model.model.embed_tokens.weight  # the hidden states' dtype and device
    x_0D = w_VD.new_empty((0, w_VD.shape[1]))
    for layer in ep_layers(model):
        layer(x_0D)


class DEPEngine:
    """One rank's view of a DEP replica: wraps this rank's `NativeEngine` (built over a model whose MoE
    blocks are `ExpertParallelMoE`s on `group`). `generate`, `step` and `set_adapter` are collective:
    every rank of `group` calls them, in the same order, with the same arguments."""

    def __init__(
        self,
        engine: NativeEngine,
        group: dist.ProcessGroup | None = None,
        distribute: Distribute = "round_robin",
        seed: int = 0,
    ):
        if engine.proposer is not None:
            raise ValueError(
                "DSpark speculation is not supported in a DEP replica yet (its draft and verify passes "
                "are not lockstepped over the EP group); build the NativeEngine without a drafter"
            )
        if distribute not in ("round_robin", "by_length"):
            raise ValueError(f"distribute must be 'round_robin' or 'by_length', got {distribute!r}")
        layers = ep_layers(engine.model)
        if not layers:
            raise ValueError(
                "DEPEngine: the model has no ExpertParallelMoE layer: call apply_expert_parallel"
            )
        if any(group_size(m.ep_group) != group_size(group) for m in layers):
            raise ValueError("DEPEngine: the model's EP layers are sharded over another group than `group`")
        self.engine, self.group, self.distribute = engine, group, distribute
        self.rank, self.world = group_rank(group), group_size(group)
        self._seed_gen = torch.Generator().manual_seed(seed)  # same seed on every rank: same draws
        self._next_request = 0
        self.idle_steps = 0  # steps this rank ran with zero tokens (load-balance diagnostics)

    def any_unfinished(self) -> bool:
        """Collective: whether any rank of the replica still has work."""
        busy = torch.tensor([int(self.engine.has_unfinished())], device=self.engine.device)
        if self.world > 1:
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self.group)
        return bool(busy.item())  # SYNC: the loop's exit condition, once per step

    def step(self) -> list[Completion]:
        """Collective: one lockstep step; this rank's completions that finished in it."""
        if self.engine.has_unfinished():
            return self.engine.step()
        idle_forward(self.engine.model)
        self.idle_steps += 1
        return []

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Collective: every sample of every request (the same list on every rank), request order, on
        every rank. Each rank validates the whole list (all or nothing) and serves its share."""
        if self.engine.has_unfinished():
            raise RuntimeError("generate() needs an idle replica; finish the step() loop first")
        for r in requests:
            self.engine.validate(r)
        ids = [r.request_id for r in requests if r.request_id is not None]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique within one generate() call")
        named = []
        for r in requests:  # ids and seeds fixed before the split: the same whatever rank serves r
            seed = (
                r.seed if r.seed is not None else int(torch.randint(0, 2**62, (), generator=self._seed_gen))
            )
            named.append(
                dataclasses.replace(r, request_id=r.request_id or f"req-{self._next_request}", seed=seed)
            )
            self._next_request += 1
        order = {r.request_id: k for k, r in enumerate(named)}
        for k in split_requests(named, self.world, self.distribute)[self.rank]:
            self.engine.add_request(named[k])
        done: list[Completion] = []
        while self.any_unfinished():
            done += self.step()
        if self.world > 1:
            parts: list[Any] = [None] * self.world
            dist.all_gather_object(parts, done, group=self.group)
            done = [c for part in parts for c in part]
        return sorted(done, key=lambda c: (order[c.request_id], c.sample_index))

    def set_adapter(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Every rank loads the whole adapter (EP layers index expert adapters by global expert id)."""
        self.engine.set_adapter(tensors, version)

    def stats(self) -> EngineStats:
        """This rank's engine statistics."""
        return self.engine.stats()


def run_dep_replica(
    model: str | Callable[[], MiniMaxM3ForCausalLM],
    requests: list[Request],
    group: dist.ProcessGroup | None = None,
    max_pages: int = 64,
    distribute: Distribute = "round_robin",
    **engine_kwargs: Any,
) -> list[Completion]:
    """Run inside an initialised process group (e.g. under model.parallel.groups.launch_local): build
    this rank's model (a checkpoint directory loaded with model.checkpoint.load_model, or a factory
    returning the full model, adapters applied), shard its experts over `group`, serve `requests` (the
    same list on every rank) as one DEP replica and return every completion in request order."""
    if isinstance(model, str):
        from model.checkpoint import load_model

        net = load_model(model)
    else:
        net = model()
    apply_expert_parallel(net, group)
    engine = NativeEngine(net, max_pages, **engine_kwargs)
    return DEPEngine(engine, group, distribute).generate(requests)

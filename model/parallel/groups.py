"""Process groups for expert and context parallelism, and a local N-process launcher for tests.

What: `ParallelGroups` names the groups one replica (engine or learner) computes with: the world, the
expert-parallel (EP) group that shards routed experts and exchanges tokens, and the data-parallel
(DP) group of ranks holding the same expert shard. World ranks form a [dp, ep] grid: EP groups are
contiguous rank ranges (an EP all-to-all stays in a node when ep_size <= GPUs per node), DP groups
stride by ep_size; DCP takes any group. `launch_local` runs a function on N local processes (gloo on
CPU, NCCL on GPUs). Why: the same parallel code runs on one process, on N CPU processes (the tests)
and on N GPUs.

Invariants: `ParallelGroups.build` is collective (every rank calls it in the same order, as
`dist.new_group` requires); a group of size 1 never issues a collective.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Backend = Literal["gloo", "nccl"]

__all__ = ["Backend", "ParallelGroups", "group_rank", "group_size", "launch_local"]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group` (None = the world); 1 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside `group` (None = the world); 0 when not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


@dataclass(frozen=True)
class ParallelGroups:
    """One process's view of the world, its EP group and its DP group (None groups = size 1)."""

    world_size: int
    rank: int
    ep_size: int
    ep_rank: int
    ep_group: dist.ProcessGroup | None
    dp_size: int
    dp_rank: int
    dp_group: dist.ProcessGroup | None
    device: torch.device

    def __post_init__(self) -> None:
        if self.ep_size * self.dp_size != self.world_size:
            raise ValueError(
                f"ParallelGroups: ep_size ({self.ep_size}) x dp_size ({self.dp_size}) must equal "
                f"world_size ({self.world_size})"
            )
        if not (0 <= self.ep_rank < self.ep_size and 0 <= self.dp_rank < self.dp_size):
            raise ValueError(f"ParallelGroups: ranks out of range: {self}")

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelGroups:
        """The one-process layout: every group is this process alone, no collectives."""
        return cls(1, 0, 1, 0, None, 1, 0, None, torch.device(device))

    @classmethod
    def build(cls, ep_size: int | None = None, device: torch.device | str | None = None) -> ParallelGroups:
        """Groups over the initialised world: EP groups of `ep_size` contiguous ranks (default: the
        whole world), DP groups of the ranks with the same EP rank. Collective (see module doc)."""
        if not dist.is_initialized():
            return cls.single(device or "cpu")
        world, rank = dist.get_world_size(), dist.get_rank()
        ep = world if ep_size is None else ep_size
        if ep <= 0 or world % ep:
            raise ValueError(f"ParallelGroups.build: ep_size={ep} must divide world_size={world}")
        dp = world // ep
        ep_group = dp_group = None
        # Every rank creates every group (new_group is collective) and keeps the ones it is in.
        for d in range(dp):
            ranks = list(range(d * ep, (d + 1) * ep))
            g = dist.new_group(ranks) if ep > 1 else None
            if rank in ranks:
                ep_group = g
        for e in range(ep):
            ranks = list(range(e, world, ep))
            g = dist.new_group(ranks) if dp > 1 else None
            if rank in ranks:
                dp_group = g
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            )
        return cls(world, rank, ep, rank % ep, ep_group, dp, rank // ep, dp_group, torch.device(device))


def _worker(
    rank: int, world: int, backend: Backend, store_path: str, out_dir: str, fn: Callable, args: tuple
) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # N processes share the machine's cores; one thread each
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        result = fn(*args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch_local(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    backend: Backend = "gloo",
    start_method: Literal["fork", "spawn"] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world` local processes joined in one torch.distributed world and return
    the per-rank results (torch.save-able values, CPU tensors), rank order.

    Rendezvous is a fresh file store (no TCP port to race for). `start_method` defaults to fork for
    gloo (children inherit the imported modules: seconds faster per launch) and spawn for NCCL (CUDA
    cannot be forked); with spawn, `fn` must be importable (a module-level function). A failing rank
    raises in the caller with its traceback.
    """
    if world <= 0:
        raise ValueError(f"launch_local: world must be positive, got {world}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(
            f"launch_local: {world} NCCL ranks need {world} GPUs, found {torch.cuda.device_count()}"
        )
    method = start_method or ("spawn" if backend == "nccl" else "fork")
    with tempfile.TemporaryDirectory(prefix="launch_local_") as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(
            _worker, args=(world, backend, store, tmp, fn, args), nprocs=world, join=True, start_method=method
        )
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]

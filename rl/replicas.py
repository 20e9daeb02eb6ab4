"""Multi-process engine replicas in the Ray trainer (`rollout.engine_parallel=dep|dcp`): W rank actors
act as one rollout worker.

What: `RolloutRank` is one rank (a `RolloutWorker` whose engine is a `DEPEngine` holding 1/W of the
routed experts, or a `DCPEngine` holding every W-th KV page); `RolloutReplica` is the driver-side
handle that sends each call to every rank, and `fetch` resolves its `ReplicaCall`s and plain
ObjectRefs alike (rank 0's answer, after every rank has answered, so any rank's error surfaces).
Why every rank gets the whole prompt shard: both engines' `generate` is collective over one request
list; seeds are fixed per prompt position, so the samples equal one engine's whatever W is.

Invariants: a dead or lone-raising rank kills the whole replica (Ray restarts it, the trainer re-sends
the adapter and re-runs the call); the replica's fingerprint is the whole base's; every rank holds the
whole adapter, at the same version.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from model.checkpoint import base_fingerprint
from rl.config import TrainConfig
from rl.workers import RolloutWorker, dep_expert_range

# Group: `init_group` forms the replica's torch.distributed group by TCP rendezvous at rank 0's
# address (gloo on CPU, NCCL + gloo on GPUs). DEP (rollout/native/dep.py) splits the requests over
# the ranks itself and returns every completion on every rank; DCP (rollout/native/dcp.py) runs all
# requests on every rank in lockstep (same scheduler decisions, bit-identical logits) with
# `rollout.max_pages` local pages per rank, so the replica holds W x one engine's context.
# Faults: a rank alone cannot recover (its peers are blocked in collectives with it), so `fetch` kills
# every rank of a replica with a dead one and raises the death as a `RayActorError`, answered as for
# any dead engine; the next call re-forms the group (new rendezvous, engine rebuilt). A rank that
# raises while the others stay blocked also kills the replica (the exception is re-raised); an error
# raised by every rank (bad input) kills nothing. Fingerprint: a DEP rank loads only its experts
# (`load_model(expert_range=)`) and the ranks combine their per-expert digests.

# A replica's collectives wait at most one engine step for a peer; a rank still blocked after this
# long has lost its peer (NCCL would otherwise wait its default 10 minutes).
GROUP_TIMEOUT = timedelta(minutes=5)
# How long `fetch` waits for the other ranks after one raised before judging them blocked.
PEER_GRACE_S = 10.0

__all__ = ["ReplicaCall", "RolloutRank", "RolloutReplica", "fetch", "replica_size"]


class RolloutRank(RolloutWorker):
    """Rank `rank` of replica `index` (world `world` ranks) of a `rollout.engine_parallel` replica.
    Build it, then call `init_group` on every rank (collective) before anything else; until then it is
    an unsharded single-process engine."""

    def __init__(self, cfg: TrainConfig, base_dir: str, index: int = 0, rank: int = 0, world: int = 2):
        if cfg.rollout.engine_parallel == "none":
            raise ValueError("RolloutRank needs rollout.engine_parallel=dep or dcp")
        # DEP: this rank's routed experts only (their bytes are never read elsewhere); the fingerprint
        # is gathered over the replica's group in init_group. DCP: the whole model on every rank.
        dep = cfg.rollout.engine_parallel == "dep"
        expert_range = dep_expert_range(base_dir, rank, world) if dep else None
        super().__init__(cfg, base_dir, index, expert_range)  # policy + NativeEngine (+ fingerprint: dcp)
        self.rank, self.world = rank, world

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a free port (asked of rank 0) for the replica's TCP rendezvous."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_group(self, addr: str, port: int) -> None:
        """Join the replica's group and serve through its engine (module doc): dep shards the routed
        experts over the group (every rank keeps the whole adapter), dcp replaces the engine by a
        `DCPEngine` over the whole model. Collective: every rank of the replica calls it."""
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError(f"replica {self.index} rank {self.rank} already belongs to a group")
        # GPU engines: NCCL for the collectives on device tensors, gloo for the host-side objects.
        backend = "cpu:gloo,cuda:nccl" if self.cfg.trainer.device == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.world,
            timeout=GROUP_TIMEOUT,
        )  # fmt: skip
        # The world is this replica's ranks: every engine below runs over the default group (None).
        if self.cfg.rollout.engine_parallel == "dep":
            from model.parallel.expert_parallel import apply_expert_parallel
            from rollout.native.dep import DEPEngine

            apply_expert_parallel(self.model, None)
            self._fingerprint = base_fingerprint(self.model)  # collective: every rank's expert digests
            self.engine = DEPEngine(self.engine, None, seed=self.cfg.trainer.seed + self.index)
            return
        from rollout.native.dcp import DCPEngine

        r = self.cfg.rollout
        self.engine = None  # free the single-process cache before the local one is allocated
        # Same batching limits and (default) seed on every rank: DCPEngine's lockstep invariant.
        self.engine = DCPEngine(
            self.model, r.max_pages, None, max_batch_tokens=r.max_batch_tokens, max_num_seqs=r.max_num_seqs
        )

    def shutdown(self) -> None:
        """Leave the group (local: no peer needs to join) before the actor is killed."""
        import torch.distributed as dist

        if self.engine is not None:
            super().shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class ReplicaCall:
    """One method call sent to every rank of `replica`: `refs[r]` is rank r's ObjectRef."""

    replica: RolloutReplica
    refs: list


def fetch(futures: Any, timeout: float | None = None) -> Any:
    """`ray.get` that also takes `ReplicaCall`s (alone or in a list, beside plain ObjectRefs)."""
    import ray

    if isinstance(futures, ReplicaCall):
        return futures.replica.resolve(futures, timeout)
    if isinstance(futures, list) and any(isinstance(f, ReplicaCall) for f in futures):
        return [fetch(f, timeout) for f in futures]
    return ray.get(futures, timeout=timeout)


class _Method:
    def __init__(self, replica: RolloutReplica, name: str):
        self.replica, self.name = replica, name

    def remote(self, *args: Any, **kwargs: Any) -> ReplicaCall:
        return self.replica.call(self.name, *args, **kwargs)


class RolloutReplica:
    """Driver-side handle over the `world` rank actors of rollout replica `index`. `make_rank(rank)`
    returns a Ray actor handle of `RolloutRank` (placement and restarts are the trainer's)."""

    METHODS = ("generate", "set_adapter", "fingerprint", "shutdown", "spec_stats", "stats")

    def __init__(self, make_rank: Callable[[int], Any], world: int, index: int = 0):
        self.index, self.world = index, world
        self.ranks = [make_rank(r) for r in range(world)]
        self._needs_group = True
        for name in self.METHODS:
            setattr(self, name, _Method(self, name))

    def form_group(self) -> None:
        """(Re-)form the replica's torch.distributed group: rendezvous at rank 0, every rank joins.
        Blocks; a rank that is restarting makes it wait or raise as Ray does for that actor."""
        import ray

        self._needs_group = True
        addr = ray.get(self.ranks[0].rendezvous_address.remote())
        # A rank that fails to join leaves the others waiting in the rendezvous: resolve kills them.
        self.resolve(ReplicaCall(self, [a.init_group.remote(*addr) for a in self.ranks]))
        self._needs_group = False

    def call(self, name: str, *args: Any, **kwargs: Any) -> ReplicaCall:
        """Send `name(*args, **kwargs)` to every rank (the group is formed first if needed)."""
        if self._needs_group and name != "shutdown":
            self.form_group()
        return ReplicaCall(self, [getattr(a, name).remote(*args, **kwargs) for a in self.ranks])

    def resolve(self, call: ReplicaCall, timeout: float | None = None) -> Any:
        """Rank 0's answer once every rank has answered. A dead rank kills the replica (see module doc)."""
        import ray

        rank_of = {ref: r for r, ref in enumerate(call.refs)}
        pending, start = list(call.refs), time.monotonic()
        while pending:
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                raise ray.exceptions.GetTimeoutError(
                    f"rollout replica {self.index}: no answer in {timeout} s"
                )
            error = _error_of(done[0])
            if error is None:
                continue
            # A peer's death often shows first as a collective error on a survivor: give the other
            # ranks a moment to report, and answer a death as a death (the trainer restarts engines).
            finished, blocked = [done[0]], []
            if not _is_death(error):
                more, blocked = ray.wait(pending, num_returns=len(pending), timeout=PEER_GRACE_S)
                finished += more
            deaths = [ref for ref in finished if _is_death(_error_of(ref))]
            if deaths:  # Ray restarts the dead rank itself; its peers go down with it
                self.kill(restart=True, spare=rank_of[deaths[0]])
                raise _error_of(deaths[0])
            if blocked:  # raised on some ranks while the others wait in a collective for them
                self.kill(restart=True)
            raise error  # raised on every rank (e.g. bad input): the replica is fine
        return ray.get(call.refs[0])

    def kill(self, restart: bool = False, spare: int | None = None) -> None:
        """Kill every rank (but `spare`, already dead); with `restart` Ray brings them back and the
        group is re-formed on the replica's next call."""
        import ray

        self._needs_group = True
        for r, a in enumerate(self.ranks):
            if r == spare:
                continue
            with contextlib.suppress(Exception):  # already gone for good: nothing to kill
                ray.kill(a, no_restart=not restart)


def _error_of(ref: Any) -> BaseException | None:
    """The exception `ray.get(ref)` raises (the ref is ready), or None."""
    import ray

    try:
        ray.get(ref)
    except Exception as e:
        return e
    return None


def _is_death(error: BaseException | None) -> bool:
    import ray

    return isinstance(error, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError)


def replica_size(cfg: TrainConfig) -> int:
    """Processes (and placement bundles) per rollout replica."""
    return cfg.rollout.engine_ranks if cfg.rollout.engine_parallel != "none" else 1

"""Where a run's processes live and how they are kept alive: the base they load, the placement group,
the rollout / reward / learner actors, and restarts of the ones that die.

Why apart from the step loop: placement, actor options and fault handling are Ray matters; the step
loop (rl/trainer.py) only asks `Topology` to run calls on the workers and gets answers back.

Invariants: bundles are rollout processes first (0.., `engine_ranks` per DEP/DCP replica), then
learners; engines and scorers are restarted (stateless between steps: the adapter is re-sent and
the same call re-run with the same seeds), learners never (they hold the optimizer state); every
worker's base fingerprint is equal, or start-up fails.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from rl.config import TrainConfig
from rl.learner import Learner
from rl.replicas import RolloutRank, RolloutReplica, fetch, replica_size
from rl.resume import resume_hint
from rl.workers import RewardWorker, RolloutWorker


class TrainingAborted(RuntimeError):
    """The run stopped on purpose (a dead learner, repeated worker deaths, repeated NaN steps); the
    message says why and how to continue. Checkpoints already written stay valid."""


def prepare_base(cfg: TrainConfig, run_dir: Path) -> Path:
    """The NVFP4 base directory all workers load. A bf16 source is quantized once, here, with
    model/nvfp4.py; a preset without a checkpoint gets seeded random weights (dry runs, tests)."""
    from model.checkpoint import save_model
    from model.config import ModelConfig
    from model.convert import convert
    from model.modeling import MiniMaxM3ForCausalLM

    m = cfg.model
    if m.family == "hf":  # the learner quantizes the HF checkpoint on load; nothing to write here
        if not (Path(m.checkpoint) / "config.json").exists():
            raise FileNotFoundError(
                f"model.checkpoint={m.checkpoint!r} is not a Hugging Face model directory (no config.json)"
            )
        return Path(m.checkpoint)
    base = run_dir / "base"
    if (base / "model.safetensors.index.json").exists():
        return base
    if m.checkpoint:
        src = Path(m.checkpoint)
        if not src.exists():
            raise FileNotFoundError(
                f"model.checkpoint={m.checkpoint!r} does not exist; give a checkpoint directory "
                "(config.json + safetensors) or model.checkpoint=null with model.preset=NAME"
            )
        src_cfg = ModelConfig.from_pretrained(src)
        has_experts = any(src_cfg.is_moe_layer(i) for i in range(src_cfg.num_hidden_layers))
        if src_cfg.quantization.routed_experts == "bf16" and has_experts:
            convert(src, base)
            return base
        return src
    mcfg = dataclasses.replace(ModelConfig.preset(m.preset), **dict(m.overrides))
    model = MiniMaxM3ForCausalLM(mcfg).init_weights(seed=cfg.trainer.seed)
    save_model(model, base)
    return base


class Topology:
    """The run's actors. `rollout`: one actor per engine replica, or a `RolloutReplica` handle per
    DEP/DCP replica; `rewards`: scorer actors; `learners`: the learner group (rank 0 answers for it:
    all hold the same adapter). `base_fingerprint`: the one base they all loaded."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, base: Path, engine_base: Path):
        import ray

        self.cfg, self.run_dir = cfg, run_dir
        self.placement = self._placement_group()
        self.rollout = self._rollout_workers(str(engine_base))
        self.rewards = [
            ray.remote(num_cpus=0, max_restarts=cfg.trainer.max_restarts)(RewardWorker).remote(cfg)
            for _ in range(cfg.reward.num_workers)
        ]
        self.fault_counts = {"faults/rollout_restarts": 0.0, "faults/reward_restarts": 0.0}
        world = cfg.trainer.num_learners
        self.learners = [
            self._actor(Learner, cfg.trainer.num_gpus, self._rollout_bundles + rank).remote(
                cfg, str(base), rank, world
            )
            for rank in range(world)
        ]
        if world > 1:
            addr = ray.get(self.learners[0].rendezvous_address.remote())
            ray.get([lrn.init_group.remote(*addr) for lrn in self.learners])
        own = ray.get([lrn.fingerprint.remote() for lrn in self.learners])
        # vLLM serving an M3 checkpoint holds no model of ours: it is compared by directory identity.
        by_dir = cfg.rollout.backend == "vllm" and cfg.model.family != "hf"
        prints = ray.get([lrn.directory_fingerprint.remote() for lrn in self.learners]) if by_dir else own
        prints += fetch([w.fingerprint.remote() for w in self.rollout])
        if len(set(prints)) != 1 or len(set(own)) != 1:
            raise RuntimeError(
                f"base fingerprints differ between learner and rollout workers: {prints}; every worker must "
                "load the same NVFP4 base (one quantization function) — check model.checkpoint and dtype"
            )
        self.base_fingerprint = own[0]

    # ------------------------------------------------------------------ placement
    @property
    def _rollout_bundles(self) -> int:
        """Placement bundles (= processes) of all rollout replicas: bundle indices 0.. of the group."""
        return self.cfg.rollout.num_workers * replica_size(self.cfg)

    def _rollout_workers(self, engine_base: str) -> list:
        """One actor per replica, or (rollout.engine_parallel=dep|dcp) one `RolloutReplica` handle
        grouping its `engine_ranks` rank actors, bundles i*W .. i*W+W-1, with its torch.distributed
        group formed (rl/replicas.py)."""
        cfg, gpus = self.cfg, self.cfg.rollout.num_gpus
        if cfg.rollout.engine_parallel == "none":
            return [
                self._actor(RolloutWorker, gpus, i).remote(cfg, engine_base, i)
                for i in range(cfg.rollout.num_workers)
            ]
        world = cfg.rollout.engine_ranks

        def rank_of(i: int):
            return lambda r: self._actor(RolloutRank, gpus, i * world + r).remote(
                cfg, engine_base, i, r, world
            )

        replicas = [RolloutReplica(rank_of(i), world, i) for i in range(cfg.rollout.num_workers)]
        for rep in replicas:  # each blocks until its ranks have built their engines and joined
            rep.form_group()
        return replicas

    def _placement_group(self):
        """One bundle per rollout process then per learner, reserved up front (ray.placement=pack|
        spread); None = let Ray place actors freely."""
        import ray
        from ray.util.placement_group import placement_group

        c = self.cfg
        if c.ray.placement == "none":
            return None

        def bundle(gpus: float) -> dict[str, float]:
            return {"CPU": c.ray.bundle_cpus, **({"GPU": gpus} if gpus else {})}

        bundles = [bundle(c.rollout.num_gpus)] * self._rollout_bundles
        bundles += [bundle(c.trainer.num_gpus)] * c.trainer.num_learners
        pg = placement_group(bundles, strategy=c.ray.placement.upper())
        try:
            ray.get(pg.ready(), timeout=300)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"Ray could not reserve the run's layout ({len(bundles)} bundles: {bundles}) in 300 s; the "
                "cluster lacks the GPUs/CPUs asked for: lower rollout.num_workers / trainer.num_learners / "
                "num_gpus, add nodes, or set ray.placement=none"
            ) from None
        return pg

    def _actor(self, cls, num_gpus: float, bundle_index: int):
        import ray

        # Engines and scorers are stateless between steps (the adapter is re-sent): Ray restarts
        # them. A learner holds the optimizer state: it is not restarted (the run stops resumable).
        restarts = self.cfg.trainer.max_restarts if cls is not Learner else 0
        if self.placement is None:
            return ray.remote(num_cpus=0, num_gpus=num_gpus, max_restarts=restarts)(cls)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=bundle_index)
        return ray.remote(num_cpus=self.cfg.ray.bundle_cpus, num_gpus=num_gpus, max_restarts=restarts,
                          scheduling_strategy=strategy)(cls)  # fmt: skip

    # ------------------------------------------------------------------ calls and faults
    def from_learners(self, method: str):
        """Learner 0's answer to `method`, asked of every learner: under DEP with expert adapters it is
        collective (the learners gather their expert shards), and every learner must join it."""
        import ray

        return ray.get([getattr(lrn, method).remote() for lrn in self.learners])[0]

    def get_with_restarts(self, actor, kind: str, call, future, resync: bool, step: int):
        """fetch(future); if the actor died, wait for Ray to restart it, re-send the current adapter
        (engines), and run the same call again: same arguments, same seeds, so the step's samples
        are neither lost nor duplicated. Gives up after trainer.max_restarts."""
        import ray

        for attempt in range(self.cfg.trainer.max_restarts + 1):
            try:
                return fetch(future)  # a DEP replica: every rank's answer (a dead rank kills the replica)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if attempt == self.cfg.trainer.max_restarts:
                    raise TrainingAborted(
                        f"a {kind} worker died {attempt + 1} times at step {step} ({type(e).__name__}); "
                        f"giving up: {resume_hint(self.run_dir)}"
                    ) from None
                self.fault_counts[f"faults/{kind}_restarts"] += 1
                print(f"warning: {kind} worker died at step {step}; restarting it and re-running its work",
                      file=sys.stderr)  # fmt: skip
                if resync:
                    self._resync(actor)
                else:
                    self._until_alive(lambda: ray.get(actor.ping.remote()))
                future = call(actor)
        raise AssertionError("unreachable")

    def _resync(self, actor) -> None:
        """Send the learner's current adapter to a restarted engine (it starts at version 0). A DEP
        replica's call first re-forms its group (rl/replicas.py), waiting for its ranks as here."""
        update = self.from_learners("adapter_update")
        self._until_alive(lambda: fetch(actor.set_adapter.remote(update)))

    def _until_alive(self, call) -> None:
        """Run `call` (a blocking call on a just-died actor) until it succeeds. Calls to a
        restarting actor wait for it; "unavailable" means it is coming back; "died" right after a
        death is retried briefly; a failed restart (its __init__ raised) is final."""
        import ray

        start = time.monotonic()
        while True:
            try:
                call()
                return
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() - start > 300:
                    raise TrainingAborted(
                        f"a restarted worker never came back: {resume_hint(self.run_dir)}"
                    ) from None
            except ray.exceptions.RayActorError as e:
                if time.monotonic() - start > 30:
                    raise TrainingAborted(
                        f"a worker could not be restarted ({e}); {resume_hint(self.run_dir)}"
                    ) from None
            time.sleep(1.0)

    def close(self) -> None:
        """Stop this run's actors and release the placement group (the Ray instance itself stays up
        for whoever started it). A dead actor is no reason to fail."""
        import ray

        try:  # engines with subprocesses (vLLM) stop them first
            fetch([w.shutdown.remote() for w in self.rollout], timeout=60)
        except Exception as e:
            print(f"warning: rollout engine shutdown: {e}", file=sys.stderr)
        for w in self.rollout:  # a DEP / DCP replica: every rank actor
            if isinstance(w, RolloutReplica):
                w.kill()
            else:
                ray.kill(w)
        for actor in [*self.rewards, *self.learners]:
            ray.kill(actor)
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement)


def start_ray(cfg, log_to_driver: bool) -> None:
    """Join or start the Ray instance the `ray` section names (`address`, `num_cpus`, `num_gpus`), once."""
    import ray

    if not ray.is_initialized():
        ray.init(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus, num_gpus=cfg.ray.num_gpus,
                 include_dashboard=False, log_to_driver=log_to_driver, configure_logging=False)  # fmt: skip

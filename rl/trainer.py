"""The GRPO step loop (the driver): rollouts -> rewards -> advantages -> update -> adapter sync.

What: `Trainer(cfg)` starts (or joins) Ray, prepares the one NVFP4 base every worker loads,
starts RolloutWorker / RewardWorker / Learner actors, checks their base fingerprints agree, then
runs `cfg.trainer.total_steps` GRPO steps with eval, tracking and checkpoints on their schedules,
and ends by exporting the adapter (PEFT format) to `run_dir/adapter`.

Why here and not in the workers: everything that decides *what* to train on (prompt order, dynamic
sampling, advantages, which adapter version samples next) lives in one process, so a run is
reproducible from (config, seed) and resumable from a checkpoint of this loop's state.

Invariants: after start-up only adapter tensors move (rl/sync.py); every sample used in step s was
generated with adapter version s (on-policy); a resumed run continues exactly as an uninterrupted
one (all randomness is derived from (seed, step), and the learner's state is checkpointed).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

from common.data import skipped_row_metrics
from rl import grpo
from rl.config import TrainConfig, config_to_dict, save_config
from rl.faults import maybe_fail
from rl.learner import Learner
from rl.replicas import RolloutRank, RolloutReplica, fetch, replica_size
from rl.rewards import reward_error_metrics
from rl.workers import RewardWorker, RolloutWorker, Sample


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
        if src_cfg.quantization.routed_experts == "bf16":
            convert(src, base)
            return base
        return src
    mcfg = dataclasses.replace(ModelConfig.preset(m.preset), **dict(m.overrides))
    model = MiniMaxM3ForCausalLM(mcfg).init_weights(seed=cfg.trainer.seed)
    save_model(model, base)
    return base


# Mean |learner - engine| log-prob per sampled token above which a run is told why (see
# Trainer._check_logprob_agreement): same-computation runs measure ~1e-6; an fp32 model over a bf16
# KV cache without trainer.kv_sim measured 5e-3 (geo_vision before its recipe set kv_sim).
LOGPROB_WARN_ABS_DIFF = 1e-3


class TrainingAborted(RuntimeError):
    """The run stopped on purpose (a dead learner, repeated worker deaths, repeated NaN steps); the
    message says why and how to continue. Checkpoints already written stay valid."""


def group_advantages(samples: list[Sample]) -> None:
    """Set each sample's GRPO advantage from its group (same uid) in place."""
    uids = sorted({s.uid for s in samples})
    index = {u: i for i, u in enumerate(uids)}
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups = torch.tensor([index[s.uid] for s in samples])
    adv = grpo.group_advantages(rewards, groups)
    for s, a in zip(samples, adv.tolist(), strict=True):
        s.advantage = a


class Trainer:
    def __init__(self, cfg: TrainConfig):
        import ray

        from common.data import build_datasets
        from rl.tracking import Tracker

        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        from common.tokenizer import load_tokenizer

        self.train_stream, self.eval_prompts = build_datasets(
            cfg.data,
            seed=cfg.trainer.seed,
            batch_size=cfg.algo.batch_prompts,
            tokenizer=load_tokenizer(cfg.model.tokenizer),
        )
        self.step = 0
        resume_state = self._find_resume()
        self.tracker = Tracker(
            cfg.tracking, self.run_dir, config_to_dict(cfg),
            resume_run_id=(resume_state or {}).get("wandb_run_id"),
            resume_step=(resume_state or {}).get("step"),
        )  # fmt: skip

        t0 = time.perf_counter()
        base = self.base_dir = prepare_base(cfg, self.run_dir)
        if not ray.is_initialized():
            ray.init(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus, include_dashboard=False,
                     log_to_driver=True, configure_logging=False)  # fmt: skip
        self._placement = self._placement_group()
        engine_base = base
        if cfg.model.family == "hf":
            # vLLM serves the dequantized twin: the learner's NVFP4 values as an ordinary checkpoint.
            from rl.hf_policy import prepare_hf_base

            engine_base = prepare_hf_base(base, self.run_dir / "base_vllm", cfg.model.dtype)
        self.rollout = self._rollout_workers(str(engine_base))
        self.rewards = [
            ray.remote(num_cpus=0, max_restarts=cfg.trainer.max_restarts)(RewardWorker).remote(cfg)
            for _ in range(cfg.reward.num_workers)
        ]
        self.fault_counts = {"faults/rollout_restarts": 0.0, "faults/reward_restarts": 0.0}
        self._nonfinite_streak = 0
        self._warned_logprob_gap = False
        world = cfg.trainer.num_learners
        self.learners = [
            self._actor(Learner, cfg.trainer.num_gpus, self._rollout_bundles + rank).remote(
                cfg, str(base), rank, world
            )
            for rank in range(world)
        ]
        self.learner = self.learners[0]  # rank 0 answers for the group (all hold the same adapter)
        if world > 1:
            addr = ray.get(self.learner.rendezvous_address.remote())
            ray.get([lrn.init_group.remote(*addr) for lrn in self.learners])
        prints = ray.get([lrn.fingerprint.remote() for lrn in self.learners])
        prints += fetch([w.fingerprint.remote() for w in self.rollout])
        if len(set(prints)) != 1:
            raise RuntimeError(
                f"base fingerprints differ between learner and rollout workers: {prints}; every worker must "
                "load the same NVFP4 base (one quantization function) — check model.checkpoint and dtype"
            )
        self.base_fingerprint = prints[0]
        if resume_state:
            self._restore(resume_state)
        self._sync()  # engines start with the learner's adapter (fresh: exact zero delta)
        self.startup_s = time.perf_counter() - t0

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
        """One bundle per rollout process (indices 0.., `engine_ranks` per DEP replica) then per
        learner, reserved up front (ray.placement=pack|spread); None = let Ray place actors freely."""
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
        if self._placement is None:
            return ray.remote(num_cpus=0, num_gpus=num_gpus, max_restarts=restarts)(cls)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            self._placement, placement_group_bundle_index=bundle_index
        )
        return ray.remote(num_cpus=self.cfg.ray.bundle_cpus, num_gpus=num_gpus, max_restarts=restarts,
                          scheduling_strategy=strategy)(cls)  # fmt: skip

    # ------------------------------------------------------------------ fault handling
    def _get_with_restarts(self, actor, kind: str, call, future, resync: bool):
        """ray.get(call(actor)); if the actor died, wait for Ray to restart it, re-send the current
        adapter (engines), and run the same call again: same arguments, same seeds, so the step's
        samples are neither lost nor duplicated. Gives up after trainer.max_restarts."""
        import ray

        for attempt in range(self.cfg.trainer.max_restarts + 1):
            try:
                return fetch(future)  # a DEP replica: every rank's answer (a dead rank kills the replica)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if attempt == self.cfg.trainer.max_restarts:
                    raise TrainingAborted(
                        f"a {kind} worker died {attempt + 1} times at step {self.step} ({type(e).__name__}); "
                        f"giving up: {self._resume_hint()}"
                    ) from None
                self.fault_counts[f"faults/{kind}_restarts"] += 1
                print(f"warning: {kind} worker died at step {self.step}; restarting it and re-running its "
                      "work", file=sys.stderr)  # fmt: skip
                if resync:
                    self._resync(actor)
                else:
                    self._until_alive(lambda: ray.get(actor.ping.remote()))
                future = call(actor)
        raise AssertionError("unreachable")

    def _from_learners(self, method: str):
        """Learner 0's answer to `method`, asked of every learner: under DEP with expert adapters it is
        collective (the learners gather their expert shards), and every learner must join it."""
        import ray

        return ray.get([getattr(lrn, method).remote() for lrn in self.learners])[0]

    def _resync(self, actor) -> None:
        """Send the learner's current adapter to a restarted engine (it starts at version 0). A DEP
        replica's call first re-forms its group (rl/replicas.py), waiting for its ranks as here."""
        update = self._from_learners("adapter_update")
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
                        f"a restarted worker never came back: {self._resume_hint()}"
                    ) from None
            except ray.exceptions.RayActorError as e:
                if time.monotonic() - start > 30:
                    raise TrainingAborted(
                        f"a worker could not be restarted ({e}); {self._resume_hint()}"
                    ) from None
            time.sleep(1.0)

    def _spec_metrics(self) -> dict[str, float]:
        """`spec/accept_len`: tokens emitted per verification pass in this step's rollouts (all
        engines), when DSpark is on."""
        if self.cfg.rollout.dspark.drafter is None or self.cfg.rollout.backend != "native":
            return {}
        parts = fetch([w.spec_stats.remote() for w in self.rollout])
        steps, acc = sum(p["steps"] for p in parts), sum(p["accepted"] for p in parts)
        return {"spec/accept_len": (acc + steps) / steps if steps else 0.0, "spec/verify_steps": steps}

    def _check_finite(self, metrics: dict[str, float]) -> None:
        """Count consecutive steps with skipped (NaN/inf) updates; after trainer.max_nonfinite_steps
        in a row save a checkpoint (the adapter is still finite: bad updates were skipped) and stop."""
        bad = metrics.get("actor/nonfinite_updates", 0.0) > 0
        self._nonfinite_streak = self._nonfinite_streak + 1 if bad else 0
        metrics["actor/nonfinite_streak"] = float(self._nonfinite_streak)
        if bad:
            print(f"warning: step {self.step + 1}: NaN/inf loss or gradient; the update was skipped",
                  file=sys.stderr)  # fmt: skip
        if self._nonfinite_streak >= self.cfg.trainer.max_nonfinite_steps:
            self.step += 1
            self.tracker.log(self.step, metrics)
            saved = self.save()
            raise TrainingAborted(
                f"{self._nonfinite_streak} consecutive steps had NaN/inf losses or gradients (last: step "
                f"{self.step}); stopped with a finite adapter saved in {saved}. Lower optim.lr or raise "
                "optim.grad_clip's strictness, check the data, then resume=auto"
            )

    def _check_logprob_agreement(self, metrics: dict[str, float]) -> None:
        """Warn once when the learner's log-probs of the sampled tokens disagree with the engine's by
        more than numerics explain: the usual cause is a KV cache stored at lower precision than the
        model computes in (fp32 model, bf16/fp8/NVFP4 cache) without trainer.kv_sim."""
        diff = metrics.get("rollout_corr/abs_diff", 0.0)
        if diff > LOGPROB_WARN_ABS_DIFF and not self._warned_logprob_gap:
            self._warned_logprob_gap = True
            hint = (
                "set trainer.kv_sim=true so the learner rounds K/V as the cache stores them"
                if not self.cfg.trainer.kv_sim
                else "check that learner and engine load the same base and adapter dtypes"
            )
            print(
                f"warning: step {self.step + 1}: learner and rollout log-probs differ by {diff:.2e} per "
                f"token (rollout_corr/abs_diff; ~1e-6 when both compute the same thing): {hint}",
                file=sys.stderr,
            )

    def _resume_hint(self) -> str:
        from rl.checkpointing import find_latest

        found = find_latest(self.run_dir)
        where = f"the last complete checkpoint is {found}" if found else "no checkpoint was written yet"
        return f"{where}; rerun the same command with resume=auto to continue"

    # ------------------------------------------------------------------ pieces of a step
    def _sync(self) -> dict[str, float]:
        t0 = time.perf_counter()
        update = self._from_learners("adapter_update")
        engine_side = fetch([w.set_adapter.remote(update) for w in self.rollout])
        out = {"sync/bytes": float(update.nbytes), "sync/seconds": time.perf_counter() - t0,
               "sync/version": float(update.version)}  # fmt: skip
        loads = [e["seconds"] for e in engine_side if e and "seconds" in e]
        if loads:  # the engines' own load time (vLLM: building its LoRA weights), slowest replica
            out["sync/engine_load_seconds"] = max(loads)
        return out

    def _rollout(self, prompts: list, n: int, temperature: float, top_p: float, seed: int) -> list[Sample]:

        # Seeds come from (seed, global prompt position) and samples are put back in prompt order,
        # so the step's data is the same whatever the number of rollout / reward workers.
        k = len(self.rollout)
        positions = list(range(len(prompts)))
        shards = [(i, w) for i, w in enumerate(self.rollout) if prompts[i::k]]

        def gen(i: int):
            return lambda w: w.generate.remote(
                prompts[i::k], n, temperature, top_p, seed * 7919, self.step, positions[i::k]
            )

        first = {i: gen(i)(w) for i, w in shards}  # every shard runs before we wait on any
        maybe_fail(self.cfg.trainer.fault_injection, str(self.run_dir), "driver.rollout", self.step)
        parts = [self._get_with_restarts(w, "rollout", gen(i), first[i], resync=True) for i, w in shards]
        order = {p.uid: j for j, p in enumerate(prompts)}
        samples = sorted((s for part in parts for s in part), key=lambda s: order[s.uid])
        r = len(self.rewards)
        chunks = [(i, samples[i::r]) for i in range(r) if samples[i::r]]

        def score(chunk: list):
            return lambda w: w.score.remote(chunk, self.step)

        first = {i: score(c)(self.rewards[i]) for i, c in chunks}
        for i, c in chunks:
            samples[i::r] = self._get_with_restarts(
                self.rewards[i], "reward", score(c), first[i], resync=False
            )
        return samples

    def train_step(self) -> dict[str, float]:
        import ray

        c, a = self.cfg, self.cfg.algo
        t0 = time.perf_counter()
        kept: list[Sample] = []
        generated: list[Sample] = []
        seen_groups, n_rounds, all_rewards, all_acc, lengths, clipped = 0, 0, [], [], [], 0
        while True:
            prompts = self.train_stream.next_batch()
            samples = self._rollout(
                prompts,
                c.rollout.n_samples,
                c.rollout.temperature,
                c.rollout.top_p,
                self.step * 100 + n_rounds,
            )
            n_rounds += 1
            generated.extend(samples)
            by_uid: dict[str, list[Sample]] = {}
            for s in samples:
                by_uid.setdefault(s.uid, []).append(s)
                all_rewards.append(s.reward)
                all_acc.append(s.acc)
                lengths.append(len(s.response_ids))
                clipped += s.finish_reason == "length"
            seen_groups += len(by_uid)
            for group in by_uid.values():
                varied = len({s.reward for s in group}) > 1
                if varied or not a.dynamic_sampling:
                    kept.extend(group)
            if not a.dynamic_sampling or len({s.uid for s in kept}) >= a.batch_prompts:
                break
            if n_rounds > a.max_regen_rounds:
                break
        t_gen = time.perf_counter() - t0
        metrics: dict[str, float] = {
            "reward/mean": _mean(all_rewards),
            "acc/mean": _mean(all_acc),
            "response_length/mean": _mean(lengths),
            "response_length/clip_ratio": clipped / max(1, len(lengths)),
            "dynamic_sampling/kept_groups": float(len({s.uid for s in kept})),
            "dynamic_sampling/seen_groups": float(seen_groups),
            "dynamic_sampling/rounds": float(n_rounds),
            "timing_s/gen": t_gen,
        }
        metrics.update(self._spec_metrics())
        kinds = [s.extra.get("reward_error_kind") for s in generated]
        metrics.update(reward_error_metrics([{"error": "", "error_kind": k} if k else {} for k in kinds]))
        metrics.update(skipped_row_metrics(getattr(self.train_stream, "skipped_rows", {})))
        # Drafter co-training (rollout worker 0) overlaps the learner's update: both read this
        # step's rollouts; the drafter learns the policy that generated them.
        cotrain = self.rollout[0].cotrain_drafter.remote(generated) if c.rollout.dspark.cotrain else None
        if kept:
            group_advantages(kept)
            try:
                metrics.update(ray.get([lrn.timed_train_step.remote(kept) for lrn in self.learners])[0])
            except ray.exceptions.RayActorError as e:
                raise TrainingAborted(
                    f"the learner died during step {self.step + 1} ({type(e).__name__}); its optimizer state "
                    f"is gone, so the run stops: {self._resume_hint()}"
                ) from None
            self._check_finite(metrics)
            self._check_logprob_agreement(metrics)
            metrics.update(self._sync())
        else:
            metrics["actor/skipped_step"] = 1.0  # every group had equal rewards: nothing to learn from
            ray.get([lrn.skip_step.remote() for lrn in self.learners])
            metrics.update(self._sync())
        if cotrain is not None:
            spec, state, version = ray.get(cotrain)
            if state is not None:  # None: not a co-training round (rollout.dspark.cotrain_every)
                ray.get([w.set_drafter.remote(state, version) for w in self.rollout[1:]])
            metrics.update(spec)
        metrics.update(self.fault_counts)
        n_tokens = sum(lengths)
        step_s = time.perf_counter() - t0
        metrics["timing_s/step"] = step_s
        metrics["perf/tokens_per_s"] = n_tokens / max(t_gen, 1e-9)
        self._last_samples = kept[: c.tracking.log_samples] if kept else []
        return metrics

    def evaluate(self) -> dict[str, float]:
        c = self.cfg
        samples = self._rollout(
            self.eval_prompts,
            c.trainer.eval_n_samples,
            c.trainer.eval_temperature,
            c.trainer.eval_top_p,
            10**6,
        )
        out = {
            "eval/acc": _mean([s.acc for s in samples]),
            "eval/reward": _mean([s.reward for s in samples]),
            "eval/response_length": _mean([len(s.response_ids) for s in samples]),
        }
        # eval's own speculation counters (kept out of the next training step's spec/accept_len)
        out.update({f"eval/{k.removeprefix('spec/')}": v for k, v in self._spec_metrics().items()})
        return out

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        from tqdm import tqdm

        from rl.tracking import plot_rewards

        c = self.cfg
        last: dict[str, float] = {}
        if self.step == 0 and c.trainer.eval_every > 0:
            ev = self.evaluate()
            self.tracker.log(0, ev)
            print(f"step 0: eval/acc = {ev['eval/acc']:.3f}", file=sys.stderr)
        bar = tqdm(total=c.trainer.total_steps, initial=self.step, desc="GRPO", unit="step", file=sys.stderr)
        while self.step < c.trainer.total_steps:
            metrics = self.train_step()
            self.step += 1
            if c.trainer.eval_every > 0 and (
                self.step % c.trainer.eval_every == 0 or self.step == c.trainer.total_steps
            ):
                metrics.update(self.evaluate())
            self.tracker.log(self.step, metrics)
            if self._last_samples:
                rows = [
                    {"prompt_len": len(s.prompt_ids), "completion": s.text, "reward": s.reward,
                     "answer": s.ground_truth}
                    for s in self._last_samples
                ]  # fmt: skip
                self.tracker.log_samples(self.step, rows)
            plot_rewards(self.run_dir / "metrics.jsonl", self.run_dir / "plots" / "reward.png")
            if c.trainer.save_every > 0 and self.step % c.trainer.save_every == 0:
                self.save()
            postfix = {
                "reward": f"{metrics['reward/mean']:.3f}",
                "tok_s": f"{metrics['perf/tokens_per_s']:.0f}",
            }
            if "eval/acc" in metrics:
                postfix["eval_acc"] = f"{metrics['eval/acc']:.3f}"
            bar.set_postfix(postfix)
            bar.update(1)
            last = metrics
        bar.close()
        adapter_dir = self.export(last)
        self.tracker.log_artifact(adapter_dir, name=f"adapter-{self.cfg.recipe}", type="lora-adapter")
        self.tracker.log_image(self.step, "plots/reward", self.run_dir / "plots" / "reward.png")
        self.tracker.finish()
        return last

    def close(self) -> None:
        """Stop this run's actors (the Ray instance itself stays up for whoever started it) and close
        the tracker (idempotent: a finished run's tracker is already closed)."""
        import ray

        tracker = getattr(self, "tracker", None)
        if tracker is not None:
            tracker.finish()

        try:  # engines with subprocesses (vLLM) stop them first; a dead actor is no reason to fail
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
        if self._placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement)

    # ------------------------------------------------------------------ state
    def save(self) -> Path:

        from rl.checkpointing import capture_rng_state, save_checkpoint

        state = self._from_learners("state_dict")
        maybe_fail(self.cfg.trainer.fault_injection, str(self.run_dir), "driver.save", self.step)
        return save_checkpoint(self.run_dir, self.step, keep_last=self.cfg.trainer.keep_checkpoints, state={
            "learner": state, "step": self.step, "data": self.train_stream.state_dict(),
            "rng": capture_rng_state(), "wandb_run_id": self.tracker.run_id,
            "base_fingerprint": getattr(self, "base_fingerprint", None),
        })  # fmt: skip

    def _find_resume(self) -> dict | None:
        """State of the newest checkpoint that verifies (`resume=auto`: corrupted ones are skipped
        with a warning), of the given checkpoint (`resume=PATH`: corruption is an error), or None."""
        from rl.checkpointing import resume_checkpoint

        if not self.cfg.resume:
            return None
        found = resume_checkpoint(self.run_dir, self.cfg.resume)
        if found is None:
            return None
        path, state = found
        print(f"resuming from {path} (step {state['step']})", file=sys.stderr)
        return state

    def _restore(self, state: dict) -> None:
        import ray

        from rl.checkpointing import restore_rng_state

        recorded, now = state.get("base_fingerprint"), self.base_fingerprint
        if recorded and recorded != now:
            raise RuntimeError("the checkpoint was trained on a different base (fingerprint mismatch)")
        ray.get([lrn.load_state_dict.remote(state["learner"]) for lrn in self.learners])
        self.step = state["step"]
        self.train_stream.load_state_dict(state["data"])
        restore_rng_state(state["rng"])

    def export(self, metrics: dict[str, float] | None = None) -> Path:
        """The final adapter in PEFT format (servable by vLLM / `rollout.serve`), with the base's
        fingerprint and config so a mismatched base is refused at load."""

        from model.adapter import AdapterMetadata, save_adapter
        from model.config import ModelConfig
        from rl.workers import lora_config

        update = self._from_learners("adapter_update")
        if self.cfg.model.family == "hf":
            return self._export_hf(update.tensors, metrics)
        lora = lora_config(self.cfg)
        meta = AdapterMetadata(
            base_fingerprint=self.base_fingerprint,
            base_config=ModelConfig.from_pretrained(self.base_dir).to_hf_dict(),
            base_dtype={"fp32": "float32", "bf16": "bfloat16"}[self.cfg.model.dtype],
            step=self.step,
            metrics={k: float(v) for k, v in (metrics or {}).items()},
            tokenizer=self.cfg.model.tokenizer,
        )
        out = self.run_dir / "adapter"
        save_adapter(
            None, out, lora, base_model_name_or_path=str(self.base_dir), metadata=meta, tensors=update.tensors
        )
        return out

    def _export_hf(self, tensors: dict, metrics: dict[str, float] | None) -> Path:
        """Plain PEFT files for a Hugging Face base: `PeftModel.from_pretrained(twin, dir)` and vLLM
        (`--lora-modules`) load them; `nvfp4_source.json` names the NVFP4 base fingerprint."""
        import json

        from safetensors.torch import save_file

        from rollout.vllm_backend import peft_config_dict

        lc, out = self.cfg.lora, self.run_dir / "adapter"
        staging = out.with_name("adapter.tmp")
        staging.mkdir(parents=True, exist_ok=True)
        cfg = peft_config_dict(lc.r, lc.alpha, tuple(lc.target_modules))
        cfg["base_model_name_or_path"] = str(self.run_dir / "base_vllm")
        (staging / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / "adapter_model.safetensors"))
        from model.integrity import write_manifest

        write_manifest(staging, ["adapter_model.safetensors"])
        (staging / "nvfp4_source.json").write_text(json.dumps({
            "nvfp4_base_fingerprint": self.base_fingerprint, "step": self.step,
            "metrics": {k: float(v) for k, v in (metrics or {}).items()}}, indent=2))  # fmt: skip
        if out.exists():
            import shutil

            shutil.rmtree(out)
        staging.rename(out)
        return out


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def run(cfg: TrainConfig) -> dict[str, float]:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    trainer = Trainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()

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

from rl import grpo
from rl.config import TrainConfig, config_to_dict, save_config
from rl.workers import Learner, RewardWorker, RolloutWorker, Sample


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

        from rl.data import build_datasets
        from rl.tracking import Tracker

        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        from rl.tokenizer import load_tokenizer

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
        self.rollout = [
            self._actor(RolloutWorker, cfg.rollout.num_gpus, i).remote(cfg, str(engine_base), i)
            for i in range(cfg.rollout.num_workers)
        ]
        self.rewards = [
            ray.remote(num_cpus=0)(RewardWorker).remote(cfg) for _ in range(cfg.reward.num_workers)
        ]
        world = cfg.trainer.num_learners
        self.learners = [
            self._actor(Learner, cfg.trainer.num_gpus, len(self.rollout) + rank).remote(
                cfg, str(base), rank, world
            )
            for rank in range(world)
        ]
        self.learner = self.learners[0]  # rank 0 answers for the group (all hold the same adapter)
        if world > 1:
            addr = ray.get(self.learner.rendezvous_address.remote())
            ray.get([lrn.init_group.remote(*addr) for lrn in self.learners])
        prints = ray.get([lrn.fingerprint.remote() for lrn in self.learners] +
                         [w.fingerprint.remote() for w in self.rollout])  # fmt: skip
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
    def _placement_group(self):
        """One bundle per rollout worker (indices 0..W-1) then per learner, reserved up front
        (ray.placement=pack|spread); None = let Ray place actors freely."""
        import ray
        from ray.util.placement_group import placement_group

        c = self.cfg
        if c.ray.placement == "none":
            return None

        def bundle(gpus: float) -> dict[str, float]:
            return {"CPU": c.ray.bundle_cpus, **({"GPU": gpus} if gpus else {})}

        bundles = [bundle(c.rollout.num_gpus)] * c.rollout.num_workers
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

        if self._placement is None:
            return ray.remote(num_cpus=0, num_gpus=num_gpus)(cls)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            self._placement, placement_group_bundle_index=bundle_index
        )
        return ray.remote(num_cpus=self.cfg.ray.bundle_cpus, num_gpus=num_gpus,
                          scheduling_strategy=strategy)(cls)  # fmt: skip

    # ------------------------------------------------------------------ pieces of a step
    def _sync(self) -> dict[str, float]:
        import ray

        t0 = time.perf_counter()
        update = ray.get(self.learner.adapter_update.remote())
        engine_side = ray.get([w.set_adapter.remote(update) for w in self.rollout])
        out = {"sync/bytes": float(update.nbytes), "sync/seconds": time.perf_counter() - t0,
               "sync/version": float(update.version)}  # fmt: skip
        loads = [e["seconds"] for e in engine_side if e and "seconds" in e]
        if loads:  # the engines' own load time (vLLM: building its LoRA weights), slowest replica
            out["sync/engine_load_seconds"] = max(loads)
        return out

    def _rollout(self, prompts: list, n: int, temperature: float, top_p: float, seed: int) -> list[Sample]:
        import ray

        # Seeds come from (seed, global prompt position) and samples are put back in prompt order,
        # so the step's data is the same whatever the number of rollout / reward workers.
        k = len(self.rollout)
        futures = [
            w.generate.remote(
                prompts[i::k], n, temperature, top_p, seed * 7919, self.step, list(range(len(prompts)))[i::k]
            )
            for i, w in enumerate(self.rollout)
            if prompts[i::k]
        ]
        order = {p.uid: j for j, p in enumerate(prompts)}
        samples = sorted((s for part in ray.get(futures) for s in part), key=lambda s: order[s.uid])
        r = len(self.rewards)
        parts = ray.get([self.rewards[i].score.remote(samples[i::r]) for i in range(r) if samples[i::r]])
        for i, part in enumerate(parts):
            samples[i::r] = part
        return samples

    def train_step(self) -> dict[str, float]:
        import ray

        c, a = self.cfg, self.cfg.algo
        t0 = time.perf_counter()
        kept: list[Sample] = []
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
        if kept:
            group_advantages(kept)
            metrics.update(ray.get([lrn.timed_train_step.remote(kept) for lrn in self.learners])[0])
            metrics.update(self._sync())
        else:
            metrics["actor/skipped_step"] = 1.0  # every group had equal rewards: nothing to learn from
            ray.get([lrn.skip_step.remote() for lrn in self.learners])
            metrics.update(self._sync())
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
        return {
            "eval/acc": _mean([s.acc for s in samples]),
            "eval/reward": _mean([s.reward for s in samples]),
            "eval/response_length": _mean([len(s.response_ids) for s in samples]),
        }

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
        """Stop this run's actors (the Ray instance itself stays up for whoever started it)."""
        import ray

        try:  # engines with subprocesses (vLLM) stop them first; a dead actor is no reason to fail
            ray.get([w.shutdown.remote() for w in self.rollout], timeout=60)
        except Exception as e:
            print(f"warning: rollout engine shutdown: {e}", file=sys.stderr)
        for actor in [*self.rollout, *self.rewards, *self.learners]:
            ray.kill(actor)
        if self._placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement)

    # ------------------------------------------------------------------ state
    def save(self) -> Path:
        import ray

        from rl.checkpointing import capture_rng_state, save_checkpoint

        state = ray.get(self.learner.state_dict.remote())
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

        if state.get("base_fingerprint") and state["base_fingerprint"] != self.base_fingerprint:
            raise RuntimeError("the checkpoint was trained on a different base (fingerprint mismatch)")
        ray.get([lrn.load_state_dict.remote(state["learner"]) for lrn in self.learners])
        self.step = state["step"]
        self.train_stream.load_state_dict(state["data"])
        restore_rng_state(state["rng"])

    def export(self, metrics: dict[str, float] | None = None) -> Path:
        """The final adapter in PEFT format (servable by vLLM / `rollout.serve`), with the base's
        fingerprint and config so a mismatched base is refused at load."""
        import ray

        from model.adapter import AdapterMetadata, save_adapter
        from model.config import ModelConfig
        from model.layers.lora import LoRAConfig

        update = ray.get(self.learner.adapter_update.remote())
        lc = self.cfg.lora
        if self.cfg.model.family == "hf":
            return self._export_hf(update.tensors, metrics)
        lora = LoRAConfig(r=lc.r, alpha=lc.alpha, dropout=lc.dropout, target_modules=list(lc.target_modules))
        meta = AdapterMetadata(
            base_fingerprint=self.base_fingerprint,
            base_config=ModelConfig.from_pretrained(self.base_dir).to_hf_dict(),
            base_dtype={"fp32": "float32", "bf16": "bfloat16"}[self.cfg.model.dtype],
            step=self.step,
            metrics={k: float(v) for k, v in (metrics or {}).items()},
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

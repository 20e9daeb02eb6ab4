"""The GRPO step loop (the driver): rollouts -> rewards -> advantages -> update -> adapter sync.

What: `Trainer(cfg)` builds the run (datasets, tracker, base, the actors of rl/topology.py), then
`fit` runs `trainer.total_steps` steps (`train_step`), with `evaluate`, tracking and checkpoints
(rl/resume.py) on their schedules, and ends with the adapter in `run_dir/adapter` (rl/run_adapter.py).
Every algorithmic decision (advantages, dynamic sampling, losses) is a function of rl/grpo.py.

Why one driver: what decides *what* to train on (prompt order, dynamic sampling, advantages, which
adapter version samples next) lives in one process, so a run is reproducible from (config, seed).
Invariants: every sample used in step s was generated with adapter version s (on-policy); a resumed
run continues exactly as an uninterrupted one (randomness derives from (seed, step)).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from common.data import skipped_row_metrics
from rl import grpo
from rl.config import TrainConfig, config_to_dict, save_config
from rl.faults import maybe_fail
from rl.replicas import fetch
from rl.resume import find_resume, kept_log_step, restore_run_state, resume_hint, save_run_state
from rl.rewards import reward_error_metrics
from rl.run_adapter import export_run_adapter
from rl.topology import Topology, TrainingAborted, prepare_base, start_ray
from rl.workers import Sample

# Mean |learner - engine| log-prob per sampled token above which a run is told why (see
# Trainer._check_logprob_agreement): same-computation runs measure ~1e-6; an fp32 model over a bf16
# KV cache without trainer.kv_sim measured 5e-3 (geo_vision before its recipe set kv_sim).
LOGPROB_WARN_ABS_DIFF = 1e-3


class Trainer:
    """One run: `fit()` then `close()` (`run(cfg)` does both). Start-up order is fixed (config
    written, datasets, resume state, tracker, base, actors, restore, first sync), so a resumed run
    draws the same numbers as an uninterrupted one."""

    def __init__(self, cfg: TrainConfig):

        from common.data import build_datasets
        from common.tokenizer import load_tokenizer
        from rl.tracking import Tracker

        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        self.train_stream, self.eval_prompts = build_datasets(
            cfg.data,
            seed=cfg.trainer.seed,
            batch_size=cfg.algo.batch_prompts,
            tokenizer=load_tokenizer(cfg.model.tokenizer),
        )
        self.step = 0
        resume_state = find_resume(cfg.resume, self.run_dir)
        self.tracker = Tracker(
            cfg.tracking, self.run_dir, config_to_dict(cfg),
            resume_run_id=(resume_state or {}).get("wandb_run_id"),
            resume_step=kept_log_step(cfg.resume, resume_state),
        )  # fmt: skip

        t0 = time.perf_counter()
        base = self.base_dir = prepare_base(cfg, self.run_dir)
        start_ray(cfg, log_to_driver=True)
        engine_base = base
        if cfg.model.family == "hf":
            # vLLM serves the dequantized twin: the learner's NVFP4 values as an ordinary checkpoint.
            from rl.hf_policy import prepare_hf_base

            engine_base = prepare_hf_base(base, self.run_dir / "base_vllm", cfg.model.dtype)
        self.topology = Topology(cfg, self.run_dir, base, engine_base)
        self.rollout = self.topology.rollout
        self._nonfinite_streak = 0
        self._warned_logprob_gap = False
        self._last_samples: list[Sample] = []
        if resume_state:
            restore_run_state(self, resume_state)
        self._sync()  # engines start with the learner's adapter (fresh: exact zero delta)
        self.startup_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ one step
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
        parts = [
            self.topology.get_with_restarts(w, "rollout", gen(i), first[i], True, self.step)
            for i, w in shards
        ]
        order = {p.uid: j for j, p in enumerate(prompts)}
        samples = sorted((s for part in parts for s in part), key=lambda s: order[s.uid])
        r = len(self.topology.rewards)
        chunks = [(i, samples[i::r]) for i in range(r) if samples[i::r]]

        def score(chunk: list):
            return lambda w: w.score.remote(chunk, self.step)

        first = {i: score(c)(self.topology.rewards[i]) for i, c in chunks}
        for i, c in chunks:
            samples[i::r] = self.topology.get_with_restarts(
                self.topology.rewards[i], "reward", score(c), first[i], False, self.step
            )
        return samples

    def train_step(self) -> dict[str, float]:
        import ray

        c, a = self.cfg, self.cfg.algo
        t0 = time.perf_counter()
        kept: list[Sample] = []
        generated: list[Sample] = []
        seen_groups, n_rounds = 0, 0
        while True:  # DAPO dynamic sampling: rounds of prompts until enough groups carry a gradient
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
            uids, rewards = [s.uid for s in samples], [s.reward for s in samples]
            seen_groups += len(set(uids))
            keep = grpo.keep_varied_groups(rewards, uids) if a.dynamic_sampling else [True] * len(samples)
            kept.extend(s for s, k in zip(samples, keep, strict=True) if k)
            kept_groups = len({s.uid for s in kept})
            if not a.dynamic_sampling or not grpo.needs_another_round(
                kept_groups, a.batch_prompts, n_rounds, a.max_regen_rounds
            ):
                break
        t_gen = time.perf_counter() - t0
        lengths = [s.num_model_tokens for s in generated]  # multi-turn: the model's tokens only
        clipped = sum(s.finish_reason == "length" for s in generated)
        metrics: dict[str, float] = {
            "reward/mean": _mean([s.reward for s in generated]),
            "acc/mean": _mean([s.acc for s in generated]),
            "response_length/mean": _mean(lengths),
            "response_length/clip_ratio": clipped / max(1, len(lengths)),
            "dynamic_sampling/kept_groups": float(len({s.uid for s in kept})),
            "dynamic_sampling/seen_groups": float(seen_groups),
            "dynamic_sampling/rounds": float(n_rounds),
            "timing_s/gen": t_gen,
        }
        metrics.update(self._spec_metrics())
        if c.rollout.multi_turn.enabled:
            metrics.update(multi_turn_metrics(generated, "multi_turn/"))
        kinds = [s.extra.get("reward_error_kind") for s in generated]
        metrics.update(reward_error_metrics([{"error": "", "error_kind": k} if k else {} for k in kinds]))
        metrics.update(skipped_row_metrics(getattr(self.train_stream, "skipped_rows", {})))
        # Drafter co-training (rollout worker 0) overlaps the learner's update: both read this
        # step's rollouts; the drafter learns the policy that generated them.
        is_cotrain = c.rollout.dspark.cotrain.enabled
        cotrain = self.rollout[0].cotrain_drafter.remote(generated) if is_cotrain else None
        learners = self.topology.learners
        if kept:
            advantages = grpo.sample_advantages([s.reward for s in kept], [s.uid for s in kept])
            for s, adv in zip(kept, advantages, strict=True):
                s.advantage = adv
            try:
                metrics.update(ray.get([lrn.timed_train_step.remote(kept) for lrn in learners])[0])
            except ray.exceptions.RayActorError as e:
                raise TrainingAborted(
                    f"the learner died during step {self.step + 1} ({type(e).__name__}); its optimizer state "
                    f"is gone, so the run stops: {resume_hint(self.run_dir)}"
                ) from None
            self._check_finite(metrics)
            self._check_logprob_agreement(metrics)
        else:
            metrics["actor/skipped_step"] = 1.0  # every group had equal rewards: nothing to learn from
            ray.get([lrn.skip_step.remote() for lrn in learners])
        metrics.update(self._sync())
        if cotrain is not None:
            spec, state, version = ray.get(cotrain)
            if state is not None:  # None: not a co-training round (rollout.dspark.cotrain.every)
                ray.get([w.set_drafter.remote(state, version) for w in self.rollout[1:]])
            metrics.update(spec)
        metrics.update(self.topology.fault_counts)
        metrics["timing_s/step"] = time.perf_counter() - t0
        metrics["perf/tokens_per_s"] = sum(lengths) / max(t_gen, 1e-9)
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
            "eval/response_length": _mean([s.num_model_tokens for s in samples]),
        }
        if c.rollout.multi_turn.enabled:
            out.update(multi_turn_metrics(samples, "eval/"))
        # eval's own speculation counters (kept out of the next training step's spec/accept_len)
        out.update({f"eval/{k.removeprefix('spec/')}": v for k, v in self._spec_metrics().items()})
        return out

    def _sync(self) -> dict[str, float]:
        t0 = time.perf_counter()
        update = self.topology.from_learners("adapter_update")
        engine_side = fetch([w.set_adapter.remote(update) for w in self.rollout])
        out = {"sync/bytes": float(update.nbytes), "sync/seconds": time.perf_counter() - t0,
               "sync/version": float(update.version)}  # fmt: skip
        loads = [e["seconds"] for e in engine_side if e and "seconds" in e]
        if loads:  # the engines' own load time (vLLM: building its LoRA weights), slowest replica
            out["sync/engine_load_seconds"] = max(loads)
        return out

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
            saved = save_run_state(self)
            raise TrainingAborted(
                f"{self._nonfinite_streak} consecutive steps had NaN/inf losses or gradients (last: step "
                f"{self.step}); stopped with a finite adapter saved in {saved}. Lower optim.lr (or clip "
                "harder: a smaller optim.grad_clip), check the data, then resume=auto"
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
                if c.rollout.multi_turn.enabled:  # the whole trajectory is the completion; its turns
                    for row, s in zip(rows, self._last_samples, strict=True):
                        row.update(
                            final_answer=s.score_text,
                            turns=s.extra.get("turns"),
                            tool_calls=s.extra.get("tool_calls"),
                            tool_errors=s.extra.get("tool_errors"),
                        )
                self.tracker.log_samples(self.step, rows)
            plot_rewards(self.run_dir / "metrics.jsonl", self.run_dir / "plots" / "reward.png")
            if c.trainer.save_every > 0 and self.step % c.trainer.save_every == 0:
                save_run_state(self)
            postfix = {
                "reward": f"{metrics['reward/mean']:.3f}",
                "tok_s": f"{metrics['perf/tokens_per_s']:.0f}",
            }
            if "eval/acc" in metrics:
                postfix["eval_acc"] = f"{metrics['eval/acc']:.3f}"
            if "eval/tool_call_success" in metrics:
                postfix["eval_tool_ok"] = f"{metrics['eval/tool_call_success']:.3f}"
            bar.set_postfix(postfix)
            bar.update(1)
            last = metrics
        bar.close()
        adapter_dir = export_run_adapter(
            c, self.run_dir, self.base_dir, self.topology.base_fingerprint, self.step,
            self.topology.from_learners("adapter_update").tensors, last,
        )  # fmt: skip
        self.tracker.log_artifact(adapter_dir, name=f"adapter-{self.cfg.recipe}", type="lora-adapter")
        self.tracker.log_image(self.step, "plots/reward", self.run_dir / "plots" / "reward.png")
        self.tracker.finish()
        return last

    def close(self) -> None:
        """Stop this run's actors (the Ray instance itself stays up for whoever started it) and close
        the tracker (idempotent: a finished run's tracker is already closed)."""
        tracker = getattr(self, "tracker", None)
        if tracker is not None:
            tracker.finish()
        topology = getattr(self, "topology", None)
        if topology is not None:
            topology.close()


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def multi_turn_metrics(samples: list[Sample], prefix: str) -> dict[str, float]:
    """Per-trajectory means of a multi-turn step (or eval): turns, tool calls, tool errors, tool
    seconds, tokens by role; sandbox timeouts in all; `tool_use` = share of trajectories that tried
    a call; `tool_call_success` = share of tried calls (parsed or malformed) that ran without error."""
    ex = [s.extra for s in samples]
    attempts = sum(e.get("tool_calls", 0) + e.get("tool_malformed", 0) for e in ex)
    errors = sum(e.get("tool_errors", 0) for e in ex)
    out = {f"{prefix}{k}": _mean([float(e.get(k, 0)) for e in ex])
           for k in ("turns", "tool_calls", "tool_errors", "tool_seconds")}  # fmt: skip
    out[f"{prefix}sandbox_timeouts"] = float(sum(e.get("sandbox_timeouts", 0) for e in ex))
    out[f"{prefix}tool_use"] = _mean(
        [float(e.get("tool_calls", 0) + e.get("tool_malformed", 0) > 0) for e in ex]
    )
    out[f"{prefix}tool_call_success"] = (attempts - errors) / attempts if attempts else 0.0
    out[f"{prefix}tokens_model"] = _mean([float(s.num_model_tokens) for s in samples])
    out[f"{prefix}tokens_env"] = _mean([float(len(s.response_ids) - s.num_model_tokens) for s in samples])
    return out


def run(cfg: TrainConfig) -> dict[str, float]:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    trainer = Trainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()

"""The three kinds of worker in a GRPO run, as plain classes (Ray actors wrap them; tests build them
directly): `RolloutWorker` (owns an engine), `RewardWorker` (scores completions), `Learner` (base +
LoRA, optimizer). Data between them travels as the typed `Sample` dataclass.

Invariants: the learner and every rollout worker load the *same* NVFP4 base directory and report
`base_fingerprint`, which the driver compares before step 0; after that only `AdapterUpdate`s
(rl/sync.py) move; each `Sample` records the adapter version that generated it, and
`RolloutWorker.generate` refuses to run with a version older than the one it was asked for.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model.checkpoint import base_fingerprint, load_model
from model.layers.lora import LoRAConfig, apply_lora, load_lora_state_dict, lora_state_dict
from rl import grpo
from rl.config import TrainConfig
from rl.faults import maybe_fail
from rl.sync import AdapterUpdate, make_update
from rl.tokenizer import load_tokenizer

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Sample:
    """One completion of one prompt, from rollout to loss."""

    uid: str  # prompt id (a GRPO group is all samples of one uid in one step)
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    adapter_version: int
    text: str = ""
    ground_truth: str = ""
    reward: float = 0.0
    acc: float = 0.0
    advantage: float = 0.0
    extra: dict = field(default_factory=dict)


def build_policy(cfg: TrainConfig, base_dir: str) -> torch.nn.Module:
    """Base (as stored: NVFP4 experts stay packed) + a fresh LoRA adapter, identical in every process.
    model.family=hf: the Hugging Face model at `base_dir`, NVFP4-quantized on load (rl/hf_policy.py)."""
    if cfg.model.family == "hf":
        from rl.hf_policy import build_hf_policy

        lc = cfg.lora
        return build_hf_policy(base_dir, cfg.model.dtype, lc.r, lc.alpha, lc.target_modules, cfg.trainer.seed)
    model = load_model(base_dir, device=cfg.trainer.device, dtype=_DTYPES[cfg.model.dtype])
    # The run's cache dtypes go into the model config, which both the engine's cache and the
    # learner's KV simulation (trainer.kv_sim) read: they cannot disagree.
    if cfg.rollout.kv_cache_dtype is not None:
        model.config.kv_cache_dtype = cfg.rollout.kv_cache_dtype
    if cfg.rollout.index_cache_dtype is not None:
        model.config.index_cache_dtype = cfg.rollout.index_cache_dtype
    lora = LoRAConfig(
        r=cfg.lora.r,
        alpha=cfg.lora.alpha,
        dropout=cfg.lora.dropout,
        target_modules=list(cfg.lora.target_modules),
    )
    return apply_lora(model, lora, seed=cfg.trainer.seed)


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's LoRA tensors (MiniMax: `lora_state_dict` names; hf: PEFT file names)."""
    return model.adapter_tensors() if hasattr(model, "adapter_tensors") else lora_state_dict(model)


def load_adapter_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    if hasattr(model, "load_adapter_tensors"):
        model.load_adapter_tensors(tensors)
    else:
        load_lora_state_dict(model, tensors)


def policy_fingerprint(model: torch.nn.Module) -> str:
    return model.fingerprint() if hasattr(model, "fingerprint") else base_fingerprint(model)


class RolloutWorker:
    """One engine replica: the native engine over the policy model, or vLLM (rollout.backend=vllm)
    over `base_dir`, which for model.family=hf is the dequantized twin of the learner's NVFP4 base."""

    def __init__(self, cfg: TrainConfig, base_dir: str, index: int = 0):
        torch.set_num_threads(max(1, cfg.rollout.torch_threads))
        self.cfg, self.index = cfg, index
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.version = 0
        if cfg.rollout.backend == "vllm":
            self._init_vllm(base_dir)
            return
        from rollout.native.engine import NativeEngine

        self.model = build_policy(cfg, base_dir).eval()
        self._fingerprint = base_fingerprint(self.model)
        ds = cfg.rollout.dspark
        self.drafter, self.cotrainer, spec = None, None, None
        if ds.drafter is not None:
            from rollout.dspark import SpecConfig, load_drafter

            self.drafter = load_drafter(
                ds.drafter, target=self.model, device=self.model.lm_head.weight.device
            )
            spec = SpecConfig(mode=ds.mode)
            if ds.cotrain and index == 0:  # worker 0 trains; the driver publishes to the others
                from rollout.dspark.cotrain import CoTrainer

                self.cotrainer = CoTrainer(self.model, self.drafter, lr=ds.cotrain_lr, steps=ds.cotrain_steps,
                                           seed=cfg.trainer.seed)  # fmt: skip
        self.engine = NativeEngine(
            self.model,
            max_pages=cfg.rollout.max_pages,
            max_batch_tokens=cfg.rollout.max_batch_tokens,
            max_num_seqs=cfg.rollout.max_num_seqs,
            drafter=self.drafter,
            spec=spec,
        )
        self._spec_seen = (0, 0)  # (verification passes, accepted drafts) already reported

    def _init_vllm(self, base_dir: str) -> None:
        from model.adapter import peft_target_modules
        from rollout.vllm_backend import VLLMEngine, VLLMSettings

        cfg, r = self.cfg, self.cfg.rollout
        if cfg.model.family == "hf":
            from rl.hf_policy import twin_fingerprint

            self._fingerprint = twin_fingerprint(base_dir)
            targets = tuple(cfg.lora.target_modules)
        else:  # vLLM serves the project's checkpoint (GPU builds with MiniMax-M3 support)
            self._fingerprint = base_fingerprint(load_model(base_dir, device="cpu"))
            targets = tuple(peft_target_modules(list(cfg.lora.target_modules)))
        kv = r.kv_cache_dtype if r.kv_cache_dtype not in (None, "fp32") else "auto"
        dtypes = {"fp32": "float32", "bf16": "bfloat16"}
        self.engine = VLLMEngine(VLLMSettings(
            model=base_dir, dtype=dtypes[r.vllm_dtype or cfg.model.dtype], max_model_len=r.max_model_len,
            lora_r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_targets=targets,
            max_lora_rank=max(32, cfg.lora.r), kv_cache_dtype=kv,
            gpu_memory_utilization=r.gpu_memory_utilization, tensor_parallel_size=r.tensor_parallel_size,
            max_num_seqs=r.max_num_seqs, seed=cfg.trainer.seed + self.index,
            drafter=str(Path(r.dspark.drafter) / "dspark") if r.dspark.drafter else None,
            sync=r.vllm_sync, eos_token_id=self.tokenizer.eos_token_id,
        ))  # fmt: skip

    def fingerprint(self) -> str:
        return self._fingerprint

    def set_adapter(self, update: AdapterUpdate) -> dict[str, float]:
        tensors = update.tensors
        if self.cfg.rollout.backend == "vllm" and self.cfg.model.family != "hf":
            from model.adapter import to_peft_tensors

            tensors = to_peft_tensors(tensors)
        self.engine.set_adapter(tensors, update.version)
        self.version = update.version
        return dict(getattr(self.engine, "last_sync", {}))

    def shutdown(self) -> None:
        """Stop engine subprocesses (vLLM) before the actor is killed."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def generate(
        self,
        prompts: list,
        n: int,
        temperature: float,
        top_p: float,
        seed: int,
        min_version: int = 0,
        positions: list[int] | None = None,
    ) -> list[Sample]:
        """n samples of each prompt. Seeds derive from (seed, prompt position in the whole step's
        batch: `positions`, default 0..), so a step's rollouts are the same whatever the worker count."""
        from rollout.engine import Request, SamplingParams

        maybe_fail(self.cfg.trainer.fault_injection, self.cfg.output_dir, "rollout.generate", min_version)
        if self.version < min_version:
            raise RuntimeError(
                f"rollout worker {self.index} holds adapter v{self.version} but v{min_version} was required: "
                "a sync was lost; refusing to sample with a stale adapter"
            )
        r = self.cfg.rollout
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p if temperature > 0 else 1.0,
            max_tokens=r.max_tokens,
            stop_token_ids=tuple(self.tokenizer.stop_token_ids),
        )
        requests, ids_by_req = [], []
        positions = list(range(len(prompts))) if positions is None else positions
        for i, p in zip(positions, prompts, strict=True):
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(p.messages))
            ids_by_req.append(ids)
            requests.append(
                Request(tuple(ids), params, n=n, seed=(seed * 1_000_003 + i) % 2**31, request_id=p.uid)
            )
        completions = self.engine.generate(requests)
        by_uid = {p.uid: p for p in prompts}
        samples = []
        for c in completions:
            p = by_uid[c.request_id]
            samples.append(
                Sample(
                    uid=p.uid,
                    prompt_ids=list(c.prompt_token_ids),
                    response_ids=list(c.token_ids),
                    rollout_logprobs=c.logprobs.tolist(),
                    finish_reason=c.finish_reason,
                    adapter_version=c.adapter_version,
                    text=self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                    ground_truth=p.ground_truth,
                )
            )
        return samples

    # ------------------------------------------------------------------ DSpark
    def spec_stats(self) -> dict[str, float]:
        """Verification passes and accepted drafts since the last call (this step's speculation)."""
        s = self.engine.stats()
        steps, acc = s.spec_steps - self._spec_seen[0], s.spec_accepted - self._spec_seen[1]
        self._spec_seen = (s.spec_steps, s.spec_accepted)
        return {"steps": float(steps), "accepted": float(acc)}

    def cotrain_drafter(self, samples: list[Sample]) -> tuple[dict[str, float], dict | None, int]:
        """Distil the drafter on this step's rollouts (worker 0 only); returns (metrics, the
        drafter's new weights for the other engines, drafter version)."""
        from rollout.dspark.cotrain import drafter_state

        seqs = [(s.prompt_ids + s.response_ids, len(s.prompt_ids)) for s in samples]
        metrics = self.cotrainer.update(seqs)
        return metrics, drafter_state(self.drafter), self.cotrainer.version

    def set_drafter(self, state: dict, version: int) -> None:
        from rollout.dspark.cotrain import load_drafter_state

        load_drafter_state(self.drafter, state)
        self.drafter_version = version

    def stats(self) -> dict:
        s = self.engine.stats()
        return {
            "tokens_generated": s.tokens_generated,
            "tokens_per_s": s.tokens_per_s,
            "preemptions": s.preemptions,
        }


class RewardWorker:
    """Scores completions in a pool of scorer processes with a per-sample timeout: a scorer that
    hangs or raises gives -1 for that sample only."""

    def __init__(self, cfg: TrainConfig, processes: int = 1):
        from rl.rewards import ScoringPool

        self.cfg = cfg
        self.pool = ScoringPool(num_workers=processes)

    def ping(self) -> bool:
        return True

    def score(self, samples: list[Sample], step: int = -1) -> list[Sample]:
        maybe_fail(self.cfg.trainer.fault_injection, self.cfg.output_dir, "reward.score", step)
        results = self.pool.score(
            [s.text for s in samples],
            [s.ground_truth for s in samples],
            timeout_s=self.cfg.reward.timeout_s,
            batch_timeout_s=self.cfg.reward.batch_timeout_s,
        )
        r = self.cfg.reward
        shaping = [0.0] * len(samples)
        if r.overlong_buffer > 0:
            lengths = torch.tensor([len(s.response_ids) for s in samples])
            shaping = grpo.overlong_penalty(
                lengths, self.cfg.rollout.max_tokens, r.overlong_buffer, r.overlong_penalty
            ).tolist()
        for s, res, extra in zip(samples, results, shaping, strict=True):
            s.acc = float(res["acc"])
            s.reward = float(res["score"]) + extra
            if "error" in res:
                s.extra["reward_error"] = res["error"]
                s.extra["reward_error_kind"] = res.get("error_kind", "exception")
        return samples


class Learner:
    """Policy + optimizer. With `world` > 1 learners form a data-parallel group (gloo on CPU, NCCL
    on GPUs; `init_group`): every learner receives the whole step's samples and trains on its shard
    of each mini-batch; the token-mean loss is normalised by the mini-batch's global token count and
    LoRA gradients are summed over the group before clipping, so every learner takes the identical
    optimizer step (same adapter everywhere, equal to one learner on the union batch up to float
    summation order)."""

    def __init__(self, cfg: TrainConfig, base_dir: str, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world
        torch.manual_seed(cfg.trainer.seed)
        torch.set_num_threads(max(1, cfg.trainer.torch_threads))
        self.cfg = cfg
        self.model = build_policy(cfg, base_dir)
        self.model.gradient_checkpointing = cfg.trainer.gradient_checkpointing
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay
        )
        warm = max(0, o.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0
        )
        self.version = 0

    def fingerprint(self) -> str:
        return policy_fingerprint(self.model)

    # ------------------------------------------------------------------ data-parallel group
    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a free port (called on rank 0) for the group's TCP rendezvous."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_group(self, addr: str, port: int) -> None:
        import torch.distributed as dist

        backend = "nccl" if self.cfg.trainer.device == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.world
        )

    def _all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def _all_reduce_grads(self) -> None:
        if self.world == 1:
            return
        flat = torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float() for p in self.params
        ])  # fmt: skip
        self._all_reduce_(flat)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
            offset += n

    def adapter_update(self) -> AdapterUpdate:
        return make_update(adapter_tensors(self.model), self.version)

    def _logprobs(self, batch: dict[str, torch.Tensor], with_entropy: bool):
        c = self.cfg
        return self.model.token_logprobs(
            batch["input_ids"], batch["targets"], seq_ids_BS=batch["seq_ids"], kv_sim=c.trainer.kv_sim,
            with_entropy=with_entropy, temperature=c.rollout.temperature,
        )  # fmt: skip

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """The policy update of one GRPO step (advantages already set): `algo.ppo_epochs` passes
        over `samples`, each split into mini-batches of `algo.mini_batch_prompts` groups (one
        optimizer step each; None = the whole batch). The "old" policy is the adapter the samples
        were generated with; with one epoch and one mini-batch it is the current one and the extra
        no-grad pass is skipped. Token-mean aggregation is over a mini-batch's response tokens,
        across its micro-batches. The adapter version advances once per call."""
        cfg, a = self.cfg, self.cfg.algo
        spec, out = cfg.trainer.fault_injection, cfg.output_dir
        maybe_fail(spec, out, "learner.train_step", self.version)
        poison = maybe_fail(spec, out, "learner.loss", self.version)
        self.model.train()
        uids = list(dict.fromkeys(s.uid for s in samples))
        per_mini = a.mini_batch_prompts or len(uids)
        mini_of = {u: i // per_mini for i, u in enumerate(uids)}
        minis = [[s for s in samples if mini_of[s.uid] == m] for m in range(-(-len(uids) // per_mini))]
        if self.world > 1:  # this learner's shard of every mini-batch (possibly empty)
            minis = [m[self.rank :: self.world] for m in minis]
        mb = max(1, cfg.trainer.micro_batch_size)
        batches = [[_collate(m[j : j + mb]) for j in range(0, len(m), mb)] for m in minis]
        on_policy = a.ppo_epochs == 1 and len(minis) == 1
        if not on_policy:
            with torch.no_grad():
                for mini in batches:
                    for batch in mini:
                        batch["old_logp"] = self._logprobs(batch, with_entropy=False)[0]
        sums: dict[str, float] = {}
        n_updates, nonfinite = a.ppo_epochs * len(batches), 0
        for _ in range(a.ppo_epochs):
            for mini in batches:
                self.optimizer.zero_grad(set_to_none=True)
                local_tokens = torch.tensor([sum(float(b["mask"].sum()) for b in mini)], dtype=torch.float64)
                total_tokens = float(self._all_reduce_(local_tokens))
                for batch in mini:
                    logp_BT, ent_BT = self._logprobs(batch, with_entropy=True)
                    mask = batch["mask"]
                    old_BT = logp_BT.detach() if on_policy else batch["old_logp"]
                    loss, metrics = grpo.policy_loss(
                        logp_BT, old_BT, batch["adv"], mask, a.eps_low, a.eps_high, a.loss_agg,
                        rollout_logp_BT=batch["rollout_logp"], tis_cap=a.tis_cap,
                    )  # fmt: skip
                    weight = float(mask.sum()) / max(1.0, total_tokens)
                    if poison:  # injected fault (rl/faults.py): a NaN loss, as overflow would give
                        loss = loss * float("nan")
                    (loss * weight).backward()
                    metrics = {**metrics, "actor/entropy": grpo.masked_mean(ent_BT.detach(), mask)}
                    for k, v in metrics.items():  # SYNC: metrics once per micro-batch
                        sums[k] = sums.get(k, 0.0) + float(v) * weight / n_updates
                self._all_reduce_grads()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.grad_clip)
                if math.isfinite(float(grad_norm)):
                    self.optimizer.step()
                else:  # NaN/inf loss or gradient: this update is skipped, the adapter stays finite
                    nonfinite += 1
                sums["actor/grad_norm"] = sums.get("actor/grad_norm", 0.0) + float(grad_norm) / n_updates
        if self.world > 1:  # token-weighted shares of the global means: summing them gives the means
            import torch.distributed as dist

            parts: list = [None] * self.world
            dist.all_gather_object(parts, sums)
            norm = sums.get("actor/grad_norm", 0.0)  # identical on every learner after the all-reduce
            sums = {k: sum(p.get(k, 0.0) for p in parts) for k in sorted({k for p in parts for k in p})}
            sums["actor/grad_norm"] = norm
        sums["actor/nonfinite_updates"] = float(nonfinite)
        self.scheduler.step()
        self.version += 1
        sums["actor/lr"] = self.scheduler.get_last_lr()[0]
        return sums

    def skip_step(self) -> None:
        """No usable groups this step: the adapter is unchanged but the version still advances, so
        rollout versions keep matching step numbers."""
        self.scheduler.step()
        self.version += 1

    # checkpoint state (the adapter and optimizer: the base never changes)
    def state_dict(self) -> dict:
        return {
            "adapter": {k: v.clone() for k, v in adapter_tensors(self.model).items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
        }

    def load_state_dict(self, state: dict) -> None:
        load_adapter_tensors(self.model, state["adapter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]

    def timed_train_step(self, samples: list[Sample]) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.train_step(samples)
        metrics["timing_s/update"] = time.perf_counter() - t0
        return metrics


def _collate(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] tensors: input = prompt + response[:-1], targets shifted by one,
    mask = 1 on response targets; padding gets seq id -1 so attention ignores it."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    T = max(len(x) for x in seqs) - 1
    B = len(samples)
    input_ids = torch.zeros(B, T, dtype=torch.long)
    targets = torch.zeros(B, T, dtype=torch.long)
    seq_ids = torch.full((B, T), -1, dtype=torch.long)
    mask = torch.zeros(B, T)
    adv = torch.zeros(B, T)
    rollout_logp = torch.zeros(B, T)
    for b, (s, full) in enumerate(zip(samples, seqs, strict=True)):
        n = len(full) - 1
        input_ids[b, :n] = torch.tensor(full[:-1])
        targets[b, :n] = torch.tensor(full[1:])
        seq_ids[b, :n] = 0
        p, r = len(s.prompt_ids), len(s.response_ids)
        mask[b, p - 1 : p - 1 + r] = 1.0
        adv[b, p - 1 : p - 1 + r] = s.advantage
        rollout_logp[b, p - 1 : p - 1 + r] = torch.tensor(s.rollout_logprobs)
    return {"input_ids": input_ids, "targets": targets, "seq_ids": seq_ids, "mask": mask, "adv": adv,
            "rollout_logp": rollout_logp}  # fmt: skip

"""The learner: the policy (NVFP4 base + LoRA) and its optimizer, one GRPO/DAPO update per step.

What: `Learner` (a Ray actor in a run; tests build it directly) turns a step's scored `Sample`s
(rl/workers.py) into mini-batches (`collate`), computes token log-probs with the KV simulation the
engine's cache implies, the policy loss (rl/grpo.py), and steps AdamW on the adapter only;
`adapter_update` hands the adapter to the driver for the rollout engines (rl/sync.py).

Why a module of its own: data-parallel learners and DEP (sharded experts and expert adapters) make
the learner the largest worker; the rollout and reward workers stay in rl/workers.py.

Invariants: only LoRA parameters have gradients; several learners take the identical optimizer step
(equal to one learner on the union batch up to float summation order); what leaves a learner group
(adapter, optimizer state, checkpoints) is in the single-process layout.
"""

from __future__ import annotations

import math
import time

import torch

from model.checkpoint import directory_fingerprint
from rl import grpo
from rl.config import TrainConfig
from rl.faults import maybe_fail
from rl.sync import AdapterUpdate, make_update
from rl.workers import (
    _DTYPES,
    Sample,
    adapter_tensors,
    build_policy,
    dep_expert_range,
    load_adapter_tensors,
    policy_fingerprint,
)


class Learner:
    """Policy + optimizer. With `world` > 1 learners form a data-parallel group (gloo on CPU, NCCL
    on GPUs; `init_group`): every learner receives the whole step's samples and trains on its shard
    of each mini-batch; the token-mean loss is normalised by the mini-batch's global token count and
    LoRA gradients are summed over the group before clipping, so every learner takes the identical
    optimizer step (same adapter everywhere, equal to one learner on the union batch up to float
    summation order).

    DEP (`trainer.learner_parallel=dep`, world > 1): `init_group` also shards the routed experts over
    the learners (`apply_expert_parallel`, after `apply_lora`; attention and everything else stay
    replicated), and with `lora.routed_experts` their adapters too: each learner holds, trains and
    keeps optimizer state for its experts' factors only. Those gradients are not all-reduced (the
    MoE backward all-to-all already brought every learner's tokens' gradient to the owner; with the
    global-token normalisation above they equal the union-batch gradient); clipping uses the global
    norm. Every forward is collective, so learners run equally many micro-batches (padded with empty
    ones). `adapter_update`, `state_dict` and `load_state_dict` are then collective too (call them on
    every learner): they gather / slice the sharded tensors, so what leaves the group is the
    single-process adapter and optimizer state (a DEP checkpoint resumes on any learner count)."""

    def __init__(self, cfg: TrainConfig, base_dir: str, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world
        self.base_dir = base_dir
        torch.manual_seed(cfg.trainer.seed)
        torch.set_num_threads(max(1, cfg.trainer.torch_threads))
        self.cfg = cfg
        self.is_dep = cfg.trainer.learner_parallel == "dep" and world > 1
        # DEP: only this learner's routed experts are read and allocated (a 248 GB base never has to
        # fit one device); `init_group` then wraps them in the expert-parallel MoE.
        expert_range = dep_expert_range(base_dir, rank, world) if self.is_dep else None
        self.model = build_policy(cfg, base_dir, expert_range)
        self.model.gradient_checkpointing = cfg.trainer.gradient_checkpointing
        self.ep_group = None  # DEP: the learners' expert-parallel group (set by init_group)
        self.shards: dict = {}  # DEP: adapter parameter name -> ExpertShard, for sharded expert factors
        self._fingerprint: str | None = None  # DEP: the whole base's, gathered over the group
        self._build_optimizer()
        self.version = 0

    @property
    def device(self) -> torch.device:
        """Where the policy's parameters live (trainer.device): batches are moved there."""
        return next(self.model.parameters()).device

    def _build_optimizer(self) -> None:
        """AdamW + warm-up schedule over the trainable (LoRA) parameters, in model order (which the
        single-process optimizer state layout, and so checkpoints, index by; DEP keeps names and
        order, only the sharded tensors' expert rows differ)."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        # DEP: optimizer index -> ExpertShard of the sharded expert-adapter parameters.
        self._sharded_index = {i: self.shards[n] for i, (n, _) in enumerate(named) if n in self.shards}
        o = self.cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay
        )
        warm = max(0, o.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0
        )

    def fingerprint(self) -> str:
        """The whole base's fingerprint (DEP: gathered over the group by `init_group`)."""
        return self._fingerprint or policy_fingerprint(self.model)

    def directory_fingerprint(self) -> str:
        """The loaded base directory's file-level identity, which a vLLM engine serving that directory
        reports (model.checkpoint.directory_fingerprint). Not re-verified: `load_model` checked the
        same files against their manifest when this learner loaded them."""
        return directory_fingerprint(self.base_dir, _DTYPES[self.cfg.model.dtype], verify=False)

    # ------------------------------------------------------------------ data-parallel group
    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a free port (called on rank 0) for the group's TCP rendezvous."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_group(self, addr: str | None = None, port: int | None = None) -> None:
        """Join the learners' torch.distributed world by TCP rendezvous at addr:port (a process that
        already belongs to a world of `self.world` ranks, e.g. under `launch_local`, keeps it), then,
        for DEP, shard the experts. Collective: every learner calls it, before any step."""
        import torch.distributed as dist

        if not dist.is_initialized():
            # GPU learners: NCCL for device tensors, gloo for the small host tensors (token counts,
            # metrics) that the step all-reduces.
            backend = "cpu:gloo,cuda:nccl" if self.cfg.trainer.device == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.world
            )
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world):
            raise RuntimeError(
                f"learner {self.rank}/{self.world} joined a world as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}: the rank and world given to Learner must match the group"
            )
        if self.is_dep:
            self._shard_experts()

    def _shard_experts(self) -> None:
        """DEP: experts (and expert adapters) of this learner's range only; a fresh optimizer over
        the sharded parameters (before any step, so nothing is lost)."""
        from model.parallel.dep_learner import sharded_adapter_params
        from model.parallel.expert_parallel import apply_expert_parallel
        from model.parallel.groups import ParallelGroups

        if self.version != 0:
            raise RuntimeError("DEP sharding must happen before the first step (in init_group)")
        groups = ParallelGroups.build(ep_size=self.world, device=self.cfg.trainer.device)
        self.ep_group = groups.ep_group
        apply_expert_parallel(self.model, self.ep_group, shard_lora=True)
        # Collective: the experts' row digests gathered over the group = the whole base's fingerprint.
        self._fingerprint = policy_fingerprint(self.model, group=self.ep_group)
        self.shards = sharded_adapter_params(self.model)
        self._build_optimizer()

    def _all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def _all_reduce_grads(self) -> None:
        """Sum the replicated parameters' gradients over the learners. DEP: sharded expert-adapter
        gradients stay where they are (already the union-batch gradient); a missing one becomes
        zeros, as those experts' rows of a single learner's [E, ...] gradient are, so AdamW steps
        (moments decay) exactly as it would there."""
        if self.world == 1:
            return
        for i in self._sharded_index:
            p = self.params[i]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        replicated = [p for i, p in enumerate(self.params) if i not in self._sharded_index]
        flat = torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float() for p in replicated
        ])  # fmt: skip
        self._all_reduce_(flat)
        offset = 0
        for p in replicated:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
            offset += n

    def adapter_update(self) -> AdapterUpdate:
        return make_update(self._adapter_tensors(), self.version)

    # ------------------------------------------------------------------ DEP helpers
    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The full adapter: with sharded expert factors, gathered from every learner (collective)."""
        tensors = adapter_tensors(self.model)
        if not self.shards:
            return tensors
        from model.parallel.dep_learner import gather_expert_shards

        return gather_expert_shards(tensors, self.shards)

    def _optimizer_state(self) -> dict:
        """The optimizer state in the single-process layout (collective with sharded factors)."""
        state = self.optimizer.state_dict()
        if not self._sharded_index:
            return state
        from model.parallel.dep_learner import gather_optimizer_state

        return gather_optimizer_state(state, self._sharded_index)

    def _local_state(self, adapter: dict, optimizer: dict) -> tuple[dict, dict]:
        """Single-process adapter and optimizer state -> this learner's shards of them."""
        if not self._sharded_index:
            return adapter, optimizer
        from model.parallel.dep_learner import slice_expert_shards, slice_optimizer_state

        local_optimizer = slice_optimizer_state(optimizer, self._sharded_index)
        return slice_expert_shards(adapter, self.shards), local_optimizer

    def _clip_grads(self, max_norm: float) -> torch.Tensor:
        """`clip_grad_norm_` over the group's parameters: with sharded expert factors the global norm
        (replicated gradients once, shards summed over learners), the same on every learner."""
        if not self._sharded_index:
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        from model.parallel.dep_learner import clip_grad_norm_

        sharded = [self.params[i] for i in sorted(self._sharded_index)]
        replicated = [p for i, p in enumerate(self.params) if i not in self._sharded_index]
        return clip_grad_norm_(replicated, sharded, max_norm, self.ep_group)

    def _align_micro_batches(self, batches: list[list[dict]]) -> list[list[dict]]:
        """DEP: every forward and backward is collective (the MoE all-to-alls), so every learner runs
        as many micro-batches per mini-batch as the busiest one; the others are padded with empty
        micro-batches (mask 0: no loss, gradient or metric weight). Otherwise `batches` as given."""
        if not self.is_dep:
            return batches
        import torch.distributed as dist

        counts = torch.tensor([len(m) for m in batches], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        # SYNC: the padded counts decide this host's loop (once per step, len(batches) ints).
        need = counts.tolist()
        return [m + [_empty_batch() for _ in range(n - len(m))] for m, n in zip(batches, need, strict=True)]

    def _logprobs(self, batch: dict, with_entropy: bool):
        c = self.cfg
        # Images (if any) are merged at their placeholders: the features the engine used.
        images = {"images": batch["images"]} if batch.get("images") else {}
        return self.model.token_logprobs(
            batch["input_ids"], batch["targets"], seq_ids_BS=batch["seq_ids"], kv_sim=c.trainer.kv_sim,
            with_entropy=with_entropy, temperature=c.rollout.temperature, **images,
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
        mini_of, n_minis = grpo.mini_batch_index([s.uid for s in samples], a.mini_batch_prompts)
        minis = [[s for s, m in zip(samples, mini_of, strict=True) if m == i] for i in range(n_minis)]
        if self.world > 1:  # this learner's shard of every mini-batch (possibly empty)
            minis = [m[self.rank :: self.world] for m in minis]
        mb = max(1, cfg.trainer.micro_batch_size)
        ignore = tuple(getattr(self.model, "vision_token_ids", ()))
        batches = [[collate(m[j : j + mb], ignore) for j in range(0, len(m), mb)] for m in minis]
        batches = self._align_micro_batches(batches)
        # Collated on the CPU; the model may live on a GPU (trainer.device). Images move in the tower.
        dev = self.device
        batches = [
            [{k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in mini]
            for mini in batches
        ]
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
                    weight = grpo.micro_batch_weight(float(mask.sum()), total_tokens)
                    if poison:  # injected fault (rl/faults.py): a NaN loss, as overflow would give
                        loss = loss * float("nan")
                    (loss * weight).backward()
                    metrics = {**metrics, "actor/entropy": grpo.masked_mean(ent_BT.detach(), mask)}
                    for k, v in metrics.items():  # SYNC: metrics once per micro-batch
                        sums[k] = sums.get(k, 0.0) + float(v) * weight / n_updates
                self._all_reduce_grads()
                grad_norm = self._clip_grads(cfg.optim.grad_clip)
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
        """On the CPU: the driver that checkpoints it may have no GPU (and must not hold GPU memory)."""
        return {
            "adapter": {k: v.detach().to("cpu", copy=True) for k, v in self._adapter_tensors().items()},
            "optimizer": _to_cpu(self._optimizer_state()),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
        }

    def load_state_dict(self, state: dict) -> None:
        adapter, optimizer = self._local_state(state["adapter"], state["optimizer"])
        load_adapter_tensors(self.model, adapter)
        self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]

    def timed_train_step(self, samples: list[Sample]) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.train_step(samples)
        metrics["timing_s/update"] = time.perf_counter() - t0
        return metrics


def _empty_batch() -> dict[str, torch.Tensor]:
    """One token of sequence 0 with mask 0: a micro-batch that only takes part in collectives."""
    ids = torch.zeros(1, 1, dtype=torch.long)
    zero = torch.zeros(1, 1)
    return {"input_ids": ids, "targets": ids.clone(), "seq_ids": ids.clone(), "mask": zero,
            "adv": zero.clone(), "rollout_logp": zero.clone()}  # fmt: skip


def _to_cpu(obj):
    """Tensors anywhere in nested dicts/lists moved to the CPU (optimizer state_dicts)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def collate(samples: list[Sample], ignore_ids: tuple[int, ...] = ()) -> dict:
    """Right-padded [B, T] tensors: input = prompt + response[:-1], targets shifted by one,
    mask = 1 on response targets the model sampled (`Sample.response_mask`: tool tokens of a multi-turn
    trajectory stay 0, so they get no loss and no count in token means); padding gets seq id -1. `ignore_ids`
    (image placeholders and brackets) are never targets, even in a response. "images" lists every
    sample's images in row order: the reading order of the batch's placeholders."""
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
        # Multi-turn: only the model's tokens are targets; the environment's stay at mask 0.
        mask[b, p - 1 : p - 1 + r] = (
            1.0 if s.response_mask is None else torch.tensor(s.response_mask, dtype=torch.float32)
        )
        adv[b, p - 1 : p - 1 + r] = s.advantage
        rollout_logp[b, p - 1 : p - 1 + r] = torch.tensor(s.rollout_logprobs)
    if ignore_ids:
        mask[torch.isin(targets, torch.tensor(ignore_ids, dtype=torch.long))] = 0.0
    images = [im for s in samples for im in s.images]
    return {"input_ids": input_ids, "targets": targets, "seq_ids": seq_ids, "mask": mask, "adv": adv,
            "rollout_logp": rollout_logp, "images": images}  # fmt: skip

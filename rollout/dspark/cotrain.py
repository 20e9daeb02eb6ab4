"""Online co-training of the DSpark drafter during RL (`rollout.dspark.cotrain.enabled=true`).

Why: GRPO moves the policy every step, so a drafter distilled from the step-0 policy loses
acceptance; verification stays lossless either way (docs/FACTS.md, "DSpark speculative decoding"),
so this is a speed matter. What: `CoTrainer.update(sequences)` computes the rollouts' features once,
logs held-out acceptance, keeps a replay buffer of the last `replay_steps` steps and every `every`
calls distils for `steps` steps; the driver publishes the drafter like an adapter.
Invariants: the target is only read; the drafter's embedding / lm_head stay the target's; the buffer
is bounded.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from rollout.dspark.cotrain_config import CoTrainConfig
from rollout.dspark.model import Drafter
from rollout.dspark.train import Features, build_features, distill_loss, estimate_accept_len, sample_anchors

# Design notes (moved from the module docstring)
# Why: GRPO changes the policy (its LoRA adapter) every step; a drafter distilled from the step-0
# policy predicts an ever older distribution and its acceptance decays. Verification stays lossless
# either way (docs/FACTS.md, "DSpark speculative decoding"), so this is purely a speed matter.
#
# What: `CoTrainer(target, drafter, CoTrainConfig(...), seed)` (rollout/dspark/cotrain_config.py)
# keeps one optimizer and a replay buffer.
# `update(sequences)`, once per policy step with that step's rollouts (prompt + completion ids,
# sampled by the policy the target holds right now):
# 1. one target pass over the rollouts gives the drafter's fused hidden states and the policy's
#    next-token distributions (rollout/dspark/train.py: `build_features`); exact for the policy
#    that sampled them, so they are computed once, here, and kept;
# 2. the drafter's teacher-forced accepted length on them is logged before any training on them
#    (held out: the decay signal, `spec/cotrain_accept_len_before`);
# 3. they join a buffer of the last `replay_steps` policy steps' features (older ones dropped);
# 4. every `every`-th call, `steps` distillation steps on batches drawn from the whole buffer, with
#    the offline loss (optionally `focus`-weighted towards the positions whose drafts verification
#    would reject), bump the version; the driver publishes the drafter's weights to every engine,
#    like adapters (`drafter_state` / `load_drafter_state`).
#
# Cost (why this shape): the features pass is the only per-step work (about as much as one
# learner forward over the rollouts, without backward); the drafter's own steps are few and run on
# rollout worker 0 while the learner updates. A bounded buffer lets rounds be rarer and smaller
# without starving the drafter of data, and a low learning rate keeps one round's noise from
# undoing what the drafter already knows.
#
# Invariants: the target is only read (no gradient reaches the policy or its adapter); the drafter's
# frozen embedding / lm_head stay the target's (bound, not copied); weights move as a plain state
# dict of the drafter's own parameters; the buffer holds at most `replay_steps` steps of at most
# `max_seqs_per_step` sequences each.
#
# Legend: B sequences, S length, X captured width (L target layers x D), D hidden.


def concat_features(parts: list[Features]) -> Features:
    """One padded Features of several steps' (their lengths differ: pad S to the longest)."""
    S = max(p.ids_BS.shape[1] for p in parts)

    def pad(t: torch.Tensor) -> torch.Tensor:  # right-pad dim 1 with zeros (past every length)
        if t.shape[1] == S:
            return t
        return torch.cat([t, t.new_zeros(t.shape[0], S - t.shape[1], *t.shape[2:])], dim=1)

    return Features(
        ids_BS=torch.cat([pad(p.ids_BS) for p in parts]),
        lens_B=torch.cat([p.lens_B for p in parts]),
        prompt_lens_B=torch.cat([p.prompt_lens_B for p in parts]),
        captured_BSX=torch.cat([pad(p.captured_BSX) for p in parts]),
        final_BSD=torch.cat([pad(p.final_BSD) for p in parts]),
    )


class CoTrainer:
    def __init__(
        self, target: torch.nn.Module, drafter: Drafter, cfg: CoTrainConfig | None = None, seed: int = 0
    ):
        """`seed`: the co-trainer's own draws (subsets, anchors, batches); a run passes trainer.seed."""
        self.target, self.drafter = target, drafter
        self.cfg = cfg or CoTrainConfig()
        self.gen = torch.Generator().manual_seed(seed)
        self.buffer: deque[Features] = deque(maxlen=self.cfg.replay_steps)
        self.opt: torch.optim.Optimizer | None = None
        self.calls = 0
        self.version = 0

    def update(self, sequences: list[tuple[list[int], int]]) -> dict[str, float]:
        """Take one policy step's rollouts ((token ids, prompt length) pairs); train if this is a
        round. Returns `spec/cotrain_*` metrics; `spec/drafter_version` moves only on rounds."""
        t0 = time.perf_counter()
        c = self.cfg
        self.calls += 1
        seqs = [(ids, p) for ids, p in sequences if len(ids) - p >= 2]  # an anchor needs a next token
        metrics = {"spec/cotrain_sequences": float(len(seqs)), "spec/drafter_version": float(self.version)}
        if seqs:
            if len(seqs) > c.max_seqs_per_step:
                keep = torch.randperm(len(seqs), generator=self.gen)[: c.max_seqs_per_step].tolist()
                seqs = [seqs[i] for i in sorted(keep)]
            self.target.eval()
            feats = build_features(
                self.target, seqs, self.drafter.config.target_layer_ids, self.drafter.dtype
            )
            metrics.update(self._held_out(feats))
            self.buffer.append(feats)
        metrics["spec/cotrain_features_seconds"] = time.perf_counter() - t0
        if self.buffer and self.calls % c.every == 0:
            metrics.update(self._train_round())
        metrics["spec/cotrain_seconds"] = time.perf_counter() - t0
        return metrics

    def _held_out(self, feats: Features) -> dict[str, float]:
        """Teacher-forced accepted length of the current drafter on rollouts it never trained on."""
        n = min(len(feats), self.cfg.eval_seqs)
        sub = feats.select(torch.arange(n, device=feats.ids_BS.device))
        self.drafter.eval()
        est = estimate_accept_len(self.drafter, sub, torch.Generator().manual_seed(self.calls))
        return {"spec/cotrain_accept_len_before": est["accept_len_sampled"],
                "spec/cotrain_accept_len_greedy_before": est["accept_len_greedy"]}  # fmt: skip

    def _train_round(self) -> dict[str, float]:
        c = self.cfg
        t0 = time.perf_counter()
        params = list(self.drafter.parameters())  # its own only: embedding/lm_head are bound, not owned
        if self.opt is None:
            self.opt = torch.optim.AdamW(params, lr=c.lr, betas=(0.9, 0.98))
        data = concat_features(list(self.buffer)) if len(self.buffer) > 1 else self.buffer[0]
        dev = data.ids_BS.device
        self.drafter.train()
        for p in params:
            p.requires_grad_(True)
        losses = []
        for _ in range(c.steps):
            idx = torch.randint(len(data), (min(c.batch_size, len(data)),), generator=self.gen).to(dev)
            batch = data.select(idx)
            anchors_BA, valid_BA = sample_anchors(batch, c.anchors_per_seq, self.gen)
            loss, _ = distill_loss(self.drafter, batch, anchors_BA, valid_BA, focus=c.focus)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            self.opt.step()
            losses.append(loss.detach())
        for p in params:
            p.requires_grad_(False)
        self.drafter.eval()
        self.version += 1
        self.drafter.config.metadata["cotrain_version"] = self.version
        return {
            "spec/cotrain_loss": float(torch.stack(losses).mean()),  # SYNC: once per round, for logging
            "spec/cotrain_buffer_sequences": float(len(data)),
            "spec/cotrain_train_seconds": time.perf_counter() - t0,
            "spec/drafter_version": float(self.version),
        }


def drafter_state(drafter: Drafter) -> dict[str, torch.Tensor]:
    """The drafter's own tensors (the target's shared embedding / lm_head are not among its
    parameters), CPU copies."""
    return {n: p.detach().to("cpu", copy=True) for n, p in drafter.named_parameters()}


@torch.no_grad()
def load_drafter_state(drafter: Drafter, state: dict[str, torch.Tensor]) -> None:
    """Copy published drafter weights in place (strict names and shapes)."""
    own = dict(drafter.named_parameters())
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise ValueError(f"drafter update has tensors this drafter lacks: {unknown[:3]}")
    for n, t in state.items():
        if own[n].shape != t.shape:
            raise ValueError(f"drafter update {n}: shape {tuple(t.shape)} != {tuple(own[n].shape)}")
        own[n].copy_(t.to(own[n].device, own[n].dtype))

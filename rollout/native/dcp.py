"""A decode-context-parallel (DCP) engine replica: W ranks share every sequence's KV pages.

What: every rank holds the whole model and serves all of the replica's requests but keeps only
block b % W == rank of each sequence's K/V and index keys (`DCPKVCache`); sparse layers merge local
top-k blocks and log-sum-exp partial outputs across ranks. Why: at long context the cache bounds the
batch and the step reads keys; W ranks divide both by W. Invariants: every rank makes the same calls
in the same order with the same seed, so all compute bit-identical logits and a single engine's
completions (`check_every` verifies it); DSpark is refused.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from model.kv_cache import KVDtype
from model.modeling import MiniMaxM3ForCausalLM
from model.parallel.context_parallel import DCPKVCache
from model.parallel.groups import group_size
from rollout.engine import Completion, Request
from rollout.native.engine import NativeEngine

# Design notes (moved from the module docstring)
# What: each rank of the replica's torch.distributed group (one process per rank: gloo on CPU, NCCL on
# GPUs) holds the whole model and serves ALL of the replica's requests, but keeps only its interleaved
# share of every sequence's K/V and index-key pages: block b on rank b % W
# (`model.parallel.context_parallel.DCPKVCache`). Every attention layer's engine step appends the
# tokens of the blocks it owns, selects blocks with `dcp_index_select_blocks` (local top-k, exchanged,
# merged exactly into the global top-k) and attends with `dcp_sparse_attention` (partial outputs merged
# by log-sum-exp); everything else (embeddings, MoE, lm_head, sampling) runs replicated.
#
# Why: at long context the KV cache bounds the batch and a decode step is bound by reading index keys
# and selected K/V. Spreading the pages over W GPUs divides both by W (a rank with M pages holds W x
# the context of an M-page single engine) for two small all-gathers per sparse layer (one per dense
# layer).
#
# How: `DCPEngine` is a `NativeEngine` over a `DCPKVCache`. A block-table entry (the scheduler's page)
# covers W * page_size tokens and names one local page on every rank, so the unchanged scheduler,
# with the same requests, makes the same decisions (admission, chunked prefill, preemption, prefix
# forks and their copy-on-write) on every rank, and page accounting per rank is the local share.
#
# Invariants: every rank calls `add_request` / `generate` / `step` / `set_adapter` in the same order
# with the same arguments and the same engine `seed`. Then every rank computes bit-identical logits
# (the merged attention output is computed from the same gathered partials on every rank) and so
# samples the same tokens from the same per-sequence random streams; its completions equal a single
# `NativeEngine`'s (tokens exactly, log-probs up to fp32 summation order). `check_every = n > 0`
# verifies that (a checksum of every sequence's tokens and log-probs, all-gathered every n steps and
# after `generate`; a mismatch raises on every rank at once). A world of 1 runs no collective.
# DSpark speculation is refused (its drafter cache and verify pass are single-rank).
#
# Host syncs: the engine's one per step, plus one per attention layer in the DCP ops (they size the
# gathered local keys), plus the checksum exchange when enabled.

__all__ = ["DCPEngine", "run_dcp_replica"]


class DCPEngine(NativeEngine):
    """One rank's view of a DCP replica over `group` (None = the world): a `NativeEngine` whose cache
    holds `max_pages` local pages of this rank's blocks. Collective methods: see the module doc."""

    def __init__(
        self,
        model: MiniMaxM3ForCausalLM,
        max_pages: int,
        group: dist.ProcessGroup | None = None,
        *,
        kv_dtype: KVDtype | None = None,
        index_dtype: KVDtype | None = None,
        check_every: int = 0,
        **engine_kwargs: Any,
    ):
        if check_every < 0:
            raise ValueError(f"check_every must be >= 0 (0 = never), got {check_every}")
        if engine_kwargs.get("drafter") is not None:  # also at world 1, where NativeEngine cannot tell
            raise ValueError(
                "DSpark speculation is not supported in a DCP replica yet (its drafter cache and verify "
                "pass are single-rank); build the DCPEngine without a drafter"
            )
        device = model.lm_head.weight.device
        cache = DCPKVCache(model.config, max_pages, group, device, dtype=kv_dtype, index_dtype=index_dtype)
        super().__init__(model, max_pages, cache=model.install_kv_scales(cache), **engine_kwargs)
        self.group = group
        self.rank, self.world = cache.layout.rank, cache.layout.world
        self.check_every = check_every
        self.num_checks = 0  # agreement checks run (diagnostics, tests)

    def step(self) -> list[Completion]:
        """Collective: one engine step (every rank runs the same chunks)."""
        finished = super().step()
        if self.check_every and self._stats.steps % self.check_every == 0:
            self.check_agreement(finished)
        return finished

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Collective: every sample of every request (the same list on every rank), request order."""
        done = super().generate(requests)
        if self.check_every:
            self.check_agreement(done)
        return done

    def check_agreement(self, finished: list[Completion]) -> None:
        """Collective: raise RuntimeError (on every rank) unless all ranks hold the same running
        sequences (tokens, log-probs, cached lengths) and the same `finished` completions."""
        self.num_checks += 1
        if group_size(self.group) == 1:
            return
        running = [(s.seq_id, s.num_computed, s.output, s.logprobs) for s in self.scheduler.running]
        done = [(c.request_id, c.sample_index, c.token_ids, c.logprobs.tolist()) for c in finished]
        crc = zlib.crc32(repr((running, done)).encode())  # floats' repr is exact: bitwise agreement
        digest = torch.tensor([crc], dtype=torch.long, device=self.device)
        digests = [torch.empty_like(digest) for _ in range(self.world)]
        dist.all_gather(digests, digest, group=self.group)
        values = [int(d) for d in digests]  # SYNC: debug check, off unless check_every > 0
        if len(set(values)) > 1:
            raise RuntimeError(
                f"DCP ranks diverged by step {self._stats.steps}: state checksums per rank {values}"
            )

    def kv_bytes_in_use(self) -> int:
        """Bytes of this rank's K/V and index-key pages that sequences hold now."""
        per_page = self.cache.total_bytes_per_token() * self.cache.page_size
        return self.scheduler.allocator.num_in_use * per_page


def run_dcp_replica(
    model: str | Callable[[], MiniMaxM3ForCausalLM],
    requests: list[Request],
    group: dist.ProcessGroup | None = None,
    max_pages: int = 64,
    **engine_kwargs: Any,
) -> list[Completion]:
    """Run inside an initialised process group (e.g. under model.parallel.groups.launch_local): build
    this rank's full model (a checkpoint directory loaded with model.checkpoint.load_model, or a
    factory returning the model, adapters applied), serve `requests` (the same list on every rank) as
    one DCP replica with `max_pages` local pages per rank and return every completion, request order."""
    if isinstance(model, str):
        from model.checkpoint import load_model

        net = load_model(model)
    else:
        net = model()
    return DCPEngine(net, max_pages, group, **engine_kwargs).generate(requests)

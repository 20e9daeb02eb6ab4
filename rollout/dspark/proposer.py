"""The engine's side of DSpark: drafter, its paged context store, the target pass that feeds it, and
the choice of how much to verify. The native engine owns the batch and the bookkeeping; this object
owns everything speculative that is not bookkeeping.

Per engine step: `draft(...)` (one batched drafter pass, a block of N tokens for every decoding
sequence), `choose(...)` (a prefix to verify per sequence, rollout/dspark/schedule.py), `forward(...)`
(prefill chunks and [anchor, drafts] of every sequence in ONE target pass that also writes the
drafter context of every token it ran), then the engine runs rollout.dspark.verify and rolls lengths
back. Invariant: rejected drafts' context entries are stale slots past the sequence's length,
exactly like their target KV.
"""

from __future__ import annotations

import torch

from model.kv_cache import KVCache
from rollout.dspark.cache import DraftCache, forward_cached_hidden, slots_of
from rollout.dspark.model import Draft, Drafter
from rollout.dspark.schedule import SpecConfig, StepCost, choose_num_verify, fit_step_cost, time_call

# Legend: B decoding sequences drafting this step, N block size, T tokens of the step, P pages.


class Proposer:
    def __init__(self, drafter: Drafter, spec: SpecConfig, target: torch.nn.Module, cache: KVCache):
        drafter.config.check_target(target.config)
        if drafter._shared is None or drafter._shared[1] is not target.lm_head:
            drafter.bind(target)
        self.drafter = drafter.eval()
        self.spec = spec
        self.target = target
        self.block_size = drafter.config.block_size
        self.num_verify = min(spec.num_verify or self.block_size, self.block_size)
        self.cache = DraftCache(drafter, cache.num_pages, cache.page_size, cache.kv[0].device)
        self.cost: StepCost | None = None  # target pass time vs tokens run
        self.draft_cost: StepCost | None = None  # drafter pass time vs sequences drafting

    # ------------------------------------------------------------------ target pass
    def forward(
        self,
        input_ids_T: torch.Tensor,
        positions_T: torch.Tensor,
        seq_idx_T: torch.Tensor,
        kv_cache: KVCache,
        block_tables_BP: torch.Tensor,
        seq_lens_B: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The target's logits for `logits_indices`; writes every token's drafter context."""
        logits, hidden_TX = forward_cached_hidden(
            self.target, self.drafter.config.target_layer_ids, input_ids_T, positions_T, seq_idx_T,
            kv_cache, block_tables_BP, seq_lens_B, logits_indices,
        )  # fmt: skip
        slots_T = slots_of(block_tables_BP, seq_idx_T, positions_T, self.cache.page_size)
        self.cache.write(slots_T, self.drafter.context_kv(hidden_TX, positions_T))
        return logits

    # ------------------------------------------------------------------ drafting
    def draft(self, seqs: list, block_tables_BP: torch.Tensor) -> Draft:
        """A block per decoding sequence (rollout.native.scheduler.Sequence): anchor = its last
        token, at position num_computed; context = its num_computed cached tokens."""
        dev = block_tables_BP.device
        lens = [s.num_computed for s in seqs]
        anchors_B = torch.tensor([s.output[-1] for s in seqs], dtype=torch.long, device=dev)
        temps_B = torch.tensor(
            [s.group.request.params.temperature for s in seqs], dtype=torch.float32, device=dev
        )
        return self._draft(anchors_B, lens, block_tables_BP, temps_B, [s.rng for s in seqs])

    def _draft(self, anchors_B, lens: list[int], block_tables_BP, temps_B, rngs) -> Draft:
        lens_B = torch.tensor(lens, dtype=torch.long, device=anchors_B.device)
        ctx_kv, valid_BS = self.cache.read(block_tables_BP, lens_B, max(lens))
        return self.drafter.draft(anchors_B, lens_B, ctx_kv, valid_BS, temps_B, rngs)

    def choose(self, draft: Draft, caps: list[int], base_tokens: int, extra_value: float) -> list[int]:
        """Drafts to verify per sequence, each <= caps[b] (fixed: the cap)."""
        if self.spec.mode == "fixed" or self.cost is None:
            return list(caps)
        caps_B = torch.tensor(caps, dtype=torch.long, device=draft.confidence_BN.device)
        fixed_s = self.cost(base_tokens) + self.draft_cost(len(caps))
        return choose_num_verify(draft.survival_BN, caps_B, fixed_s, self.cost.per_token_s, extra_value)

    # ------------------------------------------------------------------ profiling
    @torch.inference_mode()
    def profile(self, kv_cache: KVCache, max_seqs: int, max_batch_tokens: int) -> StepCost:
        """Time the target pass for a few batch sizes of [anchor + N drafts] sequences and one
        drafter pass, on scratch pages (the engine calls this while every page is free: whatever
        it writes is stale data no sequence reads)."""
        dev, N, page = self.cache.pages.device, self.num_verify, self.cache.page_size
        ctx = page - 1  # drafts straddle a page boundary, as they often do
        pages_per_seq = -(-(ctx + N + 1) // page)
        tokens, seconds, draft_B, draft_s = [], [], [], []
        for B in sorted({1, 4, 16, max_seqs}):
            if B > 1 and B * pages_per_seq > kv_cache.num_pages:
                continue
            table_BP = torch.arange(B * pages_per_seq, device=dev).view(B, pages_per_seq) % kv_cache.num_pages
            for k in (0, N):
                if B * (k + 1) > max(max_batch_tokens, N + 1):
                    continue
                T = B * (k + 1)
                pos_T = (ctx + torch.arange(k + 1, device=dev)).repeat(B)
                seq_T = torch.arange(B, device=dev).repeat_interleave(k + 1)
                ids_T = torch.randint(3, self.drafter.config.vocab_size, (T,), device=dev)
                lens_B = torch.full((B,), ctx + k + 1, dtype=torch.long, device=dev)
                rows = torch.arange(T, device=dev)
                tokens.append(T)
                args = (ids_T, pos_T, seq_T, kv_cache, table_BP, lens_B, rows)
                seconds.append(time_call(lambda a=args: self.forward(*a), self.spec.profile_repeats, dev))
            anchors_B = torch.randint(3, self.drafter.config.vocab_size, (B,), device=dev)
            temps_B = torch.zeros(B, device=dev)
            draft_B.append(B)
            draft_s.append(
                time_call(lambda a=(anchors_B, [ctx] * B, table_BP, temps_B, [None] * B): self._draft(*a),
                          self.spec.profile_repeats, dev)
            )  # fmt: skip
        self.cost = fit_step_cost(tokens, seconds)
        self.draft_cost = fit_step_cost(draft_B, draft_s)
        return self.cost

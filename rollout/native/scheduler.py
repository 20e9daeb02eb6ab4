"""Continuous-batching scheduler of the native engine: page allocation, chunked prefill, preemption by
recomputation, prompt-prefix sharing and parked multi-turn sequences. Pure Python bookkeeping, no model.

What: `Scheduler.schedule()` picks, under a token budget, the chunk each sequence runs this step
(one token when decoding, a prompt chunk when prefilling); pages of `page_size` (= the MSA block)
come from a reference-counted `PageAllocator`. Invariants: the oldest running sequence always
progresses (every request finishes if one sequence alone fits); a preempted sequence keeps its
tokens and RNG state, so its next draws are unchanged; a page with refcount > 1 is never written.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout.engine import Request

if TYPE_CHECKING:
    from rollout.native.images import RequestImages
    from rollout.native.sampler import CounterRNG


# Design notes (moved from the module docstring)
# What: every engine step `Scheduler.schedule()` picks, under a token budget, how many new tokens
# each sequence runs: one for a decoding sequence, a chunk of the remaining prompt (or of
# prompt + generated tokens after a preemption) for a prefilling one. A sequence whose chunk
# reaches the end of its tokens gets its next token sampled from the chunk's last logits.
#
# Pages: the KV cache is split into pages of `page_size` tokens (= the MSA block size); a
# sequence's block table lists its pages in position order. `PageAllocator` hands out page ids
# with reference counts so pages can be shared.
#
# Policy (vLLM-like, first come first served):
# - running sequences first, oldest first; if one cannot get the pages its tokens need, the
#   newest running sequence is preempted (pages freed, KV to be recomputed) until it fits. The
#   oldest sequence thus always progresses, so every request finishes as long as one sequence
#   alone fits in the cache (checked when requests are added).
# - then waiting sequences (preempted ones first) while budget, pages and `max_num_seqs` allow;
#   admitting never preempts.
# - a preempted sequence keeps its generated tokens, log-probs and RNG state: recomputing
#   prompt + generated tokens reproduces its cache, so its next draws are unchanged.
#
# Prefix sharing (GRPO groups): sample 0 of an n-sample request (the leader) prefills the prompt;
# when its prefill completes, `fork` gives each sibling the leader's full prompt pages (refcount
# +1, read-only forever: only positions >= prompt length are written again) and a private copy
# of the partially filled last page (copy-on-write, done eagerly at fork; the engine copies the
# page data). All siblings then sample their first token from the leader's last logits row. A
# sibling that finds no free page falls back to prefilling on its own.
#
# Prefix pages are keyed by adapter version: the engine forks with `share=False` when the adapter
# changed while the leader was prefilling, so siblings never start from stale KV.
#
# Multi-turn (parked sequences): a finished turn of a `park` request leaves the running list with its
# pages and cached length; the engine later extends its tokens (`Sequence.history`: every earlier turn
# plus the environment's tokens) and `resume` queues it, so only the uncached tokens (the last sampled
# token and the environment's) are prefilled. Parked and queued sequences' pages are the first to go
# when pages are short (`_evict_idle`, before any running sequence is preempted, and also to admit a
# waiting one): an evicted sequence recomputes its KV from its tokens, exactly like a preempted one.
#
# Invariant: a page with refcount > 1 is never written (checked in `_ensure_pages`).

TokenCallback = Callable[[int, int, float], None]  # (sample_index, token_id, logprob)


class PageAllocator:
    """Reference-counted page ids 0..num_pages-1."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self._free = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"cannot share free page {p}")
            self.refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"page {p} released more often than taken")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)


@dataclass
class Group:
    """The n samples of one request."""

    request: Request
    request_id: str
    added_t: float
    stop_token_ids: frozenset[int]
    on_token: TokenCallback | None = None
    sequences: list[Sequence] = field(default_factory=list)
    images: RequestImages | None = None  # the request's images and placeholder positions
    park: bool = False  # finished samples keep their pages for a next turn (NativeEngine.continue_sequence)


@dataclass
class Sequence:
    """One sample: its tokens, cache pages and RNG. tokens = prompt + output."""

    seq_id: int
    group: Group
    sample_index: int
    seed: int
    rng: CounterRNG | None  # None for greedy requests
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    adapter_versions: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    kv_version: int | None = None  # adapter version when the cached KV's prefill began
    pending_forks: list[Sequence] = field(default_factory=list)  # siblings sharing our prompt
    first_scheduled_t: float | None = None
    first_token_t: float | None = None
    spec_steps: int = 0  # speculative decoding: verification passes, drafts verified / accepted
    spec_drafted: int = 0
    spec_accepted: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Multi-turn: a continued sequence's tokens so far (every earlier turn and the environment's
    # tokens; None = the request's prompt) and this turn's token limit (None = the request's).
    history: tuple[int, ...] | None = None
    turn_max_tokens: int | None = None

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.group.request.prompt_token_ids if self.history is None else self.history

    @property
    def max_tokens(self) -> int:
        return self.group.request.params.max_tokens if self.turn_max_tokens is None else self.turn_max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, stop: int) -> list[int]:
        P = len(self.prompt)
        return [*self.prompt[start:stop], *self.output[max(start - P, 0) : max(stop - P, 0)]]


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_new: int  # tokens run this step, positions num_computed .. num_computed + num_new - 1

    @property
    def samples(self) -> bool:
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


class Scheduler:
    """Waiting queue + running list over one PageAllocator (policy in the module docstring)."""

    def __init__(self, num_pages: int, page_size: int, max_batch_tokens: int, max_num_seqs: int):
        if max_batch_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"need max_batch_tokens >= 1 and max_num_seqs >= 1, got "
                             f"{max_batch_tokens} and {max_num_seqs}")  # fmt: skip
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []  # finished turns keeping their pages (multi-turn), oldest first
        self.num_preemptions = 0
        self.num_shared_pages = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # ------------------------------------------------------------------ pages
    def _ensure_pages(self, seq: Sequence, upto: int) -> bool:
        """Give `seq` pages for positions < upto; False (nothing taken) if too few are free."""
        need = -(-upto // self.page_size) - len(seq.block_table)
        if need > self.allocator.num_free:
            return False
        if need > 0:
            seq.block_table += self.allocator.allocate(need)
        first_written = seq.num_computed // self.page_size
        if any(self.allocator.refcount[p] > 1 for p in seq.block_table[first_written:]):
            raise RuntimeError(f"sequence {seq.seq_id} would write a shared page")
        return True

    def reserve(self, seq: Sequence, upto: int) -> bool:
        """Pages for positions < upto beyond what `schedule` gave (speculative drafts); False
        (nothing taken) if too few are free. Never preempts: drafts are optional."""
        return self._ensure_pages(seq, upto)

    def rollback(self, seq: Sequence, num_computed: int) -> None:
        """Keep only the first `num_computed` cached tokens of `seq` (rejected drafts): its length
        shrinks and pages past the one holding position num_computed (the next token's slot) are
        released. The dropped slots are stale and get overwritten (model/kv_cache.py)."""
        if not 0 <= num_computed <= seq.num_computed:
            raise ValueError(f"rollback to {num_computed} outside [0, {seq.num_computed}]")
        seq.num_computed = num_computed
        keep = num_computed // self.page_size + 1
        if len(seq.block_table) > keep:
            self.allocator.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _release_pages(self, seq: Sequence) -> None:
        self.allocator.release(seq.block_table)
        seq.block_table = []

    def _drop_kv(self, seq: Sequence) -> None:
        """`seq` loses its pages: its KV is recomputed from its tokens when it runs again."""
        self._release_pages(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _preempt(self, seq: Sequence) -> None:
        self._drop_kv(seq)
        self.waiting.appendleft(seq)

    def free(self, seq: Sequence) -> None:
        """A finished sequence gives its pages back."""
        self._release_pages(seq)
        self.running.remove(seq)

    # ------------------------------------------------------------------ multi-turn
    def park(self, seq: Sequence) -> None:
        """A finished turn leaves the running list but keeps its pages (and num_computed) for the
        next turn. Parked pages are counted in use; `_evict_idle` takes them back when pages run short."""
        self.running.remove(seq)
        self.parked.append(seq)

    def resume(self, seq: Sequence) -> None:
        """A parked sequence (its tokens already extended by the caller) queues for its next turn,
        with whatever pages it still holds: only its uncached tokens run."""
        self.parked.remove(seq)
        self.waiting.append(seq)

    def release_parked(self, seq: Sequence) -> None:
        """The trajectory is over: a parked sequence gives its pages back."""
        self.parked.remove(seq)
        self._release_pages(seq)

    def _evict_idle(self, keep: Sequence) -> bool:
        """Free the pages of one sequence that is not running (newest parked first, then queued
        sequences that still hold pages), so a running or admitted one can proceed; its KV will be
        recomputed from its tokens (as a preemption's). False if there is none."""
        idle = [s for s in reversed(self.parked) if s.block_table and s is not keep]
        idle += [s for s in reversed(self.waiting) if s.block_table and s is not keep]
        if not idle:
            return False
        self._drop_kv(idle[0])
        return True

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks (running sequences first, then admitted ones), pages allocated."""
        budget = self.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            fits = self._ensure_pages(seq, seq.num_computed + n)
            while not fits and self._evict_idle(seq):  # idle (parked / queued) pages go first
                fits = self._ensure_pages(seq, seq.num_computed + n)
            while not fits:
                victim = self.running.pop()  # newest first
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                fits = self._ensure_pages(seq, seq.num_computed + n)
            if not fits:  # `seq` itself was the newest and got preempted
                break
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
            i += 1
        # A preemption means pages are short: admit nothing new this step.
        now = time.perf_counter()
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed, budget)
            fits = self._ensure_pages(seq, seq.num_computed + n)
            while not fits and self._evict_idle(seq):  # admitting takes idle pages, never running ones
                fits = self._ensure_pages(seq, seq.num_computed + n)
            if not fits:
                break
            self.waiting.popleft()
            self.running.append(seq)
            if seq.first_scheduled_t is None:
                seq.first_scheduled_t = now
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

    def fork(self, leader: Sequence, share: bool = True) -> tuple[list[Sequence], list[int], list[int]]:
        """Siblings of `leader` (whose prompt is now fully cached) take its prompt pages.

        Returns the forked siblings (now running, num_computed = prompt length) and the
        (src, dst) page lists the caller must copy in the KV cache; siblings that found no page,
        or all of them when `share` is False (stale KV), are queued to prefill on their own."""
        P = len(leader.prompt)
        n_full = P // self.page_size
        has_partial = P % self.page_size != 0
        forked, src, dst = [], [], []
        if not share:
            self.waiting.extend(leader.pending_forks)
            leader.pending_forks = []
            return forked, src, dst
        for sib in leader.pending_forks:
            no_page = has_partial and self.allocator.num_free == 0
            if no_page or len(self.running) >= self.max_num_seqs:
                self.waiting.append(sib)
                continue
            full = leader.block_table[:n_full]
            self.allocator.share(full)
            sib.block_table = list(full)
            self.num_shared_pages += n_full
            if has_partial:
                page = self.allocator.allocate(1)[0]
                sib.block_table.append(page)
                src.append(leader.block_table[n_full])
                dst.append(page)
            sib.num_computed = P
            sib.first_scheduled_t = leader.first_scheduled_t
            self.running.append(sib)
            forked.append(sib)
        leader.pending_forks = []
        return forked, src, dst

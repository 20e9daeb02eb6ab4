"""The native rollout engine: continuous batching over the model's paged KV cache.

What: `NativeEngine` implements rollout.engine.Engine for `MiniMaxM3ForCausalLM`; each `step()` is
scheduler (rollout/native/scheduler.py) -> model runner (rollout/native/runner.py: one copy into
persistent buffers, eager or a replayed CUDA graph) -> sampler (rollout/native/sampler.py), with
optional DSpark speculation and images. `generate` = add requests, step until done. Multi-turn:
requests added with `park=True` keep each finished sample's KV pages; `continue_sequence` appends
the environment's tokens and runs the next turn without re-prefilling the history; `release` ends it.
Invariants: the engine adds nothing to the model's numbers (fp32 log-probs equal
`model.token_logprobs`, NVFP4 caches equal `token_logprobs(kv_sim=True)`, whatever the batch);
adapters swap in place between steps and every token records the version it was sampled under;
one host sync per step (sampled ids and log-probs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from model.kv_cache import KVCache
from model.modeling import MiniMaxM3ForCausalLM
from model.vision.chat import check_placeholders
from model.vision.lora import has_projector_lora
from rollout.engine import Completion, EngineStats, Request
from rollout.native.images import ImageFeatureCache, RequestImages
from rollout.native.runner import ModelRunner, StepInputs
from rollout.native.sampler import CounterRNG
from rollout.native.scheduler import Group, ScheduledChunk, Scheduler, Sequence, TokenCallback

if TYPE_CHECKING:
    from rollout.dspark.model import Draft, Drafter
    from rollout.dspark.schedule import SpecConfig


# Design notes (moved from the module docstring)
# What: `NativeEngine` implements rollout.engine.Engine for `MiniMaxM3ForCausalLM`. Each `step()`
# is scheduler -> model runner -> sampler (nano-vllm's shape): the scheduler (rollout/native/
# scheduler.py) picks this step's chunks (prefill chunks of new or preempted sequences and one token
# per decoding sequence, under `max_batch_tokens`), `_plan` turns them into host lists, the runner
# (rollout/native/runner.py) copies those to its persistent device buffers in one copy and runs one
# `forward_cached` (all-decode steps padded to a bucket and, on CUDA, replayed as a captured graph
# that samples too: `cuda_graphs`, `static_decode`), then one token is sampled for every sequence
# whose chunk reached its end (rollout/native/sampler.py) and finished sequences retire. `generate` =
# add, step until done.
#
# Numerics: the engine adds nothing to the model's numbers: with an fp32 model and an fp32 cache
# its log-probs equal `model.token_logprobs` of the same tokens, with an NVFP4 cache they equal
# `token_logprobs(..., kv_sim=True)` (both tested), whatever the batch composition.
#
# Adapters: `set_adapter(tensors, version)` copies LoRA tensors into the model in place between
# steps: through model.layers.lora.load_lora_state_dict when the model carries LoRA adapters
# (apply_lora), else by exact base-parameter name (strict, for adapter-free models and tests).
# Sequences in flight keep the KV they computed under the old version and continue under the new
# one; every sampled token records the version it was sampled under.
# Prefix pages are keyed by adapter version: siblings share a leader's prompt pages only if the
# adapter did not change since the leader's prefill began; otherwise they prefill afresh.
#
# Speculative decoding (DSpark, optional: `drafter=`, `spec=`): every decoding sequence drafts a
# block (rollout/dspark/proposer.py); the step's one target pass runs [anchor, k drafts] for each of
# them beside the prefill chunks (drafts ride on top of `max_batch_tokens`, at most k per sequence,
# and take pages only if free: they never preempt); rollout/dspark/verify.py accepts a prefix
# losslessly and adds one target token; `Scheduler.rollback` shortens the sequence to the kept
# tokens and frees pages past the next slot. Target KV, index keys and the drafter's context are
# all per-token entries, so the kept prefix is exactly what a run without the rejected drafts
# wrote (tested, fp32 and NVFP4 caches). Log-probs are the target's; greedy output equals the
# plain engine's token for token.
#
# Images (models with a vision tower): a request's `images` are checked against its placeholder
# tokens at validation (model.vision.check_placeholders); their features are computed once per
# request, through a row-bounded LRU keyed by image content shared across requests
# (rollout/native/images.py), and each prefill chunk hands `forward_cached` the rows of its own
# placeholders, so a chunk may end inside an image; a request's rows are dropped once all its samples
# have cached their placeholders. Prompt-page sharing happens only between the
# samples of one request (same ids, same images); no page is ever shared across requests, so equal
# ids with different images never share KV. Image ids are banned from sampling (a truncation: the
# log-probs stay full-vocabulary, rollout/engine.py). DSpark speculation does not take images: a
# vision model with a drafter is refused.
#
# Async decode (`async_decode`, on with the static path): an all-decode padded step launches the next
# one before its own ids are read back (`_launch_ahead`: the next step's input ids are gathered on the
# device from the sampled buffer), so the read-back, the bookkeeping and the next staging overlap the
# device's pass. It runs only what `schedule` would run next (nothing queued, every running sequence
# in the step, a page each without preempting); a row whose sequence then stops on a token is dropped
# and its draw and cache slot undone; an adapter sync cancels the launched step; an abort drops its row.
#
# Host syncs: one per step (`# SYNC` below), to hand sampled ids (and log-probs, same copy) to the
# scheduler (with speculation: one for the accepted lengths, ids and log-probs together, and in
# scheduled mode one for the lengths to verify; the runner's staging may wait on its own copy of two
# stagings ago).
#
# Legend: T flattened tokens of the step, B sequences in the step (after the forward: rows being
# sampled), P block-table width, V vocab.


class NativeEngine:
    """Continuous-batching engine over `model` with a paged cache of `max_pages` pages.

    kv_dtype / index_dtype override the config's cache dtypes ("fp32", "bf16", "fp8", "nvfp4");
    `detokenize(token_ids) -> str` is needed only for stop strings; `seed` seeds the generator
    that draws seeds for requests that bring none. `drafter` (a bound or unbound
    rollout.dspark.Drafter) turns on DSpark speculation with `spec` settings (default: fixed,
    the drafter's block size); scheduled mode profiles the step cost once, here.
    `image_cache_rows` bounds the image feature cache (rows = image tokens) of a vision model.
    `cache` (instead of kv_dtype / index_dtype) serves a prebuilt cache with at least `max_pages`
    pages, e.g. a decode-context-parallel shard (rollout/native/dcp.py); the scheduler's page is
    its `table_page_size`. `cuda_graphs` (None = on for a CUDA model) captures the all-decode passes
    per batch bucket; `static_decode` runs those padded passes without capture (the CPU test of the
    captured path). Both keep one extra cache page as the padded rows' scratch page and are off with
    a drafter, a prebuilt cache or expert-parallel layers. `compile_decode` runs those passes through
    torch.compile (fewer, fused kernels; compiled once per engine, minutes on a GPU; implies static).
    `async_decode` (None = on with the static path) launches the next all-decode step before reading
    back the current one's tokens (`_Inflight`): the host's bookkeeping overlaps the device's pass.
    """

    def __init__(
        self,
        model: MiniMaxM3ForCausalLM,
        max_pages: int,
        max_batch_tokens: int = 512,
        max_num_seqs: int = 64,
        kv_dtype: str | None = None,
        index_dtype: str | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        seed: int = 0,
        drafter: Drafter | None = None,
        spec: SpecConfig | None = None,
        image_cache_rows: int = 8192,
        cache: KVCache | None = None,
        cuda_graphs: bool | None = None,
        static_decode: bool | None = None,
        compile_decode: bool = False,
        async_decode: bool | None = None,
    ):
        self.model = model
        self.config = model.config
        self.device = model.lm_head.weight.device
        # Static decode (and graphs) pad rows onto a scratch page: one page past the scheduler's.
        can_static = drafter is None and cache is None and not _has_expert_parallel(model)
        if cuda_graphs and not can_static:
            raise ValueError("cuda_graphs=True needs an engine without a drafter, a prebuilt (DCP) cache or "
                             "expert-parallel layers (their passes are not capture-safe yet)")  # fmt: skip
        use_graphs = (can_static and self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        use_static = use_graphs or bool(static_decode) or compile_decode
        if use_static and not can_static:
            raise ValueError("static_decode=True and compile_decode=True need an engine without a drafter, "
                             "a prebuilt cache or expert-parallel layers")  # fmt: skip
        if cache is None:
            n_pages = max_pages + 1 if use_static else max_pages
            cache = model.new_kv_cache(n_pages, dtype=kv_dtype, index_dtype=index_dtype)
        elif kv_dtype is not None or index_dtype is not None or cache.num_pages < max_pages:
            raise ValueError(
                f"a prebuilt cache sets its own dtypes (got {kv_dtype=}, {index_dtype=}) and needs at "
                f"least max_pages={max_pages} pages (has {cache.num_pages})"
            )
        self.cache = cache
        self.scheduler = Scheduler(max_pages, cache.table_page_size, max_batch_tokens, max_num_seqs)
        self.detokenize = detokenize
        self.adapter_version = 0
        self._seed_gen = torch.Generator().manual_seed(seed)
        self._next_seq_id = 0
        self._next_request = 0
        self._active: dict[str, int] = {}  # request id -> samples not finished yet
        self._groups: dict[str, Group] = {}  # request id -> its group, while in flight
        self._parked: dict[tuple[str, int], Sequence] = {}  # (request id, sample) -> a finished turn
        self._stats = EngineStats(pages_total=max_pages)
        vision = getattr(model, "vision", None)
        self.vision_config = vision.config if vision is not None else None
        self.images = ImageFeatureCache(vision, image_cache_rows) if vision is not None else None
        banned = getattr(model, "vision_token_ids", ())
        banned_ids = torch.tensor(banned, dtype=torch.long, device=self.device) if banned else None
        if vision is not None and drafter is not None:
            raise ValueError(
                "DSpark speculation does not support vision models yet (the drafter's target pass takes "
                "no image features); build the engine without a drafter"
            )
        self.proposer = None
        if drafter is not None and cache.table_page_size != cache.page_size:
            raise ValueError(
                "DSpark speculation does not support a decode-context-parallel cache yet (its drafter "
                "cache and verify pass are single-rank); build the engine without a drafter"
            )
        if drafter is not None:
            from rollout.dspark.proposer import Proposer
            from rollout.dspark.schedule import SpecConfig

            self.proposer = Proposer(drafter, spec or SpecConfig(), model, self.cache)
            if self.proposer.spec.mode == "scheduled":
                self.proposer.profile(self.cache, max_num_seqs, max_batch_tokens)
        elif spec is not None:
            raise ValueError("spec settings need a drafter: pass drafter=... (rollout.dspark.load_drafter)")
        if async_decode and not use_static:
            raise ValueError("async_decode=True launches padded (static) decode steps ahead: turn on "
                             "cuda_graphs, static_decode or compile_decode too")  # fmt: skip
        self.async_decode = use_static if async_decode is None else async_decode
        self._inflight: _Inflight | None = None  # a launched step whose tokens are not read back yet
        self.lookahead_steps = 0  # steps launched ahead of the previous one's read-back
        self.lookahead_discarded = 0  # their rows dropped: the sequence finished on a stop token
        self.readback_wait_s = 0.0  # host time spent waiting for launched steps' tokens (CUDA)
        scratch = max_pages if use_static else None  # the page past the scheduler's
        self.runner = ModelRunner(model, self.cache, max_num_seqs, static_decode=use_static,
                                  cuda_graphs=use_graphs, scratch_page=scratch,
                                  compile_decode=compile_decode, banned_ids=banned_ids)  # fmt: skip

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request, on_token: TokenCallback | None = None, park: bool = False) -> str:
        """Validate and queue one request (n sequences); returns its request id. `on_token(
        sample_index, token_id, logprob)` is called after every token sampled for it (streaming).
        `park`: each finished sample keeps its KV pages for a next turn (`continue_sequence`) until
        `release` (multi-turn rollouts)."""
        self.validate(request)
        cfg, p = self.config, request.params
        request_id = request.request_id or f"req-{self._next_request}"
        if request_id in self._active or any(k[0] == request_id for k in self._parked):
            raise ValueError(f"request_id {request_id!r} is already in flight")
        if park and (request.images or self.proposer is not None):
            raise ValueError("park=True (multi-turn) does not support images or DSpark speculation yet: "
                             "send a text request to an engine without a drafter")  # fmt: skip
        self._next_request += 1
        self._active[request_id] = request.n
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos and cfg.eos_token_id is not None:
            stop_ids.add(cfg.eos_token_id)
        group = Group(request, request_id, time.perf_counter(), frozenset(stop_ids), on_token, park=park)
        if request.images:
            group.images = RequestImages.of(
                request.prompt_token_ids, request.images, self.vision_config.image_token_id
            )
        self._groups[request_id] = group
        base_seed = request.seed
        if base_seed is None:
            base_seed = int(torch.randint(0, 2**62, (), generator=self._seed_gen))
        for i in range(request.n):
            rng = None if p.is_greedy else CounterRNG(base_seed + i)
            seq = Sequence(self._next_seq_id, group, i, base_seed + i, rng)
            self._next_seq_id += 1
            group.sequences.append(seq)
        leader, *siblings = group.sequences
        leader.pending_forks = siblings
        self.scheduler.add(leader)
        return request_id

    def validate(self, request: Request) -> None:
        """Raise ValueError if this engine cannot serve `request` (vocabulary, positions, cache)."""
        cfg, p = self.config, request.params
        ids = request.prompt_token_ids
        if min(ids) < 0 or max(ids) >= cfg.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size}), got min {min(ids)} "
                             f"max {max(ids)}")  # fmt: skip
        if len(ids) >= cfg.max_position_embeddings:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room to generate: the model has "
                             f"{cfg.max_position_embeddings} positions")  # fmt: skip
        if any(t >= cfg.vocab_size for t in p.stop_token_ids):
            raise ValueError(f"stop_token_ids {p.stop_token_ids} outside the vocabulary ({cfg.vocab_size})")
        if p.stop and self.detokenize is None:
            raise ValueError("stop strings need the engine to be built with a detokenize callable")
        if self.vision_config is not None:
            check_placeholders(ids, request.images, self.vision_config)  # ImageInputError: a ValueError
        elif request.images:
            raise ValueError(
                "the request has images but this model has no vision tower (its config has no "
                "vision_config); use a minimax_m3_vl checkpoint or the tiny-vl preset"
            )
        # The last sampled token is never run through the model, hence the - 1.
        longest = min(len(ids) + p.max_tokens, cfg.max_position_embeddings) - 1
        need = -(-longest // self.scheduler.page_size)
        if need > self.scheduler.allocator.num_pages:
            raise ValueError(f"a sequence of up to {longest} cached tokens needs {need} pages but the cache "
                             f"has {self.scheduler.allocator.num_pages}")  # fmt: skip

    def has_unfinished(self) -> bool:
        """Sequences queued or running (parked ones wait for `continue_sequence` and do not count)."""
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ multi-turn
    def continue_sequence(self, request_id: str, sample_index: int, append_ids: list[int] | tuple[int, ...],
                          max_tokens: int) -> None:  # fmt: skip
        """Extend a parked sample (a finished turn of a `park` request) by `append_ids` (the
        environment's tokens) and queue its next turn of up to `max_tokens` tokens, sampled with the
        request's other parameters and the sample's own generator (its draws continue). The KV of
        every earlier token is kept (unless pages ran short and it was evicted: then recomputed),
        so only the last sampled token and `append_ids` are prefilled. The turn's Completion holds
        the new turn's tokens only; its `prompt_token_ids` is the whole history before them."""
        s = self._parked.get((request_id, sample_index))
        if s is None:
            raise ValueError(f"no parked sample {sample_index} of request {request_id!r} (it is running, was "
                             "released, or its request was not added with park=True)")  # fmt: skip
        cfg = self.config
        ids = [int(t) for t in append_ids]
        if ids and (min(ids) < 0 or max(ids) >= cfg.vocab_size):
            raise ValueError(
                f"append_ids must be in [0, {cfg.vocab_size}), got min {min(ids)} max {max(ids)}"
            )
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        history = (*s.prompt, *s.output, *ids)
        longest = min(len(history) + max_tokens, cfg.max_position_embeddings) - 1
        if len(history) >= cfg.max_position_embeddings:
            raise ValueError(f"the history has {len(history)} tokens, no room left in the model's "
                             f"{cfg.max_position_embeddings} positions: end the trajectory")  # fmt: skip
        if -(-longest // self.scheduler.page_size) > self.scheduler.allocator.num_pages:
            raise ValueError(f"a sequence of up to {longest} cached tokens does not fit the cache's "
                             f"{self.scheduler.allocator.num_pages} pages: lower max_tokens")  # fmt: skip
        del self._parked[(request_id, sample_index)]
        s.history, s.turn_max_tokens = history, max_tokens
        s.output, s.logprobs, s.adapter_versions = [], [], []
        s.finish_reason = s.stop_reason = None
        s.first_token_t = None
        self._active[request_id] = self._active.get(request_id, 0) + 1
        self._groups[request_id] = s.group
        self.scheduler.resume(s)

    def release(self, request_id: str, sample_index: int) -> None:
        """End a parked sample's trajectory: its pages go back to the cache."""
        s = self._parked.pop((request_id, sample_index), None)
        if s is None:
            raise ValueError(f"no parked sample {sample_index} of request {request_id!r}")
        self.scheduler.release_parked(s)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Every sample of every request, ordered by request then sample index."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; finish the step() loop first")
        for r in requests:  # all or nothing: a bad request queues none
            self.validate(r)
        ids = [r.request_id for r in requests if r.request_id is not None]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique within one generate() call")
        order = {self.add_request(r): k for k, r in enumerate(requests)}
        done: list[Completion] = []
        while self.has_unfinished():
            done += self.step()
        return sorted(done, key=lambda c: (order[c.request_id], c.sample_index))

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[Completion]:
        """Run one batch; returns the completions that finished in it."""
        t0 = time.perf_counter()
        if self._inflight is not None:  # this step was launched by the previous one: read it back
            cur, self._inflight = self._inflight, None
            finished = self._advance(cur)
        else:
            finished = self._step_scheduled()
        self._stats.preemptions = self.scheduler.num_preemptions
        self._stats.shared_prefix_pages = self.scheduler.num_shared_pages
        self._stats.steps += 1
        self._stats.step_time_s += time.perf_counter() - t0
        return finished

    def _step_scheduled(self) -> list[Completion]:
        """A step the scheduler chose: schedule, plan, one pass, sample (or verify), update."""
        chunks = self.scheduler.schedule()
        if not chunks:
            raise RuntimeError("no sequence could be scheduled: the cache is too small for any of them")
        draft, spec_chunks, num_verify = self._draft(chunks) if self.proposer is not None else (None, [], [])
        if self.images is not None:  # features of every request whose chunk reaches a placeholder
            self.images.fill([ch.seq.group.images for ch in chunks if _chunk_has_images(ch)])
            self._stats.images_encoded, self._stats.image_cache_hits = self.images.encoded, self.images.hits
        inputs, sampled, forks = self._plan(chunks, spec_chunks, num_verify)
        views = self.runner.prepare(inputs)
        logits_RV = self.runner.run(views, inputs, draft, self.proposer)
        verified = dict(zip(map(id, spec_chunks), num_verify))
        for ch in chunks:
            ch.seq.num_computed += ch.num_new + verified.get(id(ch), 0)
        for src, dst in forks:  # copy-on-write of the leaders' last pages, written by this pass
            self.cache.copy_pages(src, dst)
            if self.proposer is not None:
                self.proposer.cache.copy_pages(src, dst)
        if self.images is not None:
            _release_image_features(chunks)
        if self.async_decode and "static_bs" in views:  # an all-decode padded step: pipeline from here
            return self._advance(self._read_back(sampled, *self.runner.sample(logits_RV, views, inputs)))
        finished = self._sample_and_update(logits_RV, views, inputs, sampled) if sampled else []
        if spec_chunks:
            finished += self._verify_and_update(logits_RV, views, draft, [ch.seq for ch in spec_chunks],
                                                num_verify)  # fmt: skip
        return finished

    # ------------------------------------------------------------------ async decode
    def _read_back(self, seqs: list[Sequence], tokens_B: torch.Tensor, logprobs_B: torch.Tensor) -> _Inflight:
        """Start copying a launched step's ids and log-probs to the host (one copy, not waited for)."""
        packed_2B = torch.stack([tokens_B.double(), logprobs_B.double()])
        event = None
        if packed_2B.is_cuda:
            host_2B = torch.empty(packed_2B.shape, dtype=torch.float64, pin_memory=True)
            host_2B.copy_(packed_2B, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host_2B = packed_2B
        return _Inflight(seqs, [True] * len(seqs), tokens_B, host_2B, event)

    def _advance(self, cur: _Inflight) -> list[Completion]:
        """Launch the step after `cur` if it is all-decode for sure, then read `cur` back and update."""
        nxt = self._launch_ahead(cur) if self.async_decode else None
        finished = self._resolve(cur, nxt)
        self._inflight = nxt if nxt is not None and any(nxt.live) else None
        return finished

    def _launch_ahead(self, cur: _Inflight) -> _Inflight | None:
        """The next step of `cur`'s sequences, launched before `cur`'s tokens are on the host: what
        `schedule` would run next, if nothing is queued, every running sequence was in `cur` and each
        gets its next page without preempting. Sequences that finish on length now are left out; one
        that turns out to stop on a token has its row dropped (`_resolve` undoes its draw and slot).
        None (the next step is scheduled as usual) otherwise."""
        sch = self.scheduler
        live = [(i, s) for i, (s, ok) in enumerate(zip(cur.seqs, cur.live)) if ok]
        same = len(sch.running) == len(live) and all(a is b for a, (_, b) in zip(sch.running, live))
        if sch.waiting or not same:
            return None
        max_pos = self.config.max_position_embeddings
        rows = [(i, s) for i, s in live if len(s.output) + 1 < s.max_tokens and s.num_computed + 1 < max_pos]
        if not rows or len(rows) > sch.max_batch_tokens or len(rows) > self.runner.buckets[-1]:
            return None
        if not all(sch.reserve(s, s.num_computed + 1) for _, s in rows):
            return None  # pages are short: the scheduler decides (it may preempt)
        seqs = [s for _, s in rows]
        n = len(seqs)
        inputs = StepInputs(
            [0] * n, [s.num_computed for s in seqs], list(range(n)), [s.block_table for s in seqs],
            [s.num_computed + 1 for s in seqs], list(range(n)), sample_src=list(range(n)),
            **_sampling_fields(seqs), extra_ints={"src": [i for i, _ in rows]}, is_decode=True,
        )  # fmt: skip
        views = self.runner.prepare_lookahead(inputs, cur.tokens_B)
        logits_RV = self.runner.run(views, inputs)
        for s in seqs:
            s.num_computed += 1
        self.lookahead_steps += 1
        return self._read_back(seqs, *self.runner.sample(logits_RV, views, inputs))

    def _resolve(self, cur: _Inflight, nxt: _Inflight | None) -> list[Completion]:
        """Read `cur`'s tokens back (the step's one host sync) and emit them; a sequence that finishes
        while `nxt` already runs its next token loses that row: its draw and its cache slot are undone,
        so it ends in the state a synchronous engine leaves (parked turns continue from it)."""
        if cur.event is not None:
            t0 = time.perf_counter()
            cur.event.synchronize()  # SYNC: the scheduler needs the ids (ids and log-probs in one copy)
            self.readback_wait_s += time.perf_counter() - t0
        tokens, logprobs = cur.host_2B.tolist()
        in_next = {id(s): j for j, s in enumerate(nxt.seqs)} if nxt is not None else {}
        now, finished = time.perf_counter(), []
        for s, ok, tok, lp in zip(cur.seqs, cur.live, tokens, logprobs):
            if not ok or not self._emit(s, int(tok), lp, now):
                continue
            j = in_next.get(id(s))
            if j is not None:
                nxt.live[j] = False
                self._undo_ahead(s)
            finished.append(self._finish(s, now))
        return finished

    def _cancel_ahead(self) -> None:
        """Drop the step launched ahead, as if it had not been: every row's draw and cache slot are
        undone (its writes land in slots the next step overwrites, in stream order)."""
        nxt, self._inflight = self._inflight, None
        if nxt is None:
            return
        for s, ok in zip(nxt.seqs, nxt.live):
            if ok:
                self._undo_ahead(s)

    def _undo_ahead(self, s: Sequence) -> None:
        """`s`'s row of the step launched ahead never happened: its draw and its cache slot go back."""
        if s.rng is not None:
            s.rng.draws -= 1
        self.scheduler.rollback(s, s.num_computed - 1)
        self.lookahead_discarded += 1

    def _plan(
        self, chunks: list[ScheduledChunk], spec_chunks: list[ScheduledChunk], num_verify: list[int]
    ) -> tuple[StepInputs, list[Sequence], list[tuple[list[int], list[int]]]]:
        """The step as host lists for the runner, the sequences sampled (forked siblings after their
        leader, sampling the leader's logits row) and the (src, dst) pages forks copy after the pass.
        Logits rows: one per sampling chunk, then k + 1 per speculating chunk (k drafts verified)."""
        verified = dict(zip(map(id, spec_chunks), num_verify))
        N = self.proposer.block_size if self.proposer is not None else 0
        ids, pos, seq_idx, tables, lens, sample_rows = [], [], [], [], [], []
        spec_rows, draft_at, draft_src, feature_parts, sampling = [], [], [], [], []
        for b, ch in enumerate(chunks):
            s = ch.seq
            k = verified.get(id(ch), 0)
            start, stop = s.num_computed, s.num_computed + ch.num_new
            first = len(ids)
            ids += s.token_slice(start, stop) + [0] * k  # drafts are scattered in on the device
            if s.group.images is not None:
                row_a, row_b = s.group.images.span(start, stop)
                if row_b > row_a:
                    feature_parts.append(s.group.images.features_NE[row_a:row_b])
            pos += range(start, stop + k)
            seq_idx += [b] * (ch.num_new + k)
            tables.append(s.block_table)
            lens.append(stop + k)
            if id(ch) in verified:
                spec_rows.append(list(range(len(ids) - k - 1, len(ids))))
                j = len(spec_rows) - 1  # draft row j belongs to speculating chunk j
                draft_at += range(first + 1, first + 1 + k)
                draft_src += [j * N + i for i in range(k)]  # flat index into draft.tokens_BN
            elif ch.samples:
                sample_rows.append(len(ids) - 1)
                sampling.append(s)
            if start == 0:
                s.kv_version = self.adapter_version
            is_decode = ch.num_new == 1 and bool(s.output)
            self._stats.prefill_tokens += 0 if is_decode else ch.num_new
        # Forks are page bookkeeping only (no model state): deciding them before the pass is what
        # deciding them after it was; the page copies wait for the pass (it writes the leader's page).
        sample_src, seqs, forks = [], [], []
        for r, seq in enumerate(sampling):
            sample_src.append(r)
            seqs.append(seq)
            if seq.pending_forks:
                fresh = seq.kv_version == self.adapter_version
                forked, src, dst = self.scheduler.fork(seq, share=fresh)
                if src:
                    forks.append((src, dst))
                sample_src += [r] * len(forked)
                seqs += forked
        inputs = StepInputs(
            ids, pos, seq_idx, tables, lens, sample_rows + [r for rows in spec_rows for r in rows],
            sample_src=sample_src, **_sampling_fields(seqs),
            image_features_NE=torch.cat(feature_parts) if feature_parts else None,
        )  # fmt: skip
        inputs.is_decode = (
            not spec_chunks and not feature_parts and len(seqs) == len(chunks)
            and all(ch.num_new == 1 and ch.samples and ch.seq.output for ch in chunks)
        )  # fmt: skip
        if spec_chunks:
            self._plan_verify(inputs, spec_chunks, num_verify, draft_at, draft_src, len(sample_rows))
        return inputs, seqs, forks

    @staticmethod
    def _plan_verify(inputs: StepInputs, spec_chunks: list[ScheduledChunk], num_verify: list[int],
                     draft_at: list[int], draft_src: list[int], first_row: int) -> None:  # fmt: skip
        """DSpark extras of a step: where drafted tokens go, the [B, K + 1] logits rows to verify (each
        request padded with its last row, ignored) and the speculating requests' sampling parameters."""
        K = max(num_verify)
        verify_rows, r = [], first_row
        for k in num_verify:
            verify_rows += [r + min(i, k) for i in range(K + 1)]
            r += k + 1
        vp = [ch.seq.group.request.params for ch in spec_chunks]
        inputs.extra_ints.update(verify_rows=verify_rows, num_verify=list(num_verify))
        if draft_at:
            inputs.extra_ints.update(draft_at=draft_at, draft_src=draft_src)
        inputs.extra_floats["verify_temperature"] = [p.temperature for p in vp]
        if any(p.top_k != 0 for p in vp):
            inputs.extra_ints["verify_top_k"] = [p.top_k for p in vp]
        if any(p.top_p != 1.0 for p in vp):
            inputs.extra_floats["verify_top_p"] = [p.top_p for p in vp]
        if any(p.min_p != 0.0 for p in vp):
            inputs.extra_floats["verify_min_p"] = [p.min_p for p in vp]

    # ------------------------------------------------------------------ speculation
    def _draft(self, chunks: list[ScheduledChunk]) -> tuple[Draft | None, list[ScheduledChunk], list[int]]:
        """Draft a block for every decoding sequence, choose how many drafts each verifies and get
        pages for them. Returns (draft, speculating chunks, drafts verified per chunk); draft row j
        belongs to speculating chunk j."""
        t0 = time.perf_counter()
        cands, caps = [], []
        max_pos = self.config.max_position_embeddings
        for ch in chunks:
            s = ch.seq
            if ch.num_new != 1 or not ch.samples or not s.output:
                continue  # prefill chunks and first tokens sample as usual
            # k drafts emit up to k + 1 tokens; the last position run is num_computed + k.
            cap = min(self.proposer.num_verify, s.max_tokens - len(s.output) - 1,
                      max_pos - 1 - s.num_computed)  # fmt: skip
            if cap > 0:
                cands.append(ch)
                caps.append(cap)
        if not cands:
            return None, [], []
        seqs = [ch.seq for ch in cands]
        width = max(len(s.block_table) for s in seqs)
        table = [p for s in seqs for p in (*s.block_table, *(0,) * (width - len(s.block_table)))]
        table_BP = self.runner.stage("draft", {"table": table}, shapes={"table": (len(seqs), width)})["table"]
        draft = self.proposer.draft(seqs, table_BP)
        base_tokens = sum(ch.num_new for ch in chunks)
        extra_value = sum(1 for ch in chunks if ch.samples)
        num_verify = self.proposer.choose(draft, caps, base_tokens, extra_value)
        for j, s in enumerate(seqs):  # drafts are optional: verify fewer if pages are short
            k = num_verify[j]
            while k > 0 and not self.scheduler.reserve(s, s.num_computed + 1 + k):
                k = min(k - 1, len(s.block_table) * self.scheduler.page_size - s.num_computed - 1)
            num_verify[j] = max(k, 0)
        self._stats.draft_time_s += time.perf_counter() - t0
        return draft, cands, num_verify

    def _verify_and_update(self, logits_RV: torch.Tensor, views: dict[str, torch.Tensor], draft: Draft,
                           seqs: list[Sequence], num_verify: list[int]) -> list[Completion]:  # fmt: skip
        """Accept drafts losslessly (rollout/dspark/verify.py), roll back the rejected ones' cache
        entries, emit the accepted tokens plus one from the target."""
        from rollout.dspark.verify import verify

        K = max(num_verify)
        logits_BK1V = logits_RV[views["verify_rows"].view(len(seqs), K + 1)]
        res = verify(
            logits_BK1V,
            draft.tokens_BN[:, :K],
            None if draft.probs_BNV is None else draft.probs_BNV[:, :K],
            views["num_verify"],
            views["verify_temperature"],
            [s.rng for s in seqs],
            top_k_B=views.get("verify_top_k"),
            top_p_B=views.get("verify_top_p"),
            min_p_B=views.get("verify_min_p"),
        )
        # SYNC: the scheduler needs the accepted lengths and the ids (one copy for all three).
        packed_B = torch.cat(
            [res.num_accepted_B[:, None].double(), res.tokens_BK1.double(), res.logprobs_BK1.double()], dim=1
        ).tolist()
        now, finished = time.perf_counter(), []
        st = self._stats
        for s, k, row in zip(seqs, num_verify, packed_B):
            m, toks, lps = int(row[0]), row[1 : K + 2], row[K + 2 :]
            # Ran anchor + k drafts; keep anchor + m accepted (the new token is not cached yet).
            self.scheduler.rollback(s, s.num_computed - k + m)
            s.spec_steps += 1
            s.spec_drafted += k
            s.spec_accepted += m
            st.spec_steps, st.spec_drafted, st.spec_accepted = (
                st.spec_steps + 1,
                st.spec_drafted + k,
                st.spec_accepted + m,
            )
            for tok, lp in zip(toks[: m + 1], lps[: m + 1]):
                if self._emit(s, int(tok), lp, now):
                    finished.append(self._finish(s, now))
                    break
        return finished

    # ------------------------------------------------------------------ sampling
    def _sample_and_update(self, logits_RV: torch.Tensor, views: dict[str, torch.Tensor], inputs: StepInputs,
                           seqs: list[Sequence]) -> list[Completion]:  # fmt: skip
        tokens_B, logprobs_B = self.runner.sample(logits_RV, views, inputs)
        # SYNC: the scheduler needs the ids (ids and log-probs in one copy; int64 ids < 2^53 are exact).
        tokens, logprobs = torch.stack([tokens_B.double(), logprobs_B.double()]).tolist()
        now = time.perf_counter()
        return [
            self._finish(s, now)
            for s, tok, lp in zip(seqs, tokens, logprobs)
            if self._emit(s, int(tok), lp, now)
        ]

    def _emit(self, s: Sequence, tok: int, lp: float, now: float) -> bool:
        """Append one sampled token to `s`; True if it finished the sequence."""
        s.output.append(tok)
        s.logprobs.append(lp)
        s.adapter_versions.append(self.adapter_version)
        if s.first_token_t is None:
            s.first_token_t = now
        self._stats.tokens_generated += 1
        if s.group.on_token is not None:
            s.group.on_token(s.sample_index, tok, lp)
        return self._check_finished(s, tok)

    def _finish(self, s: Sequence, now: float) -> Completion:
        if s.group.park:  # keeps its pages for the next turn (continue_sequence / release)
            self.scheduler.park(s)
            self._parked[(s.group.request_id, s.sample_index)] = s
        else:
            self.scheduler.free(s)
        self._active[s.group.request_id] -= 1
        if not self._active[s.group.request_id]:
            del self._active[s.group.request_id]
            del self._groups[s.group.request_id]
            if s.group.images is not None:
                s.group.images.features_NE = None  # the cache may keep them; the request does not
        return self._completion(s, now)

    def _check_finished(self, s: Sequence, token: int) -> bool:
        p = s.group.request.params
        if token in s.group.stop_token_ids:
            s.finish_reason, s.stop_reason = "stop", token
        elif p.stop and any(st in (text := self.detokenize(s.output)) for st in p.stop):
            s.finish_reason, s.stop_reason = "stop", next(st for st in p.stop if st in text)
        elif len(s.output) >= s.max_tokens or s.num_tokens >= self.config.max_position_embeddings:
            s.finish_reason = "length"
        return s.finish_reason is not None

    def _completion(self, s: Sequence, now: float) -> Completion:
        g = s.group
        return Completion(
            request_id=g.request_id,
            sample_index=s.sample_index,
            prompt_token_ids=tuple(s.prompt),
            token_ids=list(s.output),
            logprobs=torch.tensor(s.logprobs, dtype=torch.float32),
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            adapter_versions=list(s.adapter_versions),
            seed=s.seed,
            num_preemptions=s.num_preemptions,
            queue_s=(s.first_scheduled_t or now) - g.added_t,
            ttft_s=(s.first_token_t or now) - g.added_t,
            e2e_s=now - g.added_t,
            spec_drafted=s.spec_drafted,
            spec_accepted=s.spec_accepted,
            spec_steps=s.spec_steps,
        )

    # ------------------------------------------------------------------ adapters, stats
    @torch.no_grad()
    def set_adapter(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy adapter tensors into the model in place (no re-allocation); later tokens record
        `version`. Call between steps."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"adapter version must be an int, got {version!r}")
        self._cancel_ahead()  # the next step runs under the new adapter, as without async decode
        if any("lora_" in name for name, _ in self.model.named_parameters()):
            # Adapters injected by model.layers.lora.apply_lora: its strict loader (every adapter
            # tensor, exact names and shapes) copies into them in place.
            from model.layers.lora import load_lora_state_dict

            load_lora_state_dict(self.model, tensors)
        else:
            _copy_named_parameters(self.model, tensors)
        if self.images is not None and has_projector_lora(self.model.vision):
            self.images.clear()  # features depend on the adapter: recompute them
            for g in self._groups.values():
                if g.images is not None:
                    g.images.features_NE = None
        self.adapter_version = version
        self._stats.adapter_version = version

    def stats(self) -> EngineStats:
        s = self._stats
        s.pages_in_use = self.scheduler.allocator.num_in_use
        return EngineStats(**vars(s))

    def abort(self, request_id: str, sample_index: int | None = None) -> int:
        """Drop the unfinished samples of `request_id` (only `sample_index` if given): they leave
        the scheduler, their pages are freed and no Completion is returned for them. Call between
        steps (a server whose client left, or whose sample hit a stop string it matches itself).
        Returns how many samples were dropped (0: not in flight)."""
        group = self._groups.get(request_id)
        if group is None:
            return 0
        dropped = 0
        for s in group.sequences:
            if s.finish_reason is not None or (sample_index is not None and s.sample_index != sample_index):
                continue
            s.finish_reason = "abort"
            if self._inflight is not None and s in self._inflight.seqs:  # its launched row is dropped
                self._inflight.live[self._inflight.seqs.index(s)] = False
            if s in self.scheduler.running:
                self.scheduler.free(s)
            elif s in self.scheduler.waiting:
                self.scheduler.waiting.remove(s)
                self.scheduler.allocator.release(s.block_table)
                s.block_table = []
            for leader in group.sequences:  # a sibling not forked yet is in its leader's list
                if s in leader.pending_forks:
                    leader.pending_forks.remove(s)
            self.scheduler.waiting.extend(x for x in s.pending_forks if x.finish_reason is None)
            s.pending_forks = []  # siblings of a dropped leader prefill on their own
            dropped += 1
        self._active[request_id] -= dropped
        if not self._active[request_id]:
            del self._active[request_id], self._groups[request_id]
            if group.images is not None:
                group.images.features_NE = None
        return dropped


def _sampling_fields(seqs: list[Sequence]) -> dict:
    """Per-row sampling inputs of a step (`StepInputs` fields) for the sampled sequences, in row order."""
    params = [s.group.request.params for s in seqs]
    return dict(rngs=[s.rng for s in seqs], temperature=[p.temperature for p in params],
                top_k=[p.top_k for p in params], top_p=[p.top_p for p in params],
                min_p=[p.min_p for p in params])  # fmt: skip


def _has_expert_parallel(model: torch.nn.Module) -> bool:
    from model.parallel.expert_parallel import ExpertParallelMoE

    return any(isinstance(m, ExpertParallelMoE) for m in model.modules())


def _chunk_has_images(ch: ScheduledChunk) -> bool:
    im = ch.seq.group.images
    if im is None:
        return False
    a, b = im.span(ch.seq.num_computed, ch.seq.num_computed + ch.num_new)
    return b > a


def _release_image_features(chunks: list[ScheduledChunk]) -> None:
    """Drop a request's feature rows once every live sample has cached all its placeholders (the
    leader prefilled and the siblings forked): held features scale with the requests in prefill,
    not in flight. A preempted sample that recomputes them gets them again from the cache."""
    for ch in chunks:
        im = ch.seq.group.images
        if im is None or im.features_NE is None:
            continue
        last = im.positions[-1]
        if all(s.num_computed > last for s in ch.seq.group.sequences if s.finish_reason is None):
            im.features_NE = None


def _copy_named_parameters(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Strict in-place copy by parameter name: every name must exist with the same shape (all
    checked before anything is written, so a bad adapter leaves the model untouched)."""
    params = dict(model.named_parameters())
    unknown = sorted(k for k in tensors if k not in params)
    if unknown:
        raise ValueError(f"adapter tensors with no matching model parameter: {unknown[:5]}")
    bad = [
        (k, tuple(v.shape), tuple(params[k].shape)) for k, v in tensors.items() if v.shape != params[k].shape
    ]
    if bad:
        raise ValueError(f"adapter tensor shapes differ from the model's (name, got, expected): {bad[:5]}")
    for k, v in tensors.items():
        params[k].copy_(v)


@dataclass
class _Inflight:
    """A launched step whose sampled ids are still being copied to the host: row i samples `seqs[i]`
    unless `live[i]` was cleared (it finished or was aborted after the launch). `tokens_B` stays on
    the device for the step launched after it (it reads its input ids from there)."""

    seqs: list[Sequence]
    live: list[bool]
    tokens_B: torch.Tensor
    host_2B: torch.Tensor
    event: torch.cuda.Event | None

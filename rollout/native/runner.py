"""The native engine's model runner: persistent step buffers, one host-to-device copy, eager or graphs.

What: `ModelRunner.prepare(inputs)` packs one step (token ids, positions, sequence rows, block tables,
context lengths, logits rows, per-row sampling parameters, speculative extras) into one pinned host
buffer and moves it with ONE copy into a persistent device buffer; the step's tensors are views of it.
`run` executes the model pass (`forward_cached`, or DSpark's target pass); `sample` draws through
rollout/native/sampler.py. All-decode steps may run "static": padded to a batch bucket on fixed-address
buffers (the path CUDA graphs capture and replay; on CPU the same code runs eagerly). Padded rows take
token 0 at position 0 of a reserved scratch page (length 1): they write and read only that page, and
only the first bs rows are read back. The static pass samples too (`sampler.sample_with_keys`, banned
ids applied, no truncation): `prepare` draws each row's key from its `CounterRNG` into the staged
buffers, so a graph-replayed decode step is one copy in, one replay, one copy of tokens and log-probs
out. Steps with a top-k / top-p / min-p row re-sample the pass's logits eagerly with the same keys (the
in-pass draw is discarded). Every path draws one key per sampled row and step, so seeds reproduce.
Legend: T tokens, B sequences, P block-table width, R logits rows, V vocab, W captured table width.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from model.kv_cache import KVCache, static_shapes
from rollout.native import sampler
from rollout.native.sampler import CounterRNG

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_TABLE_WIDTH = 8  # pages: short sequences share one capture instead of re-capturing at 1, 2, 4 pages
_ALIGN = 8  # bytes: every packed field starts 8-byte aligned so any dtype view is legal
_NP = {torch.int64: np.int64, torch.float32: np.float32}
_ITEMSIZE = {torch.int64: 8, torch.float32: 4}
_TRUNCATION = ("top_k_B", "top_p_B", "min_p_B")


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Padded batch sizes of static decode steps: powers of two below max_num_seqs, then it (<= 256)."""
    top = min(max_num_seqs, BATCH_BUCKETS[-1])
    return (*(b for b in BATCH_BUCKETS if b < top), top)


@dataclass
class StepInputs:
    """One step as host lists (the scheduler's decisions), before `prepare`. Sampled rows index the
    logits rows (`sample_src`: forks repeat their leader's row); per-sample parameters align with it."""

    token_ids: list[int]
    positions: list[int]
    seq_idx: list[int]
    block_tables: list[list[int]]
    seq_lens: list[int]
    logits_rows: list[int]
    sample_src: list[int] = field(default_factory=list)
    rngs: list[CounterRNG | None] = field(default_factory=list)  # None: greedy; one draw per step
    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)
    extra_ints: dict[str, list[int]] = field(default_factory=dict)  # e.g. DSpark draft / verify rows
    extra_floats: dict[str, list[float]] = field(default_factory=dict)
    image_features_NE: torch.Tensor | None = None
    is_decode: bool = False  # every chunk one token that samples, no images, no forks, no drafts


class _Staging:
    """A growable device buffer filled from a ring of two pinned host buffers by one copy per call.
    The ring (with an event per slot) keeps a host slot from being rewritten while its copy may still
    be in flight: steps without sampling have no host sync of their own."""

    def __init__(self, device: torch.device, fixed_bytes: int | None = None):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.fixed = fixed_bytes is not None  # fixed: the device buffer never moves (graph addresses)
        self.dev = torch.zeros(fixed_bytes or 0, dtype=torch.uint8, device=device)
        self.hosts: list[torch.Tensor | None] = [None, None]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.slot = 0

    def _host(self, nbytes: int) -> torch.Tensor:
        self.slot ^= 1
        ev = self.events[self.slot]
        if ev is not None:
            ev.synchronize()  # SYNC: only waits for the copy of two stagings ago (normally long done)
        h = self.hosts[self.slot]
        if h is None or h.numel() < nbytes:
            h = torch.zeros(max(nbytes, 2 * (0 if h is None else h.numel())), dtype=torch.uint8,
                            pin_memory=self.is_cuda)  # fmt: skip
            self.hosts[self.slot] = h
        return h

    @staticmethod
    def offsets(fields: list[tuple[str, torch.dtype, list, tuple[int, ...]]]) -> tuple[list[int], int]:
        """Byte offset of each field and the total size (every field starts `_ALIGN`-aligned)."""
        offsets, off = [], 0
        for _, dtype, values, _ in fields:
            offsets.append(off)
            off += -(-len(values) * _ITEMSIZE[dtype] // _ALIGN) * _ALIGN
        return offsets, max(off, _ALIGN)

    def stage(self, fields: list[tuple[str, torch.dtype, list, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """fields: (name, dtype, flat values, shape) -> device views by name, after one copy."""
        offsets, total = self.offsets(fields)
        host = self._host(total)
        host_np = host.numpy()
        for (_, dtype, values, _), o in zip(fields, offsets):
            if values:
                host_np[o : o + len(values) * _ITEMSIZE[dtype]].view(_NP[dtype])[:] = values
        if self.dev.numel() < total:
            if self.fixed:
                raise RuntimeError(f"static buffer of {self.dev.numel()} B cannot hold {total} B")
            self.dev = torch.empty(2 * total, dtype=torch.uint8, device=self.device)
        if self.is_cuda:
            self.dev[:total].copy_(host[:total], non_blocking=True)
            ev = self.events[self.slot] or torch.cuda.Event()
            ev.record()
            self.events[self.slot] = ev
        else:
            self.dev[:total].copy_(host[:total])
        return {
            name: self.dev[o : o + len(values) * _ITEMSIZE[dtype]].view(dtype).view(shape)
            for (name, dtype, values, shape), o in zip(fields, offsets)
        }


class ModelRunner:
    """Persistent buffers + the model pass of one engine (module docstring).

    `static_decode`: run all-decode steps padded to `batch_buckets(max_num_seqs)` on fixed buffers;
    `cuda_graphs`: capture those static passes (CUDA only; implies static_decode). `scratch_page`: a
    cache page no sequence owns (padded rows write it); required for the static path. `banned_ids`:
    token ids never sampled (a vision model's image ids), int64 on the model's device."""

    def __init__(self, model, cache: KVCache, max_num_seqs: int, *, static_decode: bool = False,
                 cuda_graphs: bool = False, scratch_page: int | None = None,
                 compile_decode: bool = False, banned_ids: torch.Tensor | None = None):  # fmt: skip
        self.model, self.cache = model, cache
        self.banned_ids = banned_ids
        self.device = model.lm_head.weight.device
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA model, this one is on {self.device}")
        self.cuda_graphs = cuda_graphs
        self.static_decode = static_decode or cuda_graphs
        if self.static_decode and scratch_page is None:
            raise ValueError("static decode needs a scratch page for the padded rows")
        self.scratch_page = scratch_page
        self.buckets = batch_buckets(max_num_seqs)
        self._eager = _Staging(self.device)
        self._aux: dict[str, _Staging] = {}
        self._width = 0  # W: block-table width of the static buffers (0 = not built)
        self._static: _Staging | None = None
        self._static_views: dict[str, torch.Tensor] = {}
        # bucket -> (graph, its outputs: logits [bs, V], tokens [bs], log-probs [bs])
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.num_captures = 0  # times the bucket graphs were (re)captured
        self.graph_error: str | None = None  # why capture failed (graphs then off), None if it did not
        self.static_steps = 0  # steps that ran the static path (eager or replayed)
        self.sampled_in_pass = 0  # static steps whose tokens came out of the pass (no truncation)
        # torch.compile of the static pass (before capture): Inductor fuses the per-layer small ops
        # (norms, RoPE, router math, residual adds) into few kernels; batch is marked dynamic so one
        # compilation serves every bucket above 1. A failure turns compilation off (logged once).
        self.compile_decode = compile_decode and self.static_decode
        self.compile_error: str | None = None
        self._decode_fn = self.model.forward_cached
        if self.compile_decode:
            # Dynamo specializes the code after each graph break per layer (each reads its own cache
            # tensors) and per engine (cache shapes): ~5 entries x layers x 2 (batch 1 and dynamic)
            # per engine. Below that limit Dynamo would silently stop compiling.
            dc = torch._dynamo.config
            dc.recompile_limit = max(dc.recompile_limit, 1024)
            dc.accumulated_recompile_limit = max(dc.accumulated_recompile_limit, 8192)
            self._decode_fn = torch.compile(self.model.forward_cached, fullgraph=False)

    # ------------------------------------------------------------------ staging
    def stage(self, key: str, ints: dict[str, list[int]], floats: dict[str, list[float]] | None = None,
              shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
        """One copy of named int64 / fp32 host lists into the device buffer of `key` (its own buffer,
        so views of another key stay valid) -> device views by name (`shapes` reshapes some)."""
        shapes = shapes or {}
        fields = [(k, torch.int64, v, shapes.get(k, (len(v),))) for k, v in ints.items()]
        fields += [(k, torch.float32, v, shapes.get(k, (len(v),))) for k, v in (floats or {}).items()]
        if key not in self._aux:
            self._aux[key] = _Staging(self.device)
        return self._aux[key].stage(fields)

    def can_run_static(self, inputs: StepInputs) -> bool:
        return self.static_decode and inputs.is_decode and len(inputs.seq_lens) <= self.buckets[-1]

    def prepare(self, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """The step's device tensors (views of persistent buffers), after one host-to-device copy."""
        if self.can_run_static(inputs):
            return self._prepare_static(inputs)
        B = len(inputs.block_tables)
        P = max(len(t) for t in inputs.block_tables)
        table = [p for t in inputs.block_tables for p in (*t, *(0,) * (P - len(t)))]
        ints = {"ids": inputs.token_ids, "pos": inputs.positions, "seq": inputs.seq_idx,
                "lens": inputs.seq_lens, "rows": inputs.logits_rows, "table": table,
                "sample_src": inputs.sample_src, **_truncation_ints(inputs), **inputs.extra_ints}  # fmt: skip
        floats = {"temperature": inputs.temperature, **_truncation_floats(inputs), **inputs.extra_floats}
        fields = [(k, torch.int64, v, (B, P) if k == "table" else (len(v),)) for k, v in ints.items()]
        fields += [(k, torch.float32, v, (len(v),)) for k, v in floats.items()]
        return self._eager.stage(fields)

    # ------------------------------------------------------------------ model pass
    def run(
        self, views: dict[str, torch.Tensor], inputs: StepInputs, draft=None, proposer=None
    ) -> torch.Tensor:
        """fp32 logits [R, V] of the step's logits rows (static steps: the first bs rows). With a DSpark
        `proposer` its target pass runs (it also writes the drafter's context)."""
        if "static_bs" in views:
            return self._run_static(views, len(inputs.seq_lens))
        ids_T = views["ids"]
        if "draft_at" in views:  # drafted tokens are on the device already: scatter them in
            ids_T[views["draft_at"]] = draft.tokens_BN.reshape(-1)[views["draft_src"]]
        args = (ids_T, views["pos"], views["seq"], self.cache, views["table"], views["lens"])
        if proposer is not None:
            return proposer.forward(*args, logits_indices=views["rows"])
        return self.model.forward_cached(*args, logits_indices=views["rows"],
                                         image_features_NE=inputs.image_features_NE)  # fmt: skip

    def sample(self, logits_RV: torch.Tensor, views: dict[str, torch.Tensor],
               inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(tokens_B, logprobs_B) of the sampled rows, on the device (the caller syncs once). Image ids
        (`banned_ids`) are never drawn; the log-prob stays over the full vocabulary, as for truncation,
        which is what the learner recomputes."""
        if "tokens_B" in views:  # sampled inside the static pass
            return views["tokens_B"], views["logprobs_B"]
        logits_BV = logits_RV[views["sample_src"]] if "sample_src" in views else logits_RV
        trunc = {k: views.get(k) for k in _TRUNCATION}
        if "keys" in views:  # a static step with truncation: its keys were drawn in `prepare`
            return sampler.sample_with_keys(logits_BV, views["temperature"], views["keys"], **trunc,
                                            banned_ids=self.banned_ids)  # fmt: skip
        temperature_B = views["temperature"]
        return sampler.sample(logits_BV, temperature_B, inputs.rngs, **trunc, banned_ids=self.banned_ids)

    # ------------------------------------------------------------------ static decode
    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _ensure_width(self, need: int) -> None:
        """Static buffers (and graphs) for block tables of >= `need` pages; growing re-captures."""
        if need <= self._width:
            return
        W = max(MIN_TABLE_WIDTH, 1 << max(need - 1, 0).bit_length())
        if self._graphs:
            logger.info("cuda graphs: block-table width %d -> %d pages, re-capturing %d buckets",
                        self._width, W, len(self.buckets))  # fmt: skip
        self._graphs.clear()
        self._width = W
        _, nbytes = _Staging.offsets(self._static_fields(None, []))
        self._static = _Staging(self.device, fixed_bytes=nbytes)
        self._fill_static()  # every row padded: warm-up and capture write only the scratch page
        if self.cuda_graphs:
            self._capture_all()

    def _static_fields(self, inputs: StepInputs | None, keys: list[int]) -> list:
        """The static layout: the real rows of `inputs` (None: none) with their draw keys, padded to the
        largest bucket (padded rows: greedy, key 0, truncation off)."""
        x = inputs or StepInputs([], [], [], [], [], [])
        Bm, W = self.buckets[-1], self._width
        n = len(x.seq_lens)
        pad = Bm - n
        scratch = self.scratch_page
        table = [p for t in x.block_tables for p in (*t, *(scratch,) * (W - len(t)))] + [scratch] * (pad * W)
        src = x.extra_ints.get("src", [])
        ints = [("ids", x.token_ids + [0] * pad), ("pos", x.positions + [0] * pad), ("seq", list(range(Bm))),
                ("lens", x.seq_lens + [1] * pad), ("keys", keys + [0] * pad),
                ("top_k_B", (x.top_k or [0] * n) + [0] * pad), ("table", table),
                ("src", src + [0] * (Bm - len(src)))]  # fmt: skip
        floats = [("temperature", x.temperature + [0.0] * pad),
                  ("top_p_B", (x.top_p or [1.0] * n) + [1.0] * pad),
                  ("min_p_B", (x.min_p or [0.0] * n) + [0.0] * pad)]  # fmt: skip
        return [(k, torch.int64, v, (len(v),)) for k, v in ints] + [
            (k, torch.float32, v, (Bm,)) for k, v in floats
        ]

    def _fill_static(self, inputs: StepInputs | None = None, keys: list[int] | None = None) -> None:
        """Stage the real rows of `inputs` (None: every row padded) and their keys in the static buffers."""
        self._static_views = self._static.stage(self._static_fields(inputs, keys or []))

    def _prepare_static(self, inputs: StepInputs) -> dict[str, torch.Tensor]:
        n = len(inputs.seq_lens)
        if len(inputs.rngs) != n or len(inputs.temperature) != n:
            raise ValueError(f"a static step samples every row: need {n} rngs and temperatures, got "
                             f"{len(inputs.rngs)} and {len(inputs.temperature)}")  # fmt: skip
        self._ensure_width(max(len(t) for t in inputs.block_tables))
        self._fill_static(inputs, sampler.draw_keys(inputs.rngs))  # this step's draws, one per row
        v = self._static_views
        views = {"static_bs": torch.empty(0), "temperature": v["temperature"][:n], "keys": v["keys"][:n]}
        for k, off in (("top_k_B", 0), ("top_p_B", 1.0), ("min_p_B", 0.0)):
            if any(x != off for x in getattr(inputs, k[:-2])):
                views[k] = v[k][:n]
        return views

    def prepare_lookahead(self, inputs: StepInputs, prev_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """`prepare` of a static step whose input tokens are still on the device: row i's token is
        `prev_tokens[inputs.extra_ints["src"][i]]` (the previous step's sampled ids, not read back yet);
        `inputs.token_ids` are placeholders. One gather after the one staging copy, no host sync."""
        if not self.can_run_static(inputs):
            raise ValueError("a lookahead step must be an all-decode step the static path can run")
        views = self._prepare_static(inputs)
        v, n = self._static_views, len(inputs.seq_lens)
        torch.index_select(prev_tokens, 0, v["src"][:n], out=v["ids"][:n])
        return views

    def static_forward(self, bs: int) -> torch.Tensor:
        """The padded model pass of bucket `bs` on the static buffers -> fp32 logits [bs, V]."""
        v, W = self._static_views, self._width
        args = [v["ids"][:bs], v["pos"][:bs], v["seq"][:bs], self.cache, v["table"][: bs * W].view(bs, W),
                v["lens"][:bs]]  # fmt: skip
        if self.compile_decode and bs > 1:
            for i in (0, 1, 2, 4, 5):
                torch._dynamo.maybe_mark_dynamic(args[i], 0)
        with static_shapes():
            if not self.compile_decode:
                return self.model.forward_cached(*args)
            try:
                return self._decode_fn(*args)
            except Exception as exc:  # an op Inductor cannot compile: run uncompiled from now on (logged)
                self._compile_failed(exc)
                return self.model.forward_cached(*args)

    def static_step(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`static_forward`, then every row sampled with its staged key (banned ids applied, truncation
        off) -> (logits [bs, V], tokens [bs], log-probs [bs]): what a CUDA graph captures per bucket."""
        logits_BV = self.static_forward(bs)
        v = self._static_views
        tokens_B, logprobs_B = sampler.sample_with_keys(logits_BV, v["temperature"][:bs], v["keys"][:bs],
                                                        banned_ids=self.banned_ids)  # fmt: skip
        return logits_BV, tokens_B, logprobs_B

    def _compile_failed(self, exc: BaseException) -> None:
        self.compile_error = f"{type(exc).__name__}: {str(exc)[:500]}"
        logger.warning("torch.compile of the decode pass failed (%s); running it uncompiled",
                       self.compile_error)  # fmt: skip
        self.compile_decode = False
        self._decode_fn = self.model.forward_cached

    def _run_static(self, views: dict[str, torch.Tensor], n: int) -> torch.Tensor:
        self.static_steps += 1
        bs = self._bucket(n)
        if bs in self._graphs:
            graph, outs = self._graphs[bs]
            graph.replay()
        else:
            outs = self.static_step(bs)
        logits_BV, tokens_B, logprobs_B = outs
        if not any(k in views for k in _TRUNCATION):  # the in-pass draw is untruncated
            views["tokens_B"], views["logprobs_B"] = tokens_B[:n], logprobs_B[:n]
            self.sampled_in_pass += 1
        return logits_BV[:n]

    def _capture_all(self) -> None:
        """Capture every bucket, largest first, in one memory pool. A failure (an op that is not
        capture-safe) is logged once and turns graphs off: the static path then runs eagerly."""
        stream = torch.cuda.Stream(self.device)
        pool = None
        try:
            for bs in reversed(self.buckets):
                pool = self.capture_bucket(bs, pool, stream)
        except Exception as exc:  # any capture failure falls back to eager (logged)
            while exc.__context__ is not None:  # the op's own error, not capture_end's re-raise of it
                exc = exc.__context__
            self.graph_error = f"{type(exc).__name__}: {exc}"
            logger.warning("cuda graphs off: capture failed (%s); running the padded passes eagerly",
                           self.graph_error)  # fmt: skip
            self._graphs.clear()
            self.cuda_graphs = False
            return
        self.num_captures += 1

    def capture_bucket(self, bs: int, pool=None, stream: torch.cuda.Stream | None = None):
        """Warm up and capture bucket `bs` (the static buffers hold only padded rows then: warm-up and
        capture write nothing but the scratch page); returns the memory pool for the next capture.
        Warm-up runs on the capture stream first: Triton autotuning and per-stream kernel scratch
        (model.kernels.triton_gemv.split_counters) must not first happen inside a capture."""
        stream = stream or torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.static_step(bs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outs = self.static_step(bs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._graphs[bs] = (graph, outs)
        return graph.pool()

    def poison_padding(self, n: int, generator: torch.Generator) -> None:
        """Tests: garbage in the padded rows (>= n) of the static buffers: token ids, positions inside the
        scratch page, temperatures and draw keys (tables stay on the scratch page: that is the contract)."""
        v, Bm = self._static_views, self.buckets[-1]
        vocab, page = self.model.config.vocab_size, self.cache.page_size
        v["ids"][n:] = torch.randint(0, vocab, (Bm - n,), generator=generator).to(self.device)
        pos = torch.randint(0, page, (Bm - n,), generator=generator).to(self.device)
        v["pos"][n:] = pos
        v["lens"][n:] = pos + 1
        v["temperature"][n:] = torch.rand(Bm - n, generator=generator).to(self.device) + 0.5
        v["keys"][n:] = torch.randint(-(2**62), 2**62, (Bm - n,), generator=generator).to(self.device)


def _truncation_ints(inputs: StepInputs) -> dict[str, list[int]]:
    return {"top_k_B": inputs.top_k} if any(k != 0 for k in inputs.top_k) else {}


def _truncation_floats(inputs: StepInputs) -> dict[str, list[float]]:
    out = {}
    if any(p != 1.0 for p in inputs.top_p):
        out["top_p_B"] = inputs.top_p
    if any(p != 0.0 for p in inputs.min_p):
        out["min_p_B"] = inputs.min_p
    return out

"""Scale-out benchmark: expert-parallel MoE (DEP) and decode-context-parallel (DCP) indexer and
attention on 1 vs W ranks, tokens/s and memory per GPU, with correctness checked before timing.

Benches: ep_moe_fwd / ep_moe_fwd_bwd (one MoE layer, weak scaling), dcp_indexer / dcp_attention /
dcp_decode (one MSA layer's decode step, strong scaling), dep_learner (a learner's forward + backward
with experts and adapters sharded). Each world size runs in fresh processes (NCCL, or gloo on CPU).

Usage:
  python benchmarks/scaleout.py --device cuda --worlds 1,2 --json OUT.jsonl        (spawns ranks)
  torchrun --nproc-per-node 2 benchmarks/scaleout.py --device cuda                  (one world)
  python benchmarks/scaleout.py --device cpu --worlds 1,2 --preset tiny             (CPU smoke test)
  ... --benches dep_learner                                                          (a subset)
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

# What each bench checks and counts:
# - ep_moe_*: NVFP4 routed + shared experts, every rank feeding its own `--tokens` tokens
#   (data-parallel attention: W x tokens per step), experts in contiguous ranges; forward and
#   forward + input-gradient backward. Correct: each rank's EP output vs the single-process MoE.
# - dcp_*: `--batch` sequences of `--context` tokens, pages interleaved over W ranks. Correct: top-k
#   sets identical to, and attention within tolerance of, the single-rank torch ops. DCP runs the
#   batched torch path at every world size (the Triton kernels expose no per-rank scores / LSEs), so
#   its 1-vs-W ratio is a same-code scaling figure, not a comparison with the Triton kernels.
# - dep_learner: token log-probs + backward of a `learner_layers`-layer MSA + MoE model, LoRA on
#   attention and routed experts, `apply_expert_parallel(..., shard_lora=True)`. Correct: each
#   rank's log-probs vs the unsharded model's, beside that model's own error in the run's dtype
#   against fp32 (bf16 moves a random M3-width model's log-probs by ~20%; DEP's bf16 error is ~10x
#   smaller, its fp32 error 4e-7 on an H200).
# Tokens/s counts all ranks' tokens; step time is the slowest rank's median (ranks barrier-aligned
# before every repeat). `state_gb` = this rank's expert bank (+ adapters) or KV + index pages;
# `peak_gb` = torch.cuda.max_memory_allocated during the timed steps (None on CPU).

# The repo root ahead of benchmarks/ (this script's own folder, sys.path[0]): benchmarks/rollout.py
# would otherwise shadow the `rollout` package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from model.config import ModelConfig, QuantConfig
from model.kernels.indexer import index_select_blocks_torch
from model.kernels.sparse_attention import sparse_attention_torch
from model.kv_cache import PagedIndex, PagedKV
from model.layers.lora import LoRAConfig, apply_lora
from model.layers.moe import MoE
from model.modeling import MiniMaxM3ForCausalLM
from model.parallel.context_parallel import (
    DCPLayout,
    dcp_index_select_blocks,
    dcp_sparse_attention,
    shard_pages,
)
from model.parallel.expert_parallel import ExpertParallelMoE, apply_expert_parallel, expert_ranges
from model.parallel.groups import ParallelGroups, launch_local

sys.path.insert(1, str(Path(__file__).resolve().parent))
from random_init import build_random_model, random_model_, random_nvfp4_bank_

# Shapes: M3.1-Flash's MoE layer and MSA layer (docs/FACTS.md, "M3 architecture"), and a CPU-sized twin.
PRESETS = {
    "m3": dict(hidden=6144, ffn=3072, experts=128, topk=4, tokens=2048, heads=64, kv_heads=4, head_dim=128,
               page=128, topk_blocks=16, context=131072, batch=8, reps=10, model="m3.1-flash",
               learner_layers=2, engine_model="small", engine_batches=(64, 256), prompt_len=128,
               gen_tokens=64),
    "tiny": dict(hidden=64, ffn=64, experts=8, topk=2, tokens=64, heads=4, kv_heads=2, head_dim=32,
                 page=16, topk_blocks=4, context=512, batch=2, reps=3, model="tiny", learner_layers=2,
                 engine_model="tiny", engine_batches=(4,), prompt_len=12, gen_tokens=6),
}  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, reps: int, device: torch.device) -> float:
    """Median seconds of fn() over `reps` barrier-aligned repeats after two warm-ups."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------------------------------------ EP
def bench_ep(p: dict, groups: ParallelGroups, device: torch.device, dtype: torch.dtype) -> list[dict]:
    cfg = dataclasses.replace(
        ModelConfig.preset("tiny"), hidden_size=p["hidden"], moe_intermediate_size=p["ffn"],
        shared_intermediate_size=p["ffn"], num_local_experts=p["experts"], num_experts_per_tok=p["topk"],
    )  # fmt: skip
    with torch.device(device):
        moe = MoE(cfg, fmt="nvfp4")
    moe.to(dtype)
    random_nvfp4_bank_(moe, torch.Generator(device).manual_seed(0))
    gen = torch.Generator(device).manual_seed(1 + groups.rank)  # every rank its own tokens
    x_TD = torch.randn(p["tokens"], p["hidden"], generator=gen, device=device).to(dtype)
    check_TD = x_TD[:64]
    with torch.no_grad():
        ref = moe(check_TD).float()
    ep = ExpertParallelMoE(moe, groups.ep_group)
    del moe  # the unsharded bank goes: memory below is the shard's
    with torch.no_grad():
        err = ((ep(check_TD).float() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()
    state = _bytes(*ep.experts.buffers())
    rows = []
    x_grad_TD = x_TD.clone().requires_grad_(True)

    def fwd():
        with torch.no_grad():
            ep(x_TD)

    def fwd_bwd():
        ep(x_grad_TD).float().square().mean().backward()

    for name, fn, reps in (
        ("ep_moe_fwd", fwd, p["reps"]),
        ("ep_moe_fwd_bwd", fwd_bwd, max(2, p["reps"] // 2)),
    ):
        _reset_peak(device)
        t = _timed(fn, reps, device)
        rows.append(dict(bench=name, step_s=t, tokens=p["tokens"] * groups.world_size, rel_err=err,
                         state_gb=state / 1e9, peak_gb=_peak_gb(device)))  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------- DCP
def bench_dcp(p: dict, groups: ParallelGroups, device: torch.device, dtype: torch.dtype) -> list[dict]:
    B, L, page, N, H, C = p["batch"], p["context"], p["page"], p["kv_heads"], p["heads"], p["head_dim"]
    kv_dtype = "bf16" if dtype == torch.bfloat16 else "fp32"
    gen = torch.Generator(device).manual_seed(2)  # the same cache and queries on every rank
    nb = -(-L // page)
    table_BP = torch.randperm(B * nb, generator=gen, device=device).view(B, nb)
    lens_B = torch.full((B,), L, device=device) - torch.arange(B, device=device) * (page // 3)  # ragged
    one = torch.tensor(1.0, device=device)
    index = PagedIndex(torch.randn(B * nb, page, C, generator=gen, device=device).to(dtype), kv_dtype, one, C)
    kv = PagedKV(
        torch.randn(B * nb, 2 * N, page, C, generator=gen, device=device).to(dtype), kv_dtype, one, one, C
    )
    seq_idx_T = torch.arange(B, device=device)
    pos_T = lens_B - 1  # one decode token per sequence
    index_q_TNC = torch.randn(B, N, C, generator=gen, device=device).to(dtype)
    q_THC = torch.randn(B, H, C, generator=gen, device=device).to(dtype)
    sel_args = dict(topk=p["topk_blocks"], local_blocks=1, init_blocks=0)
    scale = C**-0.5
    ref_sel = index_select_blocks_torch(index_q_TNC, index, table_BP, seq_idx_T, pos_T, lens_B, **sel_args)
    ref_out = sparse_attention_torch(
        q_THC, kv, table_BP, seq_idx_T, pos_T, lens_B, ref_sel, softmax_scale=scale
    )
    layout = DCPLayout(groups.rank, groups.world_size, page)
    ipages, itable = shard_pages(index.pages, table_BP, lens_B, layout)
    kpages, ktable = shard_pages(kv.pages, table_BP, lens_B, layout)
    local_index = dataclasses.replace(index, pages=ipages)
    local_kv = dataclasses.replace(kv, pages=kpages)
    del index, kv  # the unsharded cache goes: memory below is this rank's pages
    group = groups.ep_group

    def indexer():
        return dcp_index_select_blocks(
            index_q_TNC, local_index, itable, seq_idx_T, pos_T, lens_B, group=group, **sel_args
        )

    def attention(sel):
        return dcp_sparse_attention(
            q_THC, local_kv, ktable, seq_idx_T, pos_T, lens_B, sel, softmax_scale=scale, group=group
        )

    sel = indexer()
    out = attention(sel)
    same = bool(torch.equal(torch.sort(sel, -1).values, torch.sort(ref_sel, -1).values))
    err = ((out.float() - ref_out.float()).abs().max() / ref_out.float().abs().max()).item()
    state = _bytes(ipages, kpages)
    rows = []
    for name, fn in (("dcp_indexer", indexer), ("dcp_attention", lambda: attention(sel)),
                     ("dcp_decode", lambda: attention(indexer()))):  # fmt: skip
        _reset_peak(device)
        t = _timed(fn, p["reps"], device)
        rows.append(dict(bench=name, step_s=t, tokens=B, topk_identical=same, rel_err=err,
                         state_gb=state / 1e9, peak_gb=_peak_gb(device)))  # fmt: skip
    return rows


# --------------------------------------------------------------------------------- DEP learner
def bench_dep_learner(
    p: dict, groups: ParallelGroups, device: torch.device, dtype: torch.dtype
) -> list[dict]:
    L = p["learner_layers"]
    cfg = dataclasses.replace(
        ModelConfig.preset(p["model"]), num_hidden_layers=L, layer_types=["minimax_m3_sparse"] * L,
        mlp_layer_types=["sparse"] * L, num_local_experts=p["experts"], num_experts_per_tok=p["topk"],
        quantization=QuantConfig(routed_experts="nvfp4"), num_mtp_modules=0,
    )  # fmt: skip
    with torch.device(device):
        model = MiniMaxM3ForCausalLM(cfg)
    random_model_(model, torch.Generator(device).manual_seed(0))
    apply_lora(model, LoRAConfig(r=32, alpha=64.0, routed_experts=True), seed=0)
    gen = torch.Generator(device).manual_seed(1 + groups.rank)  # every rank its own sequences
    ids_BS = torch.randint(3, cfg.vocab_size, (2, p["tokens"] // 2 + 1), generator=gen, device=device)
    inputs_BS, targets_BS = ids_BS[:, :-1], ids_BS[:, 1:]

    def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()

    with torch.no_grad():
        # The unsharded model in fp32 and in the run's dtype: a random M3-width model is so sensitive
        # that bf16 alone moves its log-probs by ~20%, which is the scale to judge DEP's error by.
        ref32 = model.token_logprobs(inputs_BS, targets_BS)[0]
        model.to(dtype)
        ref = model.token_logprobs(inputs_BS, targets_BS)[0]
        apply_expert_parallel(model, groups.ep_group, shard_lora=True)
        got = model.token_logprobs(inputs_BS, targets_BS)[0]
    err, dtype_err = rel_err(got, ref), rel_err(ref, ref32)
    state = 0
    for m in model.modules():
        if isinstance(m, ExpertParallelMoE):
            state += _bytes(*m.experts.buffers(recurse=False), *m.experts.lora.parameters())
    model.train()

    def fwd_bwd():
        model.token_logprobs(inputs_BS, targets_BS)[0].sum().backward()

    _reset_peak(device)
    t = _timed(fwd_bwd, max(2, p["reps"] // 2), device)
    return [dict(bench="dep_learner", step_s=t, tokens=p["tokens"] * groups.world_size, rel_err=err,
                 dtype_rel_err=dtype_err, state_gb=state / 1e9, peak_gb=_peak_gb(device))]  # fmt: skip


# ---------------------------------------------------------------------------------- DEP engine
def bench_dep_engine(p: dict, groups: ParallelGroups, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The native engine serving `engine_model` (random weights, NVFP4 routed experts and KV cache;
    `engine_layers` cuts it to its first layers) as one replica: a plain NativeEngine at world 1, a
    DEPEngine (data-parallel attention over the ranks' own requests, experts sharded) at world W,
    where every rank builds only its own experts (`build_random_model(..., expert_range=)`: a model
    too large for one GPU is served). Strong scaling: the same `engine_batches` requests of
    `prompt_len` random tokens, `gen_tokens` greedy tokens each, split over the ranks.
    Correctness: 4 requests' greedy tokens, fp32 model and cache, returned as `check_tokens`; `main`
    compares every world's with world 1's (`greedy_match`: mean fraction of each sequence equal
    before the first difference). The timed runs are in the run's dtype."""
    from rollout.engine import Request, SamplingParams
    from rollout.native.dep import DEPEngine
    from rollout.native.engine import NativeEngine

    cfg = ModelConfig.preset(p["engine_model"])
    if p.get("engine_layers"):
        n = p["engine_layers"]
        cfg = dataclasses.replace(cfg, num_hidden_layers=n, layer_types=cfg.layer_types[:n],
                                  mlp_layer_types=cfg.mlp_layer_types[:n], num_mtp_modules=0)  # fmt: skip
    W = groups.world_size
    expert_range = expert_ranges(cfg.num_local_experts, W)[groups.rank] if W > 1 else None
    # fp32 for the check: a random model's greedy tokens flip under bf16 noise.
    model = build_random_model(cfg, device, seed=0, expert_range=expert_range)
    if W > 1:
        apply_expert_parallel(model, groups.ep_group)
    gen = torch.Generator().manual_seed(3)  # the same prompts on every rank
    sp = SamplingParams(temperature=0.0, max_tokens=p["gen_tokens"], ignore_eos=True)

    def requests(n: int) -> list[Request]:
        ids = torch.randint(3, cfg.vocab_size, (n, p["prompt_len"]), generator=gen)
        return [Request(row.tolist(), sp) for row in ids]

    page = cfg.index_block_size
    pages_per_seq = -(-(p["prompt_len"] + p["gen_tokens"] + 16) // page)

    def serve(reqs: list[Request], kv: str = "nvfp4") -> list:
        eng = NativeEngine(model, max_pages=len(reqs) * pages_per_seq + 8, max_batch_tokens=4096,
                           max_num_seqs=len(reqs), kv_dtype=kv)  # fmt: skip
        return DEPEngine(eng, groups.ep_group).generate(reqs) if W > 1 else eng.generate(reqs)

    # The check runs an fp32 cache: NVFP4 KV rounding would turn fp32 summation-order noise in the
    # EP combine into visible logit changes (and flipped greedy tokens) that say nothing about DEP.
    check = [c.token_ids for c in serve(requests(4), "fp32")]
    model.to(dtype)  # timed in the run's dtype (bf16 on the GPU); NVFP4 banks keep their dtypes
    experts = sum(
        _bytes(*m.experts.buffers(recurse=False))
        for m in model.modules()
        if isinstance(m, (MoE, ExpertParallelMoE)) and hasattr(m, "experts")
    )
    rows = []
    for batch in p["engine_batches"]:
        reqs = requests(batch)
        _reset_peak(device)
        t = _timed(lambda reqs=reqs: serve(reqs), max(1, p["reps"] // 5), device)
        rows.append(dict(bench=f"dep_engine_b{batch}", step_s=t, tokens=batch * p["gen_tokens"], rel_err=0.0,
                         check_tokens=check, state_gb=experts / 1e9, peak_gb=_peak_gb(device)))  # fmt: skip
    return rows


def attach_greedy_match(rows: list[dict]) -> None:
    """dep_engine rows: `greedy_match` of the world's check tokens against world 1's (None without a
    world-1 run), `rel_err` = 1 - match; the tokens themselves are dropped from the rows."""
    ref = {r["bench"]: r["check_tokens"] for r in rows if r["world"] == 1 and "check_tokens" in r}
    for r in rows:
        got = r.pop("check_tokens", None)
        if got is None:
            continue
        want = ref.get(r["bench"])
        match = None if want is None else statistics.mean(
            next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) / len(b)
            for a, b in zip(got, want, strict=True)
        )  # fmt: skip
        r["greedy_match"], r["rel_err"] = match, (None if match is None else 1.0 - match)


BENCHES = ("ep", "dcp", "dep_learner", "dep_engine")


def bench_rank(p: dict, device_type: str, benches: tuple[str, ...] = BENCHES) -> list[dict]:
    """Everything one rank runs (inside an initialised world); returns its rows."""
    groups = ParallelGroups.build()
    device = (
        torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    )
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    fns = {"ep": bench_ep, "dcp": bench_dcp, "dep_learner": bench_dep_learner, "dep_engine": bench_dep_engine}
    rows = [row for name in benches for row in fns[name](p, groups, device, dtype)]
    for r in rows:
        r.update(world=groups.world_size, rank=groups.rank, device=device_type)
    return rows


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """One row per benchmark: the slowest rank's time, the largest memory, the worst error."""
    out = []
    for rows in zip(*per_rank, strict=True):
        first = dict(rows[0])
        first.pop("rank")
        first["step_s"] = max(r["step_s"] for r in rows)
        first["rel_err"] = max(r["rel_err"] for r in rows)
        if "dtype_rel_err" in first:
            first["dtype_rel_err"] = max(r["dtype_rel_err"] for r in rows)
        first["state_gb"] = max(r["state_gb"] for r in rows)
        peaks = [r["peak_gb"] for r in rows if r["peak_gb"] is not None]
        first["peak_gb"] = max(peaks) if peaks else None
        if "topk_identical" in first:
            first["topk_identical"] = all(r["topk_identical"] for r in rows)
        first["tokens_per_s"] = first["tokens"] / first["step_s"]
        out.append(first)
    return out


def print_table(rows: list[dict]) -> None:
    base = {r["bench"]: r["tokens_per_s"] for r in rows if r["world"] == 1}
    header = [
        "bench",
        "world",
        "tokens/step",
        "step ms",
        "tokens/s",
        "vs 1 rank",
        "state GB/rank",
        "peak GB/GPU",
    ]
    print("\n| " + " | ".join([*header, "check"]) + " |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base[r['bench']]:.2f}x" if r["bench"] in base else "-"
        peak = f"{r['peak_gb']:.2f}" if r["peak_gb"] is not None else "-"
        check = (
            f"rel err {r['rel_err']:.1e}" + (", top-k identical" if r.get("topk_identical") else "")
            if r["rel_err"] is not None
            else "-"
        )
        if r.get("greedy_match") is not None:
            check = f"greedy prefix equal to 1 GPU (fp32): {r['greedy_match']:.0%}"
        if "dtype_rel_err" in r:
            check += f" (the dtype's own vs fp32: {r['dtype_rel_err']:.1e})"
        if r.get("topk_identical") is False:
            check += ", TOP-K DIFFERS"
        cells = [r["bench"], r["world"], r["tokens"], f"{r['step_s'] * 1e3:.2f}", f"{r['tokens_per_s']:.0f}",
                 ratio, f"{r['state_gb']:.4g}", peak, check]  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument(
        "--worlds", default="1,2", help="comma-separated world sizes to spawn (ignored under torchrun)"
    )
    ap.add_argument("--preset", choices=list(PRESETS), default=None, help="default: m3 on cuda, tiny on cpu")
    for key in ("tokens", "context", "batch", "experts", "reps"):
        ap.add_argument(f"--{key}", type=int, default=None, help=f"override the preset's {key}")
    ap.add_argument(
        "--engine-batches",
        default=None,
        help="comma-separated request counts for dep_engine (default 64,256)",
    )
    ap.add_argument("--engine-model", default=None, help="dep_engine: a ModelConfig preset (default small)")
    ap.add_argument("--engine-layers", type=int, default=None, help="dep_engine: keep the first N layers")
    ap.add_argument("--json", default=None, help="append one JSON line per result to this file")
    ap.add_argument(
        "--benches", default=",".join(BENCHES), help=f"comma-separated subset of {','.join(BENCHES)}"
    )
    args = ap.parse_args()
    benches = tuple(b.strip() for b in args.benches.split(",") if b.strip())
    unknown = [b for b in benches if b not in BENCHES]
    if unknown:
        ap.error(f"--benches: unknown {unknown}; choose from {list(BENCHES)}")
    p = dict(PRESETS[args.preset or ("m3" if args.device == "cuda" else "tiny")])
    p.update(
        {k: getattr(args, k) for k in ("tokens", "context", "batch", "experts", "reps") if getattr(args, k)}
    )
    if args.engine_model:
        p["engine_model"] = args.engine_model
    if args.engine_layers:
        p["engine_layers"] = args.engine_layers
    if args.engine_batches:
        p["engine_batches"] = tuple(int(b) for b in args.engine_batches.split(","))
    backend = "nccl" if args.device == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: one world, this process is one rank
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        mine = bench_rank(p, args.device, benches)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        is_main = dist.get_rank() == 0
        dist.destroy_process_group()
        if not is_main:
            return
        rows = summarize(gathered)
    else:
        rows = []
        for world in (int(w) for w in args.worlds.split(",")):
            rows += summarize(launch_local(bench_rank, world, p, args.device, benches, backend=backend))
    attach_greedy_match(rows)
    for r in rows:
        r["shape"] = p
        print(json.dumps(r))
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print_table(rows)


if __name__ == "__main__":
    main()

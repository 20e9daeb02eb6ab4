"""Decode-kernel benchmark: Triton KV append, indexer, sparse attention and W4A16 MoE on an H200.

Prints per kernel and shape the median time, bytes that must move, bandwidth, % of the 4.17 TB/s copy
roofline and the target ratios of docs/PERFORMANCE.md ("Targets"), each measured side by side in this
process, plus every Triton kernel against the naive torch path of the same op. Correctness against
the torch path is checked on the same inputs before timing; data is random (never zeros). Shapes are
M3.1-Flash's (`ModelConfig.preset("m3.1-flash")`), batch 1 and 64, contexts 32K and 128K.

Usage: python benchmarks/decode_kernels.py --device cuda --json OUT.jsonl [--quick] [--only indexer attention]
       [--variants v2 v7]   (MoE: --only moe --variants v2 v7, the CUDA v7 vs the v2 tile kernel;
       attention v2 vs v6 vs FP8: --only attention --variants v2 v6; GEMV: --only gemv --variants v3 v7)
"""

# ruff: noqa: B023 -- the timed lambdas run inside the loop iteration that defines them.
import argparse
import json
import time

import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.kernels.indexer import index_select_blocks_torch
from model.kernels.moe import moe_experts_torch, swigluoai
from model.kernels.sparse_attention import sparse_attention_torch
from model.kernels.triton_gemv import GEMV_MAX_ROWS, nvfp4_linear_triton
from model.kernels.triton_indexer import _index_scores_tuned, index_select_blocks_triton
from model.kernels.triton_kv_append import kv_append
from model.kernels.triton_moe import _nvfp4_moe_tuned, moe_nvfp4_triton, nvfp4_mlp_triton
from model.kernels.triton_sparse_attention import (
    _sparse_attn_tuned,
    _sparse_attn_v6_tuned,
    sparse_attention_triton,
)
from model.kv_cache import PagedIndex, PagedKV, dequantize_kv, kv_append_ref, stored_width
from model.layers.moe import ExpertBank

# Targets timed: indexer NVFP4 vs FP8 index keys (>= 1.7x), sparse attention NVFP4 vs FP8 cache
# (>= 1.5x), W4A16 GEMV (m <= 16, 6144 x 6144) vs torch bf16 (>= 3x), MoE layer (batch 64, 128
# experts top-4 + shared) vs a bf16 grouped torch layer (>= 2.5x).
#
# Timing: the headline time of each Triton kernel and of the torch bf16 GEMV is replayed from a CUDA
# graph (`bench_graph`: no host launch cost, as a graph-captured decode step pays none) over inputs
# rotated so L2 does not hold them (8 weight copies for the GEMV, 4 block selections for attention;
# the B=1 indexer's 2.4 MB of keys do stay in L2). `eager_us` is triton.testing.do_bench (L2 flushed
# before every repeat, launch cost included), launch-bound below ~150 us. Naive torch baselines
# (host syncs, not capturable) are eager.
#
# `--variants`: the versions timed side by side, each op taking those it has (OP_VARIANTS; without the
# flag OP_DEFAULTS; the first named is the baseline of the ratio rows). Indexer: v7 (the CUDA kernel of
# model/kernels/cuda_indexer.py for NVFP4, the default; FP8 keys take the tuned tile kernel), v2
# (byte-wise); later versions record whether their selections equal the baseline's. Attention: v6 (K / V
# decoded in registers into the dot operands, the default; autotuned over V6_CONFIGS), v2 (byte-wise).
# GEMV: v3 (split-K FMA, the default), v2 (tile kernel). NVFP4 and FP8 are timed per version (FP8 / bf16
# run the same code in every version); the ratio table prints NVFP4 vs FP8 for each and each later version
# vs the first. MoE: the routed experts by the v2 tile kernel and by v7 (`model.kernels.cuda_moe`, CUDA
# mma.sync, the default at decode sizes) side by side, routed and layer times per variant, then v7 vs v2
# (v2 is always timed, as the baseline).

ROOFLINE_TBS = 4.17
OP_VARIANTS = {
    "indexer": ("v2", "v7"),
    "attention": ("v2", "v6", "v7"),
    "gemv": ("v2", "v3", "v7"),
    "moe": ("v2", "v7"),
}
OP_DEFAULTS = {"indexer": ("v7",), "attention": ("v6",), "gemv": ("v3",), "moe": ("v2", "v7")}
ROWS: list[dict] = []
JSON_PATH: str | None = None  # rows are appended as they are measured (a cut-short run keeps them)


def op_variants(op: str, named: list[str] | None) -> tuple[str, ...]:
    """The versions of `op` to time: OP_DEFAULTS[op] without --variants, else the named ones it has in
    the order named (the MoE always starts with v2, the baseline of its ratio rows)."""
    if named is None:
        return OP_DEFAULTS[op]
    picked = tuple(v for v in named if v in OP_VARIANTS[op])
    return ("v2", *(v for v in picked if v != "v2")) if op == "moe" else picked


def bench(fn, rep_ms: int = 200) -> float:
    """Median microseconds of fn (L2 flushed before each repeat by do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def bench_graph(fn, reps: int = 1, rep_ms: int = 50) -> float:
    """Median microseconds of one call of fn's work, replayed from a CUDA graph (no host launch cost:
    what a graph-captured decode step pays). fn does `reps` calls over rotated inputs (so the 60 MB
    L2 does not hold them across calls); the time is divided by reps. NaN if fn cannot be captured."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3 / reps
    except Exception as exc:  # a baseline with host syncs: report, keep going
        print(f"  (graph capture failed: {type(exc).__name__}: {str(exc)[:120]})", flush=True)
        return float("nan")


def bench_slow(fn, reps: int = 3) -> float:
    """Median microseconds of a slow (launch-bound) baseline: one warm-up call, `reps` timed calls."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def record(kernel: str, shape: str, variant: str, us: float, n_bytes: float, **extra) -> dict:
    row = dict(
        kernel=kernel,
        shape=shape,
        variant=variant,
        us=round(us, 2),
        bytes=int(n_bytes),
        tb_s=round(n_bytes / us / 1e6, 3),
        pct_roofline=round(100 * n_bytes / us / 1e6 / ROOFLINE_TBS, 1),
        **extra,
    )
    ROWS.append(row)
    if JSON_PATH:
        with open(JSON_PATH, "a") as f:
            f.write(json.dumps({"date": time.strftime("%Y-%m-%d"), **row}) + "\n")
    print(
        f"{kernel:10s} {shape:28s} {variant:22s} {us:10.1f} us {row['tb_s']:7.3f} TB/s "
        f"{row['pct_roofline']:6.1f}% {extra if extra else ''}",
        flush=True,
    )
    return row


def random_pages(shape_rows: tuple, dtype: str, C: int, device) -> torch.Tensor:
    """Random stored rows of the given cache dtype (valid encodings, no NaN)."""
    if dtype == "bf16":
        return torch.randn(*shape_rows, C, device=device, dtype=torch.bfloat16)
    if dtype == "fp8":
        return (torch.randn(*shape_rows, C, device=device) * 4).to(torch.float8_e4m3fn).view(torch.uint8)
    packed = torch.randint(0, 256, (*shape_rows, C // 2), dtype=torch.uint8, device=device)
    scales = (torch.rand(*shape_rows, C // 16, device=device) * 60 + 4).to(torch.float8_e4m3fn)
    return torch.cat([packed, scales.view(torch.uint8)], dim=-1)


def tables(B: int, ctx: int, page: int, device) -> tuple[torch.Tensor, int]:
    n = ctx // page
    perm = torch.randperm(B * n, device=device, dtype=torch.int64).int()
    return perm.view(B, n), B * n


# ------------------------------------------------------------------------------------------ indexer
def ratio_rows(kernel: str, shape: str, times: dict, variants: tuple, target: float) -> None:
    """NVFP4 vs FP8 per version, then each later version's NVFP4 time vs the first one's."""
    for variant in variants:
        record(kernel, shape, f"ratio nvfp4 vs fp8 {variant}", times["nvfp4", variant], 0,
               speedup=round(times["fp8", variant] / times["nvfp4", variant], 2), target=target)  # fmt: skip
    for variant in variants[1:]:
        record(kernel, shape, f"ratio nvfp4 {variant} vs {variants[0]}", times["nvfp4", variant], 0,
               speedup=round(times["nvfp4", variants[0]] / times["nvfp4", variant], 2))  # fmt: skip


def run_indexer(
    cfg: ModelConfig, B: int, ctx: int, device, with_torch: bool, variants=OP_DEFAULTS["indexer"]
) -> None:
    """Indexer scores + top-k per cache format and decode version (`variant`: v7 the CUDA kernel for
    NVFP4; v2 the byte-wise decode, one config). FP8 and bf16 keys take the same tile kernel in every
    version (v2 only leaves their launch untuned). Ratios per version."""
    N, C, page, K = cfg.index_n_heads, cfg.index_head_dim, cfg.index_block_size, cfg.index_topk_blocks
    table, n_pages = tables(B, ctx, page, device)
    seq = torch.arange(B, device=device, dtype=torch.int32)
    pos = torch.full((B,), ctx - 1, device=device, dtype=torch.int64)
    lens = pos + 1
    q = torch.randn(B, N, C, device=device, dtype=torch.bfloat16)
    shape = f"B={B} ctx={ctx // 1024}K"
    kw = dict(topk=K, local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks)
    times, outs = {}, {}  # outs: each version's selections, compared with the baseline version's
    for dtype in ("nvfp4", "fp8", "bf16"):
        pages = random_pages((n_pages, page), dtype, C, device)
        scale = torch.tensor(0.01, device=device)
        n_bytes = B * ctx * pages.shape[-1] * pages.element_size() + q.nbytes
        want = t_torch = None
        if with_torch and dtype in ("nvfp4", "bf16"):
            index = PagedIndex(pages, dtype, scale, C)
            want = index_select_blocks_torch(q, index, table, seq, pos, lens, **kw)
            t_torch = bench(
                lambda: index_select_blocks_torch(q, index, table, seq, pos, lens, **kw), rep_ms=100
            )
            record("indexer", shape, f"torch {dtype}", t_torch, n_bytes)
        for variant in variants if dtype != "bf16" else variants[-1:]:
            fn = lambda: index_select_blocks_triton(
                q, pages, dtype, scale, table, seq, pos, **kw, variant=variant
            )
            got = fn()
            extra = {}
            if variant != variants[0] and (dtype, variants[0]) in outs:  # the baseline's selections?
                extra[f"equal_{variants[0]}"] = bool(torch.equal(got, outs[dtype, variants[0]]))
            outs[dtype, variant] = got
            if want is not None:
                extra["agree_with_torch"] = round(
                    (got.sort(-1).values == want.sort(-1).values).float().mean().item(), 4
                )
            t_eager = bench(fn)
            times[dtype, variant] = bench_graph(fn)
            extra["eager_us"] = round(t_eager, 1)  # do_bench, L2 flushed, host launch cost included
            if t_torch is not None:
                extra["speedup_vs_torch_eager"] = round(t_torch / t_eager, 2)
            tuned = str(getattr(_index_scores_tuned, "best_config", None))
            extra["config"] = tuned if variant != "v2" else "default"
            if variant == "v7" and dtype == "nvfp4":
                extra["config"] = "cuda v7"
            record("indexer", shape, f"triton {dtype} {variant}", times[dtype, variant], n_bytes, **extra)
    ratio_rows("indexer", shape, times, variants, target=1.7)


# ------------------------------------------------------------------------------------------ attention
def naive_selected_attention(q, kv: PagedKV, table, pos, sel, scale):
    """Naive torch decode baseline: gather only the selected pages, dequantize, masked softmax."""
    T, H, C = q.shape
    N, page = kv.pages.shape[1] // 2, kv.pages.shape[2]
    G = H // N
    pages_TNK = table.long().gather(1, sel.clamp(min=0).view(T, -1)).view(T, N, -1)
    heads = torch.arange(N, device=q.device)[None, :, None]
    k = dequantize_kv(kv.pages[pages_TNK, 2 * heads], kv.dtype, kv.k_scale, C)  # [T, N, K, page, C]
    v = dequantize_kv(kv.pages[pages_TNK, 2 * heads + 1], kv.dtype, kv.v_scale, C)
    tok = sel[..., None] * page + torch.arange(page, device=q.device)
    ok = (tok <= pos[:, None, None, None]) & (sel[..., None] >= 0)
    s = torch.einsum("tngc,tnkpc->tngkp", q.float().view(T, N, G, C), k) * scale
    s = s.masked_fill(~ok[:, :, None], float("-inf")).flatten(-2)
    p = torch.softmax(s, -1).view(*s.shape[:-1], -1, page)
    return torch.einsum("tngkp,tnkpc->tngc", p, v).reshape(T, H, C).to(q.dtype)


def run_attention(
    cfg: ModelConfig, B: int, ctx: int, device, with_torch: bool, variants=OP_DEFAULTS["attention"]
) -> None:
    """Sparse attention decode per cache format and version (v6: NVFP4 code bytes decoded in
    registers into the dot operands, `_sparse_attn_v6_tuned`; v2: byte-wise to e4m3, FP8 dots; v7
    (opt-in): the CUDA kernel of model/kernels/cuda_attention.py for NVFP4, v6's path for the other
    caches; FP8 / bf16 caches run the same code in every version), each with its own autotune pick.
    Ratios NVFP4 vs FP8 per version, and each later version vs the first."""
    from model.kernels.cuda_attention import plan_splits as attention_splits
    from model.kernels.cuda_attention import sparse_attention_cuda, v7_applies

    H, N, C = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    page, K = cfg.index_block_size, cfg.index_topk_blocks
    table, n_pages = tables(B, ctx, page, device)
    seq = torch.arange(B, device=device, dtype=torch.int32)
    pos = torch.full((B,), ctx - 1, device=device, dtype=torch.int64)
    nb = ctx // page
    R = 4  # selections rotated inside one graph-timed call, so replays do not hit in L2

    def make_sel():
        sel = torch.stack([torch.randperm(nb - 1, device=device)[: K - 1] for _ in range(B * N)]).view(
            B, N, K - 1
        )
        return torch.cat([torch.full((B, N, 1), nb - 1, device=device), sel], dim=-1)  # local block first

    def attend(variant, q, kv, sel):
        if variant == "v7" and v7_applies(q, kv):
            return sparse_attention_cuda(q, kv, table, seq, pos, sel, softmax_scale=C**-0.5)
        triton_variant = "v6" if variant == "v7" else variant  # v7's other caches: v6's path
        return sparse_attention_triton(
            q, kv, table, seq, pos, sel, softmax_scale=C**-0.5, variant=triton_variant
        )

    sels = [make_sel() for _ in range(R)]
    sel = sels[0]
    q = torch.randn(B, H, C, device=device, dtype=torch.bfloat16)
    shape = f"B={B} ctx={ctx // 1024}K"
    times = {}
    for dtype in ("nvfp4", "fp8", "bf16"):
        pages = random_pages((n_pages, 2 * N, page), dtype, C, device)
        kv = PagedKV(pages, dtype, torch.tensor(0.01, device=device), torch.tensor(0.02, device=device), C)
        want = naive_selected_attention(q, kv, table, pos, sel, C**-0.5).float()
        n_bytes = B * N * K * page * 2 * pages.shape[-1] * pages.element_size() + 2 * q.nbytes
        t_eager = None
        for variant in variants if dtype != "bf16" else variants[-1:]:
            fn = lambda: attend(variant, q, kv, sel)
            got = fn()
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            t_eager = bench(fn)
            times[dtype, variant] = bench_graph(lambda: [attend(variant, q, kv, s_) for s_ in sels], reps=R)
            is_cuda = variant == "v7" and v7_applies(q, kv)
            v6_tuned = variant in ("v6", "v7") and dtype == "nvfp4"
            tuner = _sparse_attn_v6_tuned if v6_tuned else _sparse_attn_tuned
            cfg_str = str(getattr(tuner, "best_config", None))
            if is_cuda:  # (splits, units of 32 keys per split) of the CUDA launch
                n_sms = torch.cuda.get_device_properties(device).multi_processor_count
                cfg_str = "cuda splits/units {} {}".format(*attention_splits(B * N, K, page, n_sms))
            kind = "cuda" if is_cuda else "triton"
            record("attention", shape, f"{kind} {dtype} {variant}", times[dtype, variant], n_bytes,
                   rel_err_vs_fp32=round(err, 4), config=cfg_str, eager_us=round(t_eager, 1))  # fmt: skip
        t_naive = bench(lambda: naive_selected_attention(q, kv, table, pos, sel, C**-0.5), rep_ms=100)
        record("attention", shape, f"naive-gather {dtype}", t_naive, n_bytes,
               speedup_triton_eager=round(t_naive / t_eager, 2))  # fmt: skip
        if with_torch and dtype == "bf16":
            t_torch = bench(
                lambda: sparse_attention_torch(q, kv, table, seq, pos, pos + 1, sel, softmax_scale=C**-0.5),
                rep_ms=100,
            )
            record("attention", shape, "torch-path bf16", t_torch, n_bytes,
                   speedup_triton_eager=round(t_torch / t_eager, 2))  # fmt: skip
    ratio_rows("attention", shape, times, variants, target=1.5)


# ------------------------------------------------------------------------------------------ moe
def random_nvfp4(E: int, n_out: int, n_in: int, device) -> tuple:
    packed = torch.randint(0, 256, (E, n_out, n_in // 2), dtype=torch.uint8, device=device)
    scales = (torch.rand(E, n_out, n_in // 16, device=device) * 60 + 4).to(torch.float8_e4m3fn)
    return packed, scales, torch.full((E,), 1e-3, device=device)


def gemv_fn(variant: str):
    """The GEMV entry of a version: (x, packed, scales, scale_2) -> bf16 y. v7 is the CUDA kernel of
    model/kernels/cuda_gemv.py; v2 / v3 the Triton launches of nvfp4_linear_triton."""
    if variant == "v7":
        from model.kernels.cuda_gemv import nvfp4_gemv_cuda

        return nvfp4_gemv_cuda
    return lambda x, packed, scales, sc2: nvfp4_linear_triton(x, packed, scales, sc2, variant=variant)


def gemv_config(variant: str, m: int, D: int, device) -> tuple[str, str]:
    """(kernel family, launch configuration) of a version at m rows, for the JSON rows."""
    if variant == "v7":
        from model.kernels.cuda_gemv import n_tiles, split_k

        n_sms = torch.cuda.get_device_properties(device).multi_processor_count
        return "cuda mma split-K", f"n_tiles={n_tiles(min(m, 32))} split={split_k(D, D, min(m, 32), n_sms)}"
    from model.kernels.triton_gemv import _w4a16_gemv_tuned

    is_fma = variant != "v2" and m <= GEMV_MAX_ROWS
    tuner = _w4a16_gemv_tuned if is_fma else _nvfp4_moe_tuned
    return ("split-K FMA" if is_fma else "tile"), str(getattr(tuner, "best_config", None))


def run_gemv(device, D: int = 6144, R: int = 8, variants=OP_DEFAULTS["gemv"]) -> None:
    """W4A16 GEMV, v3 (split-K FMA for m <= 4, else the tile kernel), v2 (tile kernel for every m) and
    v7 (the CUDA tensor-core kernel, every m) vs torch bf16 F.linear, all graph-timed over R rotated
    weight copies (NVFP4: R x 21 MB, bf16: R x 75 MB, so no replay reads its weights from L2), plus
    the eager (host-launched) times."""
    ws = [tuple(t[0] for t in random_nvfp4(1, D, D, device)) for _ in range(R)]
    packed, scales, sc2 = ws[0]
    w_bf16s = [torch.randn(D, D, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(R)]
    from model.kernels.nvfp4_linear import _NVFP4LinearTiled

    for m in (1, 4, 16):
        x = torch.randn(m, D, device=device, dtype=torch.bfloat16)
        want = _NVFP4LinearTiled.apply(x, packed, scales, sc2.reshape(()), 256)
        shape = f"{D}x{D} m={m}"
        t_bf16 = bench_graph(lambda: [F.linear(x, w) for w in w_bf16s], reps=R)
        t_bf16_eager = bench(lambda: F.linear(x, w_bf16s[0]))
        t_naive = bench(lambda: _NVFP4LinearTiled.apply(x, packed, scales, sc2.reshape(()), 256), rep_ms=100)
        record("gemv", shape, "torch bf16", t_bf16, D * D * 2, eager_us=round(t_bf16_eager, 1))
        record("gemv", shape, "naive torch nvfp4", t_naive, D * D * 9 / 16)
        times = {}
        for variant in variants:
            fn = gemv_fn(variant)
            got = fn(x, packed, scales, sc2)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            t_eager = bench(lambda: fn(x, packed, scales, sc2))
            times[variant] = t = bench_graph(lambda: [fn(x, *w) for w in ws], reps=R)
            kernel, config = gemv_config(variant, m, D, device)
            record(
                "gemv",
                shape,
                f"{'cuda' if variant == 'v7' else 'triton'} w4a16 {variant}",
                t,
                D * D * 9 / 16 + 4 * m * D,
                rel_err=round(err, 4),
                gemv_kernel=kernel,
                config=config,
                eager_us=round(t_eager, 1),
                speedup_vs_bf16=round(t_bf16 / t, 2),
                speedup_vs_bf16_eager=round(t_bf16_eager / t_eager, 2),
                target=3.0,
                speedup_vs_naive=round(t_naive / t_eager, 1),
            )
        for variant in variants[1:]:
            record("gemv", shape, f"ratio {variant} vs {variants[0]}", times[variant], 0,
                   speedup=round(times[variants[0]] / times[variant], 2))  # fmt: skip


def run_moe_layer(cfg: ModelConfig, device, T: int = 64, variants: tuple = ("v2",)) -> None:
    """Routed experts (`moe_nvfp4_triton(variant=)`: v2 the tile kernel, v7 the CUDA mma kernel of
    `cuda_moe`) and the whole layer (+ the NVFP4 shared expert) per variant, vs the naive torch NVFP4
    path and a bf16 grouped torch layer; ratio rows v7 vs v2 (routed and layer)."""
    E, D, K = cfg.num_local_experts, cfg.hidden_size, cfg.num_experts_per_tok
    F_, Fs = cfg.moe_intermediate_size, cfg.shared_intermediate_size
    alpha, limit = cfg.swiglu_alpha, cfg.swiglu_limit
    w1, w3, w2 = (
        random_nvfp4(E, F_, D, device),
        random_nvfp4(E, F_, D, device),
        random_nvfp4(E, D, F_, device),
    )
    shared = (random_nvfp4(1, Fs, D, device), random_nvfp4(1, Fs, D, device), random_nvfp4(1, D, Fs, device))
    s1, s3, s2 = (tuple(t[0] for t in w) for w in shared)
    x = torch.randn(T, D, device=device, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=device)[:K] for _ in range(T)])
    wts = torch.rand(T, K, device=device)
    kw = dict(swiglu_alpha=alpha, swiglu_limit=limit)

    nv = ExpertBank(E, D, F_, "nvfp4", device=device)
    for p, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        for suffix, t in zip(("weight", "weight_scale", "weight_scale_2"), w):
            getattr(nv, f"{p}_{suffix}").copy_(t)
    want = moe_experts_torch(x, ids, wts, nv)  # the naive torch NVFP4 path (dequantize tiles + matmul)
    t_naive = bench_slow(lambda: moe_experts_torch(x, ids, wts, nv))
    bf = ExpertBank(E, D, F_, "float", dtype=torch.bfloat16, device=device)
    for p in ("w1", "w3", "w2"):
        getattr(bf, f"{p}_weight").data.normal_(0, 0.02)
    sh = [torch.randn(s, device=device, dtype=torch.bfloat16) * 0.02 for s in ((Fs, D), (Fs, D), (D, Fs))]

    def bf16_layer():
        y = moe_experts_torch(x, ids, wts, bf)
        return y + F.linear(swigluoai(F.linear(x, sh[0]), F.linear(x, sh[1]), alpha, limit), sh[2])

    t_bf16 = bench(bf16_layer)
    n_active = int(torch.unique(ids).numel())
    shape = f"T={T} E={E} top{K} +shared"
    routed_bytes = n_active * 3 * F_ * D * 9 / 16
    record("moe", shape, "naive torch nvfp4 routed", t_naive, routed_bytes)
    record("moe", shape, "torch bf16 grouped layer", t_bf16, (n_active * 3 * F_ * D + 3 * Fs * D) * 2)
    t_routed, t_layer = {}, {}
    for variant in variants:

        def routed():
            return moe_nvfp4_triton(x, ids, wts, w1, w3, w2, **kw, variant=variant)

        def triton_layer():
            return routed() + nvfp4_mlp_triton(x, s1, s3, s2, **kw)

        got = routed()
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        t_routed[variant] = bench(routed)
        t_routed_graph = bench_graph(routed)
        t_layer[variant] = bench(triton_layer)
        t_layer_graph = bench_graph(triton_layer)
        if variant == "v7":
            config = "cuda_moe mma.sync (fixed tiles)"
        else:
            config = str(getattr(_nvfp4_moe_tuned, "best_config", None))
        record("moe", shape, f"triton routed {variant}", t_routed[variant], routed_bytes,
               rel_err_vs_torch=round(err, 4), graph_us=round(t_routed_graph, 1),
               speedup_vs_naive=round(t_naive / t_routed[variant], 1), config=config)  # fmt: skip
        record("moe", shape, f"triton layer {variant}", t_layer[variant], routed_bytes + 3 * Fs * D * 9 / 16,
               graph_us=round(t_layer_graph, 1), speedup_vs_bf16=round(t_bf16 / t_layer[variant], 2),
               target=2.5)  # fmt: skip
    for variant in variants[1:]:
        base = variants[0]
        record("moe", shape, f"ratio routed {variant} vs {base}", t_routed[variant], 0,
               speedup=round(t_routed[base] / t_routed[variant], 2))  # fmt: skip
        record("moe", shape, f"ratio layer {variant} vs {base}", t_layer[variant], 0,
               speedup=round(t_layer[base] / t_layer[variant], 2))  # fmt: skip


# ------------------------------------------------------------------------------------------ append
def run_append(cfg: ModelConfig, device, T: int = 64) -> None:
    """One sparse layer's whole append (NVFP4 K and V, bf16 index keys): the fused launch vs the torch
    path (quantize + scatter per cache), bytes checked equal first."""
    N, C, Ci, page = cfg.num_key_value_heads, cfg.head_dim, cfg.index_head_dim, cfg.index_block_size

    def views():
        kv_pages = torch.zeros(T * 2, 2 * N, page, stored_width("nvfp4", C), dtype=torch.uint8, device=device)
        idx_pages = torch.zeros(T * 2, page, Ci, dtype=torch.bfloat16, device=device)
        scale = torch.tensor(0.01, device=device)
        return PagedKV(kv_pages, "nvfp4", scale, scale, C), PagedIndex(idx_pages, "bf16", scale, Ci)

    k, v = (torch.randn(T, N, C, device=device, dtype=torch.bfloat16) for _ in range(2))
    idx_k = torch.randn(T, Ci, device=device, dtype=torch.bfloat16)
    slots = torch.randperm(T * 2 * page, device=device)[:T]
    (kv, index), (kv_ref, index_ref) = views(), views()
    kv_append(slots, kv, k, v, index, idx_k)
    kv_append_ref(slots, kv_ref, k, v, index_ref, idx_k)
    assert torch.equal(kv.pages, kv_ref.pages) and torch.equal(index.pages, index_ref.pages)
    t = bench(lambda: kv_append(slots, kv, k, v, index, idx_k))
    t_graph = bench_graph(lambda: kv_append(slots, kv, k, v, index, idx_k))
    t_torch = bench(lambda: kv_append_ref(slots, kv_ref, k, v, index_ref, idx_k))
    n_bytes = k.nbytes + v.nbytes + 2 * T * N * stored_width("nvfp4", C) + 2 * idx_k.nbytes  # read + write
    record("append", f"T={T} N={N} C={C} Ci={Ci}", "triton fused K + V + index (one launch)", t, n_bytes,
           graph_us=round(t_graph, 2), speedup_vs_torch=round(t_torch / t, 1))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None, help="write one JSON line per measurement here")
    ap.add_argument("--quick", action="store_true", help="one context (32K) and fewer cases")
    ap.add_argument("--only", nargs="*", default=None, help="subset of: append indexer attention gemv moe")
    ap.add_argument("--contexts", nargs="*", type=int, default=None, help="context lengths (tokens)")
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 64], help="batch sizes")
    ap.add_argument("--variants", nargs="*", default=None, choices=["v2", "v3", "v6", "v7"],
                    help="versions to time side by side, each op taking those it has (indexer v2 v7, "
                         "attention v2 v6, gemv v2 v3 v7, moe v2 v7; the first named is the baseline of the "
                         "ratio rows); default: indexer v7, attention v6, gemv v3, moe v2 v7")  # fmt: skip
    args = ap.parse_args()
    global JSON_PATH
    JSON_PATH = args.json
    if JSON_PATH:
        open(JSON_PATH, "w").close()
    if args.device != "cuda" or not torch.cuda.is_available():
        raise SystemExit(
            "decode_kernels.py times Triton kernels on a CUDA device: use --device cuda on a GPU"
        )
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = ModelConfig.preset("m3.1-flash")
    print(f"device {torch.cuda.get_device_name(device)}; torch {torch.__version__}")
    only = set(args.only or ["append", "indexer", "attention", "gemv", "moe"])
    contexts = args.contexts or ([32768] if args.quick else [32768, 131072])
    t0 = time.time()
    variants = {op: op_variants(op, args.variants) for op in OP_VARIANTS}
    only -= {op for op, names in variants.items() if not names}  # none of the named versions exist there
    if "append" in only:
        run_append(cfg, device)
    for B in args.batches:
        for ctx in contexts:
            small = B * ctx <= 64 * 32768
            if "indexer" in only:
                run_indexer(cfg, B, ctx, device, with_torch=small, variants=variants["indexer"])
            if "attention" in only:
                run_attention(
                    cfg, B, ctx, device, with_torch=small and B == 1, variants=variants["attention"]
                )
            torch.cuda.empty_cache()
    if "gemv" in only:
        run_gemv(device, cfg.hidden_size, variants=variants["gemv"])
    if "moe" in only:
        run_moe_layer(cfg, device, variants=variants["moe"])
    print_ratio_table()
    print(f"total {time.time() - t0:.0f} s")


def print_ratio_table() -> None:
    """The docs/PERFORMANCE.md target ratios measured in this run, one line each (target 0: no target, a
    version-to-version comparison)."""
    print("\nratios (candidate vs baseline, same run):")
    print(f"{'kernel':10s} {'shape':28s} {'comparison':34s} {'ratio':>7s} {'target':>7s}")
    for row in ROWS:
        ratio = row.get("speedup", row.get("speedup_vs_bf16"))
        if ratio is None or not (row["variant"].startswith("ratio") or "target" in row):
            continue
        label = row["variant"] if row["variant"].startswith("ratio") else f"{row['variant']} vs bf16"
        print(f"{row['kernel']:10s} {row['shape']:28s} {label:34s} {ratio:7.2f} {row.get('target', 0):7.1f}")


if __name__ == "__main__":
    main()

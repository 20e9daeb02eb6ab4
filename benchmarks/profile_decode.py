"""Decode-kernel profiling driver for Nsight Compute: one launch per kernel, nothing of the set-up.

Runs each decode kernel of interest once at the benchmark's headline shape, after its autotune and
warm-up, inside cudaProfilerStart/Stop, so

  ncu --profile-from-start off --clock-control none --set full -o OUT python benchmarks/profile_decode.py

profiles exactly one launch per (kernel, cache format) and nothing of the set-up. Why a separate
script: decode_kernels.py times hundreds of launches (autotune, graphs, baselines) that would each be
replayed by ncu. Shapes as decode_kernels.py (M3.1-Flash, B=64, 128K context; GEMV 6144 x 6144).

`--only moe` profiles the routed experts' launches (v7, the default: the CUDA mma kernels of
model/kernels/cuda_moe.py, fused gate/up + swigluoai, then down; the v2 tile kernel: `--variants v2
v7`) at M3.1-Flash widths for --batch tokens (random top-k ids, every token K distinct experts).

Usage: python benchmarks/profile_decode.py [--only indexer attention gemv moe] [--batch 64] [--context 131072]
       [--variants v2 v6 v7]   (each op profiles the named versions it has, else its default: indexer
       v7 (the CUDA kernel of model/kernels/cuda_indexer.py), attention v6, moe v7; attention v2 vs v6:
       --only attention --variants v2 v6; indexer v2 vs v7: --only indexer --variants v2 v7)
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.kernels.triton_gemv import nvfp4_linear_triton
from model.kernels.triton_indexer import index_select_blocks_triton
from model.kernels.triton_moe import moe_nvfp4_triton
from model.kernels.triton_sparse_attention import sparse_attention_triton
from model.kv_cache import PagedKV

sys.path.insert(1, str(Path(__file__).resolve().parent))
from decode_kernels import OP_VARIANTS, random_nvfp4, random_pages, tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--only",
        nargs="*",
        default=["indexer", "attention", "gemv"],
        choices=["indexer", "attention", "gemv", "moe"],
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--variants", nargs="*", default=None, choices=["v2", "v3", "v6", "v7"])
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    cfg = ModelConfig.preset("m3.1-flash")
    B, ctx = args.batch, args.context
    table, n_pages = tables(B, ctx, cfg.index_block_size, device)
    seq = torch.arange(B, device=device, dtype=torch.int32)
    pos = torch.full((B,), ctx - 1, device=device, dtype=torch.int64)
    launches = []  # (name, fn): warmed up first, then profiled once each

    def versions(op: str, default: str) -> list[str]:
        picked = [v for v in args.variants or [] if v in OP_VARIANTS[op]]
        return picked or [default]

    if "indexer" in args.only:
        N, C = cfg.index_n_heads, cfg.index_head_dim
        q_i = torch.randn(B, N, C, device=device, dtype=torch.bfloat16)
        kw = dict(
            topk=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks
        )
        scale = torch.tensor(0.01, device=device)
        for dtype in ("nvfp4", "fp8"):
            pages = random_pages((n_pages, cfg.index_block_size), dtype, C, device)
            for v in versions("indexer", "v7"):
                fn = lambda p=pages, d=dtype, v=v: index_select_blocks_triton(
                    q_i, p, d, scale, table, seq, pos, **kw, variant=v
                )
                launches.append((f"indexer {dtype} {v}", fn))
    if "attention" in args.only:
        H, N, C, K = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.index_topk_blocks
        nb = ctx // cfg.index_block_size
        sel = torch.stack([torch.randperm(nb - 1, device=device)[: K - 1] for _ in range(B * N)]).view(
            B, N, K - 1
        )
        sel = torch.cat([torch.full((B, N, 1), nb - 1, device=device), sel], dim=-1)
        q_a = torch.randn(B, H, C, device=device, dtype=torch.bfloat16)
        for dtype in ("nvfp4", "fp8"):
            pages = random_pages((n_pages, 2 * N, cfg.index_block_size), dtype, C, device)
            kv = PagedKV(
                pages, dtype, torch.tensor(0.01, device=device), torch.tensor(0.02, device=device), C
            )
            for v in versions("attention", "v6"):
                fn = lambda kv=kv, v=v: sparse_attention_triton(
                    q_a, kv, table, seq, pos, sel, softmax_scale=C**-0.5, variant=v
                )
                launches.append((f"attention {dtype} {v}", fn))
    if "gemv" in args.only:
        D = cfg.hidden_size
        packed, scales, sc2 = (t[0] for t in random_nvfp4(1, D, D, device))
        w = torch.randn(D, D, device=device, dtype=torch.bfloat16)
        for m in (1, 4):
            x = torch.randn(m, D, device=device, dtype=torch.bfloat16)
            launches.append((f"gemv w4a16 m={m}", lambda x=x: nvfp4_linear_triton(x, packed, scales, sc2)))
            launches.append((f"gemv bf16 m={m}", lambda x=x: F.linear(x, w)))
    if "moe" in args.only:
        E, D, K, F_ = (
            cfg.num_local_experts,
            cfg.hidden_size,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
        )
        w1, w3 = random_nvfp4(E, F_, D, device), random_nvfp4(E, F_, D, device)
        w2 = random_nvfp4(E, D, F_, device)
        x = torch.randn(B, D, device=device, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=device)[:K] for _ in range(B)])
        wts = torch.rand(B, K, device=device)
        kw = dict(swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)
        for v in versions("moe", "v7"):  # v2 tile kernel, v7 CUDA mma (cuda_moe)
            launches.append(
                (
                    f"moe routed {v} T={B}",
                    lambda v=v: moe_nvfp4_triton(x, ids, wts, w1, w3, w2, **kw, variant=v),
                )
            )
    for _, fn in launches:  # autotune + compile outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    for name, fn in launches:
        print(f"profiling: {name}", flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()

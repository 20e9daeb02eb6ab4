"""EXPERIMENT (session 9): indexer v6 at B=64 / 1, 32K / 128K: programs per SM x block-scale loads."""
import json, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))
import torch
from model.config import ModelConfig
import model.kernels.triton_indexer as ti
from decode_kernels import random_pages, tables, bench_graph

cfg = ModelConfig.preset("m3.1-flash")
dev = torch.device("cuda")
N, C, page, K = cfg.index_n_heads, cfg.index_head_dim, cfg.index_block_size, cfg.index_topk_blocks
kw = dict(topk=K, local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks)
out = open(sys.argv[1], "a") if len(sys.argv) > 1 else None
for B, ctx in ((64, 131072), (64, 32768), (1, 131072)):
    table, n_pages = tables(B, ctx, page, dev)
    seq = torch.arange(B, device=dev, dtype=torch.int32)
    pos = torch.full((B,), ctx - 1, device=dev, dtype=torch.int64)
    q = torch.randn(B, N, C, device=dev, dtype=torch.bfloat16)
    pages = random_pages((n_pages, page), "nvfp4", C, dev)
    scale = torch.tensor(0.01, device=dev)
    nbytes = B * ctx * pages.shape[-1]
    ref = None
    for pps in (4, 8, 16):
        for rows in (False, True):
            ti.PROGRAMS_PER_SM, ti._V6_SCALE_ROWS = pps, rows
            ti._index_scores_v6_tuned.cache.clear()
            fn = lambda: ti.index_select_blocks_triton(q, pages, "nvfp4", scale, table, seq, pos, **kw, variant="v6")
            got = fn()
            same = True if ref is None else bool(torch.equal(got, ref))
            ref = got if ref is None else ref
            us = bench_graph(fn)
            row = dict(B=B, ctx=ctx, pps=pps, scale_rows=rows, us=round(us, 1), tb_s=round(nbytes / us / 1e6, 3),
                       same=same, config=str(ti._index_scores_v6_tuned.best_config))
            print(row, flush=True)
            if out:
                out.write(json.dumps(row) + "\n"); out.flush()

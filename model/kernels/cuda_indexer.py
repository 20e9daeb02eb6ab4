"""CUDA NVFP4 lightning-indexer decode scores on tensor cores (v7): keys on the mma.sync M side.

What: `index_block_scores_cuda(q, pages, scale, block_tables, seq_idx, positions)` = the block scores
[T, N, P] of `triton_indexer.index_block_scores_triton` (entries of blocks past a row's own block left
unwritten) for NVFP4 index keys of head dim 128 in packed 72-byte rows, bf16 queries, N <= 8 heads and
pages of a multiple of 64 tokens; `index_block_scores_triton(variant="v7")` dispatches here.
Why: the indexer streams every cached key at every decode step, so it should run at the HBM roofline; the
Triton keys-on-M kernel it replaced (v6, deleted; 0.55x this at B = 64, 128K) was latency / occupancy bound
(121 registers, 19.8% occupancy, DRAM 29-32%). Here each warp streams whole 64-key chunks (4.6 KB TMA copies
into a per-warp shared-memory ring), every lane reads its key rows' code bytes in the order of its
mma.m16n8k16 A fragment (two scale blocks per row and lane: a fixed k permutation, free because the 128 dims
are summed inside the warp) and decodes them with three integer ops and one bf16x2 FMA per value pair, as
model/kernels/cuda_moe.cu. The kernel, its fragment mapping and the decode arithmetic are documented in
model/kernels/cuda_indexer.cu.

Invariants: semantics are `model.kernels.indexer`'s (raw dot, max over the causally visible keys of a
block, the positive global scale applied after the max); the decoded key e2m1 * s * 2^-7 is exact in
bf16 and each product with the bf16 query exact in fp32, so scores equal the reference up to fp32
summation order. No host sync, no atomics (deterministic), CUDA-graph safe after a first call (which
compiles the extension). Imported on CPU (tests emulate the lanes); compiled only on CUDA.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from model.kernels.cuda_common import (
    device_info,
    graph_us,
    index_tensor,
    load_kernels,
    ragged_tables,
    random_nvfp4_rows,
)

# Legend: T query rows, N index heads, C index head dim, B sequences, P block-table width, K top-k.
# Mirrors of the kernel's constants (cuda_indexer.cu).
HEAD_DIM = 128  # C: the only index head dim served
ROW_BYTES = HEAD_DIM // 2 + HEAD_DIM // 16  # 72: 64 code bytes then 8 e4m3 scale bytes
MAX_HEADS = 8  # the N of mma.m16n8k16
WARPS = 4  # independent warps per CTA, each on its own blocks
CHUNK = 64  # key rows per TMA copy (a page must hold whole chunks)
CTAS_PER_SM = 4  # 4 x 54 KB of shared memory per SM, <= 128 registers (__launch_bounds__)
WAVES = 4  # CTAs ~ WAVES x CTAS_PER_SM x SMs: small tail, and B = 1 still spreads over the SMs
MIN_BLOCKS_PER_WARP = 1  # a split hands each warp at least one block (when the row has enough)


# ------------------------------------------------------------------------------------------ mapping
def k_of(step: int, kappa: int, t: int) -> int:
    """Index dim held at MMA column kappa of k-step `step` (0..7) by lanes of thread-in-group t: lane
    t holds whole scale blocks t (steps 0-3) and t + 4 (steps 4-7); the halves of an A register are
    values e and e + 4 of a 32-bit code word (the decode's nibble distance)."""
    return (
        16 * (t + 4 * (step >> 2)) + 8 * ((step >> 1) & 1) + 4 * (kappa & 1) + 2 * (step & 1) + (kappa >= 8)
    )


def key_of_row(m: int) -> int:
    """Key (within a 16-key tile) on MMA row m = g + 8h: conflict-free 8-byte shared loads."""
    g, h = m % 8, m // 8
    return 4 * (g & 3) + (g >> 2) + 2 * h


# ------------------------------------------------------------------------------------------ launch
def plan_splits(n_rows: int, n_blocks: int, n_sms: int, waves: int = WAVES) -> tuple[int, int]:
    """(splits, blocks per split) from shapes only (no sync): about `waves` waves of CTAS_PER_SM CTAs
    per SM, blocks per split a multiple of WARPS and >= WARPS * MIN_BLOCKS_PER_WARP where the row has
    that many (B = 64, 128K, 132 SMs: 32 splits of 32 blocks; B = 1: 256 splits of 4)."""
    want = max(1, -(-waves * CTAS_PER_SM * n_sms // max(1, n_rows)))
    bps = -(-n_blocks // want)
    bps = max(min(WARPS * MIN_BLOCKS_PER_WARP, n_blocks), bps)
    bps = -(-bps // WARPS) * WARPS
    return -(-n_blocks // bps), bps


@functools.cache
def _extension(capability: tuple[int, int]):
    """The compiled kernel (`cuda_common.load_kernels`)."""
    decl = (
        "void index_scores_launch(torch::Tensor q, torch::Tensor pages, torch::Tensor bt, torch::Tensor seq, "
        "torch::Tensor pos, torch::Tensor scale, torch::Tensor out, int64_t bps, int64_t splits);"
    )
    return load_kernels(
        "cuda_indexer", decl, ("index_scores_launch",), capability,
        op="index_block_scores_cuda", min_capability=(9, 0), needs="cp.async.bulk, mbarrier tx",
    )  # fmt: skip


def v7_applies(index_q_TNC: torch.Tensor, pages: torch.Tensor, dtype: str) -> bool:
    """Whether `variant="v7"` runs this kernel: CUDA sm_90+, NVFP4 keys of head dim 128 in packed
    72-byte rows (16-byte aligned pages of a multiple of 64 tokens), bf16 queries, <= 8 heads."""
    if not (index_q_TNC.is_cuda and pages.is_cuda) or dtype not in ("nvfp4", "nvfp4_4over6"):
        return False
    if device_info(index_q_TNC.device)[0] < (9, 0):
        return False
    _, N, C = index_q_TNC.shape
    return (
        C == HEAD_DIM and N <= MAX_HEADS and index_q_TNC.dtype == torch.bfloat16
        and pages.dtype == torch.uint8
        and pages.ndim == 3 and pages.shape[1] % CHUNK == 0 and pages.shape[2] == ROW_BYTES
        and pages.stride(2) == 1 and pages.stride(1) == ROW_BYTES and pages.stride(0) % 16 == 0
        and pages.data_ptr() % 16 == 0
    )  # fmt: skip


@torch.compiler.disable(recursive=True)
def index_block_scores_cuda(
    index_q_TNC: torch.Tensor, pages: torch.Tensor, scale: torch.Tensor, block_tables_BP: torch.Tensor,
    seq_idx_T: torch.Tensor, positions_T: torch.Tensor, *, out_TNP: torch.Tensor | None = None,
    waves: int = WAVES,
) -> torch.Tensor:  # fmt: skip
    """Block scores [T, N, P] fp32 for NVFP4 index pages uint8 [pages, page, 72] (see `v7_applies`);
    scale: the fp32 dequant-side global (0-d). Entries of blocks past a row's own block are left as
    they were (unwritten). Positions must lie inside the rows' allocated pages (as for the tile kernel)."""
    T, N, _ = index_q_TNC.shape
    if not v7_applies(index_q_TNC, pages, "nvfp4"):
        raise ValueError(
            "index_block_scores_cuda: need CUDA sm_90+, bf16 queries [T, N <= 8, 128] and NVFP4 pages uint8 "
            f"[pages, page % 64 == 0, 72] packed and 16-byte aligned; got q {index_q_TNC.dtype} "
            f"{tuple(index_q_TNC.shape)} on {index_q_TNC.device}, pages {pages.dtype} {tuple(pages.shape)} "
            f"strides {pages.stride()}"
        )
    if index_q_TNC.stride(-1) != 1 or index_q_TNC.stride(1) % 8 or index_q_TNC.stride(0) % 8 \
            or index_q_TNC.data_ptr() % 16:  # fmt: skip
        index_q_TNC = index_q_TNC.contiguous()  # the kernel reads query rows in 16-byte vectors
    P = block_tables_BP.shape[1]
    if out_TNP is None:
        out_TNP = torch.empty((T, N, P), dtype=torch.float32, device=index_q_TNC.device)
    elif out_TNP.dtype != torch.float32 or tuple(out_TNP.shape) != (T, N, P) or out_TNP.stride(-1) != 1:
        raise ValueError(
            f"index_block_scores_cuda: out_TNP must be fp32 {(T, N, P)} with unit last stride, got "
            f"{out_TNP.dtype} {tuple(out_TNP.shape)} strides {out_TNP.stride()}"
        )
    for name, x in (("scale", scale), ("block_tables_BP", block_tables_BP), ("seq_idx_T", seq_idx_T),
                    ("positions_T", positions_T), ("out_TNP", out_TNP)):  # fmt: skip
        if x.device != index_q_TNC.device:
            raise ValueError(f"index_block_scores_cuda: {name} on {x.device}, q on {index_q_TNC.device}")
    if T == 0 or P == 0:
        return out_TNP
    op = "index_block_scores_cuda"
    block_tables_BP = index_tensor(block_tables_BP, op, "block_tables_BP")
    seq_idx_T = index_tensor(seq_idx_T, op, "seq_idx_T")
    positions_T = index_tensor(positions_T, op, "positions_T")
    scale = scale.reshape(1)
    if scale.dtype != torch.float32:
        scale = scale.float()
    capability, n_sms = device_info(index_q_TNC.device)
    splits, bps = plan_splits(T, P, n_sms, waves)
    _extension(capability).index_scores_launch(
        index_q_TNC, pages, block_tables_BP, seq_idx_T, positions_T, scale, out_TNP, bps, splits
    )
    return out_TNP


# ------------------------------------------------------------------------------------------ self-check
def block_scores_ref(index_q_TNC, pages, scale, block_tables_BP, seq_idx_T, positions_T) -> torch.Tensor:
    """Block scores [T, N, P] in torch (fp32 dequantized keys, `indexer.index_select_blocks_ref`'s
    numerics); -inf where a block is past the row's own block."""
    from model import nvfp4

    T, N, _ = index_q_TNC.shape
    page, P = pages.shape[1], block_tables_BP.shape[1]
    out = torch.full((T, N, P), float("-inf"), device=index_q_TNC.device)
    for r in range(T):  # SYNC: reference only
        pos = int(positions_T[r])
        nb = pos // page + 1
        table = block_tables_BP[int(seq_idx_T[r]), :nb].long()
        keys_SC = nvfp4.kv_dequantize(pages[table].reshape(nb * page, ROW_BYTES), scale, torch.float32)
        s_NS = index_q_TNC[r].float() @ keys_SC.T
        s_NS[:, pos + 1 :] = float("-inf")
        out[r, :, :nb] = s_NS.view(N, nb, page).amax(-1)
    return out


def _case(B: int, ctx: int, page: int, N: int, gen: torch.Generator, ragged: bool, special: bool, dev):
    """Inputs of B sequences of up to ctx tokens (ragged: random lengths), block tables padded with -1."""
    lens = torch.randint(1, ctx + 1, (B,), generator=gen).tolist() if ragged else [ctx] * B
    lens[0] = ctx  # the longest row reaches the table's width
    table, n_pages = ragged_tables(lens, page, gen)
    pages = random_nvfp4_rows((n_pages, page), dev, torch.Generator(device=dev).manual_seed(B + ctx), special)
    q = (torch.randn(B, N, HEAD_DIM, generator=gen) * 2).to(torch.bfloat16).to(dev)
    seq = torch.arange(B, dtype=torch.int32)
    pos = torch.tensor(lens).long() - 1
    return q, pages, table.to(dev), seq.to(dev), pos.to(dev)


def _time_shape(B: int, ctx: int, gen: torch.Generator, scale: torch.Tensor, kw: dict, reps: int) -> dict:
    """v7 (scores alone, and with the top-k launch) vs the byte-wise tile kernel (v2) and the FP8 tile
    kernel at one shape, each
    a CUDA graph of one call replayed `reps` times (B = 64: keys far beyond the 60 MB L2; B = 1: they
    fit in it), plus v7's split heuristic at half and twice its waves."""
    from model.kernels.triton_indexer import index_block_scores_triton, index_select_blocks_triton

    dev = torch.device("cuda")
    q, pages, table, seq, pos = _case(B, ctx, 128, 4, gen, False, False, dev)
    fp8 = (torch.randn(pages.shape[0], 128, HEAD_DIM, device=dev) * 4).to(torch.float8_e4m3fn)
    fp8 = fp8.view(torch.uint8)
    row = dict(kind="time", B=B, ctx=ctx)
    v7s = index_block_scores_cuda(q, pages, scale, table, seq, pos)
    v2s = index_block_scores_triton(q, pages, "nvfp4", scale, table, seq, pos, variant="v2")
    cand = (torch.arange(table.shape[1], device=dev) <= (pos // 128)[:, None, None]).expand_as(v7s)
    row["err_v7_vs_v2"] = ((v7s - v2s).abs()[cand].max() / v2s.abs()[cand].max()).item()

    def select(variant: str, keys: torch.Tensor = pages, dtype: str = "nvfp4"):
        return lambda: index_select_blocks_triton(
            q, keys, dtype, scale, table, seq, pos, **kw, variant=variant
        )

    row["select_equal_v2"] = round((select("v7")() == select("v2")()).float().mean().item(), 4)
    timed = {
        "v7_scores": lambda: index_block_scores_cuda(q, pages, scale, table, seq, pos),
        "v7": select("v7"),
        "v2": select("v2"),
        "fp8": select("v7", fp8, "fp8"),
    }
    for waves in (WAVES // 2, WAVES * 2):  # the split heuristic's neighbours
        timed[f"v7_scores_waves{waves}"] = functools.partial(
            index_block_scores_cuda, q, pages, scale, table, seq, pos, waves=waves
        )
    for name, fn in timed.items():
        row[f"{name}_us"] = graph_us(fn, reps)
    nv_bytes, fp8_bytes = B * ctx * ROW_BYTES, B * ctx * HEAD_DIM
    for name in ("v7_scores", "v7", "v2"):
        row[f"{name}_tb_s"] = nv_bytes / row[f"{name}_us"] / 1e6
        row[f"{name}_of_4.17"] = row[f"{name}_tb_s"] / 4.17
    row["fp8_tb_s"] = fp8_bytes / row["fp8_us"] / 1e6
    row["v7_vs_fp8"] = row["fp8_us"] / row["v7_us"]
    row["v2_vs_fp8"] = row["fp8_us"] / row["v2_us"]
    row["v7_vs_v2"] = row["v2_us"] / row["v7_us"]
    return row


def _selftest(reps: int, quick: bool) -> list[dict]:
    from model.kernels.triton_indexer import index_block_scores_triton, index_select_blocks_triton

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor(0.01, device=dev)
    kw = dict(topk=16, local_blocks=1, init_blocks=0)
    rows = []
    # Correctness: ragged lengths (not multiples of a block), -1 padded tables, special scale bytes.
    cases = ((1, 1000, 128, 4, False), (4, 5000, 128, 4, True), (64, 3000, 128, 4, False),
             (3, 700, 64, 8, True), (5, 900, 128, 3, False))  # fmt: skip
    for B, ctx, page, N, special in cases:
        q, pages, table, seq, pos = _case(B, ctx, page, N, gen, True, special, dev)
        ref = block_scores_ref(q, pages, scale, table, seq, pos)
        got = index_block_scores_cuda(
            q, pages, scale, table, seq, pos, out_TNP=torch.full_like(ref, float("nan"))
        )
        v2 = index_block_scores_triton(q, pages, "nvfp4", scale, table, seq, pos, variant="v2")
        cand = torch.isfinite(ref)
        norm = ref[cand].abs().max().item()
        sel7 = index_select_blocks_triton(q, pages, "nvfp4", scale, table, seq, pos, **kw, variant="v7")
        sel2 = index_select_blocks_triton(q, pages, "nvfp4", scale, table, seq, pos, **kw, variant="v2")
        row = dict(kind="check", B=B, ctx=ctx, page=page, N=N, special=special,
                   err_vs_ref=(got[cand] - ref[cand]).abs().max().item() / norm,
                   err_v2_vs_ref=(v2[cand] - ref[cand]).abs().max().item() / norm,
                   untouched_kept=bool(got[~cand].isnan().all()),
                   select_equal_v2=round((sel7 == sel2).float().mean().item(), 4))  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    # Timings: M3.1-Flash indexer shapes (4 heads, 128 dims, blocks of 128, top-16).
    shapes = [(1, 32768), (64, 32768)] if quick else [(1, 32768), (1, 131072), (64, 32768), (64, 131072)]
    for B, ctx in shapes:
        row = _time_shape(B, ctx, gen, scale, kw, reps)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description="v7 CUDA indexer self-check: errors vs reference / v2, timings")
    ap.add_argument("--selftest", action="store_true", required=True)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="32K contexts only")
    args = ap.parse_args()
    rows = _selftest(args.reps, args.quick)
    print(f"{'B':>3} {'ctx':>7} {'v7 us':>8} {'v2 us':>8} {'fp8 us':>8} {'v7 TB/s':>8} {'of 4.17':>8} "
          f"{'v7/fp8':>7} {'v2/fp8':>7} {'v7/v2':>6} {'sel=v2':>7}")  # fmt: skip
    for r in rows:
        if r["kind"] == "time":
            print(f"{r['B']:3d} {r['ctx']:7d} {r['v7_us']:8.1f} {r['v2_us']:8.1f} {r['fp8_us']:8.1f} "
                  f"{r['v7_scores_tb_s']:8.3f} {r['v7_scores_of_4.17']:8.1%} {r['v7_vs_fp8']:7.2f} "
                  f"{r['v2_vs_fp8']:7.2f} {r['v7_vs_v2']:6.2f} {r['select_equal_v2']:7.4f}")  # fmt: skip
    bad = [r for r in rows if r["kind"] == "check" and (r["err_vs_ref"] > 1e-4 or not r["untouched_kept"])]
    print("CHECKS", f"FAILED: {json.dumps(bad)}" if bad else "passed (within 1e-4 of the reference's max)")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

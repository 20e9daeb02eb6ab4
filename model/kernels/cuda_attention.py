"""CUDA NVFP4 sparse-attention decode on tensor cores (v7): K and V decoded in registers.

What: `sparse_attention_cuda(q, kv_cache, block_tables, seq_idx, positions, selected)` = the op of
`model.kernels.sparse_attention` (same arguments as the Triton v6 path) for NVFP4 K/V pages of head
dim 128 in packed 72-byte rows, bf16 queries and up to 16 query heads per KV group (M3.1-Flash: 16);
`sparse_attention(..., variant="v7")` dispatches here where `v7_applies`, else to v6.
Why: decode attention reads only the indexer's selected pages, so it should run at the HBM roofline
over those bytes; Triton v6 is occupancy / instruction bound (30% of it at B = 64, 128K). Here each
warp streams 32-key units (K and V rows, TMA copies into a per-warp shared-memory ring) and decodes
them in registers straight into bf16 mma.m16n8k16 operands: keys on M for Q.K (the indexer's decode),
P moved into the A operand of P.V by movmatrix, V's code words paired across keys by one prmt. The
kernel, its fragment maps and its softmax are documented in model/kernels/cuda_attention.cu.

Invariants: semantics are `sparse_attention_ref`'s (keys <= the query's position in its group's
selected blocks, dense when `selected` is None; a group with no visible key gives zeros); decoded K
and V equal `nvfp4.kv_dequantize` exactly, every product is exact in fp32, P is rounded to bf16 for
P.V (the row sums use fp32 P), the output to bf16. Splits are merged by log-sum-exp in split order: no
atomics on data, deterministic, no host sync, CUDA-graph safe after a first call (which compiles the
extension and takes the stream's split counters, `cuda_common.split_counters`). Imported on CPU
(tests emulate the lanes); compiled only on CUDA.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from typing import Literal

import torch

from model.kernels.cuda_common import (
    device_info,
    graph_us,
    index_tensor,
    load_kernels,
    ragged_tables,
    random_nvfp4_rows,
    split_counters,
)
from model.kv_cache import NVFP4_DTYPES, PagedKV

# Legend: T tokens, H query heads, N kv heads, G = H / N, C head dim, B sequences, P block-table width,
# K selected slots. Mirrors of the kernel's constants (cuda_attention.cu).
HEAD_DIM = 128  # C: the only head dim served
ROW_BYTES = HEAD_DIM // 2 + HEAD_DIM // 16  # 72: 64 code bytes then 8 e4m3 scale bytes
MAX_GROUP_HEADS = 16  # G: P.V's M side (one m16 tile); Q.K uses ceil(G / 8) n8 tiles
WARPS = 4  # independent warps per CTA
UNIT = 32  # keys per unit (a page must hold whole units)
CTAS_PER_SM = 3  # 3 x 59 KB of shared memory per SM, <= 168 registers (__launch_bounds__)
PART_FLOATS = 64 * 32 + 2 * 16  # one split's partial: O [64 registers][32 lanes], m[16], l[16]
WAVES = 3  # CTAs ~ WAVES x CTAS_PER_SM x SMs
AttentionVariant = Literal["v6", "v7"]


# ------------------------------------------------------------------------------------------ mapping
def sig(x: int) -> int:
    """The row interleave of the kernel (`sig`): 0, 1, 2, 3 -> 0, 2, 1, 3."""
    return 2 * (x & 1) + (x >> 1)


def key_of_row(m: int) -> int:
    """Key (within a 16-key tile) on MMA row m of S^T: the rows lanes read in Q.K, and (through the
    movmatrix transposes) the keys of P.V's k index; chosen so every shared load is conflict-free."""
    return 4 * sig((m & 7) >> 1) + 2 * (m & 1) + (m >> 3)


def qk_block(t: int, half: int) -> int:
    """Scale block (16 dims) lane t holds in Q.K steps 0-3 (half 0) and 4-7 (half 1)."""
    return (t & 1) + 4 * (t >> 1) + 2 * half


def k_of(step: int, kappa: int, t: int) -> int:
    """Head dim at MMA column kappa of Q.K k-step `step` (0..7) for lanes of thread-in-group t: whole
    scale blocks per lane; the halves of an A register are values e and e + 4 of a 32-bit code word."""
    return (
        16 * qk_block(t, step >> 2) + 8 * ((step >> 1) & 1) + 4 * (kappa & 1) + 2 * (step & 1) + (kappa >= 8)
    )


def pv_key(t: int, reg: int, half: int) -> int:
    """Key of P.V's B register `reg` (0, 1), low (half 0) or high half, for lanes t: the key that
    P's A-operand column 2t + half + 8 reg holds after the movmatrix of S^T rows 8 reg + 2t + half."""
    return key_of_row(8 * reg + 2 * t + half)


def pv_dim(n_tile: int, col: int) -> int:
    """Head dim of P.V n-tile `n_tile` (0..15), column `col` (0..7): lane group g decodes block g."""
    return 16 * col + n_tile


# ------------------------------------------------------------------------------------------ launch
def plan_splits(n_pairs: int, n_slots: int, page: int, n_sms: int, waves: int = WAVES) -> tuple[int, int]:
    """(splits, units per split) from shapes only (no sync): about `waves` waves of CTAS_PER_SM CTAs
    per SM over the T x N (token, group) pairs, a multiple of WARPS units per split (each warp the same
    count), at least one unit per warp. B = 64, 128K (256 pairs, 16 slots of 4 units, 132 SMs): 4
    splits of 16 units; B = 1: 16 splits of 4 (one unit per warp)."""
    units = max(1, n_slots * (page // UNIT))
    want = max(1, -(-waves * CTAS_PER_SM * n_sms // max(1, n_pairs)))
    ups = -(-units // want)
    ups = max(WARPS, -(-ups // WARPS) * WARPS)
    return -(-units // ups), ups


@functools.cache
def _extension(capability: tuple[int, int]):
    """The compiled kernel (`cuda_common.load_kernels`)."""
    decl = (
        "void sparse_attn_launch(torch::Tensor q, torch::Tensor pages, torch::Tensor bt, torch::Tensor seq, "
        "torch::Tensor pos, torch::Tensor sel, torch::Tensor k_scale, torch::Tensor v_scale, "
        "double sm_scale_log2, torch::Tensor out, torch::Tensor part, torch::Tensor counters, "
        "int64_t heads, int64_t ups, int64_t splits);"
    )
    return load_kernels(
        "cuda_attention", decl, ("sparse_attn_launch",), capability,
        op="sparse_attention_cuda", min_capability=(9, 0), needs="cp.async.bulk, mbarriers",
    )  # fmt: skip


def v7_applies(q_THC: torch.Tensor, kv_cache: PagedKV) -> bool:
    """Whether the CUDA kernel runs this call: CUDA sm_90+, bf16 queries [T, H, 128], NVFP4 pages uint8
    [P, 2N, page % 32 == 0, 72] contiguous and 16-byte aligned, G = H / N <= 16."""
    pages = kv_cache.pages
    if not (q_THC.is_cuda and pages.is_cuda) or kv_cache.dtype not in NVFP4_DTYPES:
        return False
    if device_info(q_THC.device)[0] < (9, 0):
        return False
    if q_THC.ndim != 3 or q_THC.dtype != torch.bfloat16 or q_THC.shape[2] != HEAD_DIM:
        return False
    if pages.ndim != 4 or pages.dtype != torch.uint8 or pages.shape[3] != ROW_BYTES or pages.shape[1] % 2:
        return False
    N, H = pages.shape[1] // 2, q_THC.shape[1]
    return (
        H % N == 0 and H // N <= MAX_GROUP_HEADS and pages.shape[2] % UNIT == 0
        and pages.is_contiguous() and pages.data_ptr() % 16 == 0
    )  # fmt: skip


@torch.compiler.disable(recursive=True)
def sparse_attention_cuda(
    q_THC: torch.Tensor, kv_cache: PagedKV, block_tables_BP: torch.Tensor, seq_idx_T: torch.Tensor,
    positions_T: torch.Tensor, selected_TNK: torch.Tensor | None, *, softmax_scale: float,
    out_THC: torch.Tensor | None = None, waves: int = WAVES,
) -> torch.Tensor:  # fmt: skip
    """[T, H, C] bf16 (written into `out_THC` if given); see the module notes and `v7_applies`.
    selected_TNK: distinct blocks, left-packed, -1 padded, never past the query's block (None: every
    block). Positions must lie inside the rows' allocated pages (< 2^31)."""
    if not v7_applies(q_THC, kv_cache):
        raise ValueError(
            "sparse_attention_cuda: need CUDA sm_90+, bf16 q [T, H, 128] and an NVFP4 cache uint8 [P, 2N, "
            f"page % 32 == 0, 72] (contiguous, 16-byte aligned) with H / N <= {MAX_GROUP_HEADS}; got q "
            f"{q_THC.dtype} {tuple(q_THC.shape)} on {q_THC.device}, cache {kv_cache.dtype} "
            f"{tuple(kv_cache.pages.shape)} {kv_cache.pages.dtype} strides {kv_cache.pages.stride()}"
        )
    T, H, C = q_THC.shape
    pages = kv_cache.pages
    N, page = pages.shape[1] // 2, pages.shape[2]
    dev = q_THC.device
    if q_THC.stride(-1) != 1 or q_THC.stride(1) % 8 or q_THC.stride(0) % 8 or q_THC.data_ptr() % 16:
        q_THC = q_THC.contiguous()  # the kernel reads query rows in 16-byte vectors
    if out_THC is None:
        out_THC = torch.empty((T, H, C), dtype=torch.bfloat16, device=dev)
    elif (out_THC.dtype != torch.bfloat16 or tuple(out_THC.shape) != (T, H, C) or out_THC.stride(-1) != 1
          or out_THC.stride(1) % 4 or out_THC.stride(0) % 4 or out_THC.data_ptr() % 8):  # fmt: skip
        raise ValueError(
            f"sparse_attention_cuda: out_THC must be bf16 {(T, H, C)} with unit last stride and 8-byte "
            f"aligned rows, got {out_THC.dtype} {tuple(out_THC.shape)} strides {out_THC.stride()}"
        )
    tensors = (("block_tables_BP", block_tables_BP), ("seq_idx_T", seq_idx_T), ("positions_T", positions_T),
               ("k_scale", kv_cache.k_scale), ("v_scale", kv_cache.v_scale))  # fmt: skip
    for name, x in tensors + ((("selected_TNK", selected_TNK),) if selected_TNK is not None else ()):
        if x.device != dev:
            raise ValueError(f"sparse_attention_cuda: {name} on {x.device}, q on {dev}")
    if selected_TNK is not None and (selected_TNK.ndim != 3 or tuple(selected_TNK.shape[:2]) != (T, N)):
        raise ValueError(f"sparse_attention_cuda: selected_TNK must be [T={T}, N={N}, K], got "
                         f"{tuple(selected_TNK.shape)}")  # fmt: skip
    if T == 0:
        return out_THC
    if selected_TNK is not None and selected_TNK.shape[2] == 0:  # no slots: no key (the launcher
        return out_THC.zero_()  # reads an empty selection as a dense walk)
    op = "sparse_attention_cuda"
    block_tables_BP = index_tensor(block_tables_BP, op, "block_tables_BP")
    seq_idx_T = index_tensor(seq_idx_T, op, "seq_idx_T")
    positions_T = index_tensor(positions_T, op, "positions_T")
    if selected_TNK is None:
        sel, n_slots = torch.empty(0, dtype=torch.int32, device=dev), block_tables_BP.shape[1]
    else:
        sel, n_slots = index_tensor(selected_TNK, op, "selected_TNK"), selected_TNK.shape[2]
    k_scale, v_scale = (s.reshape(1).float() for s in (kv_cache.k_scale, kv_cache.v_scale))
    capability, n_sms = device_info(dev)
    splits, ups = plan_splits(T * N, n_slots, page, n_sms, waves)
    if splits > 1:
        part = torch.empty(T * N * splits * PART_FLOATS, dtype=torch.float32, device=dev)
    else:
        part = torch.empty(1, dtype=torch.float32, device=dev)
    counters = split_counters(dev, T * N)
    _extension(capability).sparse_attn_launch(
        q_THC, pages, block_tables_BP, seq_idx_T, positions_T, sel, k_scale, v_scale,
        softmax_scale * math.log2(math.e), out_THC, part, counters, H // N, ups, splits,
    )  # fmt: skip
    return out_THC


# ------------------------------------------------------------------------------------------ self-check
def decode_problem(B: int, ctx: int, N: int, G: int, K: int, device, seed: int, page: int = 128):
    """M3-style decode inputs: B sequences of ctx tokens (one query each, at ctx - 1), per-group
    selections of K distinct blocks (the query's own block first), a random page permutation."""
    gen = torch.Generator(device=device).manual_seed(seed)
    nb = -(-ctx // page)
    table = torch.randperm(B * nb, generator=gen, device=device).int().view(B, nb)
    kv = PagedKV(random_nvfp4_rows((B * nb, 2 * N, page), device, gen), "nvfp4",
                 torch.tensor(0.01, device=device), torch.tensor(0.02, device=device), HEAD_DIM)  # fmt: skip
    q = torch.randn(B, N * G, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    seq = torch.arange(B, dtype=torch.int32, device=device)
    pos = torch.full((B,), ctx - 1, dtype=torch.int64, device=device)
    return q, kv, table, seq, pos, selections(B, N, K, nb, device, gen)


def selections(B: int, N: int, K: int, nb: int, device, gen: torch.Generator) -> torch.Tensor:
    """[B, N, K] int64: the last block, then K - 1 distinct earlier ones (-1 padded where nb < K)."""
    sel = torch.full((B * N, K), -1, dtype=torch.long, device=device)
    sel[:, 0] = nb - 1
    n_rest = min(K - 1, nb - 1)
    if n_rest > 0:
        earlier = torch.rand(B * N, nb - 1, generator=gen, device=device).argsort(-1)
        sel[:, 1 : 1 + n_rest] = earlier[:, :n_rest]
    return sel.view(B, N, K)


def selected_pages_ref(q_THC, kv: PagedKV, table, pos, sel, scale) -> torch.Tensor:
    """`sparse_attention_ref` for one query per sequence, gathering only the selected pages (fast
    enough for B = 64 at 128K): fp32 dequantized K / V, masked softmax; [T, H, C] fp32."""
    from model.kv_cache import dequantize_kv

    T, H, C = q_THC.shape
    N, page = kv.pages.shape[1] // 2, kv.pages.shape[2]
    pages_TNK = table.long().gather(1, sel.clamp(min=0).view(T, -1)).view(T, N, -1)
    heads = torch.arange(N, device=q_THC.device)[None, :, None]
    k = dequantize_kv(kv.pages[pages_TNK, 2 * heads], kv.dtype, kv.k_scale, C)  # [T, N, K, page, C]
    v = dequantize_kv(kv.pages[pages_TNK, 2 * heads + 1], kv.dtype, kv.v_scale, C)
    tok = sel[..., None] * page + torch.arange(page, device=q_THC.device)
    ok = (tok <= pos[:, None, None, None]) & (sel[..., None] >= 0)
    s = torch.einsum("tngc,tnkpc->tngkp", q_THC.float().view(T, N, -1, C), k) * scale
    s = s.masked_fill(~ok[:, :, None], float("-inf")).flatten(-2)
    p = torch.softmax(s, -1).nan_to_num(0.0).view(*s.shape[:-1], -1, page)
    return torch.einsum("tngkp,tnkpc->tngc", p, v).reshape(T, H, C)


def _time_shape(B: int, ctx: int, reps: int, R: int = 4) -> dict:
    """v7 vs v6 (NVFP4) vs the FP8 kernel at one M3.1-Flash decode shape (N = 4, G = 16, top-16 of
    128-token blocks), each a CUDA graph of R calls over R rotated selections (so L2 does not hold the
    pages between calls) replayed `reps` times; v7 also at half and twice its waves."""
    from model.kernels.triton_sparse_attention import sparse_attention_triton

    dev = torch.device("cuda")
    N, G, K, page = 4, 16, 16, 128
    q, kv, table, seq, pos, sel = decode_problem(B, ctx, N, G, K, dev, seed=B + ctx)
    gen = torch.Generator(device=dev).manual_seed(1)
    sels = [sel] + [selections(B, N, K, table.shape[1], dev, gen) for _ in range(R - 1)]
    fp8_pages = torch.randint(0, 256, (*kv.pages.shape[:3], HEAD_DIM), generator=gen, device=dev,
                              dtype=torch.uint8)  # fmt: skip
    fp8_pages[(fp8_pages & 0x7F) == 0x7F] = 0x7E  # e4m3 bytes without NaN (the timing ignores values)
    fp8 = PagedKV(fp8_pages, "fp8", kv.k_scale, kv.v_scale, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    want = selected_pages_ref(q, kv, table, pos, sel, scale)
    norm = want.abs().max().item()
    row = dict(kind="time", B=B, ctx=ctx)
    v7 = sparse_attention_cuda(q, kv, table, seq, pos, sel, softmax_scale=scale)
    v6 = sparse_attention_triton(q, kv, table, seq, pos, sel, softmax_scale=scale, variant="v6")
    row["err_v7"] = (v7.float() - want).abs().max().item() / norm
    row["err_v6"] = (v6.float() - want).abs().max().item() / norm
    row["deterministic"] = bool(torch.equal(v7, sparse_attention_cuda(q, kv, table, seq, pos, sel,
                                                                      softmax_scale=scale)))  # fmt: skip

    def calls(fn):
        return lambda: [fn(s) for s in sels]

    timed = {
        "v7": calls(lambda s: sparse_attention_cuda(q, kv, table, seq, pos, s, softmax_scale=scale)),
        "v6": calls(lambda s: sparse_attention_triton(q, kv, table, seq, pos, s, softmax_scale=scale)),
        "fp8": calls(lambda s: sparse_attention_triton(q, fp8, table, seq, pos, s, softmax_scale=scale)),
    }
    for w in (max(1, WAVES // 2), WAVES * 2):  # the split heuristic's neighbours
        timed[f"v7_waves{w}"] = calls(
            lambda s, w=w: sparse_attention_cuda(q, kv, table, seq, pos, s, softmax_scale=scale, waves=w)
        )
    for name, fn in timed.items():
        fn()  # autotune / compile outside the graph
        row[f"{name}_us"] = graph_us(fn, reps) / R
    n_sel = int((sel >= 0).sum())  # selected (group, block) pairs: every one is read whole
    nv_bytes = n_sel * page * 2 * ROW_BYTES + 2 * q.nbytes  # K + V rows, q in, out
    row["bytes"] = nv_bytes
    for name in ("v7", "v6"):
        row[f"{name}_tb_s"] = nv_bytes / row[f"{name}_us"] / 1e6
        row[f"{name}_of_4.17"] = row[f"{name}_tb_s"] / 4.17
    row["fp8_tb_s"] = (n_sel * page * 2 * HEAD_DIM + 2 * q.nbytes) / row["fp8_us"] / 1e6
    row["v7_vs_fp8"] = row["fp8_us"] / row["v7_us"]
    row["v6_vs_fp8"] = row["fp8_us"] / row["v6_us"]
    row["v7_vs_v6"] = row["v6_us"] / row["v7_us"]
    return row


def _check_case(B, lens, G, K, seed, dense=False, calib=448.0) -> dict:
    """v7 against `sparse_attention_ref` on ragged sequences (partial last pages, a group with no
    selected block, -1 slots), output poisoned."""
    from model.kernels.sparse_attention import sparse_attention_ref

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    N, page = 2, 128
    q, kv, table, seq, pos, sel = ragged_problem(lens, N, G, K, page, gen, calib)
    cpu = (q, kv, table, seq, pos, torch.tensor(lens))
    want = sparse_attention_ref(*cpu, None if dense else sel, softmax_scale=HEAD_DIM**-0.5).float()
    kv_d = PagedKV(kv.pages.to(dev), kv.dtype, kv.k_scale.to(dev), kv.v_scale.to(dev), HEAD_DIM)
    got = sparse_attention_cuda(q.to(dev), kv_d, table.to(dev), seq.to(dev), pos.to(dev),
                                None if dense else sel.to(dev), softmax_scale=HEAD_DIM**-0.5,
                                out_THC=torch.full_like(q, float("nan")).to(dev))  # fmt: skip
    err = (got.float().cpu() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    return dict(kind="check", B=B, G=G, K=K, dense=dense, calib=calib, err_vs_ref=err,
                finite=bool(torch.isfinite(got).all()))  # fmt: skip


def quantized_kv(n_pages: int, page: int, N: int, gen: torch.Generator, calib: float, dtype: str = "nvfp4",
                 head_dim: int = HEAD_DIM) -> PagedKV:  # fmt: skip
    """A CPU paged K / V cache (pages [n_pages, 2N, page, row bytes]) from real values, k ~ 2 N(0, 1)
    and v ~ N(0, 1) quantized (`quantize_kv`) at global scales amax / calib (448: block scales <= 74.7;
    2688, the weight rule: block scales up to 448)."""
    from model.kv_cache import quantize_kv

    k = torch.randn(n_pages, page, N, head_dim, generator=gen) * 2
    v = torch.randn(n_pages, page, N, head_dim, generator=gen)
    ks, vs = torch.tensor(float(k.abs().max()) / calib), torch.tensor(float(v.abs().max()) / calib)
    stored = torch.stack([quantize_kv(k, dtype, ks), quantize_kv(v, dtype, vs)], dim=3)
    pages = stored.reshape(n_pages, page, 2 * N, -1).transpose(1, 2).contiguous()  # [P, 2N, page, X]
    return PagedKV(pages, dtype, ks, vs, head_dim)


def visible_selections(pos_T: torch.Tensor, N: int, K: int, page: int, gen: torch.Generator) -> torch.Tensor:
    """[T, N, K] int64: per query row and group, up to K distinct blocks among the row's visible ones
    (0 .. pos // page; none at pos -1) in shuffled slot order, -1 padded."""
    sel = torch.full((len(pos_T), N, K), -1, dtype=torch.long)
    for t in range(len(pos_T)):
        nb = int(pos_T[t]) // page + 1
        for n in range(N):
            pick = torch.randperm(nb, generator=gen)[:K]
            sel[t, n, : len(pick)] = pick
    return sel


def ragged_problem(lens: list[int], N: int, G: int, K: int, page: int, gen: torch.Generator, calib: float):
    """CPU inputs from real K / V (`quantized_kv`) for sequences of `lens` tokens, one query each at its
    last position, `visible_selections` of up to K blocks and group 0 of row 0 with none; table padded
    with -1."""
    table, n_pages = ragged_tables(lens, page, gen)
    kv = quantized_kv(n_pages, page, N, gen, calib)
    B = len(lens)
    q = (torch.randn(B, N * G, HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)
    pos = torch.tensor(lens).long() - 1
    sel = visible_selections(pos, N, K, page, gen)
    sel[0, 0] = -1
    return q, kv, table, torch.arange(B, dtype=torch.int32), pos, sel


def _selftest(reps: int, quick: bool) -> list[dict]:
    rows = []
    cases = [(3, [300, 129, 1000], 16, 4, False), (5, [5000, 128, 77, 4096, 3000], 16, 16, False),
             (4, [700, 1, 260, 2049], 2, 8, False), (2, [900, 333], 16, 16, True),
             (3, [1500, 40, 640], 5, 16, False)]  # fmt: skip
    for i, (B, lens, G, K, dense) in enumerate(cases):
        for calib in (448.0, 2688.0):
            row = _check_case(B, lens, G, K, seed=i, dense=dense, calib=calib)
            print(json.dumps(row), flush=True)
            rows.append(row)
    shapes = [(64, 8192), (64, 131072)] if quick else [(b, c) for c in (8192, 131072) for b in (1, 8, 64)]
    for B, ctx in shapes:
        row = _time_shape(B, ctx, reps)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description="v7 CUDA sparse attention self-check: errors vs reference, times"
    )
    ap.add_argument("--selftest", action="store_true", required=True)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="B = 64 only")
    args = ap.parse_args()
    rows = _selftest(args.reps, args.quick)
    print(f"{'B':>3} {'ctx':>7} {'v7 us':>8} {'v6 us':>8} {'fp8 us':>8} {'v7 TB/s':>8} {'of 4.17':>8} "
          f"{'v7/fp8':>7} {'v6/fp8':>7} {'v7/v6':>6} {'err v7':>8} {'err v6':>8}")  # fmt: skip
    for r in rows:
        if r["kind"] == "time":
            print(f"{r['B']:3d} {r['ctx']:7d} {r['v7_us']:8.1f} {r['v6_us']:8.1f} {r['fp8_us']:8.1f} "
                  f"{r['v7_tb_s']:8.3f} {r['v7_of_4.17']:8.1%} {r['v7_vs_fp8']:7.2f} {r['v6_vs_fp8']:7.2f} "
                  f"{r['v7_vs_v6']:6.2f} {r['err_v7']:8.2e} {r['err_v6']:8.2e}")  # fmt: skip
    bad = [r for r in rows if r["kind"] == "check" and not (r["err_vs_ref"] <= 2**-7 and r["finite"])]
    bad += [r for r in rows if r["kind"] == "time" and not (r["err_v7"] <= 2**-7 and r["deterministic"])]
    print("CHECKS", f"FAILED: {json.dumps(bad)}" if bad else "passed (within 2^-7 of the reference's max)")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

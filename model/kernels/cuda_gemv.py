"""CUDA NVFP4 W4A16 decode GEMV on tensor cores (v7): one NVFP4 matrix times m <= 64 bf16 rows.

What: `nvfp4_gemv_cuda(x, packed, scales, scale_2, out_dtype)` = x [m, K] @ dequant(W [N, K]).T, the op
of `nvfp4_linear` (its opt-in CUDA variant "v7"). Why: a decode GEMV is a pure weight stream (0.5625
B per weight, 3.56x fewer bytes than bf16), and the FMA GEMV (Triton v3) reaches only bf16's time.
This is the routed-MoE v7 design (model/kernels/cuda_moe.cu) with one matrix: bf16 mma.m16n8k16 with
16 output features on M and 8 x rows per n-tile on N (m <= 8: one n-tile, <= 16 two, <= 32 four;
more rows take several launches), the canonical NVFP4 storage read in place and decoded in
registers, K split across CTAs. Each warp streams its chunks through a 3- or 4-stage cp.async ring
in shared memory, so it keeps 3 chunks (6.9 KB) in flight from its first instruction (6144 x 6144 is
24 chunks per CTA: a register double buffer would pay one memory latency per chunk). The splits are
summed in split order through global partials and ticket counters (`reduce="ticket"`, the default)
or inside a thread-block cluster from the other CTAs' shared memory (`reduce="cluster"`: no fence /
atomic / reload chain at the kernel's end). Kernel, fragment map, layouts: model/kernels/cuda_gemv.cu.

Invariants: no host sync; CUDA-graph safe after a warm-up call (the extension and the split counters
are made on first use); every launch leaves its split counters at 0; K splits summed in split order
and warps in warp order (deterministic; both reductions give the same bits for the same split; the
split depends on the shape and on m only through the n-tile count, so for m <= 16 a row's result
does not depend on m). The decoded weight e2m1 * s * 2^-7 is exact in bf16 and every product with x
exact in fp32: the result is the exact-weight product up to fp32 accumulation and one rounding to
out_dtype, where `nvfp4_linear_ref` rounds the weights to bf16 first (< 2^-8 relative per weight).
Imported on CPU (tests emulate the lanes); compiled only on CUDA.
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Literal

import torch

from model.kernels.cuda_common import device_info, graph_us, load_kernels, split_counters

# Legend: m rows of x (MMA N side, 8 per n-tile), K input features, N output features; W as stored:
# packed uint8 [N, K/2] (low nibble = even input), scales e4m3 [N, K/16], scale_2 fp32 (one value).
TILE_N = 64  # output features per CTA (4 MMA tiles of 16): N must be a multiple
CHUNK_K = 64  # inputs per warp step (4 NVFP4 blocks): K must be a multiple
WARPS = 4  # K-interleaved warps per CTA
ROWS_PER_LAUNCH = 32  # the kernel's largest n-tile count (4) times 8
MAX_SPLIT_K = 16
MAX_CLUSTER = 8  # the portable thread-block cluster size: the cluster reduction's largest split
SplitReduce = Literal["ticket", "cluster"]
"""How K splits are summed: "ticket" global partials + counters (any split), "cluster" one thread-block
cluster per column group, partials read from the other CTAs' shared memory: at the largest split <=
MAX_CLUSTER whose clusters are all resident at once (asked of the driver once per device and shape
class; a GPC holds whole clusters only), the ticket path where none is."""
DEFAULT_REDUCE: SplitReduce = "ticket"
_last_reduction = ["none"]  # the latest launch's: "none" (one split), "ticket <split>" or "cluster <split>"
MIN_CHUNKS_PER_WARP = 2  # a split hands each warp at least this many chunks where K allows


def n_tiles(m: int) -> int:
    """MMA n-tiles (8 x rows each) of a launch of m <= ROWS_PER_LAUNCH rows: the kernel's template NT."""
    return 1 if m <= 8 else 2 if m <= 16 else 4


def ctas_per_sm(m: int) -> int:
    """Resident CTAs per SM (cuda_gemv.cu `Shape::CTAS_PER_SM`): shared memory allows 3 of 53 / 70 KB
    (NT = 1, 2), 2 of 77 KB (NT = 4)."""
    return 3 if n_tiles(m) <= 2 else 2


def split_k(n_out: int, n_in: int, m: int, n_sms: int, max_split: int = MAX_SPLIT_K) -> int:
    """K splits from shapes only (no sync): the most that keep the grid within one wave of resident
    CTAs (the wave is the whole kernel: a second one would start after the first finished its
    loads), and at least MIN_CHUNKS_PER_WARP chunks per warp. 6144 x 6144 on 132 SMs, m <= 16: 96
    column groups x 4 splits = 384 CTAs on 396 slots (2.9 per SM: every SM streams; 5 splits would
    exceed a wave), 24 chunks per CTA = 6 per warp, 3 of them in flight from the start. 2048 x 6144
    (N x K): 32 groups x 12 splits (8 chunks each; 8 for the cluster reduction); 6144 x 2048: 96 x 4
    (2 chunks per warp)."""
    groups = n_out // TILE_N
    wave = ctas_per_sm(m) * n_sms
    return max(1, min(wave // max(groups, 1), max_split, n_in // CHUNK_K // (WARPS * MIN_CHUNKS_PER_WARP)))


def last_reduction() -> str:
    """The split reduction the latest `nvfp4_gemv_cuda` launch ran: "none" (one split), "ticket S" or
    "cluster S" for S splits (diagnostics: the self-check and tests report it)."""
    return _last_reduction[0]


# ------------------------------------------------------------------------------------------ launch
@functools.cache
def _extension(capability: tuple[int, int]):
    """The compiled kernel (`cuda_common.load_kernels`)."""
    decl = (
        "int64_t gemv_launch(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor sc2, "
        "torch::Tensor out, torch::Tensor part, torch::Tensor counters, int64_t split, bool cluster);"
    )
    return load_kernels("cuda_gemv", decl, ("gemv_launch",), capability, op="nvfp4_gemv_cuda",
                        min_capability=(8, 9), needs="cvt e4m3x2 -> f16x2")  # fmt: skip


def gemv_supported(x_MK: torch.Tensor, packed_NK2: torch.Tensor, scales_NK16: torch.Tensor) -> bool:
    """Whether `nvfp4_gemv_cuda` takes these operands as they are (the dispatch's test): CUDA bf16 x
    with unit last stride, K and N multiples of 64, packed and scales contiguous with 16- and 4-byte
    aligned addresses (the kernel's cp.async copies read them in place)."""
    N, K = packed_NK2.shape[0], 2 * packed_NK2.shape[-1]
    return (
        x_MK.is_cuda and x_MK.dtype == torch.bfloat16 and x_MK.dim() == 2 and x_MK.stride(-1) == 1
        and K % CHUNK_K == 0 and N % TILE_N == 0
        and packed_NK2.is_contiguous() and scales_NK16.is_contiguous()
        and packed_NK2.data_ptr() % 16 == 0 and scales_NK16.data_ptr() % 4 == 0
    )  # fmt: skip


def _check(x_MK, packed_NK2, scales_NK16, scale_2, out_dtype) -> None:
    if not x_MK.is_cuda or x_MK.dtype != torch.bfloat16 or x_MK.dim() != 2 or x_MK.stride(-1) != 1:
        raise ValueError(
            f"nvfp4_gemv_cuda: x must be a 2-D CUDA bf16 tensor with unit last stride, got "
            f"{x_MK.device} {x_MK.dtype} {tuple(x_MK.shape)}, strides {x_MK.stride()}"
        )
    K = x_MK.shape[1]
    if K % CHUNK_K:
        raise ValueError(f"nvfp4_gemv_cuda: K = x.shape[1] = {K} must be a multiple of {CHUNK_K}")
    if packed_NK2.dtype != torch.uint8 or packed_NK2.dim() != 2 or packed_NK2.shape[1] * 2 != K:
        raise ValueError(f"nvfp4_gemv_cuda: packed must be uint8 [N, K/2 = {K // 2}], got "
                         f"{packed_NK2.dtype} {tuple(packed_NK2.shape)}")  # fmt: skip
    N = packed_NK2.shape[0]
    if N % TILE_N:
        raise ValueError(f"nvfp4_gemv_cuda: N = packed.shape[0] = {N} must be a multiple of {TILE_N}")
    if scales_NK16.dtype != torch.float8_e4m3fn or tuple(scales_NK16.shape) != (N, K // 16):
        raise ValueError(f"nvfp4_gemv_cuda: scales must be float8_e4m3fn [{N}, {K // 16}], got "
                         f"{scales_NK16.dtype} {tuple(scales_NK16.shape)}")  # fmt: skip
    if scale_2.dtype != torch.float32 or scale_2.numel() != 1:
        raise ValueError(f"nvfp4_gemv_cuda: scale_2 must be one fp32 value, got {scale_2.dtype} "
                         f"{tuple(scale_2.shape)}")  # fmt: skip
    devices = {t.device for t in (x_MK, packed_NK2, scales_NK16, scale_2)}
    if len(devices) != 1:
        raise ValueError(f"nvfp4_gemv_cuda: tensors on several devices: {sorted(map(str, devices))}")
    if not (packed_NK2.is_contiguous() and scales_NK16.is_contiguous()):
        raise ValueError("nvfp4_gemv_cuda: packed and scales must be contiguous (read in place, not copied)")
    if packed_NK2.data_ptr() % 16 or scales_NK16.data_ptr() % 4:
        raise ValueError(f"nvfp4_gemv_cuda: packed must be 16-byte and scales 4-byte aligned, got addresses "
                         f"{packed_NK2.data_ptr():#x}, {scales_NK16.data_ptr():#x}")  # fmt: skip
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"nvfp4_gemv_cuda: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")


@torch.compiler.disable(recursive=True)
def nvfp4_gemv_cuda(
    x_MK: torch.Tensor, packed_NK2: torch.Tensor, scales_NK16: torch.Tensor, scale_2: torch.Tensor,
    out_dtype: torch.dtype | None = None, *, out_MN: torch.Tensor | None = None,
    reduce: SplitReduce = DEFAULT_REDUCE,
) -> torch.Tensor:  # fmt: skip
    """y [m, N] = x [m, K] @ dequant(W).T in `out_dtype` (default bf16; fp16 and fp32 too: one rounding
    of the fp32 sum) for bf16 x on CUDA; W read in place (packed uint8 [N, K/2] and scales e4m3
    [N, K/16] contiguous, 16- / 4-byte aligned; K, N multiples of 64). out_MN: an [m, N] tensor of
    out_dtype with unit last stride to write into (graph capture into a static buffer). reduce: how the
    K splits are summed (`SplitReduce`). No host sync."""
    if reduce not in SplitReduce.__args__:
        raise ValueError(f"nvfp4_gemv_cuda: reduce must be one of {SplitReduce.__args__}, got {reduce!r}")
    out_dtype = out_dtype or (out_MN.dtype if out_MN is not None else torch.bfloat16)
    _check(x_MK, packed_NK2, scales_NK16, scale_2, out_dtype)
    M, N = x_MK.shape[0], packed_NK2.shape[0]
    if out_MN is None:
        out_MN = torch.empty((M, N), dtype=out_dtype, device=x_MK.device)
    elif out_MN.dtype != out_dtype or tuple(out_MN.shape) != (M, N) or out_MN.stride(-1) != 1:
        raise ValueError(f"nvfp4_gemv_cuda: out_MN must be {out_dtype} [{M}, {N}] with unit last stride, got "
                         f"{out_MN.dtype} {tuple(out_MN.shape)} strides {out_MN.stride()}")  # fmt: skip
    if M == 0:
        return out_MN
    if x_MK.stride(0) % 8 or x_MK.data_ptr() % 16:  # the kernel copies x rows in 16-byte pieces
        x_MK = x_MK.clone(memory_format=torch.contiguous_format)
    capability, n_sms = device_info(x_MK.device)
    ext = _extension(capability)
    scale_bytes, sc2 = scales_NK16.view(torch.uint8), scale_2.reshape(1)
    groups = N // TILE_N
    counters = split_counters(x_MK.device, groups)
    cluster = reduce == "cluster"
    for r0 in range(0, M, ROWS_PER_LAUNCH):  # m > 32: one launch per 32 rows (each reads W again)
        m = min(ROWS_PER_LAUNCH, M - r0)
        split = split_k(N, 2 * packed_NK2.shape[1], m, n_sms, MAX_CLUSTER if cluster else MAX_SPLIT_K)
        n_part = split * groups * 4 * n_tiles(m) * 32 * WARPS if split > 1 else 1
        part = torch.empty((n_part,), dtype=torch.float32, device=x_MK.device)
        rows = slice(r0, r0 + m)
        c_split = ext.gemv_launch(x_MK[rows], packed_NK2, scale_bytes, sc2, out_MN[rows], part, counters,
                                  split, cluster)  # fmt: skip
        _last_reduction[0] = f"cluster {c_split}" if c_split else f"ticket {split}" if split > 1 else "none"
    return out_MN


# ------------------------------------------------------------------------------------------ self-check
def random_nvfp4(N: int, K: int, device, seed: int = 0, special: bool = False):
    """(packed, scales, scale_2) of random codes (all 16), e4m3 scales in [4, 64] and scale_2 1e-3,
    drawn on `device`. special: scale bytes 0x00-0x3F instead (zero, the e4m3 subnormals 0x01-0x07, up
    to 1.875) and scale_2 2^-6."""
    gen = torch.Generator(device=device).manual_seed(seed)
    packed = torch.randint(0, 256, (N, K // 2), generator=gen, device=device).to(torch.uint8)
    if special:
        sbytes = torch.randint(0, 0x40, (N, K // 16), generator=gen, device=device).to(torch.uint8)
        scales = sbytes.view(torch.float8_e4m3fn)
    else:
        scales = (torch.rand(N, K // 16, generator=gen, device=device) * 60 + 4).to(torch.float8_e4m3fn)
    return packed, scales, torch.full((), 2.0**-6 if special else 1e-3, device=device)


def _rotated_us(call, operands: list, reps: int) -> float:
    """Microseconds per call of `call(*operands[i])`, one CUDA graph of a call per operand set (rotated
    copies: the sets together exceed the 60 MB L2, so every call reads its weights from HBM)."""
    return graph_us(lambda: [call(*ops) for ops in operands], reps) / len(operands)


def _selftest(shapes: list[tuple[int, int]], rows: list[int], copies: int, reps: int) -> list[dict]:
    """Compile, check against `nvfp4_linear_ref` and the exact fp64 product, time v7 (ticket and
    cluster reductions; `cluster_equal`: the same bits where the splits agree, `cluster_ran`: whether
    the clusters fitted) and torch bf16 F.linear (weights of the same shape) over `copies` rotated
    weight sets, and v3 (Triton) where it is importable. Errors are max |got - other| / max |exact|:
    ~2^-9 (bf16 output rounding) vs the exact product, a few times that vs the reference (its bf16
    weights)."""
    import torch.nn.functional as F

    from model import nvfp4
    from model.kernels.nvfp4_linear import nvfp4_linear_ref

    try:
        from model.kernels.triton_gemv import nvfp4_linear_triton
    except ImportError:  # pragma: no cover - Triton is on every CUDA install the project uses
        nvfp4_linear_triton = None
    dev = torch.device("cuda", torch.cuda.current_device())
    out = []
    for N, K in shapes:
        ws = [random_nvfp4(N, K, dev, seed=i) for i in range(copies)]
        w_bf16 = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        dq = nvfp4.dequantize(nvfp4.NVFP4Tensor(*ws[0]), torch.float32).double()
        for m in rows:
            gen = torch.Generator(device="cpu").manual_seed(m)
            x = torch.randn(m, K, generator=gen).to(torch.bfloat16).to(dev)
            exact = x.double() @ dq.T
            scale = exact.abs().max().item()
            got = nvfp4_gemv_cuda(x, *ws[0]).double()
            ticket_ran = last_reduction()
            row = dict(N=N, K=K, m=m, split=split_k(N, K, min(m, ROWS_PER_LAUNCH), device_info(dev)[1]))
            row["err_vs_exact"] = (got - exact).abs().max().item() / scale
            row["err_vs_ref"] = (got - nvfp4_linear_ref(x, *ws[0]).double()).abs().max().item() / scale
            row["deterministic"] = bool(torch.equal(nvfp4_gemv_cuda(x, *ws[0]), nvfp4_gemv_cuda(x, *ws[0])))
            row["v7_us"] = _rotated_us(functools.partial(nvfp4_gemv_cuda, x), ws, reps)
            cluster = functools.partial(nvfp4_gemv_cuda, x, reduce="cluster")
            by_cluster = cluster(*ws[0])
            row["ticket_ran"], row["cluster_ran"] = ticket_ran, last_reduction()
            row["cluster_equal"] = bool(torch.equal(by_cluster, nvfp4_gemv_cuda(x, *ws[0])))
            row["v7_cluster_us"] = _rotated_us(cluster, ws, reps)
            row["bf16_us"] = _rotated_us(functools.partial(F.linear, x), [(w,) for w in w_bf16], reps)
            if nvfp4_linear_triton is not None and m <= 16:
                row["v3_us"] = _rotated_us(functools.partial(nvfp4_linear_triton, x), ws, reps)
            n_bytes = N * K * 9 / 16 + 2 * m * (K + N)
            row["v7_tb_s"] = n_bytes / row["v7_us"] / 1e6
            row["v7_share_of_4.17"] = row["v7_tb_s"] / 4.17
            row["v7_vs_bf16"] = row["bf16_us"] / row["v7_us"]
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="v7 CUDA W4A16 GEMV self-check: errors vs reference, timings")
    ap.add_argument("--selftest", action="store_true", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--copies", type=int, default=8, help="rotated weight sets (8 x 21 MB > the 60 MB L2)")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 8, 16])
    ap.add_argument("--quick", action="store_true", help="6144 x 6144 only")
    args = ap.parse_args()
    shapes = [(6144, 6144)] if args.quick else [(6144, 6144), (2048, 6144), (6144, 2048)]
    rows = _selftest(shapes, args.rows, args.copies, args.reps)
    print(f"{'N':>5} {'K':>5} {'m':>3} {'split':>5} {'err exact':>9} {'err ref':>9} {'v7 us':>7} "
          f"{'cluster':>7} {'v3 us':>7} {'bf16 us':>7} {'v7/bf16':>7} {'v7 TB/s':>7} "
          f"{'of 4.17':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['N']:5d} {r['K']:5d} {r['m']:3d} {r['split']:5d} {r['err_vs_exact']:9.2e} "
              f"{r['err_vs_ref']:9.2e} {r['v7_us']:7.2f} {r['v7_cluster_us']:7.2f} "
              f"{r.get('v3_us', float('nan')):7.2f} {r['bf16_us']:7.2f} {r['v7_vs_bf16']:7.2f} "
              f"{r['v7_tb_s']:7.3f} {r['v7_share_of_4.17']:7.0%}")  # fmt: skip


if __name__ == "__main__":
    main()

"""CUDA NVFP4 MoE decode on tensor cores (v7): routed experts as bf16 mma.sync with weights on M.

What: `moe_nvfp4_mma(x, ids, weights, w1, w3, w2, ...)` = sum_k w[t, k] * expert_{ids[t, k]}(x[t]), the
op and calling convention of `triton_moe.moe_nvfp4_triton` (its default on CUDA, `variant="v7"`).
Why: decode batches put ~2 slots on each touched expert, so the routed part is a weight stream. The
kernels read the bank's canonical NVFP4 storage in place (no repack, no second copy of the weights):
each CTA copies a round of raw codes and scales (one whole 128-byte line of each of its 64 weight
rows) into a 3-stage shared-memory ring with cp.async, and each lane decodes its A fragments from
there in registers (three integer ops per value pair and one bf16x2 multiply by the block scale;
nothing decoded is stored) for mma.m16n8k16. Staging is what makes the canonical layout as cheap as a
lane-ordered copy: reading the fragments straight from global memory touched 8-16 cache lines per
load instruction (two 8-byte code loads and a 4-byte scale word per lane, tile and chunk: ~272 L1
line lookups per warp and GLU chunk, 65% of HBM at T = 64 on the H200), the copies touch 4 (codes)
and 8 (scales) and the shared reads are conflict-free (~128 lookups), and 2 rounds per CTA are in
flight without holding weight registers. Tokens sit on the MMA's N side: slot rows grouped by expert in
blocks of 8 (`triton_moe._group_by_expert`), or of 16 (two column groups sharing each decoded
fragment, `rows_per_block`) once experts average >= 6 slots, so an expert's weights are read once
for up to 16 slots. Two launches (gate / up + swigluoai, then down x router weight), then
`moe_combine`. The kernels, their fragment mapping, the stage layout and the decode arithmetic are
documented in model/kernels/cuda_moe.cu.

Invariants: no host sync; CUDA-graph safe after a warm-up call (the split counters and the compiled
extension are made on first use); every launch leaves its split counters at 0 and writes every valid
act / y row; K splits summed in split order (deterministic). The decoded weight e2m1 * s * 2^-7 is
exact in bf16 and the products x * w exact in fp32, so results differ from `moe_experts_ref` (weights
bf16(e2m1 * s * scale_2)) by < 2^-8 relative per weight; gate, up, act and y round to bf16 where the
tile kernel (v2) rounds them. By construction the staged kernels give the unstaged version's results
bit for bit (the same registers reach every MMA in the same order; 16-row blocks only add MMA
columns). Imported on CPU (tests); compiled only on CUDA. ptxas (nvcc 13, sm_90a), registers /
spills: GLU 113 / 0, down 95 / 0 (8-row blocks); GLU 160 / 0, down 128 / 0 (16-row blocks); shared
memory per CTA 54 / 27 KB (GLU / down): 4 GLU and 5 down CTAs per SM at 8-row blocks.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from model.kernels.cuda_common import device_info, eager_us, graph_us, load_kernels, split_counters

# Legend: T tokens, D model dim, F expert ffn dim, E experts, K top-k, S = T*K slots, MB row blocks of
# RB = 8 or 16 slot rows, N / I a projection's output / input features. Weights as the bank stores them:
# packed uint8 [E, N, I/2] (low nibble = even input), scales e4m3 [E, N, I/16], scale_2 fp32 [E].
ROW_BLOCK = 8  # RB: slot rows per block = the N of mma.m16n8k16 (wide blocks: 2 RB)
WIDE_BLOCK_SLOTS = 6  # mean slots per expert from which blocks hold 2 * ROW_BLOCK rows (`rows_per_block`)
TILE_N = 64  # output features per CTA (4 tiles of 16), so N must be a multiple of 64
CHUNK_K = 64  # inputs per lane step (4 scale blocks over the 4 lanes of a group)
MAX_SLOTS_PER_EXPERT = 8  # v7 dispatch bound on T*K / E (larger batches: the v2 tile kernel)
MAX_SPLIT_K = 16
CTAS_PER_SM = 3  # the split heuristic's occupancy (the kernels' __launch_bounds__ minimum); kept at 3
# when the staged kernels fit 4 GLU CTAs per SM: the split count fixes the summation order (bits)
POISON_INTERMEDIATES = False  # tests set True: act and y start as NaN, so a missed row shows


# ------------------------------------------------------------------------------------------ launch
@functools.cache
def _extension(capability: tuple[int, int]):
    """The compiled kernels (`cuda_common.load_kernels`)."""
    tensors = ["x", "rows", "block_expert", "router_w", "wa", "sa", "sc2a", "wb", "sb", "sc2b", "out", "part",
               "counters"]  # fmt: skip
    decl = (
        "void moe_mma_launch(" + ", ".join(f"torch::Tensor {t}" for t in tensors) + ", int64_t n_out, "
        "int64_t n_in, int64_t topk, int64_t split, double alpha, double limit, bool glu, "
        "int64_t rows_per_block);"
    )
    return load_kernels("cuda_moe", decl, ("moe_mma_launch",), capability, op="moe_nvfp4_mma",
                        min_capability=(8, 9), needs="cvt e4m3x2 -> f16x2")  # fmt: skip


def split_k(n_blocks: int, n_out: int, n_in: int, n_sms: int) -> int:
    """K splits of one launch, from shapes only (no sync): enough CTAs for two waves of CTAS_PER_SM per
    SM when n_blocks row blocks hold slots (T = 1: 4), and at least 2 chunks per warp (4 warps) in
    each split. M3 widths on 132 SMs: T = 1 takes 5 splits of gate / up and 3 of down, T = 4 two and
    one, T >= 8 one."""
    ctas = n_blocks * (n_out // TILE_N)
    want = -(-2 * CTAS_PER_SM * n_sms // max(ctas, 1))
    return max(1, min(want, MAX_SPLIT_K, n_in // CHUNK_K // 8))


def rows_per_block(n_slots: int, n_experts: int) -> int:
    """Slot rows per block, from shapes only (no sync): 16 (two MMA column groups per decoded weight
    fragment) once the experts average >= WIDE_BLOCK_SLOTS slots, else 8. Why 6: expert loads are
    ~Binomial(T, K / E); at a mean of 6 about 15% of the touched experts hold more than 8 slots (40% at
    8, T = 256 at M3 widths), and 8-row blocks read their weights once per block, while 16-row blocks
    cost every block twice the MMAs, x loads and B-fragment permutes (~10% more instructions, under
    the issue and tensor-pipe headroom of a weight-bound launch)."""
    return 2 * ROW_BLOCK if n_slots >= WIDE_BLOCK_SLOTS * n_experts else ROW_BLOCK


def _canonical(name: str, w: tuple, shape: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One projection (packed, scales, scale_2) as the kernel reads it, checked: packed uint8 `shape`
    and scales e4m3 [E, N, I/16] contiguous on CUDA (no copy: a copy would be the second weight copy
    this kernel exists to avoid), packed 16-byte and scales 4-byte aligned (the cp.async pieces).
    -> (packed, scale bytes as uint8, scale_2 fp32 [E])."""
    packed, scales, scale_2 = w
    E, N, H = shape
    s_shape = (E, N, 2 * H // 16)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != shape:
        raise ValueError(f"moe_nvfp4_mma: {name} packed must be uint8 {shape}, got {packed.dtype} "
                         f"{tuple(packed.shape)}")  # fmt: skip
    if scales.dtype != torch.float8_e4m3fn or tuple(scales.shape) != s_shape:
        raise ValueError(f"moe_nvfp4_mma: {name} scales must be float8_e4m3fn {s_shape}, got {scales.dtype} "
                         f"{tuple(scales.shape)}")  # fmt: skip
    if not (packed.is_cuda and scales.is_cuda and packed.is_contiguous() and scales.is_contiguous()):
        raise ValueError(f"moe_nvfp4_mma: {name} packed and scales must be contiguous CUDA tensors")
    if packed.data_ptr() % 16 or scales.data_ptr() % 4:
        raise ValueError(f"moe_nvfp4_mma: {name} packed must be 16-byte and scales 4-byte aligned, got "
                         f"addresses {packed.data_ptr():#x}, {scales.data_ptr():#x}")  # fmt: skip
    return packed, scales.view(torch.uint8), scale_2.reshape(-1).float().contiguous()


def _launch(ext, x, rows, block_expert, router_w, wa, wb, out, n_active, topk, glu, alpha, limit, rb):
    (wa_w, wa_s, wa_2), (wb_w, wb_s, wb_2) = wa, wb
    n_out, n_in = wa_w.shape[1], 2 * wa_w.shape[2]
    split = split_k(n_active, n_out, n_in, device_info(x.device)[1])
    n_units = block_expert.numel() * (n_out // TILE_N)
    counters = split_counters(x.device, n_units)
    n_part = split * n_units * (8 if glu else 4) * (rb // ROW_BLOCK) * 128 if split > 1 else 1
    part = torch.empty((n_part,), dtype=torch.float32, device=x.device)
    ext.moe_mma_launch(x, rows, block_expert, router_w, wa_w, wa_s, wa_2, wb_w, wb_s, wb_2, out, part,
                       counters, n_out, n_in, topk, split, alpha, limit, glu, rb)  # fmt: skip


def _scratch(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if POISON_INTERMEDIATES:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def moe_mma_supported(x_TD: torch.Tensor, w1_packed: torch.Tensor) -> bool:
    """CUDA bf16 tokens, D and F multiples of 64 (whole lane chunks and 64-feature CTA tiles), and a
    contiguous, 16-byte aligned bank (the kernels read the canonical storage in place)."""
    D, F = 2 * w1_packed.shape[2], w1_packed.shape[1]
    return (
        x_TD.is_cuda and x_TD.dtype == torch.bfloat16 and D % 64 == 0 and F % 64 == 0
        and w1_packed.is_contiguous() and w1_packed.data_ptr() % 16 == 0
    )  # fmt: skip


def use_moe_mma(n_slots: int, n_experts: int) -> bool:
    """Whether the v7 dispatch takes this module: <= 8 slots per expert on average (decode batches)."""
    return 0 < n_slots <= MAX_SLOTS_PER_EXPERT * n_experts


@torch.compiler.disable(recursive=True)
def moe_nvfp4_mma(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
    w1: tuple, w3: tuple, w2: tuple, *, swiglu_alpha: float, swiglu_limit: float,
    out_TD: torch.Tensor | None = None, shared_TD: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) for bf16 x_TD [T, D] on CUDA; each w* = (packed uint8
    [E, out, in/2], scales e4m3 [E, out, in/16], scale_2 fp32 [E]), packed and scales contiguous (read
    in place); D, F multiples of 64. No host syncs (CUDA-graph safe after a warm-up call). shared_TD
    (bf16 [T, D]): added after the sum's rounding, as `out + shared`."""
    from model.kernels.triton_moe import _group_by_expert
    from model.kernels.triton_moe_combine import moe_combine

    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    E, F = w1[0].shape[0], w1[0].shape[1]
    if not x_TD.is_cuda or x_TD.dtype != torch.bfloat16 or x_TD.stride(-1) != 1:
        raise ValueError(f"moe_nvfp4_mma: x must be a CUDA bf16 tensor with unit last stride, got "
                         f"{x_TD.device} {x_TD.dtype} strides {x_TD.stride()}")  # fmt: skip
    if D % 64 or F % 64:
        raise ValueError(f"moe_nvfp4_mma: D={D} and F={F} must be multiples of 64 (lane chunks, CTA tiles)")
    m1, m3, m2 = (
        _canonical("w1", w1, (E, F, D // 2)),
        _canonical("w3", w3, (E, F, D // 2)),
        _canonical("w2", w2, (E, D, F // 2)),
    )
    if x_TD.stride(0) % 8 or x_TD.data_ptr() % 16:  # the kernels read x rows in 16-byte vectors
        x_TD = x_TD.clone(memory_format=torch.contiguous_format)
    if out_TD is None:
        out_TD = torch.empty_like(x_TD)
    S = T * K
    if S == 0:
        return out_TD.zero_() if shared_TD is None else out_TD.zero_().add_(shared_TD)
    ext = _extension(device_info(x_TD.device)[0])
    rb = rows_per_block(S, E)
    rows, block_expert = _group_by_expert(topk_ids_TK.reshape(-1), E, block_rows=rb)
    act = _scratch((rows.numel(), F), torch.bfloat16, x_TD.device)
    y_SD = _scratch((S, D), torch.float32, x_TD.device)
    weights_S = topk_weights_TK.reshape(-1).float().contiguous()
    n_active = min(S, E)  # blocks holding slots, when no expert has more than 8 (the split heuristic)
    common = (rows, block_expert, weights_S)
    _launch(ext, x_TD, *common, m1, m3, act, n_active, K, True, swiglu_alpha, swiglu_limit, rb)
    _launch(ext, act, *common, m2, m2, y_SD, n_active, K, False, swiglu_alpha, swiglu_limit, rb)
    return moe_combine(y_SD, K, out_TD, shared_TD)


# ------------------------------------------------------------------------------------------ self-check
def random_bank(E: int, D: int, F: int, device, seed: int = 0, special: bool = False):
    """An NVFP4 ExpertBank of random codes (all 16), e4m3 scales in [4, 64] and scale_2 2e-4, drawn on
    `device` (M3 widths: quantizing random weights on the CPU would take minutes). special: scale
    bytes 0x00-0x3F instead (zero, the e4m3 subnormals 0x01-0x07, up to 1.875) and scale_2 2^-6."""
    from model.layers.moe import ExpertBank

    bank = ExpertBank(E, D, F, "nvfp4", device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for p, (n_out, n_in) in bank.proj_shapes().items():
        shape = (E, n_out, n_in // 2)
        getattr(bank, f"{p}_weight").copy_(torch.randint(0, 256, shape, generator=gen, device=device).byte())
        if special:
            sbytes = torch.randint(0, 0x40, (E, n_out, n_in // 16), generator=gen, device=device).byte()
            scales = sbytes.view(torch.float8_e4m3fn)
        else:
            scales = torch.rand(E, n_out, n_in // 16, generator=gen, device=device) * 60 + 4
        getattr(bank, f"{p}_weight_scale").copy_(scales.to(torch.float8_e4m3fn))
        getattr(bank, f"{p}_weight_scale_2").fill_(2.0**-6 if special else 2e-4)
    return bank


def _selftest(shapes: list[tuple], reps: int) -> list[dict]:
    """Compile, check v7 against the reference (and v2, the tile kernel), time v7 and v2 (a CUDA graph
    of one call, replayed `reps` times: the weights come from HBM only where they exceed the 60 MB L2)
    and the bf16 torch grouped path on a bf16 bank of the same shape (eager: it syncs for its group
    bounds). shapes: (E, D, F, K, T, weights) with weights "normal" (init_normal_), "random" or
    "special" (`random_bank`). Errors are max |v7 - other| / max |reference|, the reference
    `moe_experts_ref` at small sizes and `moe_experts_torch` (the same bf16 weights, grouped) at M3
    widths: <= 0.02 expected vs the reference, about as much vs v2 (v7 multiplies the exact
    e2m1 * s, both others bf16(e2m1 * s * scale_2)); a flushed bf16 subnormal (the e2m1 0.5 code)
    would show as a large error on the "special" row only."""
    from model.kernels.moe import moe_experts_ref, moe_experts_torch
    from model.kernels.triton_moe import moe_nvfp4_triton
    from model.layers.moe import ExpertBank

    rows = []
    dev = torch.device("cuda")
    banks, bf16_banks = {}, {}
    for E, D, F, K, T, kind in shapes:
        gen = torch.Generator(device="cpu").manual_seed(E * 7 + T)
        if (E, D, F, kind) not in banks:
            if kind == "normal":
                banks[E, D, F, kind] = ExpertBank(E, D, F, "nvfp4").init_normal_(0.05, gen).to(dev)
            else:
                banks[E, D, F, kind] = random_bank(E, D, F, dev, special=kind == "special")
        if (E, D, F) not in bf16_banks:
            bf16_banks[E, D, F] = bf = ExpertBank(E, D, F, "float", dtype=torch.bfloat16, device=dev)
            for p in ("w1", "w3", "w2"):
                getattr(bf, f"{p}_weight").data.normal_(0, 0.02)
        bank = banks[E, D, F, kind]
        parts = [tuple(getattr(bank, f"{p}_{s}") for s in ("weight", "weight_scale", "weight_scale_2"))
                 for p in ("w1", "w3", "w2")]  # fmt: skip
        kw = dict(swiglu_alpha=bank.swiglu_alpha, swiglu_limit=bank.swiglu_limit)
        x = (torch.randn(T, D, generator=gen) * 2).to(torch.bfloat16).to(dev)
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(dev)
        w = torch.rand(T, K, generator=gen).to(dev)
        v2 = functools.partial(moe_nvfp4_triton, x, ids, w, *parts, **kw, variant="v2")
        v7 = functools.partial(moe_nvfp4_mma, x, ids, w, *parts, **kw)
        # The spec loop at small sizes; the grouped torch path (same bf16 weights) at M3 widths.
        ref = (moe_experts_ref if D * F <= 1 << 16 else moe_experts_torch)(x, ids, w, bank).float()
        scale = ref.abs().max().item()
        got = v7().float()
        row = dict(E=E, D=D, F=F, K=K, T=T, weights=kind, max_abs=scale)
        row["err_vs_ref"] = (got - ref).abs().max().item() / scale
        row["err_vs_v2"] = (got - v2().float()).abs().max().item() / scale
        row["finite"] = bool(torch.isfinite(got).all())
        row["v7_us"], row["v2_us"] = graph_us(v7, reps), graph_us(v2, reps)
        bf16 = functools.partial(moe_experts_torch, x, ids, w, bf16_banks[E, D, F])
        row["bf16_us"] = eager_us(bf16, reps)
        n_active = int(torch.unique(ids).numel())
        n_weights = n_active * 3 * F * D
        row["v7_tb_s"] = n_weights * 9 / 16 / row["v7_us"] / 1e6
        row["v2_tb_s"] = n_weights * 9 / 16 / row["v2_us"] / 1e6
        row["bf16_tb_s"] = n_weights * 2 / row["bf16_us"] / 1e6
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description="v7 CUDA MoE self-check: errors vs reference / v2, timings")
    ap.add_argument("--selftest", action="store_true", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny shapes only")
    args = ap.parse_args()
    shapes = [(8, 128, 64, 2, 5, "normal"), (16, 256, 128, 4, 33, "normal"), (8, 128, 128, 2, 16, "special")]
    if not args.quick:
        shapes += [(128, 6144, 3072, 4, T, "random") for T in (1, 4, 16, 64, 256)]
    rows = _selftest(shapes, args.reps)
    print(f"{'E':>4} {'D':>5} {'F':>5} {'T':>4} {'weights':>8} {'err ref':>9} {'err v2':>9} {'v7 us':>8} "
          f"{'v2 us':>8} {'bf16 us':>8} {'v7 TB/s':>8} {'v2 TB/s':>8} {'bf16 TB/s':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['E']:4d} {r['D']:5d} {r['F']:5d} {r['T']:4d} {r['weights']:>8} {r['err_vs_ref']:9.2e} "
              f"{r['err_vs_v2']:9.2e} {r['v7_us']:8.1f} {r['v2_us']:8.1f} {r['bf16_us']:8.1f} "
              f"{r['v7_tb_s']:8.3f} {r['v2_tb_s']:8.3f} {r['bf16_tb_s']:9.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

"""CUDA NVFP4 MoE decode on tensor cores (v7): routed experts as bf16 mma.sync with weights on M.

What: `moe_nvfp4_mma(x, ids, weights, w1, w3, w2, ...)` = sum_k w[t, k] * expert_{ids[t, k]}(x[t]), the
op and calling convention of `triton_moe_gemv.moe_nvfp4_gemv` (`moe_nvfp4_triton(variant="v7")`).
Why: v6 (Triton, FMA) is bound by its decode instructions and the shared-memory round trip of the
decoded tile (22% of the H200's HBM roofline at T = 64). Here each lane's NVFP4 codes for a 16 x 64
weight tile arrive in one 16-byte load, in the order of its mma.m16n8k16 A fragment (an offline
repack, `repack_nvfp4_mma`), and are decoded in registers (three integer ops per value pair and one
bf16x2 multiply by the block scale; nothing staged in shared memory). Tokens sit on the MMA's N = 8
side: slot rows grouped by expert in blocks of 8 (`triton_moe._group_by_expert`). Two launches (gate
/ up + swigluoai, then down x router weight), then `moe_combine`. The kernels, their fragment
mapping and the decode arithmetic are documented in model/kernels/cuda_moe.cu.

Invariants: no host sync; CUDA-graph safe after a warm-up call (the repack, the split counters and the
compiled extension are made on first use); every launch leaves its split counters at 0 and writes
every valid act / y row; K splits summed in split order (deterministic). The decoded weight
e2m1 * s * 2^-7 is exact in bf16 and the products x * w exact in fp32, so results differ from
`moe_experts_ref` (weights bf16(e2m1 * s * scale_2)) by < 2^-8 relative per weight, as v6; gate, up,
act and y round to bf16 where v6 rounds them. Imported on CPU (repack, tests); compiled only on CUDA.
"""

from __future__ import annotations

import argparse
import functools
import json
import weakref
from pathlib import Path
from typing import Literal

import torch

# Legend: T tokens, D model dim, F expert ffn dim, E experts, K top-k, S = T*K slots, MB row blocks of
# RB = 8 slot rows, N / I a projection's output / input features, NT = N / 16 tiles, KC = I / 64
# chunks. Repacked weights: words uint8 [E, NT, KC, 32 lanes, 16] (the lane's four 32-bit words, one
# per MMA step), scale pairs uint8 [E, NT, KC, 32 lanes, 2] (rows g and g + 8 of scale block t).
ROW_BLOCK = 8  # RB: slot rows per block = the N of mma.m16n8k16
TILE_N = 64  # output features per CTA (4 tiles of 16), so N must be a multiple of 64
CHUNK_K = 64  # inputs per lane load (4 scale blocks over the 4 lanes of a group)
MAX_SLOTS_PER_EXPERT = ROW_BLOCK  # v7 dispatch bound on T*K / E (larger batches: the v2 tile kernel)
MAX_SPLIT_K = 16
CTAS_PER_SM = 3  # the kernels' __launch_bounds__ minimum (<= 168 registers)
POISON_INTERMEDIATES = False  # tests set True: act and y start as NaN, so a missed row shows
Decode = Literal["bf16", "f16"]
"""bf16: e2m1 * 2^-126 bit patterns (0.5 a bf16 subnormal) times s * 2^119 in one bf16x2 multiply;
f16: the fallback if a GPU's bf16 multiply flushed subnormals (fp16 bits, fp16 multiply, converts)."""


# ------------------------------------------------------------------------------------------ repack
def repack_nvfp4_mma(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [E, N, I/2], scales e4m3 [E, N, I/16]) -> (words uint8 [E, NT, KC, 32, 16], pairs
    uint8 [E, NT, KC, 32, 2]) in the kernels' lane order (bijective; `unpack_nvfp4_mma` inverts it).

    Lane 4g + t, step i, nibble 4n + 16h of word i holds the code of row 16 * tile + g + 8 (n & 1),
    input 64 * chunk + 16t + 4i + 2 (n >> 1) + h; its scale pair is (row g, row g + 8) of block
    4 * chunk + t. One expert at a time, so the temporaries stay at one expert's codes."""
    E, N, H = packed.shape
    n_in = 2 * H
    if packed.dtype != torch.uint8 or N % 16 or n_in % CHUNK_K:
        raise ValueError(f"repack_nvfp4_mma: need uint8 [E, N, I/2] with N % 16 == 0, I % 64 == 0, got "
                         f"{packed.dtype} {tuple(packed.shape)}")  # fmt: skip
    if tuple(scales.shape) != (E, N, n_in // 16):
        raise ValueError(f"repack_nvfp4_mma: scales must be [E, N, I/16] = {(E, N, n_in // 16)}, got "
                         f"{tuple(scales.shape)}")  # fmt: skip
    NT, KC = N // 16, n_in // CHUNK_K
    words = torch.empty((E, NT, KC, 32, 16), dtype=torch.uint8, device=packed.device)
    pairs = torch.empty((E, NT, KC, 32, 2), dtype=torch.uint8, device=packed.device)
    sbytes = scales.view(torch.uint8)
    for e in range(E):
        p = packed[e]
        codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(N, n_in)  # element k: byte k // 2, low = even
        # [NT, n&1 (r8), g, KC, t, i, n>>1 (kk), h] -> [NT, KC, g, t, i, h, kk, r8]: nibble 4h + 2kk + r8
        c = codes.view(NT, 2, 8, KC, 4, 4, 2, 2).permute(0, 3, 2, 4, 5, 7, 6, 1).reshape(NT, KC, 32, 16, 2)
        words[e] = c[..., 0] | (c[..., 1] << 4)
        # [NT, r8, g, KC, t] -> [NT, KC, g, t, r8]
        pairs[e] = sbytes[e].reshape(NT, 2, 8, KC, 4).permute(0, 3, 2, 4, 1).reshape(NT, KC, 32, 2)
    return words, pairs


def unpack_nvfp4_mma(words: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `repack_nvfp4_mma`: (packed uint8 [E, N, I/2], scales e4m3 [E, N, I/16])."""
    E, NT, KC = words.shape[:3]
    N, n_in = 16 * NT, CHUNK_K * KC
    c = torch.stack([words & 0xF, words >> 4], dim=-1).view(E, NT, KC, 8, 4, 4, 2, 2, 2)
    codes = c.permute(0, 1, 8, 3, 2, 4, 5, 7, 6).reshape(E, N, n_in)  # [E, NT, r8, g, KC, t, i, kk, h]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = pairs.view(E, NT, KC, 8, 4, 2).permute(0, 1, 5, 3, 2, 4).reshape(E, N, n_in // 16)
    return packed.contiguous(), scales.contiguous().view(torch.float8_e4m3fn)


# One repack per weight tensor, kept while the tensor lives (a second copy of its bytes: the bank's
# own layout stays for the other paths). Keyed by identity and version, so an in-place update of the
# bank (a checkpoint reload) repacks again.
_REPACKED: dict[tuple, tuple] = {}


def repacked(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`repack_nvfp4_mma(packed, scales)`, computed once per (tensor, version) and cached."""
    key = (id(packed), id(scales))
    version = (packed._version, scales._version, packed.data_ptr(), scales.data_ptr())
    hit = _REPACKED.get(key)
    if hit is not None and hit[0] == version and hit[1]() is packed and hit[2]() is scales:
        return hit[3]
    out = repack_nvfp4_mma(packed, scales)
    _REPACKED[key] = (version, weakref.ref(packed), weakref.ref(scales), out)
    weakref.finalize(packed, _REPACKED.pop, key, None)
    return out


# ------------------------------------------------------------------------------------------ launch
@functools.cache
def _extension(capability: tuple[int, int]):
    """The compiled kernels (torch cpp_extension, cached under ~/.cache/torch_extensions)."""
    from torch.utils.cpp_extension import load_inline

    if capability < (8, 9):
        raise RuntimeError(f"moe_nvfp4_mma needs sm_89+ (cvt e4m3x2 -> f16x2), got {capability}")
    arch = f"{capability[0]}{capability[1]}"
    source = Path(__file__).with_name("cuda_moe.cu").read_text()
    tensors = ["x", "rows", "block_expert", "router_w", "wa", "sa", "sc2a", "wb", "sb", "sc2b", "out", "part",
               "counters"]  # fmt: skip
    decl = (
        "void moe_mma_launch(" + ", ".join(f"torch::Tensor {t}" for t in tensors) + ", int64_t n_out, "
        "int64_t n_in, int64_t topk, int64_t split, double alpha, double limit, bool glu, bool f16_decode);"
    )
    return load_inline(
        name=f"cuda_moe_v7_sm{arch}", cpp_sources=decl, cuda_sources=source, functions=["moe_mma_launch"],
        extra_cuda_cflags=["-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-lineinfo"],
    )  # fmt: skip


def split_k(n_blocks: int, n_out: int, n_in: int, n_sms: int) -> int:
    """K splits of one launch, from shapes only (no sync): enough CTAs for two waves of CTAS_PER_SM per
    SM when n_blocks row blocks hold slots (T = 1: 4), and at least 2 chunks per warp (4 warps) in
    each split. M3 widths on 132 SMs: T = 1 takes 5 splits of gate / up and 3 of down, T = 4 two and
    one, T >= 8 one."""
    ctas = n_blocks * (n_out // TILE_N)
    want = -(-2 * CTAS_PER_SM * n_sms // max(ctas, 1))
    return max(1, min(want, MAX_SPLIT_K, n_in // CHUNK_K // 8))


def _launch(ext, x, rows, block_expert, router_w, wa, wb, out, n_active, topk, glu, alpha, limit, decode):
    (wa_w, wa_s, wa_2), (wb_w, wb_s, wb_2) = wa, wb
    _, NT, KC = wa_w.shape[:3]
    n_out, n_in = 16 * NT, CHUNK_K * KC
    n_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    split = split_k(n_active, n_out, n_in, n_sms)
    n_units = block_expert.numel() * (n_out // TILE_N)
    from model.kernels.triton_gemv import split_counters

    counters = split_counters(x.device, n_units)
    n_part = split * n_units * (8 if glu else 4) * 128 if split > 1 else 1
    part = torch.empty((n_part,), dtype=torch.float32, device=x.device)
    ext.moe_mma_launch(x, rows, block_expert, router_w, wa_w, wa_s, wa_2, wb_w, wb_s, wb_2, out, part,
                       counters, n_out, n_in, topk, split, alpha, limit, glu, decode == "f16")  # fmt: skip


def _scratch(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if POISON_INTERMEDIATES:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def moe_mma_supported(x_TD: torch.Tensor, w1_packed: torch.Tensor) -> bool:
    """CUDA bf16 tokens, D and F multiples of 64 (whole lane chunks and 64-feature CTA tiles)."""
    D, F = 2 * w1_packed.shape[2], w1_packed.shape[1]
    return x_TD.is_cuda and x_TD.dtype == torch.bfloat16 and D % 64 == 0 and F % 64 == 0


def use_moe_mma(n_slots: int, n_experts: int) -> bool:
    """Whether the v7 dispatch takes this module: <= 8 slots per expert on average (decode batches)."""
    return 0 < n_slots <= MAX_SLOTS_PER_EXPERT * n_experts


@torch.compiler.disable(recursive=True)
def moe_nvfp4_mma(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
    w1: tuple, w3: tuple, w2: tuple, *, swiglu_alpha: float, swiglu_limit: float,
    out_TD: torch.Tensor | None = None, shared_TD: torch.Tensor | None = None, decode: Decode = "bf16",
) -> torch.Tensor:  # fmt: skip
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) for bf16 x_TD [T, D] on CUDA; each w* = (packed uint8
    [E, out, in/2], scales e4m3 [E, out, in/16], scale_2 fp32 [E]); D, F multiples of 64. No host
    syncs (CUDA-graph safe after a warm-up call). shared_TD (bf16 [T, D]): added after the sum's
    rounding, as `out + shared`. decode: see `Decode`."""
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
    if decode not in ("bf16", "f16"):
        raise ValueError(f"moe_nvfp4_mma: decode must be 'bf16' or 'f16', got {decode!r}")
    for name, w, shape in (
        ("w1", w1, (E, F, D // 2)),
        ("w3", w3, (E, F, D // 2)),
        ("w2", w2, (E, D, F // 2)),
    ):
        if tuple(w[0].shape) != shape:
            raise ValueError(f"moe_nvfp4_mma: {name} packed must be {shape}, got {tuple(w[0].shape)}")
    if x_TD.stride(0) % 8 or x_TD.data_ptr() % 16:  # the kernels read x rows in 16-byte vectors
        x_TD = x_TD.clone(memory_format=torch.contiguous_format)
    if out_TD is None:
        out_TD = torch.empty_like(x_TD)
    S = T * K
    if S == 0:
        return out_TD.zero_() if shared_TD is None else out_TD.zero_().add_(shared_TD)
    ext = _extension(torch.cuda.get_device_capability(x_TD.device))
    rows, block_expert = _group_by_expert(topk_ids_TK.reshape(-1), E, block_rows=ROW_BLOCK)
    act = _scratch((rows.numel(), F), torch.bfloat16, x_TD.device)
    y_SD = _scratch((S, D), torch.float32, x_TD.device)
    weights_S = topk_weights_TK.reshape(-1).float().contiguous()
    m1, m3, m2 = ((*repacked(w[0], w[1]), w[2].reshape(-1).float().contiguous()) for w in (w1, w3, w2))
    n_active = min(S, E)  # blocks holding slots, when no expert has more than 8 (the split heuristic)
    common = (rows, block_expert, weights_S)
    _launch(ext, x_TD, *common, m1, m3, act, n_active, K, True, swiglu_alpha, swiglu_limit, decode)
    _launch(ext, act, *common, m2, m2, y_SD, n_active, K, False, swiglu_alpha, swiglu_limit, decode)
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
    """Compile, check v7 (both decodes) against v6 and the reference, time v7 and v6 (a CUDA graph of
    one call, replayed `reps` times: the weights come from HBM only where they exceed the 60 MB L2).
    shapes: (E, D, F, K, T, weights) with weights "normal" (init_normal_), "random" or "special"
    (`random_bank`). Errors are max |v7 - other| / max |reference|: <= 2^-7 expected vs v6 (~1e-3 seen
    for v6 vs the emulation), <= 0.02 vs the reference; a flushed bf16 subnormal (the e2m1 0.5 code)
    would show as a large bf16 error on the "special" row only."""
    from model.kernels.moe import moe_experts_ref, moe_experts_torch
    from model.kernels.triton_moe_gemv import moe_nvfp4_gemv
    from model.layers.moe import ExpertBank

    rows = []
    dev = torch.device("cuda")
    banks = {}
    for E, D, F, K, T, kind in shapes:
        gen = torch.Generator(device="cpu").manual_seed(E * 7 + T)
        if (E, D, F, kind) not in banks:
            if kind == "normal":
                banks[E, D, F, kind] = ExpertBank(E, D, F, "nvfp4").init_normal_(0.05, gen).to(dev)
            else:
                banks[E, D, F, kind] = random_bank(E, D, F, dev, special=kind == "special")
        bank = banks[E, D, F, kind]
        parts = [tuple(getattr(bank, f"{p}_{s}") for s in ("weight", "weight_scale", "weight_scale_2"))
                 for p in ("w1", "w3", "w2")]  # fmt: skip
        kw = dict(swiglu_alpha=bank.swiglu_alpha, swiglu_limit=bank.swiglu_limit)
        x = (torch.randn(T, D, generator=gen) * 2).to(torch.bfloat16).to(dev)
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(dev)
        w = torch.rand(T, K, generator=gen).to(dev)
        v6 = moe_nvfp4_gemv(x, ids, w, *parts, **kw).float()
        # The spec loop at small sizes; the grouped torch path (same bf16 weights) at M3 widths.
        ref = (moe_experts_ref if D * F <= 1 << 16 else moe_experts_torch)(x, ids, w, bank).float()
        scale = ref.abs().max().item()
        row = dict(E=E, D=D, F=F, K=K, T=T, weights=kind, max_abs=scale)
        for decode in ("bf16", "f16"):
            got = moe_nvfp4_mma(x, ids, w, *parts, **kw, decode=decode).float()
            row[f"{decode}_err_vs_v6"] = (got - v6).abs().max().item() / scale
            row[f"{decode}_err_vs_ref"] = (got - ref).abs().max().item() / scale
            row[f"{decode}_finite"] = bool(torch.isfinite(got).all())
        for name, op in (("v7", moe_nvfp4_mma), ("v6", moe_nvfp4_gemv)):
            fn = functools.partial(op, x, ids, w, *parts, **kw)
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            row[f"{name}_us"] = start.elapsed_time(end) * 1e3 / reps
        n_active = int(torch.unique(ids).numel())
        n_bytes = n_active * 3 * F * D * 9 / 16
        row["v7_tb_s"] = n_bytes / row["v7_us"] / 1e6
        row["v6_tb_s"] = n_bytes / row["v6_us"] / 1e6
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description="v7 CUDA MoE self-check: errors vs v6 / reference, timings")
    ap.add_argument("--selftest", action="store_true", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny shapes only")
    args = ap.parse_args()
    shapes = [(8, 128, 64, 2, 5, "normal"), (16, 256, 128, 4, 33, "normal"), (8, 128, 128, 2, 16, "special")]
    if not args.quick:
        shapes += [(128, 6144, 3072, 4, T, "random") for T in (1, 4, 16, 64, 256)]
    rows = _selftest(shapes, args.reps)
    print(f"{'E':>4} {'D':>5} {'F':>5} {'T':>4} {'weights':>8} {'err bf16':>9} {'err f16':>9} {'v7 us':>8} "
          f"{'v6 us':>8} {'v7 TB/s':>8} {'v6 TB/s':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['E']:4d} {r['D']:5d} {r['F']:5d} {r['T']:4d} {r['weights']:>8} "
              f"{r['bf16_err_vs_ref']:9.2e} {r['f16_err_vs_ref']:9.2e} {r['v7_us']:8.1f} {r['v6_us']:8.1f} "
              f"{r['v7_tb_s']:8.3f} {r['v6_tb_s']:8.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

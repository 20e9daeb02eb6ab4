"""NVFP4 quantize / dequantize throughput: model.nvfp4 against a naive row-loop baseline.

Proof of value for model/nvfp4.py's vectorised implementation: the baseline is the obvious
transcription (a Python loop over rows, a torch.where chain for E2M1 rounding, a per-row LUT decode);
outputs are compared byte for byte before timing, and on CUDA also with the CPU's (device
independence). Throughput counts bytes read + written (0.5625 B per NVFP4 value), on CUDA also as a
fraction of the 4.17 TB/s copy roofline; CUDA events over inputs rotated past L2, median of repeats.

    python benchmarks/nvfp4_quant.py --device cuda --sizes 1M 16M 64M --json runs/nvfp4_quant.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import nvfp4

COPY_ROOFLINE_GBPS = 4170.0
"""Measured H200 device-to-device copy throughput (read + write), GB/s."""
L2_ROTATE_BYTES = 256 << 20
"""Rotate over at least this many input bytes so repeats do not hit a warm 50 MB L2."""


# ---------------------------------------------------------------------------------------------
# Naive baseline: one row at a time, the format written out literally.
# ---------------------------------------------------------------------------------------------


def naive_quantize(x_RK: torch.Tensor, scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row loop -> (packed uint8 [R, K/2], scales e4m3 [R, K/16]); same numerics as nvfp4.quantize."""
    R, K = x_RK.shape
    gs = 1.0 / scale_2
    packed = torch.empty((R, K // 2), dtype=torch.uint8, device=x_RK.device)
    scales = torch.empty((R, K // 16), dtype=torch.float8_e4m3fn, device=x_RK.device)
    for r in range(R):
        blocks = x_RK[r].float().view(-1, 16)
        amax = blocks.abs().amax(dim=1, keepdim=True)
        s = torch.clamp(gs * (amax * (1 / 6)), -448, 448).to(torch.float8_e4m3fn)
        sf = s.float()
        inv_gs = 1.0 / gs
        m = torch.where(sf == 0, torch.full_like(sf, 1e-8), 1.0 / torch.where(sf == 0, 1.0, sf * inv_gs))
        v = torch.clamp(blocks * m, -6.0, 6.0)
        a = v.abs()
        mag = torch.where(
            a > 5.0, 7, torch.where(a >= 3.5, 6, torch.where(a > 2.5, 5, torch.where(a >= 1.75, 4, 0)))
        )
        mag = torch.where(
            a < 1.75, torch.where(a > 1.25, 3, torch.where(a >= 0.75, 2, torch.where(a > 0.25, 1, 0))), mag
        )
        codes = (mag + torch.where(v < 0, 8, 0)).to(torch.uint8).flatten()
        packed[r] = codes[0::2] + codes[1::2] * 16
        scales[r] = s.flatten()
    return packed, scales


def naive_dequantize(packed: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Row loop -> bf16 [R, K]; e2m1 * (float(s) * scale_2) in fp32, cast once."""
    lut = nvfp4.E2M1_VALUES.to(packed.device)
    R, H = packed.shape
    out = torch.empty((R, 2 * H), dtype=torch.bfloat16, device=packed.device)
    for r in range(R):
        codes = torch.stack([packed[r] & 15, packed[r] >> 4], dim=1).flatten().long()
        block_scale = scales[r].float() * scale_2
        out[r] = (lut[codes].view(-1, 16) * block_scale[:, None]).flatten().to(torch.bfloat16)
    return out


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _time_ms(fn, inputs: list, device: str, repeats: int, warmup: int) -> float:
    """Median milliseconds of fn(inputs[i % len(inputs)]) over `repeats` calls after warm-up."""
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for i in range(repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(inputs[i % len(inputs)])
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
    else:
        for i in range(repeats):
            t0 = time.perf_counter()
            fn(inputs[i % len(inputs)])
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(float(s.rstrip("kKmMgG")) * mult)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def bench_size(
    numel: int, k: int, dtype: torch.dtype, device: str, repeats: int, naive_repeats: int
) -> list[dict]:
    rows = max(1, numel // k)
    numel = rows * k
    g = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randn(rows, k, generator=g, device=device).to(dtype)
    n_copies = max(2, -(-L2_ROTATE_BYTES // x0.nbytes)) if device == "cuda" else 2
    xs = [x0] + [torch.roll(x0, i, dims=0) * (1 + i / 64) for i in range(1, n_copies)]
    scale_2 = nvfp4.compute_scale_2(x0)
    xs = [x.clamp(-2688 * scale_2, 2688 * scale_2) for x in xs]  # share one global across copies

    # Correctness first: the vectorised path and the baseline agree byte for byte.
    t = nvfp4.quantize(x0, scale_2)
    packed_n, scales_n = naive_quantize(x0, scale_2)
    assert _same_bytes(t.packed, packed_n) and _same_bytes(t.scales, scales_n), "quantize mismatch"
    assert _same_bytes(nvfp4.dequantize(t, torch.bfloat16), naive_dequantize(t.packed, t.scales, scale_2))
    if device == "cuda":
        t_cpu = nvfp4.quantize(x0[: max(1, (1 << 20) // k)].cpu(), scale_2.cpu())
        rows_cpu = t_cpu.packed.shape[0]
        assert _same_bytes(t_cpu.packed, t.packed[:rows_cpu].cpu()), "CUDA and CPU codes differ"
        assert _same_bytes(t_cpu.scales, t.scales[:rows_cpu].cpu()), "CUDA and CPU scales differ"

    ts = [nvfp4.quantize(x, scale_2, check_finite=False) for x in xs]
    q_bytes = numel * x0.element_size() + numel * 9 // 16
    dq_bytes = numel * 9 // 16 + numel * 2
    cases = [
        (
            "quantize",
            "model.nvfp4",
            lambda x: nvfp4.quantize(x, scale_2, check_finite=False),
            xs,
            repeats,
            q_bytes,
        ),
        ("quantize", "naive_rowloop", lambda x: naive_quantize(x, scale_2), xs, naive_repeats, q_bytes),
        ("dequantize", "model.nvfp4", lambda t: nvfp4.dequantize(t, torch.bfloat16), ts, repeats, dq_bytes),
        (
            "dequantize",
            "naive_rowloop",
            lambda t: naive_dequantize(t.packed, t.scales, scale_2),
            ts,
            naive_repeats,
            dq_bytes,
        ),
    ]
    records = []
    for op, impl, fn, inputs, reps, nbytes in cases:
        ms = _time_ms(fn, inputs, device, reps, warmup=2 if impl == "model.nvfp4" else 1)
        rec = {
            "op": op,
            "impl": impl,
            "device": device,
            "numel": numel,
            "shape": [rows, k],
            "dtype": str(dtype).removeprefix("torch."),
            "median_ms": round(ms, 4),
            "bytes": nbytes,
            "gbps": round(nbytes / ms / 1e6, 3),
        }
        if device == "cuda":
            rec["roofline_frac"] = round(rec["gbps"] / COPY_ROOFLINE_GBPS, 4)
        records.append(rec)
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--sizes", nargs="+", default=["1M", "16M"], help="values per tensor, e.g. 1M 16M 64M")
    p.add_argument("--k", type=int, default=4096, help="last dim (row length), multiple of 16")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--naive-repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, help="append one JSON line per measurement")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (1 is steadiest on a busy host)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    if args.k % 16:
        p.error("--k must be a multiple of 16")

    records = []
    for size in args.sizes:
        recs = bench_size(
            _parse_size(size),
            args.k,
            getattr(torch, args.dtype),
            args.device,
            args.repeats,
            args.naive_repeats,
        )
        for rec in recs:
            print(json.dumps(rec), flush=True)
        records += recs
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with args.json.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    by_key = {(r["op"], r["numel"], r["impl"]): r for r in records}
    print(
        f"\n{'op':<11}{'values':>12}{'nvfp4 ms':>11}{'naive ms':>11}{'speedup':>9}{'GB/s':>9}{'roofline':>10}"
    )
    for (op, numel, impl), r in by_key.items():
        if impl != "model.nvfp4":
            continue
        naive = by_key[(op, numel, "naive_rowloop")]
        roof = f"{r['roofline_frac']:.1%}" if "roofline_frac" in r else "-"
        print(
            f"{op:<11}{numel:>12}{r['median_ms']:>11.3f}{naive['median_ms']:>11.3f}"
            f"{naive['median_ms'] / r['median_ms']:>8.1f}x{r['gbps']:>9.2f}{roof:>10}"
        )


if __name__ == "__main__":
    main()

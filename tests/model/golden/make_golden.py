"""Regenerate nvfp4_golden.json: small NVFP4 vectors the tests check without vLLM.

Run once from the repo root (needs vllm importable):
    .venv/bin/python tests/model/golden/make_golden.py
Codes and scales of the plain cases come from vLLM's pure-torch `ref_nvfp4_quant` (so the golden
file pins vLLM's behaviour, not ours); the four-over-six and KV fp8 cases have no vLLM reference
and pin model.nvfp4's documented rules. Every tensor is stored as the hex of its raw bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from model import nvfp4  # noqa: E402

OUT = Path(__file__).with_name("nvfp4_golden.json")


def _hex(t: torch.Tensor) -> str:
    return t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes().hex()


def _inputs() -> list[tuple[str, torch.Tensor, float | None, bool]]:
    """(name, x, global scale or None for the default, four_over_six)."""
    g = torch.Generator().manual_seed(1234)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=torch.float32)
    # Block amax 6 * 2^-3 with scale_2 = 1 gives the exact block scale 2^-3, so every tie is exact.
    tie_block = torch.cat([ties, -ties]) * 2.0**-3
    mixed = torch.randn(2, 64, generator=g)
    mixed[0, :16] = 0.0  # all-zero block
    mixed[0, 16:32] *= 1e-4  # e4m3-subnormal block scale
    mixed[1, 5] = 80.0  # single outlier
    return [
        ("ties_pow2_scale", torch.stack([tie_block, tie_block * 64]), 1.0, False),
        ("normal_default_scale", torch.randn(2, 64, generator=g), None, False),
        ("bf16_zero_subnormal_outlier", mixed.to(torch.bfloat16), None, False),
        ("fp16_given_scale_saturating", (torch.randn(2, 32, generator=g) * 30).half(), 0.002, False),
        ("four_over_six", torch.randn(2, 64, generator=g) * 3, None, True),
    ]


def main() -> None:
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant

    cases = []
    for name, x, gscale, four_over_six in _inputs():
        t = nvfp4.quantize(x, gscale, four_over_six=four_over_six)
        if not four_over_six:
            vals, s = ref_nvfp4_quant(x, (1.0 / t.scale_2).reshape(1), 16)
            mag = torch.searchsorted(nvfp4.E2M1_VALUES[:8], vals.abs()).to(torch.uint8)
            codes = mag | (torch.signbit(vals).to(torch.uint8) << 3)
            packed, scales = nvfp4.pack_e2m1(codes), s.to(torch.float8_e4m3fn)
            assert torch.equal(packed, t.packed), name
            assert torch.equal(scales.view(torch.uint8), t.scales.view(torch.uint8)), name
        else:
            packed, scales = t.packed, t.scales
        cases.append(
            {
                "name": name,
                "dtype": str(x.dtype).removeprefix("torch."),
                "shape": list(x.shape),
                "x": _hex(x),
                "global_scale": gscale,
                "four_over_six": four_over_six,
                "packed": _hex(packed),
                "scales": _hex(scales),
                "scale_2": _hex(t.scale_2),
                "dequant_f32": _hex(nvfp4.dequantize(t, torch.float32)),
            }
        )
    x_kv = torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(7)) * 4
    kv_g = float(x_kv.abs().amax() / 448)  # QMUL4-friendly calibration: block scales <= 74.7
    buf = nvfp4.kv_quantize(x_kv, kv_g)
    fp8, _ = nvfp4.kv_dequantize_fp8(buf, kv_g)
    kv = {"x": _hex(x_kv), "shape": list(x_kv.shape), "global_scale": kv_g}
    kv |= {"buf": _hex(buf), "fp8": _hex(fp8)}
    OUT.write_text(json.dumps({"cases": cases, "kv": kv}, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

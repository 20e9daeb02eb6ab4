"""MXFP8: the OCP Microscaling format with FP8 E4M3 elements (docs/FACTS.md, "MXFP8").

What: every 32 consecutive values along K share one power-of-two scale stored as an E8M0 byte (bias
127, 255 = NaN): x = e4m3 * 2^(byte - 127). Checkpoints call the scale `weight_scale_inv` (M3) or
`weight_scale` (vLLM after loading). Why here: the learner must dequantize such weights exactly as the
engine does, and the converter must produce them. Scale rule: `scale_rule="floor"` (OCP MX v1.0 6.3,
the default) or vLLM's `"ceil"` (no saturation), both from the exact fp32 exponent bits.

Invariants: values come from a saturating round-to-nearest-even cast; `dequantize_mxfp8` is exact in
fp32, then rounded once; exponents are clamped to [-127, 127]; an all-zero block gets byte 0;
non-finite inputs are not supported (a NaN makes its block NaN).
"""

from __future__ import annotations

from typing import Literal

import torch

# Scale rules: OCP's shared exponent is floor(log2(amax)) - 8 (E4M3's largest normal, 448, is
# 1.75 * 2^8), so scaled values lie in [0, 512) and the few above 448 saturate. vLLM's quantizers take
# the smallest exponent that needs no saturation, ceil(log2(amax / 448)): one higher than "floor"
# exactly when the block amax scaled by the floor exponent exceeds 448. Both come from torch.frexp,
# never a rounded log2, so an amax just below a power of two never lands on the wrong exponent.

MXFP8_BLOCK = 32
"""Values per shared scale, along the last dimension."""
E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value (1.75 * 2^8)."""
E4M3_EMAX = 8
"""Exponent of the largest E4M3 normal (OCP's emax_elem)."""
E8M0_BIAS = 127
E8M0_NAN = 255

ScaleRule = Literal["floor", "ceil"]


def _check_last_dim(x: torch.Tensor, what: str) -> None:
    if x.dim() == 0 or x.shape[-1] % MXFP8_BLOCK != 0:
        raise ValueError(
            f"{what}: the last dimension must be a multiple of {MXFP8_BLOCK} (one E8M0 scale per "
            f"{MXFP8_BLOCK} values), got shape {tuple(x.shape)}; pad K to a multiple of {MXFP8_BLOCK}"
        )


def quantize_mxfp8(x: torch.Tensor, *, scale_rule: ScaleRule = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x [..., K]` to MXFP8.

    Returns (values float8_e4m3fn [..., K], scales uint8 E8M0 [..., K/32]). See the module
    docstring for the scale rule. Runs in fp32 whatever x's dtype (bf16/fp16 inputs are exact there).
    """
    _check_last_dim(x, "quantize_mxfp8")
    if scale_rule not in ("floor", "ceil"):
        raise ValueError(
            f"quantize_mxfp8: scale_rule must be 'floor' (OCP) or 'ceil' (vLLM), got {scale_rule!r}"
        )
    shape = x.shape
    x_NB32 = x.float().reshape(*shape[:-1], shape[-1] // MXFP8_BLOCK, MXFP8_BLOCK)
    amax_NB = x_NB32.abs().amax(dim=-1)
    # frexp: amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1 exactly (subnormals too).
    # tiny keeps all-zero blocks finite; they end at the lowest exponent after the clamp below.
    _, exp_NB = torch.frexp(amax_NB.clamp(min=torch.finfo(torch.float32).tiny))
    shared_NB = exp_NB - 1 - E4M3_EMAX
    if scale_rule == "ceil":
        # amax / 2^shared lies in [256, 512): one step up iff it would saturate (exact: power-of-2 divide).
        needs_bump = torch.ldexp(amax_NB, -shared_NB) > E4M3_MAX
        shared_NB = shared_NB + needs_bump.to(shared_NB.dtype)
    shared_NB = shared_NB.clamp(-E8M0_BIAS, E8M0_BIAS)
    # Multiply by 2^-shared (exact, a normal fp32 for every reachable exponent) rather than divide.
    scaled_NB32 = torch.ldexp(x_NB32, -shared_NB.unsqueeze(-1))
    values = scaled_NB32.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(shape)
    scales = (shared_NB + E8M0_BIAS).to(torch.uint8)
    return values, scales


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 powers of two (2^(byte - 127)); byte 255 -> NaN."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8, got {scales.dtype}")
    pow2 = torch.exp2(scales.float() - E8M0_BIAS)
    return torch.where(scales == E8M0_NAN, torch.full_like(pow2, float("nan")), pow2)


def dequantize_mxfp8(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """MXFP8 -> `dtype`: values float8_e4m3fn [..., K], scales uint8 E8M0 [..., K/32] -> [..., K]."""
    if values.dtype != torch.float8_e4m3fn:
        raise TypeError(f"dequantize_mxfp8: values must be float8_e4m3fn, got {values.dtype}")
    _check_last_dim(values, "dequantize_mxfp8")
    blocks = values.shape[-1] // MXFP8_BLOCK
    if tuple(scales.shape) != (*values.shape[:-1], blocks):
        raise ValueError(
            f"dequantize_mxfp8: scales shape {tuple(scales.shape)} does not match values "
            f"{tuple(values.shape)}; expected {(*values.shape[:-1], blocks)} (one byte per {MXFP8_BLOCK})"
        )
    x_NB32 = values.float().reshape(*values.shape[:-1], blocks, MXFP8_BLOCK)
    out = x_NB32 * e8m0_to_float(scales).unsqueeze(-1)
    return out.reshape(values.shape).to(dtype)

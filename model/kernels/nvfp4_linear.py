"""W4A16 NVFP4 linear: y = x @ dequant(W).T with W held as packed E2M1 codes + block scales.

Why: the frozen base weights stay in NVFP4 in memory, exactly the bytes the engines serve, and the
learner runs forward and backward through them without materialising the full-precision matrix.
CUDA inference (bf16 rows, no grad) runs a decode GEMV: variant "v3" (the default) the Triton GEMV of
`model.kernels.triton_gemv` (rows <= TRITON_MAX_ROWS), opt-in "v7" the tensor-core kernel of
`model.kernels.cuda_gemv` (rows <= V7_MAX_ROWS); everywhere else W is dequantized one tile of TILE_N
output rows at a time (`model.nvfp4.dequantize`, cast to x's dtype), multiplied and dropped, the
backward recomputing the same tiles. `nvfp4_linear_ref` is the spec (dequantize all of W, one matmul).

Invariants: gradients flow only to x; the tiled path uses element for element the weights of
`nvfp4_linear_ref` (tiling only splits output columns); the matmul runs in x's dtype, the result is
cast to `out_dtype` (default x's); the GEMV kernels equal the reference up to bf16 weight rounding.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from model.nvfp4 import NVFP4Tensor, dequantize

# Legend: T tokens (leading dims flattened), K input features (multiple of 16), N output features;
# `packed_NK2` uint8 [N, K/2] (low nibble = even element), `scales_NK16` float8_e4m3fn [N, K/16],
# `scale_2` fp32 scalar (dequant-side global scale, amax / 2688).

try:  # Triton is optional on CPU machines
    from model.kernels.triton_gemv import nvfp4_linear_triton
except ImportError:  # pragma: no cover - depends on the install
    nvfp4_linear_triton = None

NVFP4_BLOCK = 16
"""Values per E4M3 block scale, along K."""
TILE_N = 256
"""Output rows dequantized at once: 256 x 6144 fp32 = 6 MiB for M3, small beside activations."""
TRITON_MAX_ROWS = 16
"""Up to this many rows (decode GEMVs) run the Triton W4A16 kernels on CUDA when no grad is wanted."""
V7_MAX_ROWS = 64
"""Up to this many rows variant "v7" runs the CUDA tensor-core GEMV (two launches above 32 rows)."""
LinearVariant = Literal["v3", "v7"]
"""The CUDA decode GEMV: "v3" the Triton split-K FMA GEMV, "v7" `cuda_gemv.nvfp4_gemv_cuda` (operands
it cannot take in place, e.g. K or N not a multiple of 64, fall back to v3). Opt-in until timed."""
DEFAULT_VARIANT: LinearVariant = "v3"


def _dequant_rows(
    packed_NK2: torch.Tensor, scales_NK16: torch.Tensor, scale_2: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows of an NVFP4 matrix -> `dtype` [N, K] (fp32 dequant, one rounding to dtype)."""
    w_NK = dequantize(NVFP4Tensor(packed=packed_NK2, scales=scales_NK16, scale_2=scale_2), torch.float32)
    return w_NK.to(dtype)


def nvfp4_linear_ref(
    x_TK: torch.Tensor,
    packed_NK2: torch.Tensor,
    scales_NK16: torch.Tensor,
    scale_2: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The spec: dequantize the whole weight to x's dtype, then one matmul."""
    w_NK = _dequant_rows(packed_NK2, scales_NK16, scale_2.reshape(()), x_TK.dtype)
    return F.linear(x_TK, w_NK).to(out_dtype or x_TK.dtype)


class _NVFP4LinearTiled(torch.autograd.Function):
    """Tile-by-tile forward over N; backward recomputes each tile and gives a grad to x only."""

    @staticmethod
    def forward(ctx, x_TK, packed_NK2, scales_NK16, scale_2, tile_n: int):
        n_rows = packed_NK2.shape[0]
        y_TN = x_TK.new_empty(x_TK.shape[0], n_rows)
        for n0 in range(0, n_rows, tile_n):
            w_nK = _dequant_rows(
                packed_NK2[n0 : n0 + tile_n], scales_NK16[n0 : n0 + tile_n], scale_2, x_TK.dtype
            )
            y_TN[:, n0 : n0 + tile_n] = F.linear(x_TK, w_nK)
        # The weights are frozen buffers: saving them keeps references, never copies.
        ctx.save_for_backward(packed_NK2, scales_NK16, scale_2)
        ctx.tile_n = tile_n
        ctx.x_dtype = x_TK.dtype
        return y_TN

    @staticmethod
    def backward(ctx, grad_y_TN):
        packed_NK2, scales_NK16, scale_2 = ctx.saved_tensors
        grad_x_TK = None
        if ctx.needs_input_grad[0]:
            # Tiles split the reduction dim of dx = dy @ W: accumulate in fp32, round once at the end.
            acc_TK = grad_y_TN.new_zeros(grad_y_TN.shape[0], packed_NK2.shape[1] * 2, dtype=torch.float32)
            for n0 in range(0, packed_NK2.shape[0], ctx.tile_n):
                rows = slice(n0, n0 + ctx.tile_n)
                # Same per-element weights as the forward (dequant to x's dtype), multiplied in fp32.
                w_nK = _dequant_rows(packed_NK2[rows], scales_NK16[rows], scale_2, ctx.x_dtype).float()
                acc_TK += grad_y_TN[:, rows].float() @ w_nK
            grad_x_TK = acc_TK.to(ctx.x_dtype)
        return grad_x_TK, None, None, None, None


def _check_args(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor) -> None:
    if not x.is_floating_point() or x.dtype.itemsize < 2 or x.dim() < 1:
        raise TypeError(
            f"nvfp4_linear: x must be a float32/bfloat16/float16 tensor, got {x.dtype} {tuple(x.shape)}"
        )
    k = x.shape[-1]
    if k % NVFP4_BLOCK != 0:
        raise ValueError(
            f"nvfp4_linear: K = x.shape[-1] = {k} must be a multiple of {NVFP4_BLOCK} (NVFP4 block)"
        )
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise TypeError(
            f"nvfp4_linear: packed weight must be uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}"
        )
    n = packed.shape[0]
    if packed.shape[1] * 2 != k:
        raise ValueError(
            f"nvfp4_linear: packed weight {tuple(packed.shape)} holds K = {packed.shape[1] * 2} values per "
            f"row but x has K = {k}; expected packed shape ({n}, {k // 2})"
        )
    if scales.dtype != torch.float8_e4m3fn or tuple(scales.shape) != (n, k // NVFP4_BLOCK):
        raise ValueError(
            f"nvfp4_linear: block scales must be float8_e4m3fn [{n}, {k // NVFP4_BLOCK}], "
            f"got {scales.dtype} {tuple(scales.shape)}"
        )
    if scale_2.dtype != torch.float32 or scale_2.numel() != 1:
        raise ValueError(
            f"nvfp4_linear: scale_2 must be one fp32 value, got {scale_2.dtype} {tuple(scale_2.shape)}"
        )
    devices = {t.device for t in (x, packed, scales, scale_2)}
    if len(devices) != 1:
        raise ValueError(f"nvfp4_linear: all tensors must be on one device, got {sorted(map(str, devices))}")


def _is_decode_rows(x_2d: torch.Tensor) -> bool:
    """Decode-sized inference on CUDA: bf16 rows with unit stride, no gradient wanted."""
    return (
        x_2d.is_cuda
        and x_2d.dtype == torch.bfloat16
        and x_2d.shape[0] > 0
        and x_2d.stride(-1) == 1
        and not (torch.is_grad_enabled() and x_2d.requires_grad)
    )


def _decode_gemv(x_2d, packed_NK2, scales_NK16, scale_2, variant: LinearVariant) -> torch.Tensor | None:
    """The decode GEMV kernel's bf16 result for these operands (one launch, weights decoded in
    registers), or None where the tiled torch path runs."""
    if not _is_decode_rows(x_2d):
        return None
    if variant == "v7" and x_2d.shape[0] <= V7_MAX_ROWS and scale_2.dtype == torch.float32:
        from model.kernels.cuda_gemv import gemv_supported, nvfp4_gemv_cuda

        if gemv_supported(x_2d, packed_NK2, scales_NK16):
            return nvfp4_gemv_cuda(x_2d, packed_NK2, scales_NK16, scale_2)
    if nvfp4_linear_triton is not None and x_2d.shape[0] <= TRITON_MAX_ROWS:
        return nvfp4_linear_triton(x_2d, packed_NK2, scales_NK16, scale_2)
    return None


def nvfp4_linear(
    x_TK: torch.Tensor,
    packed_NK2: torch.Tensor,
    scales_NK16: torch.Tensor,
    scale_2: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    tile_n: int = TILE_N,
    variant: LinearVariant | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(W).T; differentiable w.r.t. x only. The one dispatch point;
    `variant` picks the CUDA decode GEMV (None: DEFAULT_VARIANT)."""
    _check_args(x_TK, packed_NK2, scales_NK16, scale_2)
    if tile_n < 1:
        raise ValueError(f"nvfp4_linear: tile_n must be >= 1, got {tile_n}")
    variant = variant or DEFAULT_VARIANT
    if variant not in LinearVariant.__args__:
        raise ValueError(f"nvfp4_linear: variant must be one of {LinearVariant.__args__}, got {variant!r}")
    lead = x_TK.shape[:-1]
    x_2d = x_TK.reshape(-1, x_TK.shape[-1])
    y_TN = _decode_gemv(x_2d, packed_NK2, scales_NK16, scale_2, variant)
    if y_TN is None:
        y_TN = _NVFP4LinearTiled.apply(x_2d, packed_NK2, scales_NK16, scale_2.reshape(()), tile_n)
    return y_TN.reshape(*lead, packed_NK2.shape[0]).to(out_dtype or x_TK.dtype)

"""Triton Gemma RMSNorm for inference: one launch per norm instead of the torch path's ~8.

Why: at decode every norm (residual stream, and per head on q, k, index_q, index_k: six per sparse
layer) is a chain of small kernels (casts, square, mean, add, rsqrt, two multiplies, cast), about a
quarter of the launches of a graph-captured `small` step; here a row is read once, reduced in
registers and written once. Used by `model.layers.norm.rms_norm` in inference mode (the engines)
when torch.compile is not tracing (Inductor fuses the torch path itself).

Invariants: `rms_norm`'s arithmetic in fp32 (mean of squares, + eps, 1 / sqrt, x * inv * (1 + w),
one cast at the end); the sum runs in another order than torch's mean and the sqrt and divide are
correctly rounded, so fp32 results agree to a few ulps and bf16 ones to one bf16 rounding.
Inputs [R, D] or [T, H, D] with unit last stride (any leading strides: q / k slices of a packed
projection); the output is a new contiguous tensor of the input's shape and dtype. The same launch
also takes the residual add before a norm (`add_rms_norm_triton`: the sum rounded to the stream's
dtype, as torch's add, is stored and normalised).
"""

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import f32_to_bf16, opaque_to_compile, use_hw_casts

ROW_ELEMENTS = 4096  # values per program: 32 rows of a head (128), one row of M3.1's 6144-wide stream


@triton.jit
def _row_block(n_rows, H, stride_xt, stride_xh, D: tl.constexpr, D_P2: tl.constexpr, ROWS: tl.constexpr):
    """This program's ROWS rows of the [T, H, D] input (row r = token r // H, head r % H): (row index
    int64, token index, element offset of each row, column offsets, column mask, [ROWS, D_P2] mask)."""
    offs_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, D_P2)
    is_d = offs_d < D
    mask = (offs_r < n_rows)[:, None] & is_d[None, :]
    r64 = offs_r.to(tl.int64)
    t = r64 // H
    return r64, t, t * stride_xt + (r64 % H) * stride_xh, offs_d, is_d, mask


@triton.jit
def _inv_rms(x, eps, D: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) per row of fp32 x (masked columns hold 0), correctly rounded."""
    mean_sq = tl.sum(x * x, axis=1) / D
    return tl.math.div_rn(tl.full(mean_sq.shape, 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps))


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, out_ptr, n_rows, H, stride_xt, stride_xh, eps,
                     D: tl.constexpr, D_P2: tl.constexpr, ROWS: tl.constexpr, ADD: tl.constexpr,
                     SUM_BF16: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    r64, _, row_off, offs_d, is_d, mask = _row_block(n_rows, H, stride_xt, stride_xh, D, D_P2, ROWS)
    x = tl.load(x_ptr + row_off[:, None] + offs_d[None, :], mask=mask, other=0.0)
    out_off = r64[:, None] * D + offs_d[None, :]
    if ADD:  # the residual add first, rounded to the stream's dtype as torch's add rounds it
        r = tl.load(res_ptr + out_off, mask=mask, other=0.0)
        x = x.to(tl.float32) + r.to(tl.float32)
        x = f32_to_bf16(x, HW) if SUM_BF16 else x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + out_off, x, mask=mask)
    x = x.to(tl.float32)
    inv = _inv_rms(x, eps, D)
    w1 = 1.0 + tl.load(w_ptr + offs_d, mask=is_d, other=0.0).to(tl.float32)
    y = x * inv[:, None] * w1[None, :]
    tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_supported(x: torch.Tensor) -> bool:
    """2-D or 3-D inputs with unit last stride (the kernel's row addressing)."""
    return x.dim() in (2, 3) and x.stride(-1) == 1 and x.numel() > 0


def _launch_norm(x, weight, eps, res=None, total=None) -> torch.Tensor:
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm_triton: weight must be [{D}], got {tuple(weight.shape)}")
    if x.dim() == 2:
        H, stride_t, stride_h = 1, x.stride(0), 0
    else:
        H, stride_t, stride_h = x.shape[1], x.stride(0), x.stride(1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = out.numel() // D
    d_p2 = triton.next_power_of_2(D)
    rows = max(1, ROW_ELEMENTS // d_p2)
    is_add = res is not None
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x, res if is_add else x, total if is_add else out, weight, out, n_rows, H, stride_t, stride_h, eps,
        D=D, D_P2=d_p2, ROWS=rows, ADD=is_add, SUM_BF16=x.dtype == torch.bfloat16, HW=use_hw_casts(),
        num_warps=4 if d_p2 <= 2048 else 8,
    )  # fmt: skip
    return out


@opaque_to_compile
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm over the last dim of x ([R, D] or [T, H, D], unit last stride); see the module notes."""
    if not rms_norm_supported(x):
        raise ValueError(f"rms_norm_triton: need a 2-D or 3-D input with unit last stride, got "
                         f"{tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    return _launch_norm(x, weight, eps)


def add_rms_norm_supported(x: torch.Tensor, y: torch.Tensor) -> bool:
    """x and y [R, D] of one shape and dtype, y contiguous, x with unit last stride."""
    return (
        x.dim() == 2 and x.shape == y.shape and x.dtype == y.dtype and x.numel() > 0
        and x.stride(-1) == 1 and y.is_contiguous()
    )  # fmt: skip


@opaque_to_compile
def add_rms_norm_triton(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(x + y, rms_norm(x + y)) for x, y [R, D] in one launch: the sum rounded to their dtype first
    (as torch's add), then the norm of that rounded sum; both new contiguous tensors."""
    if not add_rms_norm_supported(x, y):
        raise ValueError(f"add_rms_norm_triton: need x, y [R, D] of one dtype (y contiguous), got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(y.shape)} {y.dtype}")  # fmt: skip
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return total, _launch_norm(x, weight, eps, res=y, total=total)


# `_rms_norm_rope_kernel`: the norm above, then partial NeoX RoPE on its output (model.layers.rope):
# channel j < R pairs with j + R, R <= j < 2R with j - R, the rest pass through. The partner channel's
# normed value is recomputed from a second (cached) load of the same row, so no register shuffle is
# needed; the normed values are rounded to the input dtype before rotating, as the two torch ops do.
@triton.jit
def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, H, stride_xt, stride_xh,
                          stride_ct, eps, D: tl.constexpr, D_P2: tl.constexpr, R: tl.constexpr,
                          ROWS: tl.constexpr):  # fmt: skip
    r64, t, row_off, offs_d, is_d, mask = _row_block(n_rows, H, stride_xt, stride_xh, D, D_P2, ROWS)
    row_ptr = x_ptr + row_off
    x = tl.load(row_ptr[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = _inv_rms(x, eps, D)
    w1 = 1.0 + tl.load(w_ptr + offs_d, mask=is_d, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    y = (x * inv[:, None] * w1[None, :]).to(dt).to(tl.float32)
    is_lo = offs_d < R
    is_rot = offs_d < 2 * R
    partner = tl.where(is_lo, offs_d + R, tl.where(is_rot, offs_d - R, offs_d))
    xp = tl.load(row_ptr[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    wp1 = 1.0 + tl.load(w_ptr + partner, mask=is_d, other=0.0).to(tl.float32)
    yp = (xp * inv[:, None] * wp1[None, :]).to(dt).to(tl.float32)
    cs_off = t[:, None] * stride_ct + (offs_d % R)[None, :]
    cs_mask = mask & is_rot[None, :]
    c = tl.load(cos_ptr + cs_off, mask=cs_mask, other=1.0)
    s = tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0)
    out = y * c + tl.where(is_lo, -1.0, 1.0)[None, :] * (yp * s)
    tl.store(out_ptr + r64[:, None] * D + offs_d[None, :], out.to(dt), mask=mask)


def rms_norm_rope_supported(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """x [T, H, D] with unit last stride and cos [T, R] (2R <= D) fp32 with unit last stride."""
    return (
        x.dim() == 3 and x.stride(-1) == 1 and x.numel() > 0 and cos.dim() == 2
        and cos.shape[0] == x.shape[0] and 2 * cos.shape[1] <= x.shape[2]
        and cos.dtype == torch.float32 and cos.stride(-1) == 1
    )  # fmt: skip


@opaque_to_compile
def rms_norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                         sin: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """`apply_rope(rms_norm(x, weight, eps), cos, sin)` in one launch for x [T, H, D], cos / sin
    [T, R] fp32 (`rope_cos_sin` of the T positions); a new contiguous tensor in x's dtype."""
    if not rms_norm_rope_supported(x, cos) or sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError(f"rms_norm_rope_triton: need x [T, H, D] and fp32 cos / sin [T, R] with 2R <= D, "
                         f"got {tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")  # fmt: skip
    T, H, D = x.shape
    if weight.shape != (D,):
        raise ValueError(f"rms_norm_rope_triton: weight must be [{D}], got {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    d_p2 = triton.next_power_of_2(D)
    rows = max(1, ROW_ELEMENTS // d_p2)
    _rms_norm_rope_kernel[(triton.cdiv(T * H, rows),)](
        x, weight, cos, sin, out, T * H, H, x.stride(0), x.stride(1), cos.stride(0), eps,
        D=D, D_P2=d_p2, R=cos.shape[1], ROWS=rows, num_warps=4,
    )  # fmt: skip
    return out

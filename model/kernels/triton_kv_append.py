"""NVFP4 KV append: quantize new K / V / index-key rows straight into their paged-cache slots.

Why: the torch path (`model.kv_cache.quantize_kv` + an index_put) runs ~25 elementwise kernels and a
scatter per side per layer on the decode hot path; this is one launch per side that reads each new
value once and writes its 72 bytes (C = 128) in place. One program quantizes one (token, head) row as
C/16 blocks of 16, in fp32 and in `model.nvfp4`'s operation order (docs/FACTS.md, "NVFP4 format"),
with correctly rounded divisions (`div_rn`). The 4-over-6 writer stays on the torch path.

Invariant: the stored bytes equal `nvfp4.kv_quantize` exactly (tested): C/2 code bytes (low nibble =
even element) then C/16 scale bytes at the row's slot.
"""

import torch
import triton
import triton.language as tl

from model import nvfp4
from model.kernels.triton_common import f32_to_e4m3, opaque_to_compile, use_hw_casts

# Legend: T tokens, N heads, C head dim (multiple of 16), X = C/2 + C/16 stored bytes per row.
# Addressing: slot -> (page = slot // page_size, offset = slot % page_size); head n's row lives at
# page * stride_page + (n * head_mul + head_add) * stride_head + offset * stride_off, which covers the
# main K/V pages [P, 2N, page, X] (head_mul 2, head_add = side) and index pages [P, page, X] (N = 1).


@triton.jit
def _nvfp4_append_kernel(
    x_ptr, stride_xt, stride_xn,
    slot_ptr, scale_ptr,
    out_ptr, stride_op, stride_oh, stride_oo,
    page_size, head_mul, head_add,
    C: tl.constexpr, NBLK: tl.constexpr, NBLK_P2: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_b = tl.arange(0, NBLK_P2)  # 16-value blocks of the row
    offs_j = tl.arange(0, 8)  # byte within a block (two values each)
    is_blk = offs_b < NBLK
    mask_bj = is_blk[:, None] & (offs_j[None, :] < 8)
    x_row = x_ptr + pid_t * stride_xt + pid_n * stride_xn
    elem_bj = offs_b[:, None] * 16 + offs_j[None, :] * 2
    x_even = tl.load(x_row + elem_bj, mask=mask_bj, other=0.0).to(tl.float32)
    x_odd = tl.load(x_row + elem_bj + 1, mask=mask_bj, other=0.0).to(tl.float32)

    scale_2 = tl.load(scale_ptr).to(tl.float32)
    gs = tl.math.div_rn(1.0, scale_2)
    amax_b = tl.maximum(tl.max(tl.abs(x_even), axis=1), tl.max(tl.abs(x_odd), axis=1))
    s_b = tl.minimum(tl.maximum(gs * (amax_b * 0.16666666666666666), -448.0), 448.0)
    s8_b = f32_to_e4m3(s_b, HW)
    sf_b = s8_b.to(tl.float32)
    rcp_gs = tl.math.div_rn(1.0, gs + (gs == 0).to(tl.float32) * 1e8)
    denom_b = sf_b * rcp_gs
    m_b = tl.math.div_rn(
        tl.full(denom_b.shape, 1.0, tl.float32), denom_b + (denom_b == 0).to(tl.float32) * 1e8
    )
    code_even = _e2m1_code(x_even * m_b[:, None])
    code_odd = _e2m1_code(x_odd * m_b[:, None])
    byte_bj = (code_even | (code_odd << 4)).to(tl.uint8)

    slot = tl.load(slot_ptr + pid_t).to(tl.int64)
    page = slot // page_size
    row = (
        out_ptr
        + page * stride_op
        + (pid_n * head_mul + head_add) * stride_oh
        + (slot % page_size) * stride_oo
    )
    tl.store(row + offs_b[:, None] * 8 + offs_j[None, :], byte_bj, mask=mask_bj)
    tl.store(row + C // 2 + offs_b, s8_b.to(tl.uint8, bitcast=True), mask=is_blk)


@triton.jit
def _e2m1_code(v):
    """fp32 scaled values -> int32 E2M1 codes: clamp to +-6, ties to the even mantissa, sign iff v < 0."""
    v = tl.minimum(tl.maximum(v, -6.0), 6.0)
    a = tl.abs(v)
    # Alternating strict / non-strict bounds = round to nearest, ties to even (docs/FACTS.md, "NVFP4 format").
    idx = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    idx += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    idx += (a > 5.0).to(tl.int32)
    return idx | ((v < 0).to(tl.int32) << 3)


def nvfp4_append_ref(
    x_TNC: torch.Tensor, slot_mapping_T: torch.Tensor, scale: torch.Tensor, pages: torch.Tensor,
    head_mul: int, head_add: int,
) -> None:  # fmt: skip
    """Torch spec: `nvfp4.kv_quantize` the rows and scatter them (pages [P, H, page, X] or [P, page, X])."""
    stored_TNX = nvfp4.kv_quantize(x_TNC.float(), scale, check_finite=False)
    page_size = pages.shape[-2]
    page_T, off_T = slot_mapping_T.long() // page_size, slot_mapping_T.long() % page_size
    if pages.ndim == 3:
        pages[page_T, off_T] = stored_TNX[:, 0]
        return
    heads_N = torch.arange(x_TNC.shape[1], device=pages.device) * head_mul + head_add
    pages[page_T[:, None], heads_N[None, :], off_T[:, None]] = stored_TNX


@opaque_to_compile
def nvfp4_append(
    x_TNC: torch.Tensor, slot_mapping_T: torch.Tensor, scale: torch.Tensor, pages: torch.Tensor,
    head_mul: int = 1, head_add: int = 0,
) -> None:  # fmt: skip
    """Quantize x_TNC [T, N, C] (float) into NVFP4 rows of `pages` in place.

    pages: uint8 [P, H, page, C/2 + C/16] (head n -> row n * head_mul + head_add) or [P, page, X]
    (N must be 1); slot_mapping_T: int [T] slots (all >= 0); scale: fp32 0-d dequant-side global.
    """
    T, N, C = x_TNC.shape
    if C % 16 or pages.dtype != torch.uint8 or pages.shape[-1] != C // 2 + C // 16:
        raise ValueError(f"nvfp4_append: need C % 16 == 0 and uint8 pages [..., {C // 2 + C // 16}], got "
                         f"C={C}, pages {pages.dtype} {tuple(pages.shape)}")  # fmt: skip
    if pages.ndim == 3 and N != 1:
        raise ValueError(f"nvfp4_append: index pages [P, page, X] hold one head, got N={N}")
    if pages.stride(-1) != 1 or x_TNC.stride(-1) != 1:
        raise ValueError("nvfp4_append: pages and x_TNC must be contiguous in the last dim")
    if T == 0:
        return
    if pages.ndim == 3:
        stride_op, stride_oh, stride_oo = pages.stride(0), 0, pages.stride(1)
    else:
        stride_op, stride_oh, stride_oo = pages.stride(0), pages.stride(1), pages.stride(2)
    nblk = C // 16
    _nvfp4_append_kernel[(T, N)](
        x_TNC, x_TNC.stride(0), x_TNC.stride(1), slot_mapping_T, scale,
        pages, stride_op, stride_oh, stride_oo, pages.shape[-2], head_mul, head_add,
        C=C, NBLK=nblk, NBLK_P2=triton.next_power_of_2(nblk), HW=use_hw_casts(),
    )  # fmt: skip

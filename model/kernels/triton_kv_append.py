"""KV append: quantize one layer's new K, V and index-key rows straight into their paged-cache slots,
in one launch.

Why: the decode step is launch-bound (~2.8 us of graph replay per kernel on the H200), and the torch
path (`model.kv_cache.quantize_kv` + an index_put per cache) runs ~25 elementwise kernels and a
scatter per side per layer. One program stores one (token, row) of the layer: rows 0..2N-1 are the
main cache's slots 2 * head + side (K even, V odd), row 2N the sparse layer's index key; each reads
its values once and writes its stored bytes in place. Formats: fp32, bf16, fp8 (e4m3 of x / scale)
and NVFP4 (C/16 blocks of 16 in fp32, in `model.nvfp4`'s operation order, docs/FACTS.md "NVFP4
format", with correctly rounded divisions `div_rn`). The 4-over-6 writer stays on the torch path.

Invariant: for finite inputs the stored bytes equal `quantize_kv` of each part scattered to its
slot, exactly (tested): NVFP4 rows are C/2 code bytes (low nibble = even element) then C/16 scale
bytes. The wrapper checks shapes on the host only (no device reads: CUDA-graph capturable).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from model.kernels.triton_common import f32_to_bf16, f32_to_e4m3, opaque_to_compile, use_hw_casts

if TYPE_CHECKING:  # kv_cache imports this module; the views are only named in annotations here
    from model.kv_cache import PagedIndex, PagedKV

# Legend: T tokens, N kv heads, C head dim (Ci the index head dim), X stored bytes / values per row.
# Addressing: slot -> (page = slot // page_size, offset = slot % page_size); main K/V pages are
# [P, 2N, page, X] (row r = 2 * head + side at page * stride_kvp + r * stride_kvh + offset *
# stride_kvo), index pages [P, page, Xi]. Both caches of a layer share the slot and the page size.

# Stored formats (the `FMT` constexprs), keyed by the cache dtype names of `model.kv_cache`.
_FP32: tl.constexpr = tl.constexpr(0)
_BF16: tl.constexpr = tl.constexpr(1)
_FP8: tl.constexpr = tl.constexpr(2)
_NVFP4: tl.constexpr = tl.constexpr(3)
_FORMATS = {"fp32": (0, torch.float32), "bf16": (1, torch.bfloat16), "fp8": (2, torch.uint8),
            "nvfp4": (3, torch.uint8)}  # fmt: skip
APPEND_DTYPES = tuple(_FORMATS)  # the cache dtypes this kernel writes


@triton.jit
def _kv_append_kernel(
    slot_ptr, page_size,
    k_ptr, stride_kt, stride_kn, v_ptr, stride_vt, stride_vn, k_scale_ptr, v_scale_ptr,
    kv_ptr, stride_kvp, stride_kvh, stride_kvo,
    i_ptr, stride_it, i_scale_ptr,
    idx_ptr, stride_ip, stride_io,
    KV_ROWS: tl.constexpr, HAS_INDEX: tl.constexpr,
    C: tl.constexpr, C_P2: tl.constexpr, KV_FMT: tl.constexpr,
    CI: tl.constexpr, CI_P2: tl.constexpr, I_FMT: tl.constexpr,
    HW: tl.constexpr,
):  # fmt: skip
    # Grid (T, KV_ROWS + HAS_INDEX): rows below KV_ROWS (2N, or 0 for an index-only call) are main
    # K/V rows, the last one the index key. The constexpr guards compile only the parts a call has.
    pid_t = tl.program_id(0)
    pid_r = tl.program_id(1)
    slot = tl.load(slot_ptr + pid_t).to(tl.int64)
    page = slot // page_size
    offset = slot % page_size
    if pid_r < KV_ROWS:
        if KV_ROWS > 0:
            head = pid_r // 2  # row 2 * head + side: K and V share one quantizer body
            if pid_r % 2 == 0:
                x_row = k_ptr + pid_t * stride_kt + head * stride_kn
                scale_ptr = k_scale_ptr
            else:
                x_row = v_ptr + pid_t * stride_vt + head * stride_vn
                scale_ptr = v_scale_ptr
            kv_row = kv_ptr + page * stride_kvp + pid_r * stride_kvh + offset * stride_kvo
            _store_row(x_row, scale_ptr, kv_row, C, C_P2, KV_FMT, HW)
    else:
        if HAS_INDEX:
            idx_row = idx_ptr + page * stride_ip + offset * stride_io  # names apart: branches' types differ
            _store_row(i_ptr + pid_t * stride_it, i_scale_ptr, idx_row, CI, CI_P2, I_FMT, HW)


@triton.jit
def _store_row(x_row, scale_ptr, out_row, C: tl.constexpr, C_P2: tl.constexpr, FMT: tl.constexpr,
               HW: tl.constexpr):  # fmt: skip
    """One row of C values at x_row -> its stored form at out_row, as `quantize_kv` computes it."""
    if FMT == _NVFP4:
        _nvfp4_row(x_row, scale_ptr, out_row, C, C_P2 // 16, HW)
    else:
        offs_c = tl.arange(0, C_P2)
        is_c = offs_c < C
        x = tl.load(x_row + offs_c, mask=is_c, other=0.0).to(tl.float32)
        if FMT == _FP8:
            scaled = tl.math.div_rn(x, tl.load(scale_ptr).to(tl.float32))
            if not HW:  # the software cast needs the clamp; sm_90's cvt.rn.satfinite saturates itself
                scaled = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
            tl.store(out_row + offs_c, f32_to_e4m3(scaled, HW).to(tl.uint8, bitcast=True), mask=is_c)
        elif FMT == _BF16:
            tl.store(out_row + offs_c, f32_to_bf16(x, HW), mask=is_c)
        else:
            tl.store(out_row + offs_c, x, mask=is_c)


@triton.jit
def _nvfp4_row(x_row, scale_ptr, out_row, C: tl.constexpr, NBLK_P2: tl.constexpr, HW: tl.constexpr):
    """NVFP4 row: [NBLK_P2, 8] tiles of (even, odd) value pairs, one 16-value block per tile row."""
    NBLK: tl.constexpr = C // 16
    offs_b = tl.arange(0, NBLK_P2)  # 16-value blocks of the row
    offs_j = tl.arange(0, 8)  # byte within a block (two values each)
    is_blk = offs_b < NBLK
    mask_bj = is_blk[:, None] & (offs_j[None, :] < 8)
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
    tl.store(out_row + offs_b[:, None] * 8 + offs_j[None, :], byte_bj, mask=mask_bj)
    tl.store(out_row + C // 2 + offs_b, s8_b.to(tl.uint8, bitcast=True), mask=is_blk)


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


def _check_part(name: str, x: torch.Tensor, shape: tuple, pages: torch.Tensor, dtype: str, C: int) -> None:
    if tuple(x.shape) != shape or not x.is_floating_point() or x.stride(-1) != 1:
        raise ValueError(f"kv_append: {name} must be float {shape} contiguous in the last dim, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    if dtype not in _FORMATS:
        raise ValueError(f"kv_append: {name}'s cache dtype {dtype!r} is not one of {APPEND_DTYPES} "
                         "(the 4-over-6 writer has the torch path only)")  # fmt: skip
    if dtype == "nvfp4" and C % 16:
        raise ValueError(f"kv_append: an nvfp4 {name} needs a head dim % 16 == 0, got {C}")
    width = C // 2 + C // 16 if dtype == "nvfp4" else C
    if pages.dtype != _FORMATS[dtype][1] or pages.shape[-1] != width or pages.stride(-1) != 1:
        raise ValueError(f"kv_append: {name}'s {dtype} pages must be {_FORMATS[dtype][1]} [..., {width}] "
                         f"contiguous in the last dim, got {pages.dtype} {tuple(pages.shape)}")  # fmt: skip


@opaque_to_compile
def kv_append(
    slot_mapping_T: torch.Tensor,
    kv: PagedKV | None,
    k_TNC: torch.Tensor | None,
    v_TNC: torch.Tensor | None,
    index: PagedIndex | None = None,
    index_k_TC: torch.Tensor | None = None,
) -> None:
    """Store T tokens' K / V ([T, N, C] float, into kv.pages [P, 2N, page, X]) and index keys ([T, Ci]
    float, into index.pages [P, page, Xi]) at slot_mapping_T (int [T], all >= 0), in place, in one
    launch. Either part may be None (a full-attention layer has no index; an index-only call serves a
    main cache whose writer is torch's). Scales are the views' fp32 0-d dequant-side tensors."""
    if slot_mapping_T.ndim != 1 or slot_mapping_T.is_floating_point():
        raise ValueError(f"kv_append: slot_mapping_T must be 1-D integer, got {slot_mapping_T.dtype} "
                         f"{tuple(slot_mapping_T.shape)}")  # fmt: skip
    if kv is None and index is None:
        raise ValueError("kv_append: nothing to store (kv and index are both None)")
    T = slot_mapping_T.shape[0]
    dummy = slot_mapping_T  # stands in for an absent part's pointers (its branch is compiled out)
    kv_args, kv_consts = (dummy, 0, 0, dummy, 0, 0, dummy, dummy, dummy, 0, 0, 0), {}
    kv_rows, page_size = 0, None
    if kv is not None:
        _, H, page_size, _ = kv.pages.shape
        N, C = H // 2, kv.head_dim
        for name, x in (("k_TNC", k_TNC), ("v_TNC", v_TNC)):
            _check_part(name, x, (T, N, C), kv.pages, kv.dtype, C)
        if k_TNC.dtype != v_TNC.dtype:
            raise ValueError(
                f"kv_append: k_TNC and v_TNC must share a dtype, got {k_TNC.dtype}, {v_TNC.dtype}"
            )
        kv_rows = 2 * N
        kv_args = (k_TNC, k_TNC.stride(0), k_TNC.stride(1), v_TNC, v_TNC.stride(0), v_TNC.stride(1),
                   kv.k_scale, kv.v_scale, kv.pages, *kv.pages.stride()[:3])  # fmt: skip
        kv_consts = {"C": C, "C_P2": triton.next_power_of_2(C), "KV_FMT": _FORMATS[kv.dtype][0]}
    i_args, i_consts = (dummy, 0, dummy, dummy, 0, 0), {}
    if index is not None:
        Ci = index.head_dim
        _check_part("index_k_TC", index_k_TC, (T, Ci), index.pages, index.dtype, Ci)
        if page_size is not None and index.pages.shape[1] != page_size:
            raise ValueError(f"kv_append: index pages of {index.pages.shape[1]} slots and K/V pages of "
                             f"{page_size} cannot share a slot mapping")  # fmt: skip
        page_size = index.pages.shape[1]
        i_args = (index_k_TC, index_k_TC.stride(0), index.scale, index.pages, *index.pages.stride()[:2])
        i_consts = {"CI": Ci, "CI_P2": triton.next_power_of_2(Ci), "I_FMT": _FORMATS[index.dtype][0]}
    if T == 0:
        return
    # An absent part's constexprs only have to be valid: copy the present part's.
    kv_consts = kv_consts or {"C": i_consts["CI"], "C_P2": i_consts["CI_P2"], "KV_FMT": i_consts["I_FMT"]}
    i_consts = i_consts or {"CI": kv_consts["C"], "CI_P2": kv_consts["C_P2"], "I_FMT": kv_consts["KV_FMT"]}
    has_index = index is not None
    _kv_append_kernel[(T, kv_rows + has_index)](
        slot_mapping_T, page_size, *kv_args, *i_args,
        KV_ROWS=kv_rows, HAS_INDEX=has_index, **kv_consts, **i_consts, HW=use_hw_casts(),
    )  # fmt: skip

"""Triton NVFP4 MoE / GEMV: what the equivalence checks (tests/model/test_kernel_groups.py, group "moe")
do not cover: deleted variants are errors."""

import pytest
import torch

pytest.importorskip("triton")


def test_gemv_deleted_variant_v4_raises_naming_the_valid_ones():
    """v4 (the prefetching GEMV, measured 0.98-1.02x v3) was deleted: naming it is an error."""
    from model.kernels.triton_gemv import nvfp4_linear_triton

    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    packed, scales = torch.zeros(16, 16, dtype=torch.uint8), torch.zeros(16, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"'v3', 'v2'"):
        nvfp4_linear_triton(x, packed, scales, torch.tensor(1.0), variant="v4")


def test_moe_deleted_variant_v6_raises_naming_the_valid_ones():
    """v6 (the grouped split-K FMA GEMV) was deleted (v7 measured 2.0-9.5x it at T = 1-256, M3 widths):
    naming it is an error, not a silent tile kernel."""
    from model.kernels.triton_moe import moe_nvfp4_triton

    E, D, F = 2, 32, 16

    def weights(n_out, n_in):  # (packed, scales, scale_2) of an NVFP4 bank
        packed = torch.zeros(E, n_out, n_in // 2, dtype=torch.uint8)
        return packed, torch.zeros(E, n_out, n_in // 16, dtype=torch.uint8), torch.ones(E)

    x, ids, w = torch.zeros(1, D, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
    with pytest.raises(ValueError, match=r"\('v2', 'v7'\)"):
        moe_nvfp4_triton(x, ids, w, weights(F, D), weights(F, D), weights(D, F), swiglu_alpha=1.0,
                         swiglu_limit=7.0, variant="v6")  # fmt: skip

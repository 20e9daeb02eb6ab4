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

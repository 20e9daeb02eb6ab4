"""Triton sparse attention decode: what the equivalence checks (tests/model/test_kernel_groups.py,
group "attention") do not cover: deleted variants are errors."""

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.parametrize("variant", ["v3", "v4", "v5"])
def test_attention_deleted_variant_raises_naming_the_valid_ones(variant):
    """v3 and v4 were deleted (v5 measured 1.08x v3 with equal output, v4 0.99x), v5 too (v6 measured
    1.47x v5 at B = 64, 128K, and nearer the fp32 reference): naming one is an error, not a silent v6."""
    from model.kernels.triton_sparse_attention import sparse_attention_triton
    from model.kv_cache import PagedKV

    q = torch.zeros(1, 16, 128, dtype=torch.bfloat16)
    kv = PagedKV(
        torch.zeros(2, 2, 16, 72, dtype=torch.uint8), "nvfp4", torch.tensor(1.0), torch.tensor(1.0), 128
    )
    table, seq = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    pos = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"\('v6', 'v2'\)"):
        sparse_attention_triton(q, kv, table, seq, pos, None, softmax_scale=1.0, variant=variant)

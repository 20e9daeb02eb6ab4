"""Triton NVFP4 W4A16 MoE / linear / shared expert kernels vs their torch references.

CPU: the checks of `tests.model.kernel_cases` group "moe" run in a subprocess under
TRITON_INTERPRET=1 (one process per file, so the flag never reaches other test modules).
GPU (-m gpu): the same checks compiled on CUDA, in process.
"""

import pytest
import torch

from tests.model.kernel_cases import GROUPS, run_group, run_interpreted

pytest.importorskip("triton")
GROUP = "moe"


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(GROUP)


@pytest.mark.parametrize("check", GROUPS[GROUP])
def test_moe_kernel_equals_reference_under_interpreter(interpreted, check):
    ok, msg = interpreted[check]
    assert ok, msg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("check", GROUPS[GROUP])
def test_moe_kernel_equals_reference_on_cuda(check):
    ok, msg = run_group(GROUP, "cuda", only=check)[check]
    assert ok, msg


def test_gemv_deleted_variant_v4_raises_naming_the_valid_ones():
    """v4 (the prefetching GEMV, measured 0.98-1.02x v3) was deleted: naming it is an error."""
    from model.kernels.triton_gemv import nvfp4_linear_triton

    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    packed, scales = torch.zeros(16, 16, dtype=torch.uint8), torch.zeros(16, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"'v3', 'v2'"):
        nvfp4_linear_triton(x, packed, scales, torch.tensor(1.0), variant="v4")

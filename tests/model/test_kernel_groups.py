"""Every check group of `tests.model.kernel_cases` (NVFP4 KV append, indexer, sparse attention, MoE /
GEMV, sampling noise): the Triton decode kernels against their torch references.

CPU: each group runs once in a subprocess under TRITON_INTERPRET=1 (so the flag never reaches other
test modules: Triton picks interpreter or compiled kernels at import), each check one test.
GPU (-m gpu): the same checks compiled on CUDA, in process.
"""

import pytest
import torch

from tests.model.kernel_cases import GROUPS, run_group, run_interpreted

pytest.importorskip("triton")
CHECKS = [(group, check) for group, checks in GROUPS.items() for check in checks]
_interpreted: dict[str, dict[str, list]] = {}  # group -> its subprocess's results, run once


@pytest.mark.parametrize(("group", "check"), CHECKS)
def test_kernel_equals_reference_under_interpreter(group, check):
    if group not in _interpreted:
        _interpreted[group] = run_interpreted(group)
    ok, msg = _interpreted[group][check]
    assert ok, msg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("group", "check"), CHECKS)
def test_kernel_equals_reference_on_cuda(group, check):
    ok, msg = run_group(group, "cuda", only=check)[check]
    assert ok, msg

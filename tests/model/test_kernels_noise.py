"""The Triton counter-noise kernel (sampling noise on CUDA) vs the torch formula of the sampler.

CPU: the checks of `tests.model.kernel_cases` group "noise" run in a subprocess under
TRITON_INTERPRET=1 (one process per file, so the flag never reaches other test modules).
GPU (-m gpu): the same checks compiled on CUDA, in process.
"""

import pytest
import torch

from tests.model.kernel_cases import GROUPS, run_group, run_interpreted

pytest.importorskip("triton")
GROUP = "noise"


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(GROUP)


@pytest.mark.parametrize("check", GROUPS[GROUP])
def test_noise_kernel_equals_reference_under_interpreter(interpreted, check):
    ok, msg = interpreted[check]
    assert ok, msg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("check", GROUPS[GROUP])
def test_noise_kernel_equals_reference_on_cuda(check):
    ok, msg = run_group(GROUP, "cuda", only=check)[check]
    assert ok, msg

"""Test-wide settings: one torch thread (small matmuls slow down badly when threads compete for the
two CI cores) and a fixed seed."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)

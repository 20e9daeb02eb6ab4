"""Fixtures of the engine tests: `one_thread` runs a module's tiny-model engines on one torch thread
(deterministic timing-independent reductions, no oversubscription of the 2 CI cores)."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

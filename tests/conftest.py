"""Test-wide settings: one torch thread (small matmuls slow down badly when threads compete for the
two CI cores) and a fixed seed; `ray_local`, the local Ray instance the trainer tests share."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance (2 CPUs, no dashboard) for one test module, shut down after it. Ray is
    imported here, lazily: most test modules never start it."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()

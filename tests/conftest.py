"""Test-wide settings: one torch thread (small matmuls slow down badly when threads compete for the
two CI cores) and a fixed seed; `ray_local`, the local Ray instance the trainer tests share."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def start_local_ray(ray) -> None:
    """`ray.init` of a 2-CPU local instance, tried twice: on a loaded machine the GCS server can miss
    Ray's start-up deadline ("Timed out waiting for file .../gcs_server_port..."), seen once in a
    full-suite run (the same tests passed alone); the start is tried once more after a shutdown."""
    kwargs = dict(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        ray.init(**kwargs)
    except RuntimeError as e:
        if "Timed out waiting for file" not in str(e):
            raise
        ray.shutdown()
        ray.init(**kwargs)


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance (2 CPUs, no dashboard) for one test module, shut down after it. Ray is
    imported here, lazily: most test modules never start it."""
    ray = pytest.importorskip("ray")
    start_local_ray(ray)
    yield ray
    ray.shutdown()

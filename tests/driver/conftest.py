"""Driver test fixtures: one local Ray cluster per session (engines are started per module)."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (run `make setup`)")
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()

"""One Ray cluster on loopback for the whole pytest run, with token authentication on; ggx-ray
connects to it as a user does (`ggx_ray.connect(address)`, or GGX_RAY_ADDRESS in a subprocess).

Tests that need it take the `ray_device` fixture (RAY0: the worker on this machine, hosting the
CPU device). Where Ray cannot start here, they are skipped with the reason Ray gave; the
tests of the worker's request checks (test_worker.py) need no cluster and always run.
"""
from __future__ import annotations

import os
import uuid

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the tests of this folder after every other: once connected, the RAY devices are in
    this process's registry, and default device lists (which take every accelerator-like device)
    of tests run later would include them."""
    here = os.path.dirname(__file__)
    items.sort(key=lambda item: str(item.path).startswith(here))


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory):
    """(address, environment) of a one-node cluster this process starts and stops (ray.init on
    loopback, token authentication on); other processes join it with GGX_RAY_ADDRESS=address."""
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex, "RAY_USAGE_STATS_ENABLED": "0",
           "GGX_RAY_CACHE": str(tmp_path_factory.mktemp("ray-tensor-cache"))}
    # before ray is imported (it reads the authentication mode once); workers and any process
    # joining inherit the token and the cache folder
    os.environ.update(env)
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install ggx-ray)")
    try:
        info = ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                        namespace="ggx", log_to_driver=False, logging_level="warning")
    except Exception as e:  # noqa: BLE001 - whatever stops Ray from starting here
        pytest.skip(f"a local Ray cluster cannot start here: {type(e).__name__}: {e}"[:600])
    try:
        yield info.address_info["gcs_address"], env
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_devices(ray_cluster):
    import ggx_ray

    address, _ = ray_cluster
    return ggx_ray.connect(address)


@pytest.fixture(scope="session")
def ray_device(ray_devices):
    return ray_devices[0]

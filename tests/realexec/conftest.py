import os

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance per test module, on 127.0.0.1, stopped when the module ends."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from realexec.executor.ray_executor import PROJECT_ROOT
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False, num_cpus=2,
             runtime_env={"env_vars": {"PYTHONPATH": PROJECT_ROOT, "GLOO_SOCKET_IFNAME": "lo"}})
    yield ray
    ray.shutdown()

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def dev():
    from kvreg.errors import BackendError
    from kvreg_opencl import device

    try:
        return device.get_device()
    except BackendError as exc:
        pytest.skip(f"no OpenCL device: {exc}")


@pytest.fixture
def small_blocks(monkeypatch):
    """Tiny tunables so multi-block / multi-chunk paths run on small inputs."""
    from kvreg_opencl import config

    for name, value in config.SMALL.items():
        monkeypatch.setattr(config, name, value)
    return config

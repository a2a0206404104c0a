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

    monkeypatch.setattr(config, "BLOCK_ROWS", 8)
    monkeypatch.setattr(config, "LOCAL_SIZE", 4)
    monkeypatch.setattr(config, "HEADS_PER_WG", 2)
    monkeypatch.setattr(config, "CHUNK_TOKENS", 3)
    monkeypatch.setattr(config, "MIRROR_MIN_ROWS", 4)

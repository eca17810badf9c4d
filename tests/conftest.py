"""Every test run emulates an 8-device cluster on the CPU (set before JAX starts)."""
import os

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

NUM_DEVICES = 8


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    import jax

    assert jax.device_count() == NUM_DEVICES, f"tests need {NUM_DEVICES} emulated CPU devices, got {jax.device_count()}"

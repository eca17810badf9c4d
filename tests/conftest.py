"""Every test run emulates an 8-device cluster on the CPU (set before JAX starts)."""
import os

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from xtrain.runtime.backends import with_cpu_xla_flags  # noqa: E402  (jax not imported yet)

# jax starts in pytest_configure, before any xtrain.init(): give it xtrain's CPU flags here
os.environ["XLA_FLAGS"] = with_cpu_xla_flags(os.environ.get("XLA_FLAGS", ""))

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

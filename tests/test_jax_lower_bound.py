"""xtrain works on the lowest JAX that pyproject.toml admits (Neuron's JAX plugin trails the
newest JAX: PLATFORM.md), not only on the one pip picked for this environment.

The test installs that jax/jaxlib pair beside the environment (pip --target, cached under
~/.cache/xtrain) and runs the parity standard with it in a subprocess."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_pins import requirement

HERE = Path(__file__).resolve().parent


def lower_bound(name: str) -> str:
    bounds = [s.version for s in requirement(name).specifier if s.operator == ">="]
    assert len(bounds) == 1, f"pyproject.toml should give {name} one lower bound (>=), got {requirement(name)}"
    parts = bounds[0].split(".")
    return ".".join(parts + ["0"] * (3 - len(parts)))


def install_side_by_side(version: str) -> Path:
    target = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "xtrain" / f"jax-{version}"
    if not (target / "jaxlib").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        f"jax=={version}", f"jaxlib=={version}"], check=True)
    return target


@pytest.mark.unit
def test_jax_and_jaxlib_share_their_lower_bound():
    assert lower_bound("jax") == lower_bound("jaxlib")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_parity_on_the_lowest_admitted_jax():
    version = lower_bound("jax")
    target = install_side_by_side(version)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(HERE.parent)])}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, str(HERE / "_lower_bound_script.py"), version], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"jax {version}: {out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    assert len(re.findall("meets the parity standard", out.stdout)) == 6, out.stdout

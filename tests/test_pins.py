"""The torchax pin works with the installed torch: a broken pin fails here, loudly, first.

torchax release 0.0.13 fails to import with torch >= 2.13 (PLATFORM.md); pyproject.toml pins a
nightly verified with torch 2.13.
"""
import importlib.metadata
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from packaging.requirements import Requirement

pytestmark = pytest.mark.unit

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def project_dependencies() -> list[str]:
    # A regex, not tomllib: tomllib is Python >= 3.11 and xtrain supports 3.10.
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", PYPROJECT.read_text(), re.S | re.M)
    assert block, f"no [project] dependencies list in {PYPROJECT}"
    return re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)


def extra_requirements(extra: str) -> list[Requirement]:
    block = re.search(rf"^{extra}\s*=\s*\[(.*?)\]\s*$", PYPROJECT.read_text(), re.S | re.M)
    assert block, f"no [project.optional-dependencies] {extra} list in {PYPROJECT}"
    return [Requirement(r) for r in re.findall(r'"([^"]+)"', block.group(1))]


def requirement(name: str) -> Requirement:
    deps = project_dependencies()
    found = [Requirement(d) for d in deps if Requirement(d).name == name]
    assert len(found) == 1, f"pyproject.toml should list {name} once in [project].dependencies: {deps}"
    return found[0]


def test_torchax_is_the_pinned_build():
    pin = requirement("torchax")
    pinned = re.fullmatch(r"==(\S+)", str(pin.specifier))
    assert pinned, f"torchax must be pinned to one known-good build (==version), got {pin}"
    import torchax  # noqa: F401  (an import error with this torch is the failure this guards)

    installed = importlib.metadata.version("torchax")
    assert installed == pinned.group(1), f"installed torchax {installed}, pyproject.toml pins {pin}"


def test_installed_torch_satisfies_its_constraint():
    pin = requirement("torch")
    installed = importlib.metadata.version("torch")
    assert pin.specifier.contains(installed, prereleases=True), f"installed torch {installed} is outside {pin}"


def test_installed_torch_is_the_cpu_build():
    # xtrain only traces with torch; the CUDA build brings several GB of nvidia-* wheels that no
    # backend uses (README, "Set-up": where the CPU build comes from)
    gpu = [r for r in importlib.metadata.requires("torch") or []
           if re.match(r"(nvidia-|cuda-|triton\b)", Requirement(r).name)]
    assert not gpu, f"the installed torch {importlib.metadata.version('torch')} is a CUDA build: it requires {gpu}"


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x)).softmax(-1).pow(2).sum()


def test_torch_function_through_torchax_matches_torch():
    import torchax

    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(5, 6)
    weights, fn = torchax.extract_jax(model)
    value, grads = jax.value_and_grad(fn)(weights, (jnp.asarray(x.numpy()),))
    expected = model(x)
    expected.backward()
    np.testing.assert_allclose(float(value), expected.item(), rtol=1e-6)
    for name, param in model.named_parameters():
        np.testing.assert_allclose(np.asarray(grads[name]), param.grad.numpy(), atol=1e-6, err_msg=name)


def test_cuda_extra_pins_the_plugin_and_pjrt_to_the_pinned_jaxlib_exactly():
    pins = {r.name: r for r in extra_requirements("cuda")}
    assert set(pins) == {"jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt"}, pins
    versions = {}
    for name, req in pins.items():
        exact = re.fullmatch(r"==(\d+\.\d+\.\d+)", str(req.specifier))
        assert exact, f"[cuda] must pin {name} to one release (==x.y.z), got {req}"
        versions[name] = exact.group(1)
    assert len(set(versions.values())) == 1, f"the CUDA plugin, PJRT, jax and jaxlib must be one release: {versions}"
    assert pins["jax-cuda12-plugin"].extras == {"with-cuda"}, "the plugin brings NVIDIA's CUDA 12 wheels"
    release = versions["jaxlib"]
    for name in ("jax", "jaxlib"):
        assert requirement(name).specifier.contains(release), f"[cuda] pins {release}, outside {requirement(name)}"


def test_gpu_compile_extra_pins_the_plugin_pjrt_and_ptxas_and_dev_installs_it():
    """The deviceless GPU compile (xtrain.aot): plugin and PJRT built for exactly the jaxlib
    release [cuda] pins, without NVIDIA's runtime wheels; the CUDA compiler wheel pinned (its
    ptxas compiles the kernels, xtrain.aot.toolchain); the installed versions are the pins."""
    pins = {r.name: r for r in extra_requirements("gpu-compile")}
    assert {"jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12"} <= set(pins), pins
    jaxlib = re.fullmatch(r"==(\S+)", str({r.name: r for r in extra_requirements("cuda")}["jaxlib"].specifier))
    for name in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12"):
        exact = re.fullmatch(r"==(\S+)", str(pins[name].specifier))
        assert exact, f"[gpu-compile] must pin {name} exactly (==), got {pins[name]}"
        assert importlib.metadata.version(name) == exact.group(1), f"installed {name} is not the pin {pins[name]}"
        if name != "nvidia-cuda-nvcc-cu12":
            assert exact.group(1) == jaxlib.group(1), f"{name} {exact.group(1)} is not the jaxlib pin {jaxlib.group(1)}"
    assert not pins["jax-cuda12-plugin"].extras, "no with-cuda extra: a deviceless compile needs no CUDA runtime"
    assert any(r.name == "xtrain" and r.extras == {"gpu-compile"} for r in extra_requirements("dev")), \
        "dev must include xtrain[gpu-compile] so CI runs tests/test_aot.py"

"""The test tiers of tests/conftest.py hold: `-m unit` is a real fast loop (>= 150 tests), a test
without a tier is refused at collection, and a `unit` test that compiles a training step fails.
Each check runs pytest in a second process on this suite or on a small file beside a copy of the
conftest."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

TESTS = Path(__file__).resolve().parent
MIN_UNIT_TESTS = 150

# a training step of xtrain on the 8 emulated devices, and a small jax function beside it
PROBES = '''
import jax, numpy as np, optax, pytest, xtrain

def _step():
    loss = lambda params, x: ((x @ params["w"]) ** 2).mean()
    step = xtrain.compile(loss, xtrain.Mesh(data=8), params={"w": np.ones((4, 1), np.float32)},
                          optimizer=optax.sgd(0.1))
    return step(np.ones((8, 4), np.float32))["loss"]

@pytest.mark.unit
def test_unit_compiling_a_small_function():
    assert float(jax.jit(lambda x: x * 2)(3.0)) == 6.0

@pytest.mark.unit
def test_unit_compiling_a_step():
    assert _step() > 0

@pytest.mark.e2e
def test_e2e_compiling_a_step():
    assert _step() > 0
'''


def _pytest(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _probe_dir(tmp_path: Path, source: str) -> Path:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(TESTS.parent / "pyproject.toml", tmp_path / "pyproject.toml")  # the tier markers
    (tmp_path / "test_probe.py").write_text(source)
    return tmp_path


def _collection(session) -> tuple[int, list[str]]:
    """(tests `-m unit` selects, test ids in collection order): this session's own collection when
    it holds the whole suite (the README's command: every module, nothing deselected), else a
    second pytest's --collect-only of the suite."""
    items, option = session.items, session.config.option
    if {p.name for p in TESTS.glob("test_*.py")} <= {i.path.name for i in items} and not (option.keyword
                                                                                         or option.markexpr):
        return sum(1 for i in items if i.get_closest_marker("unit")), [i.nodeid for i in items]
    out = _pytest("--collect-only", "-q", str(TESTS), cwd=TESTS.parent)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    unit = _pytest("--collect-only", "-q", "-m", "unit", str(TESTS), cwd=TESTS.parent)
    selected = int(re.search(r"(\d+)(?:/\d+)? tests? collected", unit.stdout).group(1))
    return selected, [line for line in out.stdout.splitlines() if "::" in line]


def test_the_unit_tier_holds_enough_tests_to_be_the_fast_loop(request):
    selected, ids = _collection(request.session)
    assert selected >= MIN_UNIT_TESTS, f"-m unit selects {selected} tests, fewer than {MIN_UNIT_TESTS}"
    # conftest.LONGEST_FIRST names modules that exist (a renamed one would silently lose its place),
    # and those collected come first, in that order
    from conftest import LONGEST_FIRST

    assert all((TESTS / name).is_file() for name in LONGEST_FIRST), [n for n in LONGEST_FIRST
                                                                   if not (TESTS / n).is_file()]
    modules = list(dict.fromkeys(i.split("::")[0].rsplit("/", 1)[-1] for i in ids))
    listed = [m for m in LONGEST_FIRST if m in modules]
    assert listed and modules[:len(listed)] == listed, modules[:20]


def test_a_unit_test_that_compiles_a_training_step_fails(tmp_path):
    out = _pytest("-q", "-rA", "test_probe.py", cwd=_probe_dir(tmp_path, PROBES))
    assert "PASSED test_probe.py::test_unit_compiling_a_small_function" in out.stdout, out.stdout[-3000:]
    assert "PASSED test_probe.py::test_e2e_compiling_a_step" in out.stdout, out.stdout[-3000:]
    assert re.search(r"FAILED test_probe.py::test_unit_compiling_a_step\b", out.stdout), out.stdout[-3000:]
    assert "is marked unit but compiled 1 training step(s)" in out.stdout


def test_a_test_without_a_tier_is_refused_at_collection(tmp_path):
    out = _pytest("-q", "test_probe.py", cwd=_probe_dir(tmp_path, "def test_untiered():\n    pass\n"))
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout[-2000:] + out.stderr[-2000:]
    assert "test_probe.py::test_untiered: no tier" in out.stderr + out.stdout


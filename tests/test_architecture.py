"""The layers of xtrain are checked, not hoped for: the import contracts of pyproject.toml (run with
import-linter, and shown to fail on a deliberate violation), every collective emitted through the
collectives layer, and modules and functions kept short or saying why they are not."""
import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("xtrain", "neuron_support")
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for package in PACKAGES:
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.multiprocess
def test_the_import_contracts_hold():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


VIOLATIONS = {
    # the lowering reaching up to the torch front end
    "xtrain/lowering/_violation.py": ("from xtrain.frontend import torch_module\n",
                                      "xtrain.lowering._violation -> xtrain.frontend.torch_module"),
    # a cycle between two sibling modules of the compiler's lowest layer
    "xtrain/ir/_violation.py": ("from xtrain.ir import _violation_twin\n", "No import cycles"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("path", sorted(VIOLATIONS))
def test_a_deliberate_violation_breaks_the_contracts(tmp_path, path):
    root = _copy(tmp_path)
    source, message = VIOLATIONS[path]
    (root / path).write_text(source)
    if "_violation_twin" in source:
        (root / "xtrain/ir/_violation_twin.py").write_text("from xtrain.ir import _violation\n")
    out = _lint(root)
    assert out.returncode != 0 and message in out.stdout, out.stdout[-3000:]


# every collective of the emitted program goes through xtrain.lowering.collectives
_COLLECTIVES = {"psum", "pmax", "pmin", "psum_scatter", "all_gather", "all_gather_invariant", "ppermute",
                "all_to_all", "pbroadcast", "ragged_all_to_all"}


def _collective_calls(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            owner = getattr(func.value, "id", None) if isinstance(func, ast.Attribute) else None
            if name in _COLLECTIVES and owner in (None, "lax", "jax"):
                found.append(f"{name} (line {node.lineno})")
        if isinstance(node, ast.ImportFrom) and any(a.name in _COLLECTIVES for a in node.names):
            found.append(f"import of {[a.name for a in node.names]} (line {node.lineno})")
    return found


@pytest.mark.unit
def test_the_lowering_communicates_only_through_the_collectives_layer():
    offenders = {}
    for path in sorted((ROOT / "xtrain" / "lowering").rglob("*.py")):
        if path.name == "collectives.py" and path.parent.name == "lowering":
            continue
        calls = _collective_calls(ast.parse(path.read_text()))
        if calls:
            offenders[str(path.relative_to(ROOT))] = calls
    assert not offenders, f"collectives emitted outside xtrain/lowering/collectives.py: {offenders}"


MODULE_LINES, FUNCTION_LINES = 400, 60
REASON = "Why this is long:"


def _code_lines(node) -> int:
    """A function's lines, its docstring left out (a public function documents every argument)."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def _sources():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


@pytest.mark.unit
def test_long_modules_and_functions_say_why():
    long = []
    for path in _sources():
        text = path.read_text()
        tree = ast.parse(text)
        doc = ast.get_docstring(tree) or ""
        if len(text.splitlines()) > MODULE_LINES and REASON not in doc:
            long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = _code_lines(node)
                if lines > FUNCTION_LINES and REASON not in (ast.get_docstring(node) or ""):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"split these, or say at their top ({REASON!r}) why not: {long}"

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
    # the errors module reaching into a layer that imports it
    "xtrain/errors.py": ("from xtrain.ir import model\n", "xtrain.errors -> xtrain.ir.model"),
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


MODULE_LINES, FUNCTION_LINES, LISTED_LINES = 600, 60, 400
REASON = "Why this is long:"
# Modules past LISTED_LINES, each with why it is one module (none may pass MODULE_LINES).
LONG_MODULES = {
    "xtrain/runtime/launch.py": "one pure function of the environment per launcher (torchrun, SageMaker, Slurm, "
                                "MPI) and their precedence: read together to see which one wins",
    "xtrain/step/train.py": "the TrainStep users hold: its lifecycle (deferred or built), running, state, checkpoints "
                      "and the explanation entry points; building is xtrain.lowering.assembly's",
}


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
    long, listed = [], set()
    for path in _sources():
        text, name = path.read_text(), str(path.relative_to(ROOT))
        tree = ast.parse(text)
        lines = len(text.splitlines())
        if lines > MODULE_LINES or (lines > LISTED_LINES and name not in LONG_MODULES):
            long.append(f"{name}: {lines} lines")
        listed |= {name} if lines > LISTED_LINES else set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = _code_lines(node)
                if lines > FUNCTION_LINES and REASON not in (ast.get_docstring(node) or ""):
                    long.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    assert not long, (f"split these (modules past {MODULE_LINES} lines always; past {LISTED_LINES} unless listed in "
                      f"LONG_MODULES with a reason; functions past {FUNCTION_LINES} unless {REASON!r}): {long}")
    assert set(LONG_MODULES) == listed, f"LONG_MODULES lists modules no longer long: {set(LONG_MODULES) - listed}"


def _context_assignments(tree) -> list[str]:
    """`ctx.<field> = ...` (or `ctx.a.b = `, or one inside a tuple target) in a module's source:
    the interpreter's state changes only through the cursor's context managers."""
    def on_ctx(target) -> bool:
        if isinstance(target, (ast.Tuple, ast.List)):
            return any(on_ctx(t) for t in target.elts)
        while isinstance(target, ast.Attribute):
            target = target.value
            if isinstance(target, ast.Name) and target.id == "ctx":
                return True
        return False

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if any(on_ctx(t) for t in targets):
            found.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


@pytest.mark.unit
def test_the_check_for_context_assignments_finds_them():
    source = "def rule(ctx):\n    path, ctx.path = ctx.path, 'x'\n    ctx.cursor.layer = None\n    ctx.memo[k] = v\n"
    assert _context_assignments(ast.parse(source)) == ["line 2: path, ctx.path = (ctx.path, 'x')",
                                                         "line 3: ctx.cursor.layer = None"]


@pytest.mark.unit
def test_no_lowering_code_assigns_the_interpreter_state():
    """Rules move the cursor with `with ctx.cursor.at(path):`, never save and restore a field."""
    offenders = {}
    for path in sorted((ROOT / "xtrain" / "lowering").rglob("*.py")):
        found = _context_assignments(ast.parse(path.read_text()))
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, f"interpreter state assigned by hand (use the Cursor's context managers): {offenders}"

"""The documentation: the site builds strict, the README stays short, and every Python block of
the README and docs/ runs.

Blocks of one page run in order in one namespace, which starts from the preamble that
docs/index.md shows (the block after `<!-- preamble -->`: `model`, `batch`, `mesh`, `opt` and a
compiled `step`), built once for all pages. A block that cannot run here carries a visible
`<!-- no-run: reason -->` right before it; at most MAX_OPT_OUTS of them in all.
"""
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_OPT_OUTS = 5
MAX_README_LINES = 260
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>preamble|no-run)(?::\s*(?P<reason>.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # "preamble", "no-run" or None
    reason: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, each with the marker comment right before it."""
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, body, j = opening.group("indent"), [], i + 1
        while j < len(lines) and not re.match(rf"^{re.escape(indent)}```\s*$", lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        assert j < len(lines), f"{page.relative_to(ROOT)}:{i + 1}: a code block that is never closed"
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mark = MARKER.match(before)
        found.append(Block(page, i + 1, opening.group("lang"), "\n".join(body) + "\n",
                           mark.group("kind") if mark else None, mark.group("reason") if mark else None))
        i = j + 1
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL_BLOCKS if b.lang == "python"]
PREAMBLE = [b for b in PYTHON if b.marker == "preamble"]
RUN_PAGES = sorted({b.page for b in PYTHON if b.marker is None}, key=PAGES.index)


@pytest.mark.unit
def test_site_builds_strict(tmp_path):
    # --strict turns every warning into a failure: a broken link or anchor, a page outside the nav,
    # an API object mkdocstrings cannot find, a docstring whose parameters do not match.
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    assert "WARNING" not in run.stderr, run.stderr
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("xtrain.api.compile") > 0


@pytest.mark.unit
def test_readme_is_a_short_first_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {MAX_README_LINES})"
    readme = (ROOT / "README.md").read_text()
    for page in re.findall(r"\]\((docs/[\w./-]+\.md)\)", readme):
        assert (ROOT / page).is_file(), f"README.md links {page}, which does not exist"


@pytest.mark.unit
def test_every_python_block_runs_or_says_why_not():
    assert len(PREAMBLE) == 1 and PREAMBLE[0].page.name == "index.md", \
        f"one <!-- preamble --> block, in docs/index.md: {[b.where for b in PREAMBLE]}"
    skipped = [b for b in PYTHON if b.marker == "no-run"]
    assert len(skipped) <= MAX_OPT_OUTS, f"{len(skipped)} no-run blocks (at most {MAX_OPT_OUTS}): " \
                                         f"{[b.where for b in skipped]}"
    assert all(b.reason for b in skipped), f"a no-run marker needs a reason: {[b.where for b in skipped if not b.reason]}"
    # Python must be fenced as python to be run: no py/python3/pycon fences slipping past the test.
    other = [b.where for b in ALL_BLOCKS if b.lang.lower() in ("py", "python3", "pycon", "ipython")]
    assert not other, f"fence Python blocks as ```python so they run: {other}"
    stray = [b.where for b in ALL_BLOCKS if b.marker and b.lang != "python"]
    assert not stray, f"a preamble / no-run marker stands before a block that is not Python: {stray}"
    assert len(PYTHON) - len(skipped) - 1 >= 10, "the docs should show (and run) their examples"


@pytest.fixture(scope="module")
def preamble(tmp_path_factory):
    namespace = {"__name__": "docs_preamble"}
    exec(compile(PREAMBLE[0].code, PREAMBLE[0].where, "exec"), namespace)
    return namespace


@pytest.mark.e2e
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_snippets_run(page, preamble, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files the snippets write (checkpoints, metrics, plots) land here
    namespace = dict(preamble)
    for block in (b for b in PYTHON if b.page == page and b.marker is None):
        try:
            exec(compile(block.code, block.where, "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"the snippet at {block.where} failed: {type(err).__name__}: {err}") from err

"""Two commits of xtrain side by side: run one benchmark script of each, interleaved over rounds,
and report per table row the median of each commit's round figures and their ratio.

    python benchmarks/compare_commits.py --before 58f4d67 --after HEAD --rounds 3 \\
        --column "median step (ms)" -- benchmarks/ddp_vs_xtrain.py --rounds 1 --lowerings explicit

Each commit is checked out in a temporary git worktree and its own version of the script runs
there (PYTHONPATH pointing at it), writing its markdown table to a file of ours (`--out`). Rows
are matched by their first cells (up to the first numeric column); the figure read is `--column`.
A refactor that should not change speed is "within noise" when every ratio's median is within
5% of 1 over at least 3 rounds.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _parse(markdown: str, column: str) -> dict[str, float]:
    """{row key: figure} of the first table in `markdown` with a `column` header."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    for index, line in enumerate(lines):
        cells = [c.strip() for c in line.strip("|").split("|")]
        if column in cells:
            at, out = cells.index(column), {}
            for row in lines[index + 2:]:
                values = [c.strip() for c in row.strip("|").split("|")]
                if len(values) != len(cells):
                    break
                key = " | ".join(v for v in values[:at] if not re.fullmatch(r"[\d.,]+", v))
                out[key] = float(values[at].replace(",", ""))
            return out
    raise ValueError(f"no table with a column {column!r} in the benchmark's output")


def _run(tree: pathlib.Path, script: list[str], out: pathlib.Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, *script, "--out", str(out)], cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return out.read_text()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the commit compared against")
    p.add_argument("--after", default="HEAD")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--column", required=True, help="header of the figure to compare, e.g. 'median step (ms)'")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- the benchmark script and its arguments")
    args = p.parse_args()
    script = [a for a in args.script if a != "--"]
    figures: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for side in ("before", "after"):
            trees[side] = pathlib.Path(tmp) / side
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[side]), getattr(args, side)], cwd=ROOT,
                           check=True, capture_output=True)
        try:
            for round_ in range(args.rounds):
                for side in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
                    table = _parse(_run(trees[side], script, pathlib.Path(tmp) / f"{side}{round_}.md"), args.column)
                    for key, value in table.items():
                        figures[side].setdefault(key, []).append(value)
                    print(f"round {round_ + 1} {side}: {table}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    print(f"\n| row | {args.before} median | {args.after} median | after / before | rounds before | rounds after |")
    print("|---|---:|---:|---:|---|---|")
    for key in figures["before"]:
        if key in figures["after"]:
            b, a = statistics.median(figures["before"][key]), statistics.median(figures["after"][key])
            print(f"| {key} | {b:.1f} | {a:.1f} | {a / b:.3f} | {', '.join(f'{v:.1f}' for v in figures['before'][key])} "
                  f"| {', '.join(f'{v:.1f}' for v in figures['after'][key])} |")


if __name__ == "__main__":
    main()

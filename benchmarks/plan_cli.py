"""`xtrain plan --compile` as a user runs it, over the whole default candidate list: Llama-3.1-8B
built without weights (benchmarks/scripts/llama3_8b.py) on one p5.48xlarge, the best candidates
compiled by XLA's GPU compiler on this CPU-only host. Records the wall time, the largest process's
peak RSS (the search or a compiler child), how many candidates were lowered, the pick and its
compiled memory, and the table itself.

    python benchmarks/plan_cli.py        # -> benchmarks/results/plan_cli.md

benchmarks/real_configs.py plans each published configuration with its published-style candidates
only; this is the search over all of them.
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "plan_cli.md"
COMMAND = ["plan", "--target", "p5.48xlarge:1", "--precision", "bf16", "--compile", "3", "--all",
           "benchmarks/scripts/llama3_8b.py"]


def run(command: list[str]) -> tuple[str, float, float]:
    """The listing `xtrain <command>` prints, its wall seconds and the largest process's peak RSS (GiB)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "xtrain.cli", *command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          text=True)  # its stderr (the progress line) passes through
    wall = time.monotonic() - start
    if done.returncode:
        raise SystemExit(f"xtrain {' '.join(command)} failed ({done.returncode}): see its stderr above")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / (1 << 20)  # KiB -> GiB
    return done.stdout[done.stdout.index("xtrain plan for"):], wall, peak


def summary(listing: str) -> dict[str, str]:
    """What the table says: rows lowered, left unlowered, the pick and its compiled memory."""
    lines = listing.splitlines()
    lowered = [line for line in lines if re.search(r"\d (KiB|MiB|GiB|TiB)\s+(yes|NO)\s", line)]
    pick = next(line for line in lines if line.startswith("pick:"))
    chosen = next((line for line in lines if line.startswith("* ")), "")
    compiled = re.search(r"\[compiled: ([^\]]*)\]", chosen)
    return {"lowered": str(len(lowered)), "not lowered": str(sum("not lowered:" in line for line in lines)),
            "pick": pick.split(":", 1)[1].split(",")[0].strip(),
            "compiled": compiled.group(1) if compiled else "not compiled"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    listing, wall, peak = run(COMMAND)
    facts = summary(listing)
    text = "\n".join([
        "# `xtrain plan --compile` over the whole default candidate list",
        "",
        f"`xtrain {' '.join(COMMAND)}` (`python benchmarks/plan_cli.py`), on this CPU-only host "
        f"({os.cpu_count()} cores): Llama-3.1-8B from the meta device, seq 8192, global batch 8, on 8 H100s.",
        "",
        "| wall time | host peak RSS (largest process) | candidates lowered | left unlowered by a bound | pick | "
        "pick as compiled |",
        "|---:|---:|---:|---:|---|---|",
        f"| {wall / 60:.1f} min | {peak:.1f} GiB | {facts['lowered']} | {facts['not lowered']} | {facts['pick']} | "
        f"{facts['compiled']} |",
        "",
        "```",
        listing.rstrip(),
        "```",
        ""])
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

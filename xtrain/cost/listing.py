"""`xtrain plan`'s table of a plan search (search.SearchResult.listing)."""
from __future__ import annotations

from typing import Sequence

from xtrain.cost.candidates import NOT_LOWERED

NAME = 34  # width of the plan column


def table(result, *, show_all: bool = False) -> str:
    """`result` (a search.SearchResult) as a table: every lowered or refused candidate; those left
    unlowered because a bound shows they cannot be the pick (xtrain.cost.sweep) only with `show_all`.
    Ends with the pick, as code."""
    head = (f"{'':2}{'plan':<{NAME}}{'memory/device':>14}{'fits':>6}{'step ms':>10}{'tokens/s':>12}{'MFU':>8}"
            f"{'compute ms':>12}{'comm ms':>10}{'bubble':>8}  note")
    lines = [f"xtrain plan for {result.target} ({result.profile.notes})", head]
    shown = [r for r in result.rows if show_all or r.prediction is not None or not r.reason.startswith(NOT_LOWERED)]
    for i, row in enumerate(shown):
        mark = "* " if row is result.best else "  "
        if row.prediction is None:  # one line for a run of candidates refused for the same reason
            if i and shown[i - 1].prediction is None and shown[i - 1].reason == row.reason:
                continue
            same = sum(1 for _ in _run(shown[i:], row.reason))
            name = row.candidate.name.split(" ")[0] + f" ({same} variants)" if same > 1 else row.candidate.name
            lines.append(f"{mark}{name:<{NAME}}{'-':>14}{'-':>6}{'':>60}  {row.reason}")
            continue
        lines.append(mark + _predicted(row))
    if len(shown) < len(result.rows):
        lines.append(f"  ({len(result.rows) - len(shown)} candidates not lowered: a bound shows none of them can be "
                     "the pick; --all lists each with its bound)")
    lines += _pick(result) + [f"device memory: {size(result.profile.hbm_bytes)}"]
    if result.profile.plan_precision == "fp16":
        lines.append("precision: fp16 with dynamic loss scaling (this GPU has no bf16 arithmetic)")
    if any(r.candidate.pipe > 1 for r in result.rows):
        lines.append("bubble: a pipeline's idle share of its ticks; lockstep SPMD computes through them, so it "
                     "is inside compute ms, not added")
    return "\n".join(lines)


def _pick(result) -> list[str]:
    if result.best is None:
        return ["pick: none fits this device's memory"
                + (" and passes the target's checker" if any(r.findings for r in result.rows) else "")]
    code = result.best.candidate.code().splitlines()
    return [f"pick: {result.best.candidate.name}, as code (`model`, `batch` as the script has them):",
            *[f"    {line}" for line in code]]


def _predicted(row) -> str:
    """A listing line of a lowered candidate."""
    p = row.prediction
    comm = sum(p.comm_s.values())
    bubble = f"{row.cost.pipeline.bubble_fraction:.1%}" if row.candidate.pipe > 1 else "-"
    v = row.verified
    compiled = "" if v is None else f"  [compiled: {size(v.memory_bytes)} {'fits' if v.fits else 'does NOT fit'}" \
        + (f"; {v.note}" if v.note else "") + "]"
    return (f"{row.candidate.name:<{NAME}}{size(p.memory_bytes):>14}{'yes' if p.fits else 'NO':>6}"
            f"{p.step_s * 1e3:>10.3f}{p.tokens_per_s:>12,.0f}{p.mfu:>8.1%}{p.compute_s * 1e3:>12.3f}"
            f"{comm * 1e3:>10.3f}{bubble:>8}  {row.reason}{compiled}")


def _run(rows: Sequence, reason: str):
    for row in rows:
        if row.prediction is not None or row.reason != reason:
            return
        yield row


def size(n: float) -> str:
    """Bytes as the table writes them (B, KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)

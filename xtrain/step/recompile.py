"""The recompilation guard: a step call whose batch differs in shape or dtype from the one the
step was compiled for would compile a new program (minutes on a real model); by default that
is an error naming the input and how it changed."""
from __future__ import annotations

from typing import Any

from xtrain.errors import InputError

Signature = tuple  # per batch argument: (shape, dtype) of an array, or the Python value


def signature(batch: tuple) -> Signature:
    return tuple((tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else ("value", repr(x)) for x in batch)


def _describe(entry: Any) -> str:
    if entry[0] == "value":
        return f"the value {entry[1]}"
    return f"shape {entry[0]} dtype {entry[1]}"


def check(seen: list[Signature], now: Signature, limit: float) -> None:
    """Raises ValueError when `now` would be compiled beyond `limit` shapes, naming every batch
    argument whose shape/dtype (or value) differs from the first compiled one."""
    if now in seen or len(seen) < limit:
        return
    first = seen[0]
    if len(first) != len(now):
        changes = [f"{len(first)} batch arguments -> {len(now)}"]
    else:
        changes = [f"batch argument {i}: {_describe(a)} -> {_describe(b)}"
                   for i, (a, b) in enumerate(zip(first, now)) if a != b]
    budget = "" if limit == 1 else f" and it already has its {int(limit)} (allow_recompile={int(limit)})"
    raise InputError(
        f"this step would recompile: the batch differs from the one it was compiled for{budget} ("
        + "; ".join(changes) + "). Pad or bucket batches to a fixed set of shapes, or pass "
        "xtrain.compile(..., allow_recompile=True) to compile one step per shape "
        "(or allow_recompile=N for N shapes, e.g. N buckets)")

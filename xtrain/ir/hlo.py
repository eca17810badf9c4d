"""HLO text: the replica groups a collective instruction runs over, in the notations XLA prints
(explicit lists, iota tiles, named meshes, permute pairs). The report of XLA's partitioner and
the Neuron conformance checker both read compiled programs through this one parser."""
from __future__ import annotations

import math
import re

import numpy as np


def _mesh_groups(line: str) -> list[list[int]] | None:
    """Groups written over a named iota mesh: `replica_groups=mesh['a'=8,'b'=1] {'a'}`."""
    match = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if not match:
        return None
    dims = [(n, int(v)) for n, v in re.findall(r"'([^']+)'=(\d+)", match.group(1))]
    chosen = re.findall(r"'([^']+)'", match.group(2))
    ids = np.arange(math.prod(v for _, v in dims)).reshape([v for _, v in dims])
    order = [i for i, (n, _) in enumerate(dims) if n not in chosen] + [
        next(i for i, (n, _) in enumerate(dims) if n == c) for c in chosen]
    size = math.prod(v for n, v in dims if n in chosen)
    return ids.transpose(order).reshape(-1, size).tolist()


def replica_groups(line: str) -> list[list[int]]:
    """The device groups of one HLO collective instruction (or a permute's source/target pairs),
    in any of the notations XLA prints; [] when the line names none (all devices)."""
    mesh_groups = _mesh_groups(line)
    if mesh_groups is not None:
        return mesh_groups
    match = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
    if match:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", match.group(1))]
    match = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if match:
        out_dims = [int(x) for x in match.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in match.group(2).split(","))).reshape(
            [int(x) for x in match.group(2).split(",")])
        if match.group(3):
            ids = ids.transpose([int(x) for x in match.group(3).split(",")])
        return ids.reshape(out_dims[0], -1).tolist()
    pairs = re.search(r"source_target_pairs=\{([\d,{}]*)\}", line)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    return []

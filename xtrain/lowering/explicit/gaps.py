"""Per-layer side computations between repeated blocks, moved after them.

A model's own layer loop may compute something from each layer's output before calling the
next layer, something no later layer reads (a load-balancing term from each layer's router
logits added up across the loop). Traced, those top-level equations sit between blocks.k and
blocks.k+1, so the blocks are not consecutive and explicit/blocks.py would find no run.
`gather_blocks` moves such equations, in their order, after the last block: the result is the
same program (nothing between the blocks reads them, and they have no effects), and their
reads of each layer's values become the blocks' per-layer outputs (RepeatedBlocks.collected).
"""
from __future__ import annotations

from jax.extend import core as jcore

from xtrain.lowering.explicit.blocks import segments


def _runs_with_gaps(segs) -> list[tuple[list, list]]:
    """Per container whose blocks 0, 1, ... follow one another with only top-level equations
    (not in a numbered block) between them: (block segments, gap segments)."""
    runs, blocks, gaps, pending = [], [], [], []
    for seg in segs + [(None, None, None)]:
        key = seg[0]
        if key is None and blocks and seg[1] is not None:
            pending.append(seg)
            continue
        if key and blocks and key[0] == blocks[-1][0][0] and key[1] == blocks[-1][0][1] + 1:
            blocks.append(seg)
            gaps += pending
        else:
            if len(blocks) > 1 and gaps:
                runs.append((blocks, gaps))
            blocks, gaps = ([seg] if key and key[1] == 0 else []), []
        pending = []
    return runs


def _movable(eqns, blocks, gaps) -> bool:
    """No block reads a value the gaps define, and the gaps have no effects."""
    gap_eqns = [e for _, lo, hi in gaps for e in eqns[lo:hi]]
    defined = {v for e in gap_eqns for v in e.outvars}
    reads = {v for _, lo, hi in blocks for e in eqns[lo:hi] for v in e.invars if isinstance(v, jcore.Var)}
    return not any(e.effects for e in gap_eqns) and not (defined & reads)


def gather_blocks(closed, module_paths: frozenset[str]):
    """`closed` (a ClosedJaxpr) with the top-level equations between numbered blocks that no
    later block reads moved after the last block of their run; `closed` itself when none are."""
    eqns = list(closed.jaxpr.eqns)
    moved = False
    for blocks, gaps in reversed(_runs_with_gaps(segments(closed.jaxpr, module_paths))):
        if not _movable(eqns, blocks, gaps):
            continue
        start, stop = blocks[0][1], blocks[-1][2]
        order = [e for _, lo, hi in blocks for e in eqns[lo:hi]] + [e for _, lo, hi in gaps for e in eqns[lo:hi]]
        eqns[start:stop] = order
        moved = True
    return closed.replace(jaxpr=closed.jaxpr.replace(eqns=eqns)) if moved else closed

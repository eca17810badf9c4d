"""What may differ between the layers of one family of repeated blocks (explicit/blocks.py)
besides their parameters: constants, and which shared value a layer reads.

Gemma-2/3 mix sliding-window and full-attention layers: the same modules, but a layer reads
the sliding or the full mask and the local or the global rotary table (values computed once
before the blocks), and a model may write a window size or a scale as a Python number (a
literal in the jaxpr). Such blocks are still one family:

    literal      a constant that differs between layers becomes an input of the block body,
                 its L values a table indexed by the layer number
    selection    a body input that reads one of a few values defined before the blocks
                 (candidates) in each layer: the candidates are stacked once and the layer
                 takes row choice[layer]

The layer scan and the pipeline's stages scan over the layer number (`Picker.at`); unrolled
layers read their values directly.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from xtrain.lowering import sharded as C
from xtrain.lowering.collectives import vma
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Layout, Sharded


@dataclasses.dataclass(frozen=True)
class Selection:
    """One body input that reads, in layer k, candidates[choice[k]]."""

    candidates: tuple        # distinct vars defined before the blocks, in first-use order
    choice: tuple[int, ...]  # per layer


@dataclasses.dataclass(frozen=True)
class Variants:
    """The body's inputs after the parameters: selections, then lifted literals."""

    selections: tuple[Selection, ...] = ()
    literals: tuple[np.ndarray, ...] = ()  # per lifted literal: its value in each layer, (L,)

    def __bool__(self) -> bool:
        return bool(self.selections or self.literals)

    def inputs(self) -> list:
        """The vars the blocks read through selections."""
        return list(dict.fromkeys(c for s in self.selections for c in s.candidates))

    def describe(self) -> str:
        parts = [f"{len(self.selections)} shared input(s) chosen per layer (layer k reads candidate "
                 f"{_listed(self.selections[0].choice)}[k] of {len(self.selections[0].candidates)})"] if self.selections else []
        parts += [f"{len(self.literals)} constant(s) that differ per layer lifted into scanned data "
                  f"(e.g. {_listed(self.literals[0].tolist())})"] if self.literals else []
        return "; ".join(parts)


def _listed(values, limit: int = 12) -> str:
    values = list(values)
    return str(values) if len(values) <= limit else f"[{', '.join(map(str, values[:limit]))}, ...]"


def _same(literals) -> bool:
    first = np.asarray(literals[0].val)
    return all(np.asarray(l.val).dtype == first.dtype and np.array_equal(np.asarray(l.val), first) for l in literals)


def lift_literals(blocks: list[list]) -> tuple[list, list, list[np.ndarray]] | str:
    """Block 0's equations with every literal operand that differs between blocks replaced by
    a new var: (equations, new vars, their per-layer tables), or the reason it cannot be done.
    Literals with the same values per layer share one var."""
    eqns, new_vars, tables, made = [], [], [], {}
    for i, eqn in enumerate(blocks[0]):
        invars = list(eqn.invars)
        for p, v in enumerate(invars):
            column = [b[i].invars[p] for b in blocks]
            kinds = {isinstance(x, jcore.Literal) for x in column}
            if kinds == {True, False}:
                return f"operand {p} of {eqn.primitive} is a constant in some blocks and a computed value in others"
            if kinds == {True} and not _same(column):
                table = np.asarray([np.asarray(x.val) for x in column], dtype=v.aval.dtype)
                key = (str(v.aval), table.tobytes())
                if key not in made:
                    made[key] = jcore.Var(v.aval)
                    new_vars.append(made[key])
                    tables.append(table)
                invars[p] = made[key]
        eqns.append(eqn.replace(invars=invars) if invars != list(eqn.invars) else eqn)
    return eqns, new_vars, tables


def selections(columns: list[list]) -> tuple[Selection, ...]:
    """Per selected input position (its var in each layer): the candidates and each layer's choice."""
    out = []
    for column in columns:
        candidates = list(dict.fromkeys(column))
        out.append(Selection(tuple(candidates), tuple(candidates.index(v) for v in column)))
    return tuple(out)


def _unify(values: list) -> list:
    """The values typed as varying over the union of their mesh axes (to stack them)."""
    axes = set().union(*(vma(v) for v in values))
    return [lax.pcast(v, tuple(sorted(axes - vma(v))), to="varying") if axes - vma(v) else v for v in values]


class Picker:
    """The variant inputs of the block body for one layer, on local values: selections read
    through `read` and relaid out to their first candidate's layout, literals from their tables."""

    def __init__(self, ctx: Context, variants: Variants, read, stacked: bool):
        self.variants = variants
        self.options = []
        for selection in variants.selections:
            first = read(selection.candidates[0])
            self.options.append([first] + [C.relayout(ctx, read(c), first.layout) for c in selection.candidates[1:]])
        # stacked once, outside the scan: the layers index rows
        self.stacked = [jnp.stack(_unify([x.value for x in opts])) for opts in self.options] if stacked else None

    def at(self, layer) -> list[Sharded]:
        """Layer `layer`'s values: a Python int (unrolled layers) or a traced layer number."""
        if not self.variants:
            return []
        out = []
        for k, (selection, opts) in enumerate(zip(self.variants.selections, self.options)):
            if isinstance(layer, int):
                out.append(opts[selection.choice[layer]])
                continue
            row = jnp.asarray(np.asarray(selection.choice, np.int32))[layer]
            out.append(dataclasses.replace(opts[0], value=lax.dynamic_index_in_dim(self.stacked[k], row, keepdims=False)))
        for table in self.variants.literals:
            value = table[layer] if isinstance(layer, int) else jnp.asarray(table)[layer]
            out.append(Sharded(value, Layout.replicated(0), (), table.dtype))
        return out

"""Repeated blocks: the runs of identical layers in a traced model, which the layer scan and the
pipeline's stages run over.

A transformer traced from torch unrolls its layers: blocks.0, blocks.1, ... each contribute
a run of identical equations. `find_repeated_blocks` recognises such runs in the top-level
jaxpr (same primitives, parameters and shapes; inputs that are either the previous block's
output, the same shared value, or that block's own parameters) and describes one scan:

    carry    <- the previous block's output (the residual stream)
    xs       <- each block's parameters, stacked along a new leading axis
    shared   <- values every block reads (masks, positions)
    variants <- constants that differ per layer, and shared values a layer picks among
                (Gemma's sliding / full masks and rotary tables): explicit/variants.py
    collected-> values every block defines at one position that are read after the blocks
                (each layer's router logits for a load-balancing loss, every layer's hidden
                states): the scan's per-layer outputs, layer k's row read as block k's value

Blocks that do not match equation for equation are compared again leaving out equations whose
results nothing uses (a KV cache the loss never reads, which differs between sliding-window and
full attention layers). Numbered blocks that are not one family get a note naming the
first difference (module path and op); they run unrolled.

The interpreter then emits `lax.scan` over the first block's equations, so the program (and
its compile time) stays flat in depth.
"""
from __future__ import annotations

import dataclasses
import itertools
import re

from jax.extend import core as jcore

from xtrain.ir import walk
from xtrain.lowering.explicit import compare, variants as variants_mod
from xtrain.lowering.explicit.compare import signature
from xtrain.lowering.explicit.variants import Variants

_BLOCK = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclasses.dataclass(frozen=True)
class LayerOutput:
    """A value every block defines at the same position and something after the blocks reads
    (not a later block, other than as the next one's input): a per-layer output of the blocks."""

    per_layer: tuple   # per block: its var at this position
    what: str          # in words: "the result of op X in <module path> (<type>)"


@dataclasses.dataclass(frozen=True)
class RepeatedBlocks:
    """L identical segments of a jaxpr's equations, [start, stop) in eqn indices."""

    prefix: str                # module path of the container, e.g. "transformer.h"
    start: int
    stop: int
    length: int                # L
    body: jcore.Jaxpr          # block 0's equations: invars = carry + shared + per-layer + variant inputs;
    #                            outvars = carry outputs + collected outputs
    num_carry: int
    num_shared: int
    init: list                 # carry inputs of block 0 (vars outside the blocks)
    shared: list               # shared vars
    per_layer: list[list]      # per block: its parameter vars, in body invar order
    outputs: list              # the last block's carry outputs (vars used after the blocks)
    stacked: list = dataclasses.field(default_factory=list)  # per param position: the (L, ...) input
    #                            whose layer k block k reads (stacked storage), or None
    variants: Variants = Variants()  # per-layer constants and selections (explicit/variants.py)
    collected: tuple[LayerOutput, ...] = ()  # per-layer outputs read after the blocks, in body outvar order
    first: int = 0             # the number of the family's first block (1 when block 0 is unlike the rest)

    def path(self, k: int) -> str:
        """The module path of the family's k-th block."""
        return f"{self.prefix}.{self.first + k}"

    def span(self) -> str:
        return f"{self.path(0)} .. {self.path(self.length - 1)}"

    def stacked_input(self, position: int):
        return self.stacked[position] if self.stacked else None

    def inputs(self) -> list:
        """The vars the scan reads: carries, shared values, and per parameter position the
        stacked input or else every layer's value."""
        out = list(self.init) + list(self.shared)
        for position in range(len(self.per_layer[0])):
            source = self.stacked_input(position)
            out += [source] if source is not None else [layer[position] for layer in self.per_layer]
        return out + self.variants.inputs()


def _block_key(path: str):
    match = _BLOCK.match(path)
    return (match.group(1), int(match.group(2))) if match else None


def segments(jaxpr, module_paths: frozenset[str]) -> list[tuple[tuple | None, int, int]]:
    """Runs of top-level equations by the numbered block they belong to: ((container, k) or
    None, start, stop)."""
    keys = [_block_key(walk.eqn_path(e, module_paths)) for e in jaxpr.eqns]
    out, index = [], 0
    for key, group in itertools.groupby(keys):
        n = len(list(group))
        out.append((key, index, index + n))
        index += n
    return out


def _runs(segments) -> list[list[tuple[int, int]]]:
    """Consecutive segments blocks.0, blocks.1, ... of one container (at least 2)."""
    runs, current = [], []
    for key, lo, hi in segments:
        if key and current and key[0] == current[-1][0][0] and key[1] == current[-1][0][1] + 1:
            current.append((key, lo, hi))
            continue
        if len(current) > 1:
            runs.append(current)
        current = [(key, lo, hi)] if key and key[1] == 0 else []
    if len(current) > 1:
        runs.append(current)
    return runs


def _inputs(eqns, defined_before: set) -> list:
    """Vars a segment reads that it does not define, in first-use order."""
    local, seen, out = set(), set(), []
    for eqn in eqns:
        for v in eqn.invars:
            if isinstance(v, jcore.Var) and v not in local and v not in seen:
                seen.add(v)
                out.append(v)
        local.update(v for v in eqn.outvars if isinstance(v, jcore.Var))
    return out


def _input_kinds(ins: list[list], defs: list[dict], param_vars: set, inside: set) -> tuple[list[str], list] | int:
    """Each input position of block 0 must be consistently a carry (the previous block's output
    at one position), a shared value, a per-layer parameter, or a selection (each layer reads
    one of some values defined before the blocks): (kinds, [(position, source)]), or the first
    position that is none of these."""
    kinds, carry_src = [], []
    for pos, v0 in enumerate(ins[0]):
        vs = [i[pos] for i in ins]
        if all(v is v0 for v in vs):
            kinds.append("shared")
        elif all(v in param_vars for v in vs):
            kinds.append("param")
        elif all(vs[k] in defs[k - 1] for k in range(1, len(vs))):
            src = {defs[k - 1][vs[k]] for k in range(1, len(vs))}
            if len(src) != 1:
                return pos
            kinds.append("carry")
            carry_src.append((pos, src.pop()))
        elif not any(v in param_vars or v in inside for v in vs):
            kinds.append("select")
        else:
            return pos
    return kinds, carry_src


def _escapes(jaxpr, run, blocks: list, defs: list[dict], carry_src: list) -> tuple[int, object] | list:
    """(block, var) of the first var a block defines that a later block reads other than as the
    next block's input; else the positions (eqn, outvar) whose values are read after the run
    other than as the last block's carry output: the blocks' per-layer outputs."""
    carry_positions = {src for _, src in carry_src}
    users: dict = {}
    for k, block in enumerate(blocks):
        for e in block:
            for v in e.invars:
                if isinstance(v, jcore.Var):
                    users.setdefault(v, set()).add(k)
    after = {v for e in jaxpr.eqns[run[-1][2]:] for v in e.invars if isinstance(v, jcore.Var)}
    after |= {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    last, collected = len(blocks) - 1, set()
    for k in range(len(blocks)):
        for v, position in defs[k].items():
            if users.get(v, set()) - {k, k + 1}:
                return k, v
            if v in after and not (k == last and position in carry_positions):
                collected.add(position)
    return sorted(collected)


def _collected(blocks: list, positions: list, paths) -> tuple[LayerOutput, ...]:
    return tuple(LayerOutput(tuple(b[i].outvars[j] for b in blocks),
                             compare.produced(blocks[0], blocks[0][i].outvars[j], paths)) for i, j in positions)


def live_equations(jaxpr) -> set[int]:
    """Indices of the top-level equations whose results reach the outputs (or have effects)."""
    needed = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    live = set()
    for index in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[index]
        if eqn.effects or any(v in needed for v in eqn.outvars):
            live.add(index)
            needed.update(v for v in eqn.invars if isinstance(v, jcore.Var))
    return live


def _alike(blocks: list[list]) -> bool:
    first = [signature(x) for x in blocks[0]]  # once, not once per block compared with it
    return all(len(b) == len(first) and all(s == signature(y) for s, y in zip(first, b)) for b in blocks[1:])


def _aligned(reference: list, eqns: list, live: set) -> list | None:
    """`eqns` (index, equation) less dead equations so that they match `reference` signature by
    signature, or None. A dead equation is kept only where the next live one does not fit."""
    wanted, signatures = [signature(e) for e in reference], [signature(e) for _, e in eqns]
    out = []
    for n, (index, eqn) in enumerate(eqns):
        fits = len(out) < len(wanted) and signatures[n] == wanted[len(out)]
        if index in live and not fits:
            return None
        later = next((m for m in range(n + 1, len(eqns)) if eqns[m][0] in live), None)
        if index in live or fits and (later is None or signatures[later] != wanted[len(out)]):
            out.append(eqn)
    return out if len(out) == len(wanted) else None


def _matched(jaxpr, run, live: set[int], paths) -> list[list] | str:
    """The blocks' equations when they match position by position (literal values aside): all
    of them, or else block 0's live ones matched in each block leaving out only dead equations
    (an unread KV cache differs between sliding-window and full attention layers; the last
    block's unread carry, e.g. its next dropout key, is dead but matched), else the first
    difference of the live equations in words."""
    blocks = [jaxpr.eqns[lo:hi] for _, lo, hi in run]
    if _alike(blocks):
        return blocks
    reference = [e for i, e in enumerate(blocks[0], run[0][1]) if i in live]
    aligned = [_aligned(reference, list(enumerate(jaxpr.eqns[lo:hi], lo)), live) for _, lo, hi in run]
    if all(a is not None for a in aligned):
        return aligned
    blocks = [[e for i, e in enumerate(jaxpr.eqns[lo:hi], lo) if i in live] for _, lo, hi in run]
    return blocks if _alike(blocks) else compare.first_difference(blocks, [f"{key[0]}.{key[1]}" for key, _, _ in run],
                                                                   paths)


def _describe(jaxpr, run, param_vars: set, live: set[int], paths) -> RepeatedBlocks | str:
    """Matches blocks position by position; returns a RepeatedBlocks or the reason they are not one."""
    blocks = _matched(jaxpr, run, live, paths)
    if isinstance(blocks, str):
        return blocks
    names = [f"{key[0]}.{key[1]}" for key, _, _ in run]
    lifted = variants_mod.lift_literals(blocks)
    if isinstance(lifted, str):
        return f"{names[0]} .. {names[-1]}: {lifted}"
    body_eqns, literal_vars, tables = lifted
    # position of every var a block defines: (eqn index, outvar index)
    defs = [{v: (i, j) for i, e in enumerate(b) for j, v in enumerate(e.outvars)} for b in blocks]
    ins = [_inputs(b, set()) for b in blocks]
    if len({len(i) for i in ins}) != 1:
        return compare.input_counts(ins, names)
    inside = {v for e in jaxpr.eqns[run[0][1]:run[-1][2]] for v in e.outvars}
    found = _input_kinds(ins, defs, param_vars, inside)
    if isinstance(found, int):
        return compare.input_source(blocks, ins, found, names, paths)
    escape = _escapes(jaxpr, run, blocks, defs, found[1])
    if isinstance(escape, tuple):
        return compare.escape(blocks, names, paths, *escape)
    kinds, carry_src = found
    positions = lambda kind: [p for p, k in enumerate(kinds) if k == kind]
    carry_in = [p for p, _ in carry_src]
    body = jcore.Jaxpr(constvars=[], invars=[ins[0][p] for p in carry_in + positions("shared") + positions("param")
                                             + positions("select")] + literal_vars,
                       outvars=[blocks[0][i].outvars[j] for _, (i, j) in carry_src]
                       + [blocks[0][i].outvars[j] for i, j in escape], eqns=body_eqns,
                       effects=jcore.no_effects if hasattr(jcore, "no_effects") else set(),
                       debug_info=jcore.DebugInfo("xtrain layer scan", run[0][0][0], None, None))
    variants = Variants(variants_mod.selections([[i[p] for i in ins] for p in positions("select")]), tuple(tables))
    return RepeatedBlocks(
        prefix=run[0][0][0], start=run[0][1], stop=run[-1][2], length=len(blocks), body=body,
        num_carry=len(carry_src), num_shared=kinds.count("shared"),
        init=[ins[0][p] for p in carry_in], shared=[ins[0][p] for p in positions("shared")],
        per_layer=[[i[p] for p in positions("param")] for i in ins],
        outputs=[blocks[-1][i].outvars[j] for _, (i, j) in carry_src], variants=variants,
        collected=_collected(blocks, escape, paths), first=run[0][0][1])


def layer_views(jaxpr, param_vars) -> dict:
    """Vars that are layer k of a stacked parameter input (`slice` of row k, then `squeeze` of
    the layer dim, as xtrain.ir.stacked hands layers to the model): {var: (input, k)}."""
    params, rows, views = set(param_vars), {}, {}
    for eqn in jaxpr.eqns:
        name = str(eqn.primitive)
        if name == "slice" and eqn.invars[0] in params:
            x = eqn.invars[0].aval
            start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
            strides = eqn.params["strides"] or (1,) * x.ndim
            whole = all(s == 0 and l == n for s, l, n in zip(start[1:], limit[1:], x.shape[1:]))
            if limit[0] - start[0] == 1 and whole and set(strides) == {1}:
                rows[eqn.outvars[0]] = (eqn.invars[0], start[0])
        elif name == "squeeze" and eqn.params["dimensions"] == (0,) and eqn.invars[0] in rows:
            views[eqn.outvars[0]] = rows[eqn.invars[0]]
    return views


def _stacked_inputs(blocks: RepeatedBlocks, views: dict) -> list:
    """Per parameter position: the stacked input whose row k every block k reads, or None."""
    out = []
    for position in range(len(blocks.per_layer[0])):
        sources = [views.get(layer[position]) for layer in blocks.per_layer]
        whole = sources[0] is not None and sources[0][0].aval.shape[0] == blocks.length
        same = whole and all(s is not None and s == (sources[0][0], k) for k, s in enumerate(sources))
        out.append(sources[0][0] if same else None)
    return out


@dataclasses.dataclass(frozen=True)
class Examined:
    """What `examine` found: the families of repeated blocks, and a note per run of numbered
    blocks that is not one (naming the first difference)."""

    found: list[RepeatedBlocks]
    notes: list[str]


def examine(jaxpr, module_paths: frozenset[str], param_vars) -> Examined:
    """Every run of >= 2 consecutive blocks of the top level of `jaxpr` (blocks named by module
    path: `prefix.0`, `prefix.1`, ...) that are one family: the same equations on the same
    shapes, differing at most in their parameters, in literal constants and in which values
    defined before them they read. Block parameters may be inputs or layers of stacked inputs
    (layer_views)."""
    views = layer_views(jaxpr, param_vars)
    live = live_equations(jaxpr)
    found, notes = [], []
    for run in _runs(segments(jaxpr, module_paths)):
        blocks = _describe(jaxpr, run, set(param_vars) | set(views), live, module_paths)
        if isinstance(blocks, str) and len(run) > 2:
            # a first layer unlike the rest (ModernBERT's layer 0 has no attention norm, T5's
            # layer 0 computes the position bias the others read): the rest are the family
            rest = _describe(jaxpr, run[1:], set(param_vars) | set(views), live, module_paths)
            if not isinstance(rest, str):
                notes.append(f"{run[0][0][0]}.0 runs before the family {run[0][0][0]}.1 .. {run[0][0][0]}."
                             f"{len(run) - 1} (unrolled, with the equations before them): {blocks}")
                blocks = rest
        if isinstance(blocks, str):
            notes.append(f"{run[0][0][0]}.0 .. {run[0][0][0]}.{len(run) - 1} are not one family of repeated blocks, "
                         f"so they run unrolled (no layer scan, no pipeline stages over them): {blocks}")
        else:
            found.append(dataclasses.replace(blocks, stacked=_stacked_inputs(blocks, views)))
    return Examined(found, notes)


def find_repeated_blocks(jaxpr, module_paths: frozenset[str], param_vars) -> list[RepeatedBlocks]:
    """The families of repeated blocks of `jaxpr` (see `examine`)."""
    return examine(jaxpr, module_paths, param_vars).found

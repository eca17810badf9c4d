"""Megatron-LM tensor parallel for standard transformer blocks, found by module structure
(xtrain.ir.structure: the front end describes the model, this module never sees torch).

The layer stack is a list container of identical modules. In each block the linear layers
(torch's Linear, or HF's Conv1D with its (in, out) weight) are grouped by parent module; in a
group, the last projection back to the model width is row-parallel (split on its input) and
the others, which read the model width, are column-parallel (split on their output, biases
too): q/k/v -> out in attention, fc (or gate and up) -> down in the MLP, one all-reduce per
group. A group whose module names a head count is attention: heads must divide the axis size,
else it stays whole; with grouped-query attention, k/v stay whole when their head count does
not divide (q, out and the MLP are still split). A fused qkv projection is split contiguously
(correct, not head-aligned). The token embedding and an untied LM head are split on the
vocabulary when it divides. Everything else (norms, row-parallel biases, position embeddings)
is replicated. The notes record each choice.

Adapters (peft's LoRA): a module whose child `base_layer` is a linear layer stands for that
layer, and the other linear layers inside it are its low-rank adapters, pairs A (in -> r) then
B (r -> out). They are split to match the base so they add no collective of their own: where
the base is column-parallel B is split on its output (A whole), where it is row-parallel A is
split on its input (B whole), and its partial sums join the base layer's one all-reduce.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from xtrain.ir.structure import Kind, Module, Structure
from xtrain.sharding.plan import Spec

HEAD_ATTRS = ("num_heads", "n_head", "n_heads", "heads", "num_attention_heads")
KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_ATTENTION_ATTRS = HEAD_ATTRS + KV_ATTRS + ("head_dim", "num_key_value_groups")


@dataclasses.dataclass(frozen=True)
class _Proj:
    """A linear layer: Linear (weight (out, in)) or HF's Conv1D (weight (in, out))."""

    path: str
    d_in: int
    d_out: int
    out_dim: int           # weight dimension of the outputs: 0 for Linear, 1 for Conv1D
    weight: str
    bias: str | None
    adapters: tuple[tuple["_Proj", "_Proj"], ...] = ()   # (A, B) low-rank pairs wrapped around it

    def column(self, axis: str) -> dict[str, Spec]:
        split = (axis, None) if self.out_dim == 0 else (None, axis)
        specs = {self.weight: split, **({self.bias: (axis,)} if self.bias else {})}
        for _, b in self.adapters:   # x A^T stays whole (r wide); B makes this device's outputs
            specs.update(b.column(axis))
        return specs

    def row(self, axis: str) -> dict[str, Spec]:
        specs = {self.weight: (None, axis) if self.out_dim == 0 else (axis, None)}
        for a, _ in self.adapters:   # the device's input slice through A's matching columns: partial sums
            specs.update(a.row(axis))
        return specs


def _proj(structure: Structure, module: Module) -> _Proj | None:
    if module.kind not in (Kind.LINEAR, Kind.CONV1D):
        return None
    rows, cols = structure.shape(module, "weight")
    bias = module.params.get("bias")
    if module.kind is Kind.CONV1D:
        return _Proj(module.path, rows, cols, 1, module.params["weight"], bias)  # weight (in, out)
    return _Proj(module.path, cols, rows, 0, module.params["weight"], bias)


def _adapted(structure: Structure, module: Module) -> tuple[_Proj | None, str | None]:
    """(the projection, None) of a module that wraps a linear `base_layer` with adapters;
    (None, why) when its adapters do not pair up; (None, None) for any other module."""
    base_module = structure.modules.get(f"{module.path}.base_layer")
    base = None if base_module is None else _proj(structure, base_module)
    if base is None:
        return None, None
    others = [p for m in structure.subtree(module.path) if m is not base_module
              for p in [_proj(structure, m)] if p is not None]
    a_side = [p for p in others if p.d_in == base.d_in and p.d_out != base.d_out]
    b_side = [p for p in others if p.d_out == base.d_out and p.d_in != base.d_in]
    pairs = tuple(zip(a_side, b_side))
    if len(a_side) != len(b_side) or len(others) != 2 * len(pairs) or any(a.d_out != b.d_in for a, b in pairs):
        return None, (f"{module.path}: linear layers around base_layer are not low-rank (A: {base.d_in} -> r, "
                      f"B: r -> {base.d_out}) pairs; kept whole")
    return dataclasses.replace(base, path=module.path, adapters=pairs), None


def _linears(structure: Structure, modules: list[Module], notes: list[str]) -> list[_Proj]:
    """The linear layers among `modules`, an adapter wrapper standing for its base layer (the
    modules inside a wrapper are its parts, not layers of their own)."""
    found, wrapped = [], []
    for module in modules:
        if any(module.path.startswith(w + ".") for w in wrapped):
            continue
        proj, why = _adapted(structure, module)
        if proj is not None or why is not None:
            wrapped.append(module.path)
            notes.extend([why] if why else [])
            found.extend([proj] if proj else [])
        elif (plain := _proj(structure, module)) is not None:
            found.append(plain)
    return found


def _blocks(structure: Structure) -> list[tuple[str, list[str]]]:
    """(container path, [block paths]) for every list of identical modules that hold linear
    layers: the transformer's layer stack."""
    found: list[tuple[str, list[str]]] = []
    for path, module in structure.modules.items():
        inside = any(path.startswith(f"{p}.") for p, _ in found)  # experts inside a block
        if module.kind is not Kind.LIST or not module.children or inside:
            continue
        kinds = {structure.modules[c].type_name for c in module.children}
        first = structure.subtree(module.children[0])
        if len(kinds) == 1 and any(m.kind in (Kind.LINEAR, Kind.CONV1D) for m in first):
            found.append((path, list(module.children)))
    return found


def _int_attr(owners: list[Mapping[str, int]], names) -> int | None:
    for owner in owners:
        for name in names:
            if name in owner:
                return owner[name]
    return None


def _heads(module: Module) -> tuple[int | None, int | None]:
    """(query heads, key/value heads) of an attention module, (None, None) for anything else.

    A module is attention when it carries a head attribute itself (a head count, `head_dim`
    or `num_key_value_groups`); the counts may come from its HF `config` (an MLP holds the
    same config, so the config alone does not make a module attention).
    """
    if _int_attr([module.attrs], _ATTENTION_ATTRS) is None:
        return None, None
    owners = [module.attrs, module.config_attrs]
    heads = _int_attr(owners, HEAD_ATTRS)
    return heads, _int_attr(owners, KV_ATTRS) or heads


@dataclasses.dataclass
class _Choices:
    """What megatron decided: parameter specs and notes."""

    axis: str
    tp: int
    specs: dict[str, Spec] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)


def _mixer_groups(structure: Structure, block: str, notes: list[str] | None = None
                  ) -> list[tuple[str, Module, list[_Proj]]]:
    """The block's linear layers grouped by parent module (attention, MLP), in order."""
    groups: dict[str, list[_Proj]] = {}
    for proj in _linears(structure, structure.subtree(block), [] if notes is None else notes):
        groups.setdefault(proj.path.rpartition(".")[0], []).append(proj)
    return [(parent, structure.modules[parent], projs) for parent, projs in groups.items()]


def _width(structure: Structure, block: str) -> int:
    """The model width: what a block's first projection reads (the residual stream)."""
    return _mixer_groups(structure, block)[0][2][0].d_in


def _short(proj: _Proj, group_path: str) -> str:
    return proj.path[len(group_path) + 1:]


def _attention(c: _Choices, where: str, inputs: list[_Proj], out: _Proj, heads: int, kv: int) -> None:
    hd = out.d_in // heads
    if out.d_in % heads or heads % c.tp:
        c.notes.append(f"{where}: {heads} heads not divisible by {c.axis}={c.tp}; attention kept whole")
        return
    split, kv_whole = [], []
    for p in inputs:
        if p.d_out == heads * hd or (p.d_out == kv * hd and kv % c.tp == 0):
            split.append(p)
        elif p.d_out == kv * hd:
            kv_whole.append(_short(p, where))
        elif p.d_out == (heads + 2 * kv) * hd and p.d_out % c.tp == 0:
            split.append(p)
            c.notes.append(f"{where}: fused qkv {_short(p, where)} ({p.d_in} -> {p.d_out}) split contiguously on its "
                           f"output dim over {c.axis}={c.tp}: correct (the lowering gathers where q/k/v slices cross "
                           "shards) but not Megatron's head-aligned split")
        else:
            c.notes.append(f"{where}: {_short(p, where)} ({p.d_in} -> {p.d_out}) is not a q/k/v projection of "
                           f"{heads} heads; kept whole")
    if kv_whole:
        c.notes.append(f"{where}: {kv} key/value heads not divisible by {c.axis}={c.tp}; {', '.join(kv_whole)} "
                       "kept whole (GQA: every device holds all kv heads)")
    for p in split:
        c.specs.update(p.column(c.axis))
    c.specs.update(out.row(c.axis))
    c.notes.append(f"{where}: {', '.join(_short(p, where) for p in split)} column-parallel, {_short(out, where)} "
                   f"row-parallel over {c.axis}={c.tp} ({heads // c.tp} of {heads} heads per device)")


def _mlp(c: _Choices, where: str, inputs: list[_Proj], out: _Proj) -> None:
    if any(p.d_out != out.d_in for p in inputs) or out.d_in % c.tp:
        c.notes.append(f"{where}: hidden width {out.d_in} not divisible by {c.axis}={c.tp} (or the up/down "
                       "projections disagree); MLP kept whole")
        return
    for p in inputs:
        c.specs.update(p.column(c.axis))
    c.specs.update(out.row(c.axis))
    c.notes.append(f"{where}: {', '.join(_short(p, where) for p in inputs)} column-parallel, "
                   f"{_short(out, where)} row-parallel over {c.axis}={c.tp}")


def _mixer(c: _Choices, where: str, module: Module, projs: list[_Proj], d: int) -> None:
    """One attention or MLP: input projections (in == d) column-, the last d-output row-parallel."""
    outs = [p for p in projs if p.d_out == d]
    if not outs:
        c.notes.append(f"{where}: no projection back to the model width {d}; kept whole")
        return
    out = outs[-1]
    inputs = [p for p in projs if p is not out]
    if not inputs or any(p.d_in != d for p in inputs):
        c.notes.append(f"{where}: not an input-projections -> output-projection pattern; kept whole")
        return
    heads, kv = _heads(module)
    if heads:
        _attention(c, where, inputs, out, heads, kv)
    else:
        _mlp(c, where, inputs, out)


def _vocab(c: _Choices, structure: Structure, in_blocks: set[str], d: int) -> None:
    """Vocab-parallel token embedding and LM head where the vocabulary divides."""
    outside = [m for p, m in structure.modules.items() if not any(p == b or p.startswith(b + ".") for b in in_blocks)]
    embeddings = [m for m in outside if m.kind is Kind.EMBEDDING and structure.shape(m, "weight")[1] == d]
    heads = [h for h in _linears(structure, outside, c.notes) if h.d_in == d]
    vocab_sizes = {h.d_out for h in heads}
    rows = lambda m: structure.shape(m, "weight")[0]
    tokens = [m for m in embeddings if rows(m) in vocab_sizes] or sorted(embeddings, key=lambda m: -rows(m))[:1]
    for emb in embeddings:
        name, shape = emb.params["weight"], structure.shape(emb, "weight")
        if emb not in tokens:
            c.notes.append(f"{name} {shape}: position/other embedding kept whole (as in Megatron)")
        elif rows(emb) % c.tp:
            c.notes.append(f"{name} {shape}: vocab {rows(emb)} not divisible by {c.axis}={c.tp}; embedding kept "
                           "whole (fsdp(..., base=plan) can split it over data)")
        else:
            c.specs[name] = (c.axis, None)
            c.notes.append(f"{name}: vocab-parallel embedding over {c.axis}={c.tp}")
    for head in heads:
        tied = next((n for n in (e.params["weight"] for e in tokens) if n == head.weight), None)
        if tied:
            c.notes.append(f"{head.path} is tied to {tied}: one tensor, one rule")
        elif head.d_out % c.tp:
            c.notes.append(f"{head.weight} ({head.d_out} x {d}): vocab {head.d_out} not divisible by "
                           f"{c.axis}={c.tp}; LM head kept whole")
        else:
            c.specs.update(head.column(c.axis))
            c.notes.append(f"{head.weight}: vocab-parallel LM head over {c.axis}={c.tp}")


def megatron_specs(structure: Structure, axis: str, tp: int, *, vocab_parallel: bool = True
                   ) -> tuple[dict[str, Spec], list[str]]:
    """(parameter specs, notes) of Megatron tensor parallelism over `axis` of size `tp`."""
    stacks = _blocks(structure)
    if not stacks:
        root = structure.modules[""].type_name
        raise ValueError(f"xtrain.plans.megatron found no transformer blocks in {root}: it looks for a "
                         "torch.nn.ModuleList of identical modules holding linear layers; write the rules "
                         "yourself with xtrain.Plan(params={...})")
    c = _Choices(axis, tp)
    for prefix, blocks in stacks:
        for block in blocks:
            d = _width(structure, block)
            for where, module, projs in _mixer_groups(structure, block, c.notes):
                _mixer(c, f"{prefix}.*{where[len(block):]}", module, projs, d)
    if vocab_parallel:
        _vocab(c, structure, {b for _, bs in stacks for b in bs}, _width(structure, stacks[0][1][0]))
    else:
        c.notes.append("vocab_parallel=False: token embedding and LM head kept whole")
    return c.specs, c.notes

"""Megatron tensor parallelism derived from the traced program (xtrain.ir.analysis.dimflow), not from module
names: each column -> row pair the dimension flow found becomes parameter specs over the
tensor axis, and every decision a note in graph terms.

    split group     its columns (the matmul weights whose output dimension it follows) split on
                    that dimension, the biases added to it too, its sinks (the weights that
                    contract it) split on their input dimension: one all-reduce per group
    fused weights   a column sliced into segments (qkv, gate_up, c_attn) is split per segment
                    (xtrain.Segments: each device its slice of every segment), and its bias alike
    broken group    kept whole; the note names the op and module path that stopped it (heads
                    the axis does not divide: GQA's kv heads, a reduction over the dimension)
    logits          a group without a sink whose output dimension is the vocabulary of a
                    gathered table (an LM head), and that table: vocabulary-parallel
"""
from __future__ import annotations

import re
from typing import Mapping

from xtrain.errors import PlanError
from xtrain.ir.analysis.dimflow import Flow, Group, Use
from xtrain.sharding.plan import Spec
from xtrain.sharding.segments import Segments


def escape(name: str) -> str:
    return re.sub(r"([\[\]*?])", r"[\1]", name)


def layer_glob(name: str) -> str:
    """`blocks.3.mlp.0.weight` -> `blocks.*.mlp.0.weight` (the first numeric segment)."""
    return re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", escape(name), count=1)


def _module(name: str) -> str:
    return layer_glob(name.rpartition(".")[0] or name)


def _names(uses: list[Use]) -> str:
    return ", ".join(dict.fromkeys(_module(u.name) for u in uses))


class _Derivation:
    def __init__(self, axis: str, tp: int, shapes: Mapping[str, tuple[int, ...]]):
        self.axis, self.tp, self.shapes = axis, tp, shapes
        self.dims: dict[str, set[int]] = {}
        self.notes: list[str] = []
        self.query_heads: list[Use] = []   # the columns of split groups made into heads
        self.segments: dict[str, tuple[int, ...]] = {}  # fused columns (and their biases) split per segment

    def split(self, uses: list[Use]) -> None:
        for use in uses:
            self.dims.setdefault(use.name, set()).add(use.dim)

    def specs(self) -> dict[str, Spec]:
        out = {}
        for name, dims in self.dims.items():
            if len(dims) > 1:
                self.notes.append(f"{name}: the graph splits it on dimensions {sorted(dims)} in different places; "
                                  "kept whole")
                continue
            (dim,) = dims
            entry = Segments((self.axis,), self.segments[name]) if name in self.segments else self.axis
            out[name] = tuple(entry if d == dim else None for d in range(len(self.shapes[name])))
        return out

    def serves_split_queries(self, where: str) -> bool:
        """Whether a split group's heads are made in the module where a group broke at its heads
        (the attention module of key/value heads the axis does not divide)."""
        module = where.partition(":")[0]
        return any(u.path.startswith(module + ".") or u.path == module for u in self.query_heads)

    def where(self) -> str:
        return f"{self.axis}={self.tp}"

    def group(self, g: Group) -> None:
        cols, rows = _names(g.columns), _names(g.rows)
        heads = max(g.heads.values(), default=0) - sum(  # less the key/value heads kept whole (MQA's)
            (b - a) // g.units[n] for n, bounds in g.segments.items() if n in g.units for a, b in bounds
            if (b - a) // g.units[n] % self.tp)
        what = f"the {heads} heads of {cols}'s output" if heads else f"{cols}'s output"
        per = f" ({heads // self.tp} of {heads} heads per device)" if heads else ""
        if cols == rows:  # a routed-experts call: up and down weights of one module
            self.notes.append(f"{cols}: each expert's FFN split over {self.where()} (the up weights on their output "
                              "features, the down weights on their input features)")
        else:
            self.notes.append(f"{rows} contracts {what}: {cols} column-parallel, {rows} row-parallel over "
                              f"{self.where()}{per}")
        for name, segments in g.segments.items():
            self.fused(g, name, sorted(segments), routed=cols == rows)
        detoured = {ghost.name for ghost, _ in g.detours}
        base = _names([u for u in g.columns if u.name not in detoured])
        for ghost, low_rank in g.detours:
            self.notes.append(f"{_module(ghost.name)} adds its output to {base}'s (a low-rank detour): "
                              f"column-parallel with it; {', '.join(dict.fromkeys(map(_module, low_rank)))} "
                              "kept whole (its rank-r output is cheaper to keep than to reduce)")
        self.split(g.columns + g.followers + g.rows)

    def fused(self, g: Group, name: str, bounds: list[tuple[int, int]], routed: bool) -> None:
        """A column whose output the program slices into segments: split per segment (each device
        its slice of every segment, so the slices are local), else contiguously (noted)."""
        sizes = [b - a for a, b in bounds]
        column = next((c for c in g.columns if c.name == name), None)
        tiles = column is not None and bounds[0][0] == 0 and bounds[-1][1] == column.size and \
            all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        head = f"{_module(name)}: fused output sliced into {len(bounds)} segments {sizes}; "
        if routed or not tiles:
            why = "a routed-experts call gathers its own" if routed else "the segments do not tile one column's output"
            self.notes.append(head + f"split contiguously over {self.where()} ({why}: correct, the lowering gathers "
                              "where a segment crosses shards)")
            return
        stored = _whole_heads(sizes, self.tp * g.units.get(name, 1))
        if stored is None:
            self.notes.append(head + f"split contiguously over {self.where()} (its heads do not group into segments "
                              f"divisible by {self.where()}: correct, the lowering gathers where a segment crosses "
                              "shards)")
            return
        for use in [column] + [f for f in g.followers if f.size == column.size]:
            self.segments[use.name] = stored
        self.notes.append(head + f"split per segment over {self.where()} (xtrain.Segments: each device holds its "
                          "slice of every segment, stored interleaved, so the slices are local)")
        if stored != tuple(sizes):
            unit = g.units[name]
            self.notes.append(f"{_module(name)}: segments of {[s // unit for s in sizes]} heads; those fewer than "
                              f"{self.where()} (MQA's key and value heads) stored together as {list(stored)} and "
                              "gathered after the product (each device computes them whole)")

    def broken(self, g: Group) -> None:
        kind, op, where = next(((k, o, w) for k, o, w in g.breaks if k != "reduce"), g.breaks[0])
        kv = kind == "heads" and self.serves_split_queries(where)
        cols, where = _names(g.columns), re.sub(r"(^|\.)\d+(\.|:|$)", r"\1*\2", where, count=1)
        if kv:
            self.notes.append(f"{cols} kept whole: at {where} its output splits into key/value heads not divisible "
                              f"by {self.where()}, while the query heads that read them split (GQA/MQA): each device "
                              "computes every key/value head and its query heads read theirs; the gradient of "
                              f"{cols} gathers every device's query heads")
        elif kind == "heads":
            self.notes.append(f"{cols} kept whole: at {where} its output splits into heads (or key/value groups) "
                              f"not divisible by {self.where()} (GQA/MQA: every device holds all of them)")
        elif kind == "indivisible":
            self.notes.append(f"{cols} kept whole: {where} not divisible by {self.where()}")
        else:
            self.notes.append(f"{cols} kept whole: its output dimension meets {op} at {where or 'top level'}")


def _whole_heads(sizes, step: int) -> tuple[int, ...] | None:
    """`sizes` with runs of consecutive segments merged until each is a multiple of `step` (the
    axis times one head's rows), or None when they cannot be."""
    out, run = [], 0
    for size in sizes:
        run += size
        if run % step == 0:
            out.append(run)
            run = 0
    return tuple(out) if not run else None


def _vocab(d: _Derivation, flow: Flow, logits: list[Group], vocab_parallel: bool) -> None:
    tables = {t.name: t for t in flow.tables}
    heads = [(g, c) for g in logits for c in g.columns if c.name in tables or c.size in {t.size for t in tables.values()}]
    vocab = {c.size for _, c in heads}
    for table in tables.values():
        if table.size not in vocab:
            d.notes.append(f"{table.name} {tuple(d.shapes[table.name])}: a lookup table whose rows are no logits' "
                           "vocabulary (position or type embedding): kept whole, as in Megatron")
        elif not vocab_parallel:
            d.notes.append(f"vocab_parallel=False: {table.name} kept whole")
        elif table.size % d.tp:
            d.notes.append(f"{table.name} {tuple(d.shapes[table.name])}: vocab {table.size} not divisible by "
                           f"{d.where()}; embedding kept whole (fsdp(..., base=plan) can split it over data)")
        else:
            d.split([table])
            d.notes.append(f"{table.name}: vocab-parallel embedding over {d.where()} (read by gather)")
    for group, head in heads:
        if head.name in tables:
            d.notes.append(f"{layer_glob(head.path) or 'the top level'} computes the logits with the embedding table "
                           f"{head.name} (tied): "
                           "one tensor, one rule")
        elif not vocab_parallel or head.size % d.tp:
            why = "vocab_parallel=False" if not vocab_parallel else f"vocab {head.size} not divisible by {d.where()}"
            d.notes.append(f"{head.name}: {why}; LM head kept whole")
            continue
        else:
            d.notes.append(f"{head.name}: vocab-parallel LM head over {d.where()} (its output meets softmax and "
                           "cross entropy reductions, no matmul)")
        if vocab_parallel and head.size % d.tp == 0:
            d.split([head] + group.followers)


def derive(flow: Flow, shapes: Mapping[str, tuple[int, ...]], axis: str, tp: int, *,
           vocab_parallel: bool = True) -> tuple[dict[str, Spec], list[str]]:
    """(parameter specs, notes) of Megatron tensor parallelism over `axis` of size `tp`."""
    d = _Derivation(axis, tp, shapes)
    d.query_heads = [c for g in flow.groups if g.splittable and g.heads for c in g.columns]
    logits = []
    for g in flow.groups:
        if g.splittable:
            d.group(g)
        elif not g.rows and g.breaks and all(k in ("reduce", "lookup", "indivisible") for k, _, _ in g.breaks) \
                and any(k in ("reduce", "indivisible") for k, _, _ in g.breaks):
            logits.append(g)
        elif g.breaks:
            d.broken(g)
    _vocab(d, flow, logits, vocab_parallel)
    if not any(g.rows for g in flow.groups):  # (pairs that exist but cannot split are noted, not an error)
        raise PlanError("xtrain.plans.megatron found no column -> row matmul pairs in the traced program (a "
                        "matmul whose output dimension reaches a matmul that contracts it); write the rules "
                        "yourself with xtrain.Plan(params={...})")
    specs = d.specs()
    return specs, list(dict.fromkeys(d.notes))


def block_paths(flow: Flow) -> list[str]:
    """The module path of each layer's block: the numbered module (`model.layers.3`) holding a
    split group's sink (attention's and the MLP's row-parallel matmuls), in program order."""
    out = []
    for g in flow.groups:
        for use in g.rows if g.splittable else ():
            parts = use.path.split(".")
            layer = next((i for i, p in enumerate(parts) if p.isdigit()), None)
            if layer is not None:
                out.append(".".join(parts[:layer + 1]))
    return list(dict.fromkeys(out))

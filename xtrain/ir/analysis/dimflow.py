"""Dimension flow: which matmul output dimensions can be split over a tensor-parallel axis, found
by following them through the traced program (Megatron's column -> row pairs, from the graph).

Every dot_general of an activation with a parameter starts a *source*: the parameter's output
dimension (column-parallel if split). The analysis follows that dimension, as a label on the
dimensions of the variables that carry it, through ops that keep a contiguous split local:
elementwise ops, broadcasts, transposes, reshapes into heads (the split goes to the head
dimension when the axis divides the heads) and back, the batch dimensions of attention's
dot_generals, slices of a fused output (the slice bounds become the source's *segments*; sliced
after the reshape into heads, in whole heads, and a slice of fewer heads than the axis, MQA's key
or value head, is whole on every device), grouped convolutions' channels and stacks
(xtrain.ir.analysis.structural), call bodies (pjit, custom_jvp) and scan bodies (one slice of its
stacked operands per iteration: the blockwise attention's key blocks). It ends well at a dot_general
that contracts it with a parameter: the *sink*, row-parallel (its output is a partial sum: one
all-reduce). Sources that meet (q and k in the scores, gate and up in a gated product) form one *group*: they are
split together or not at all. A group breaks at anything else (a reduction over the split
dimension, a reshape that mixes it, a gather), and the first break is kept, with its op and
module path, to explain why it stays whole. A group without a sink whose breaks are all
reductions and lookups over the split dimension is a *logits* group (an LM head: softmax and
cross entropy over the vocabulary). Parameters read by `gather` are embedding tables.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.extend import core as jcore

from xtrain.ir import graph as graph_mod
from xtrain.ir import markers, walk
from xtrain.ir.analysis import detour, per_head, provenance, reshapes, slice_update, structural
from xtrain.ir.analysis.groups import Flow, Group, Use
from xtrain.ir.kernels import moe
from xtrain.ir.model import Model

_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "reduce_and",
                     "reduce_or", "reduce_logsumexp"})
_LOOKUP = frozenset({"gather", "dynamic_slice", "take_along_axis"})


@dataclasses.dataclass(frozen=True)
class _Label:
    source: int
    identity: bool   # the dimension still indexes the source's output directly (slices are segments)
    unit: int = 1    # ... in steps of `unit` elements (the output reshaped into (heads, head_dim): one head)
    minor: int = 0   # the split dim of this size merged as the minor part of this one (batch x heads)


class _Analysis:
    def __init__(self, tp: int, module_paths: frozenset[str]):
        self.tp, self.paths = tp, module_paths
        self.parent: list[int] = []
        self.groups: list[Group] = []
        self.tables: dict[str, Use] = {}
        self.ghosts: dict = {}      # var -> per-dimension detour.Ghost (row-parallel products' outputs)
        self.links: list = []       # (label, ghost) met at an add
        self.row_out = None         # the ghosts of the last dot_general's output

    # -- union-find over sources ------------------------------------------------------------
    def find(self, s: int) -> int:
        while self.parent[s] != s:
            self.parent[s] = self.parent[self.parent[s]]
            s = self.parent[s]
        return s

    def group(self, label: _Label) -> Group:
        return self.groups[self.find(label.source)]

    def union(self, a: _Label, b: _Label) -> None:
        ra, rb = self.find(a.source), self.find(b.source)
        if ra == rb:
            return
        self.parent[rb] = ra
        ga, gb = self.groups[ra], self.groups[rb]
        ga.columns += gb.columns
        ga.rows += gb.rows
        ga.followers += gb.followers
        ga.breaks += gb.breaks
        ga.heads.update(gb.heads)
        ga.units.update(gb.units)
        ga.detours += gb.detours
        for k, v in gb.segments.items():
            ga.segments.setdefault(k, set()).update(v)

    def new_source(self, use: Use) -> _Label:
        self.parent.append(len(self.parent))
        self.groups.append(Group(columns=[use]))
        if use.size % self.tp:
            self.groups[-1].breaks.append(("indivisible", "dot_general", f"{use.path}: output {use.size}"))
        return _Label(len(self.parent) - 1, True)

    def brk(self, labels, kind: str, op: str, where: str) -> None:
        for label in labels:
            if label is not None:
                self.group(label).breaks.append((kind, op, where))

    # -- the walk ----------------------------------------------------------------------------
    def run(self, jaxpr, labels: dict, views: dict, outer: str = "") -> None:
        for eqn in jaxpr.eqns:
            path = walk.eqn_path(eqn, self.paths, outer)
            ins = [None if isinstance(v, jcore.Literal) else self.live(labels.get(v)) for v in eqn.invars]
            gins = [None if isinstance(v, jcore.Literal) else self.ghosts.get(v) for v in eqn.invars]
            vws = [None if isinstance(v, jcore.Literal) else views.get(v) for v in eqn.invars]
            if (spec := markers.outermost(moe.ExpertsSpec, eqn.params.get("name", ""))) is not None:
                self.experts(spec, eqn, ins, vws, path)
                continue
            body = walk.inline_body(eqn)
            if body is not None:
                self.call(body, eqn, ins, vws, labels, views, path)
                continue
            held = [i for i, v in enumerate(eqn.invars) if not isinstance(v, jcore.Literal)]
            if len(held) == 1 and vws[held[0]] is not None and (view := vws[held[0]].through(eqn)) is not None:
                views[eqn.outvars[0]] = view
            self.row_out = None
            outs = self.op(eqn, ins, vws, path)
            ghosts = [self.row_out] if eqn.primitive.name == "dot_general" else detour.carry(eqn, ins, gins, self.links)
            for var, ghost in zip(eqn.outvars, ghosts):
                if ghost is not None and not isinstance(var, jcore.DropVar):
                    self.ghosts[var] = ghost
            for var, out in zip(eqn.outvars, outs):
                if out is not None and any(d is not None for d in out) and not isinstance(var, jcore.DropVar):
                    labels[var] = out

    def live(self, label):
        """`label` without the dimensions whose group broke: a split stops where it broke."""
        if label is None:
            return None
        out = tuple(None if x is None or self.group(x).breaks else x for x in label)
        return out if any(x is not None for x in out) else None

    def experts(self, spec, eqn, ins, vws, path) -> None:
        """A routed-experts call (xtrain.ir.kernels.moe): its expert FFN dimension is a source in the up
        weight and a sink in the down weight (each device computes its FFN features per expert)."""
        self.brk([x for lab in ins if lab for x in lab], "op", "routed experts", f"{path}: a split token feature")
        (up, u), (down, d) = ((vws[i], dim) for i, dim in zip((3, 4), moe.ffn_dims(spec)))
        if up is None or down is None or up.dims[u] is None or down.dims[d] is None:
            return
        size = eqn.invars[3].aval.shape[u]
        group = self.group(self.new_source(Use(up.name, up.dims[u], size, path)))
        group.rows.append(Use(down.name, down.dims[d], eqn.invars[4].aval.shape[d], path))
        if spec.gated and spec.concatenated:
            group.segments[up.name] = {(0, size // 2), (size // 2, size)}
        if spec.gated and size // 2 % self.tp:
            group.breaks.append(("indivisible", "routed experts", f"{path}: {size // 2} expert FFN features"))

    def call(self, body, eqn, ins, vws, labels, views, path) -> None:
        xs, ys = _stacked(eqn)  # a scan's per-iteration operands and results: one leading dimension more
        ins = [self.unstack(lab, path) if i in xs else lab for i, lab in enumerate(ins)]
        vws = [provenance.View(vw.name, vw.dims[1:]) if i in xs and vw is not None else vw for i, vw in enumerate(vws)]
        inner_labels = {v: lab for v, lab in zip(body.invars, ins) if lab is not None}
        inner_views = {v: vw for v, vw in zip(body.invars, vws) if vw is not None}
        for i, (v, outer) in enumerate(zip(body.invars, eqn.invars)):
            if not isinstance(outer, jcore.Literal) and outer in self.ghosts:
                self.ghosts[v] = self.ghosts[outer][1:] if i in xs else self.ghosts[outer]
        self.run(body, inner_labels, inner_views, path)
        for j, (var, out) in enumerate(zip(eqn.outvars, body.outvars)):
            if isinstance(out, jcore.Literal) or isinstance(var, jcore.DropVar):
                continue
            lead = (None,) if j in ys else ()
            if out in self.ghosts:
                self.ghosts[var] = lead + self.ghosts[out]
            if out in inner_labels:
                labels[var] = lead + inner_labels[out]
            if out in inner_views and not lead:
                views[var] = inner_views[out]

    def unstack(self, label, path: str):
        """A scan operand's label in its body (one slice of the leading dimension per iteration); a
        split of that dimension itself breaks (each iteration would need every device's slice)."""
        if label is None:
            return None
        self.brk(label[:1], "op", "scan", f"{path}: a loop over the split dimension")
        return label[1:] if any(x is not None for x in label[1:]) else None

    def op(self, eqn, ins, vws, path) -> list:
        prim = eqn.primitive.name
        shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
        out_shape = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
        labeled = [i for i, lab in enumerate(ins) if lab is not None]
        if prim == "dot_general":
            return [self.dot(eqn, ins, vws, shapes, path)]
        if prim in _LOOKUP and vws and vws[0] is not None and prim == "gather":
            self.tables.setdefault(vws[0].name, Use(vws[0].name, vws[0].dims[0], shapes[0][0], path))
        if not labeled:
            return [None] * len(eqn.outvars)
        if (outs := per_head.carry(self, eqn, ins, shapes, path)) is not None:  # attention kernels
            return outs
        if prim == "broadcast_in_dim":
            out = [None] * len(out_shape)
            for d, o in enumerate(eqn.params["broadcast_dimensions"]):
                out[o] = ins[0][d] if shapes[0][d] == out_shape[o] else None
            return [tuple(out)]
        if prim == "transpose":
            return [tuple(ins[0][p] for p in eqn.params["permutation"])]
        if prim in ("reshape", "squeeze", "expand_dims"):
            return [self.reshape(ins[0], shapes[0], out_shape, prim, path)]
        if prim == "slice":
            return [self.slice(ins[0], shapes[0], eqn.params["start_indices"], eqn.params["limit_indices"],
                               eqn.params.get("strides"), path)]
        if prim == "split":
            return self.split(eqn, ins[0], shapes[0], path)
        if (outs := structural.carry(self, eqn, ins, vws, shapes, path)) is not None:
            return outs
        if prim == "concatenate":
            return [self.elementwise(ins, vws, shapes, out_shape, path, skip=eqn.params["dimension"])]
        if (out := slice_update.carry(self, eqn, ins, shapes, out_shape, path)) is not None:
            return [out]
        if prim in _REDUCE or (prim.startswith("cum") and "axis" in eqn.params):
            return [self.reduce(eqn, ins[0], prim, path)]
        if len(eqn.outvars) == 1 and all(s in ((), out_shape) or len(s) == len(out_shape) and all(
                a in (1, b) for a, b in zip(s, out_shape)) for s in shapes):
            return [self.elementwise(ins, vws, shapes, out_shape, path)]
        kind = "lookup" if prim in _LOOKUP else "op"
        self.brk([lab for i in labeled for lab in ins[i]], kind, prim, path)
        return [None] * len(eqn.outvars)

    def elementwise(self, ins, vws, shapes, out_shape, path, skip: int | None = None) -> tuple:
        out: list = [None] * len(out_shape)
        for d in range(len(out_shape)):
            here = [lab[d] for lab in ins if lab is not None and lab[d] is not None]
            if not here:
                continue
            if d == skip:
                self.brk(here, "op", "concatenate", f"{path}: along the split dimension")
                continue
            for other in here[1:]:
                self.union(here[0], other)
            out[d] = here[0]
            for lab, vw, shape in zip(ins, vws, shapes):
                if vw is not None and vw.dims[d] is not None and (lab is None or lab[d] is None) \
                        and len(shape) == len(out_shape) and shape[d] == out_shape[d]:
                    self.group(here[0]).followers.append(Use(vw.name, vw.dims[d], shape[d], path))
        return tuple(out)

    def reduce(self, eqn, lab, prim, path) -> tuple:
        axes = eqn.params.get("axes", (eqn.params.get("axis"),))
        hit = [lab[a] for a in axes if a is not None and lab[a] is not None]
        self.brk(hit, "reduce", prim, path)
        if prim.startswith("cum"):
            return tuple(None if d in axes else x for d, x in enumerate(lab))
        return tuple(x for d, x in enumerate(lab) if d not in axes)

    def slice(self, lab, shape, starts, limits, strides, path) -> tuple:
        out = list(lab)
        for d, x in enumerate(lab):
            if x is None or (starts[d] == 0 and limits[d] == shape[d]):
                continue
            if strides and strides[d] not in (None, 1) or not x.identity:
                self.brk([x], "op", "slice", f"{path}: a strided or nested slice of the split dimension")
                out[d] = None
                continue
            self.segment(x, [(starts[d] * x.unit, limits[d] * x.unit)], x.unit)
            if (limits[d] - starts[d]) % self.tp and x.unit > 1:
                out[d] = None  # key/value heads fewer than the axis (MQA's, fused): whole on every device
                continue
            if (limits[d] - starts[d]) % self.tp:
                self.brk([x], "indivisible", "slice", f"{path}: a segment of {limits[d] - starts[d]}")
            out[d] = _Label(x.source, False)
        return tuple(out)

    def segment(self, label: _Label, bounds, unit: int = 1) -> None:
        group = self.group(label)
        name = group.columns[0].name if len(group.columns) == 1 else str(label.source)
        group.segments.setdefault(name, set()).update(bounds)
        if unit > 1:
            group.units[name] = unit

    def split(self, eqn, lab, shape, path) -> list:
        axis, outs, start = eqn.params["axis"], [], 0
        for size in eqn.params["sizes"]:
            starts = [0] * len(shape)
            limits = list(shape)
            starts[axis], limits[axis] = start, start + size
            outs.append(self.slice(lab, shape, starts, limits, None, path))
            start += size
        return outs

    def reshape(self, lab, in_shape, out_shape, prim, path) -> tuple:
        out: list = [None] * len(out_shape)
        for ins, outs in reshapes.blocks(in_shape, out_shape):
            big_in = [d for d in ins if in_shape[d] > 1]
            big_out = [d for d in outs if out_shape[d] > 1]
            for d in ins:
                if lab[d] is None:
                    continue
                # (batch, heads) merged (Bloom's baddbmm): the heads split inside it
                if d == big_in[-1] and len(big_in) > 1 and len(big_out) == 1 and \
                        not any(lab[e] for e in big_in[:-1]) and not lab[d].minor:
                    out[big_out[0]] = _Label(lab[d].source, False, minor=in_shape[d])
                    continue
                if d != big_in[0] or not big_out or lab[d].minor and out_shape[big_out[-1]] != lab[d].minor:
                    self.brk([lab[d]], "op", prim, f"{path}: {in_shape} -> {out_shape} mixes the split dimension")
                    continue
                if lab[d].minor:  # ... and apart again
                    out[big_out[-1]] = _Label(lab[d].source, False)
                    continue
                first = big_out[0]
                if reshapes.one_head(in_shape, out_shape, first):
                    self.brk([lab[d]], "heads", prim, f"{path}: 1 ({in_shape} -> {out_shape})")
                    continue
                fused = lab[d].identity and reshapes.fused_heads(in_shape[d], [out_shape[o] for o in big_out], self.tp)
                if out_shape[first] % self.tp and fused:
                    self.segment(lab[d], fused)  # (q | k | v) -> (3, heads, head_dim): each segment's heads split
                    first = big_out[1]
                elif out_shape[first] % self.tp:
                    self.brk([lab[d]], "heads", prim, f"{path}: {out_shape[first]} ({in_shape} -> {out_shape})")
                    continue
                same = len(big_in) == 1 and len(big_out) == 1
                # (q | k | v) -> (heads, head_dim): slices of whole heads are segments (Falcon's MQA)
                heads = lab[d].identity and len(big_in) == 1 and len(big_out) == 2 and big_out == outs[-2:] \
                    and not fused
                unit = lab[d].unit if same else lab[d].unit * out_shape[big_out[1]] if heads else 1
                out[first] = _Label(lab[d].source, lab[d].identity and same or heads, unit)
                if len(big_in) == 1 and len(big_out) > 1:
                    group = self.group(lab[d])
                    for use in group.columns:
                        group.heads.setdefault(use.name, out_shape[first])
        return tuple(out)

    def dot(self, eqn, ins, vws, shapes, path):
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lab = [ins[0] or (None,) * len(shapes[0]), ins[1] or (None,) * len(shapes[1])]
        contracted, row_of = False, None
        for a, b in zip(lc, rc):
            x, y = lab[0][a], lab[1][b]
            if x is None and y is None:
                continue
            contracted = True
            hit, other, side, dim = (x, 1, 1, b) if x is not None else (y, 0, 0, a)
            if y is not None and x is not None:
                self.union(x, y)
                self.brk([x], "op", "dot_general", f"{path}: contracts two split activations")
            elif vws[side] is not None and vws[side].dims[dim] is not None:
                self.group(hit).rows.append(Use(vws[side].name, vws[side].dims[dim], shapes[side][dim], path))
                row_of = hit.source
            else:
                self.brk([hit], "op", "dot_general", f"{path}: contracts the split dimension with an unsplit "
                         "activation")
        batch = []
        for a, b in zip(lb, rb):
            x, y = lab[0][a], lab[1][b]
            if x is not None and y is not None:
                self.union(x, y)
            elif (x or y) is not None and vws[0 if x is None else 1] is not None:
                vw, dim = (vws[0], a) if x is None else (vws[1], b)
                if vw.dims[dim] is not None:
                    self.group(x or y).followers.append(Use(vw.name, vw.dims[dim], shapes[0][a], path))
            batch.append(x or y)
        free, ghosts = [], []
        for side, (c, bd) in enumerate(((lc, lb), (rc, rb))):
            for d in range(len(shapes[side])):
                if d in c or d in bd:
                    continue
                label = lab[side][d]
                other = 1 - side
                starts = vws[side] is not None and vws[other] is None and not contracted and not ins[side] \
                    and vws[side].dims[d] is not None
                if starts and label is None:
                    label = self.new_source(Use(vws[side].name, vws[side].dims[d], shapes[side][d], path))
                free.append(label)
                ghosts.append(detour.Ghost(vws[side].name, vws[side].dims[d], shapes[side][d], path, row_of)
                              if row_of is not None and vws[side] is not None and vws[side].dims[d] is not None
                              and label is None else None)
        if any(g is not None for g in ghosts):
            self.row_out = (None,) * len(batch) + tuple(ghosts)
        return tuple(batch + free)


def _stacked(eqn) -> tuple[range, range]:
    """The operands and results of a scan with the leading (iteration) dimension: its `xs` and `ys`."""
    if eqn.primitive.name != "scan":
        return range(0), range(0)
    p = eqn.params
    return range(p["num_consts"] + p["num_carry"], len(eqn.invars)), range(p["num_carry"], len(eqn.outvars))


def analyze(closed, names: list[str], tp: int, module_paths: frozenset[str] = frozenset()) -> Flow:
    """The dimension flow of a traced program whose first inputs are the parameters `names`
    (in flattening order), for a tensor-parallel axis of size `tp`."""
    jaxpr = closed.jaxpr if isinstance(closed, jcore.ClosedJaxpr) else closed
    analysis = _Analysis(tp, module_paths)
    analysis.run(jaxpr, {}, provenance.inputs(names, jaxpr.invars))
    dropped = detour.absorb(analysis.groups, analysis.find, analysis.links, tp)
    for group in analysis.groups:
        group.columns += [Use(g.name, g.dim, g.size, g.path) for g, _ in group.detours
                          if Use(g.name, g.dim, g.size, g.path) not in group.columns]
    roots = sorted({analysis.find(s) for s in range(len(analysis.parent))} - dropped)
    return Flow(tuple(analysis.groups[r] for r in roots), tuple(analysis.tables.values()))


def of_model(model: Model, batch: tuple, tp: int) -> Flow:
    """The dimension flow of `model`'s loss on `batch` (arrays or ShapeDtypeStructs: only shapes
    are read), traced at global shapes."""
    params = model.param_shapes()
    buffers = model.buffer_shapes()
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tuple(batch))
    key = jax.ShapeDtypeStruct((2,), jax.numpy.uint32)  # the raw key every step traces with: one trace serves both
    traced = graph_mod.trace(model, params, buffers, key, shapes)
    names = [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return analyze(traced.jaxpr, names, tp, traced.module_paths)

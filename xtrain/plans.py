"""Presets: the usual parallel layouts as ordinary, printable, editable Plans.

    plan = xtrain.plans.megatron(model, mesh)              # tensor parallel over "tensor"
    plan = xtrain.plans.fsdp(model, mesh, base=plan)       # ... x ZeRO-3 over "data"
    print(plan)                                            # one rule per parameter group + notes

Every preset reads the model's parameter names and shapes (and, for `megatron`, its module
structure) and the mesh's axis sizes, and writes one rule per parameter (layers with the same
choice collapse to one `blocks.*.` glob). What a preset kept whole, and why, is in
`plan.notes`. `assert_sharded` is the check to run on the result (STYLE.md point 9).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
import sys
from typing import Any, Mapping

from xtrain.sharding.mesh import DATA, TENSOR, Mesh
from xtrain.sharding.plan import Plan, Spec, _axes_of

Shapes = dict[str, tuple[int, ...]]
# Tensors below this many elements (biases, norm scales of small models) are not worth a
# gather per use; FSDP keeps them whole.
MIN_SIZE = 1024


# -- inputs: parameter shapes and mesh sizes -----------------------------------------------
def _sizes(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    if isinstance(mesh, Mesh):
        if -1 not in mesh.axes.values():
            return dict(mesh.axes)
        from xtrain.runtime import job_devices

        return mesh.resolve(len(job_devices()))
    return dict(mesh)


def _shapes(model: Any) -> Shapes:
    """{parameter name: shape} of a torch module (canonical names of tied tensors, as xtrain
    names them), a {name: shape} mapping, or a JAX params pytree."""
    if hasattr(model, "named_parameters"):
        return {n: tuple(p.shape) for n, p in model.named_parameters()}
    if isinstance(model, Mapping) and all(isinstance(v, (tuple, list)) for v in model.values()):
        return {n: tuple(v) for n, v in model.items()}
    import jax

    from xtrain.frontend.jax_function import _path_name

    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    return {_path_name(p): tuple(v.shape) for p, v in leaves}


def _size_of(axes: tuple[str, ...], sizes: Mapping[str, int]) -> int:
    return math.prod(sizes[a] for a in axes)


def _require_axes(axes: tuple[str, ...], sizes: Mapping[str, int], preset: str) -> None:
    for axis in axes:
        if axis not in sizes:
            mesh = ", ".join(f"{k}={v}" for k, v in sizes.items())
            raise ValueError(f"xtrain.plans.{preset}: the mesh ({mesh}) has no axis {axis!r}; "
                             f"pass one of {list(sizes)} or add {axis!r} to the mesh")


# -- outputs: compact rules and readable notes ---------------------------------------------
def _escape(name: str) -> str:
    return re.sub(r"([\[\]*?])", r"[\1]", name)


def _layer_glob(name: str) -> str:
    """`blocks.3.mlp.0.weight` -> `blocks.*.mlp.0.weight` (the first numeric segment)."""
    return re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", _escape(name), count=1)


def _compact(specs: Mapping[str, Spec], names: list[str]) -> dict[str, Spec]:
    """Rules for the split parameters in `specs`, one glob per layer group where every layer
    made the same choice and the glob matches nothing else."""
    groups: dict[str, list[str]] = {}
    for name in specs:
        groups.setdefault(_layer_glob(name), []).append(name)
    rules: dict[str, Spec] = {}
    for glob, members in groups.items():
        same = len({specs[m] for m in members}) == 1
        if same and len(members) > 1 and set(fnmatch.filter(names, glob)) == set(members):
            rules[glob] = specs[members[0]]
        else:
            rules.update({_escape(m): specs[m] for m in members})
    return rules


def _listing(names: list[str], limit: int = 6) -> str:
    unique = list(dict.fromkeys(_layer_glob(n) for n in names))
    return ", ".join(unique[:limit]) + (f", ... ({len(unique) - limit} more)" if len(unique) > limit else "")


def _dedup(notes: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(notes))


# -- data parallel and ZeRO/FSDP ------------------------------------------------------------
def ddp(axis: str | tuple[str, ...] = DATA) -> Plan:
    """Pure data parallel: every parameter replicated, the batch split over `axis`.

    Returns:
        `Plan()` for the default axis (the batch goes over the mesh's "data" axis).
    """
    note = f"DDP: every parameter replicated, batch split over {axis!r}"
    return Plan(notes=(note,)) if axis == DATA else Plan(batch=(axis,), notes=(note,))


def _fsdp_dim(shape: tuple[int, ...], spec: Spec, n: int, sizes: Mapping[str, int]) -> int | None:
    """The largest dimension (after `spec`'s splits) that `n` divides; the first on ties."""
    padded = tuple(spec) + (None,) * (len(shape) - len(spec))
    local = [shape[d] // _size_of(_axes_of(padded[d]), sizes) for d in range(len(shape))]
    fits = [d for d in range(len(shape)) if local[d] % n == 0]
    return max(fits, key=lambda d: (local[d], -d)) if fits else None


def _add_axes(spec: Spec, ndim: int, dim: int, axes: tuple[str, ...]) -> Spec:
    padded = list(spec) + [None] * (ndim - len(spec))
    merged = _axes_of(padded[dim]) + axes
    padded[dim] = merged[0] if len(merged) == 1 else merged
    return tuple(padded)


def fsdp(model: Any, mesh: Mesh | Mapping[str, int], *, axis: str | tuple[str, ...] = DATA,
         min_size: int = MIN_SIZE, base: Plan | None = None) -> Plan:
    """ZeRO-3 / FSDP: every parameter split over `axis` on its largest divisible dimension.

    Args:
        model: a torch module, a {name: shape} mapping or a JAX params pytree.
        mesh: the mesh (or its {axis: size}).
        axis: the mesh axis (or axes) parameters are split over; gathered before each use.
        min_size: tensors with fewer elements (biases, norm scales) stay whole.
        base: a plan to add FSDP to (e.g. `megatron(...)` for TP x ZeRO-3): its splits are
            kept and `axis` is added on the largest dimension left divisible; its batch spec
            and notes carry over.

    Returns:
        A Plan with one rule per split parameter group; `notes` lists what stayed whole.
    """
    sizes, shapes = _sizes(mesh), _shapes(model)
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    _require_axes(axes, sizes, "fsdp")
    n = _size_of(axes, sizes)
    base = base or Plan()
    base_specs = base.param_specs(shapes, sizes)
    specs, small, indivisible = {}, [], []
    for name, shape in shapes.items():
        spec = base_specs[name]
        if set(axes) & {a for e in spec for a in _axes_of(e)}:
            specs[name] = spec
            continue
        dim = _fsdp_dim(shape, spec, n, sizes) if math.prod(shape) >= min_size else None
        if dim is not None:
            specs[name] = _add_axes(spec, len(shape), dim, axes)
            continue
        (small if math.prod(shape) < min_size else indivisible).append(name)
        specs[name] = spec
    where = "x".join(axes)
    notes = list(base.notes) + [f"FSDP: parameters split over {where}={n} on their largest divisible dimension"]
    if small:
        notes.append(f"{len(small)} tensors under min_size={min_size} elements not split over {where}: {_listing(small)}")
    notes += [f"{m} {shapes[m]}: no dimension divisible by {where}={n}; not split over {where}" for m in indivisible]
    split = {k: v for k, v in specs.items() if v}
    return Plan(params=_compact(split, list(shapes)), batch=base.batch, notes=_dedup(notes))


def zero(stage: int, model: Any = None, mesh: Mesh | Mapping[str, int] | None = None, **fsdp_kwargs) -> Plan:
    """ZeRO by stage over the data axis. 0: `ddp()`; 1 and 2: `Plan(zero=stage)` (optimizer
    state, and for 2 gradients, split; xtrain picks each tensor's dimension at compile time);
    3: `fsdp(model, mesh, ...)` when given the model and mesh (explicit, printable rules), else
    `Plan(zero=3)`."""
    if stage == 0:
        return ddp()
    if stage in (1, 2) or (stage == 3 and (model is None or mesh is None)):
        return Plan(zero=stage)
    if stage == 3:
        return fsdp(model, mesh, **fsdp_kwargs)
    raise ValueError(f"xtrain.plans.zero({stage!r}): the ZeRO stage must be 0, 1, 2 or 3")


def hybrid(model: Any, mesh: Mesh | Mapping[str, int], *, shard_axis: str = DATA,
           replicate_axes: tuple[str, ...] | None = None, min_size: int = MIN_SIZE) -> Plan:
    """HSDP: parameters split over `shard_axis` (FSDP within each group), replicated across
    `replicate_axes` (default: every other mesh axis); the batch spans all of them.

    e.g. Mesh(replica=2, data=4): 2 groups of 4 devices, each holding one full copy of the
    parameters split 4 ways; gradients reduce-scatter within a group, all-reduce across.
    """
    sizes = _sizes(mesh)
    _require_axes((shard_axis,), sizes, "hybrid")
    replicate = tuple(a for a in sizes if a != shard_axis) if replicate_axes is None else tuple(replicate_axes)
    _require_axes(replicate, sizes, "hybrid")
    batch_axes = tuple(a for a in sizes if a in replicate or a == shard_axis)  # mesh order
    inner = fsdp(model, sizes, axis=shard_axis, min_size=min_size)
    across = " x ".join(f"{a}={sizes[a]}" for a in replicate) or "nothing"
    note = f"HSDP: split over {shard_axis}={sizes[shard_axis]}, replicated across {across}; batch over {batch_axes}"
    return Plan(params=inner.params, batch=(batch_axes if len(batch_axes) > 1 else batch_axes[0],),
                notes=(note,) + inner.notes)


# -- Megatron tensor parallel ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Proj:
    """A linear layer: nn.Linear (weight (out, in)) or HF's Conv1D (weight (in, out))."""

    path: str
    d_in: int
    d_out: int
    out_dim: int           # weight dimension of the outputs: 0 for Linear, 1 for Conv1D
    weight: str
    bias: str | None

    def column(self, axis: str) -> dict[str, Spec]:
        split = (axis, None) if self.out_dim == 0 else (None, axis)
        return {self.weight: split, **({self.bias: (axis,)} if self.bias else {})}

    def row(self, axis: str) -> dict[str, Spec]:
        return {self.weight: (None, axis) if self.out_dim == 0 else (axis, None)}


def _is_conv1d(module) -> bool:
    # HF's Conv1D, looked up only when transformers is already loaded (an HF model is).
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return conv1d is not None and isinstance(module, conv1d)


def _is_projection(module) -> bool:
    from torch import nn

    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _proj(path: str, module, names: Mapping[int, str]) -> _Proj | None:
    if not _is_projection(module):
        return None
    bias = getattr(module, "bias", None)
    bias_name = names.get(id(bias)) if bias is not None else None
    d_out, d_in = module.weight.shape
    if _is_conv1d(module):
        return _Proj(path, d_out, d_in, 1, names[id(module.weight)], bias_name)  # weight (in, out)
    return _Proj(path, d_in, d_out, 0, names[id(module.weight)], bias_name)


def _blocks(model) -> list[tuple[str, list[tuple[str, Any]]]]:
    """(container path, [(block path, block)]) for every ModuleList of identical modules that
    hold linear layers: the transformer's layer stack."""
    from torch import nn

    found = []
    for path, module in model.named_modules():
        children = list(module.named_children())
        inside = any(path.startswith(f"{p}.") for p, _ in found)  # experts inside a block
        if not isinstance(module, nn.ModuleList) or not children or inside:
            continue
        if len({type(c) for _, c in children}) == 1 and any(map(_is_projection, children[0][1].modules())):
            found.append((path, [(f"{path}.{n}" if path else n, c) for n, c in children]))
    return found


_HEAD_ATTRS = ("num_heads", "n_head", "n_heads", "heads", "num_attention_heads")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


def _int_attr(owners, names) -> int | None:
    for owner in owners:
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _heads(module) -> tuple[int | None, int | None]:
    """(query heads, key/value heads) of an attention module, (None, None) for anything else.

    A module is attention when it carries a head attribute itself (a head count, `head_dim`
    or `num_key_value_groups`); the counts may come from its HF `config` (an MLP holds the
    same config, so the config alone does not make a module attention).
    """
    if _int_attr([module], _HEAD_ATTRS + _KV_ATTRS + ("head_dim", "num_key_value_groups")) is None:
        return None, None
    owners = [module, getattr(module, "config", None)]
    heads = _int_attr(owners, _HEAD_ATTRS)
    return heads, _int_attr(owners, _KV_ATTRS) or heads


@dataclasses.dataclass
class _Choices:
    """What megatron decided: parameter specs and notes."""

    axis: str
    tp: int
    specs: dict[str, Spec] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)


def _mixer_groups(block_path: str, block, names) -> list[tuple[str, Any, list[_Proj]]]:
    """The block's linear layers grouped by parent module (attention, MLP), in order."""
    groups: dict[str, tuple[Any, list[_Proj]]] = {}
    modules = dict(block.named_modules())
    for sub, module in block.named_modules():
        proj = _proj(f"{block_path}.{sub}", module, names)
        if proj is not None:
            parent = sub.rpartition(".")[0]
            groups.setdefault(parent, (modules[parent], []))[1].append(proj)
    return [(f"{block_path}.{p}" if p else block_path, m, projs) for p, (m, projs) in groups.items()]


def _width(block_path: str, block, names) -> int:
    """The model width: what a block's first projection reads (the residual stream)."""
    return _mixer_groups(block_path, block, names)[0][2][0].d_in


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


def _mixer(c: _Choices, where: str, module, projs: list[_Proj], d: int) -> None:
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


def _vocab(c: _Choices, model, in_blocks: set[str], names, d: int) -> None:
    """Vocab-parallel token embedding and LM head where the vocabulary divides."""
    from torch import nn

    outside = [(p, m) for p, m in model.named_modules() if not any(p == b or p.startswith(b + ".") for b in in_blocks)]
    embeddings = [(p, m) for p, m in outside if isinstance(m, nn.Embedding) and m.embedding_dim == d]
    heads = [h for h in (_proj(p, m, names) for p, m in outside) if h is not None and h.d_in == d]
    vocab_sizes = {h.d_out for h in heads}
    tokens = [(p, m) for p, m in embeddings if m.num_embeddings in vocab_sizes] or \
        sorted(embeddings, key=lambda e: -e[1].num_embeddings)[:1]
    for path, emb in embeddings:
        name = names[id(emb.weight)]
        if (path, emb) not in tokens:
            c.notes.append(f"{name} {tuple(emb.weight.shape)}: position/other embedding kept whole (as in Megatron)")
        elif emb.num_embeddings % c.tp:
            c.notes.append(f"{name} {tuple(emb.weight.shape)}: vocab {emb.num_embeddings} not divisible by "
                           f"{c.axis}={c.tp}; embedding kept whole (fsdp(..., base=plan) can split it over data)")
        else:
            c.specs[name] = (c.axis, None)
            c.notes.append(f"{name}: vocab-parallel embedding over {c.axis}={c.tp}")
    for head in heads:
        tied = next((n for n in (names[id(e.weight)] for _, e in tokens) if n == head.weight), None)
        if tied:
            c.notes.append(f"{head.path} is tied to {tied}: one tensor, one rule")
        elif head.d_out % c.tp:
            c.notes.append(f"{head.weight} ({head.d_out} x {d}): vocab {head.d_out} not divisible by "
                           f"{c.axis}={c.tp}; LM head kept whole")
        else:
            c.specs.update(head.column(c.axis))
            c.notes.append(f"{head.weight}: vocab-parallel LM head over {c.axis}={c.tp}")


def megatron(model, mesh: Mesh | Mapping[str, int], *, axis: str = TENSOR, vocab_parallel: bool = True) -> Plan:
    """Megatron-LM tensor parallel for standard transformer blocks, found by structure.

    The layer stack is a ModuleList of identical modules. In each block the linear layers
    (nn.Linear, or HF's Conv1D with its (in, out) weight) are grouped by parent module; in a
    group, the last projection back to the model width is row-parallel (split on its input)
    and the others, which read the model width, are column-parallel (split on their output,
    biases too): q/k/v -> out in attention, fc (or gate and up) -> down in the MLP, one
    all-reduce per group. A group whose module (or its `config`) names a head count
    (`num_heads`, `n_head`, `heads`, `num_attention_heads`) is attention: heads must divide
    the axis size, else it stays whole; with grouped-query attention, k/v stay whole when their
    head count does not divide (q, out and the MLP are still split). A fused qkv projection is
    split contiguously (correct, not head-aligned). The token embedding and an untied LM head
    are split on the vocabulary when it divides. Everything else (norms, row-parallel biases,
    position embeddings) is replicated. `plan.notes` records each choice.

    Args:
        model: a torch.nn.Module.
        mesh: the mesh (or its {axis: size}); must have `axis`.
        axis: the tensor-parallel mesh axis.
        vocab_parallel: split the token embedding and LM head on the vocabulary; False keeps
            them whole (the logits then stay whole too).

    Returns:
        A Plan with one rule per parameter group (batch: the default, the "data" axis).
    """
    sizes = _sizes(mesh)
    _require_axes((axis,), sizes, "megatron")
    names = {id(p): n for n, p in model.named_parameters()}
    stacks = _blocks(model)
    if not stacks:
        raise ValueError(f"xtrain.plans.megatron found no transformer blocks in {type(model).__name__}: it "
                         "looks for a torch.nn.ModuleList of identical modules holding linear layers; "
                         "write the rules yourself with xtrain.Plan(params={...})")
    c = _Choices(axis, sizes[axis])
    for prefix, blocks in stacks:
        for path, block in blocks:
            d = _width(path, block, names)
            for where, module, projs in _mixer_groups(path, block, names):
                _mixer(c, f"{prefix}.*{where[len(path):]}", module, projs, d)
    if vocab_parallel:
        _vocab(c, model, {p for _, bs in stacks for p, _ in bs}, names, _width(*stacks[0][1][0], names))
    else:
        c.notes.append("vocab_parallel=False: token embedding and LM head kept whole")
    shapes = _shapes(model)
    c.notes.append(f"replicated: {_listing([n for n in shapes if n not in c.specs])}")
    return Plan(params=_compact(c.specs, list(shapes)), notes=_dedup(c.notes))


# -- checks ---------------------------------------------------------------------------------
def _specs_and_shapes(step_or_plan, model, mesh) -> tuple[dict[str, Spec], Shapes]:
    if isinstance(step_or_plan, Plan):
        if model is None or mesh is None:
            raise ValueError("checking a Plan needs the model (or its {name: shape}) and the mesh")
        shapes = _shapes(model)
        return step_or_plan.param_specs(shapes, _sizes(mesh)), shapes
    state = step_or_plan.state
    shapes = {n: tuple(v.shape) for n, v in {**state.params, **state.frozen}.items()}
    return dict(step_or_plan.param_specs), shapes


def largest_replicated(step_or_plan, model: Any = None, mesh: Mesh | Mapping[str, int] | None = None,
                       *, top: int = 5) -> list[tuple[str, tuple[int, ...]]]:
    """The `top` largest parameters kept whole on every device, largest first.

    Args:
        step_or_plan: a compiled step (`xtrain.compile(...)`) or a Plan.
        model, mesh: for a Plan: the model (or {name: shape}) and mesh it is meant for.
    """
    specs, shapes = _specs_and_shapes(step_or_plan, model, mesh)
    whole = [n for n, s in specs.items() if not any(s)]
    return [(n, shapes[n]) for n in sorted(whole, key=lambda n: -math.prod(shapes[n]))[:top]]


def assert_sharded(step_or_plan, model: Any = None, mesh: Mesh | Mapping[str, int] | None = None,
                   *, max_replicated: float = 0.05) -> float:
    """Fails when more than `max_replicated` of the parameter elements are whole on every
    device (MaxText's `assert_params_sufficiently_sharded`). Returns that fraction.

    Raises:
        ValueError: naming the largest replicated tensors and their shapes.
    """
    specs, shapes = _specs_and_shapes(step_or_plan, model, mesh)
    total = sum(math.prod(s) for s in shapes.values())
    whole = sum(math.prod(shapes[n]) for n, s in specs.items() if not any(s))
    fraction = whole / max(total, 1)
    if fraction > max_replicated:
        worst = largest_replicated(step_or_plan, model, mesh)
        raise ValueError(
            f"{fraction:.1%} of the parameter elements are replicated on every device (allowed: "
            f"{max_replicated:.0%}); largest: {', '.join(f'{n} {s}' for n, s in worst)}. Add rules for them, "
            "or combine with xtrain.plans.fsdp(model, mesh, base=plan)")
    return fraction

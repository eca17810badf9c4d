"""Input checks: a batch's integer indices held to torch's rules inside the compiled step.

JAX clips or fills a gather index out of range (an embedding index past the vocabulary reads
NaN, a target past the classes reads the last class); torch raises. The checks find, in the
model's traced graph, every gather whose index comes from a batch argument, and the step
verifies that argument's values against the gathered dimension (its per-device shard: one
compare per element, no collective). A violation poisons the step's gradients with NaN before
the gradient sync, which spreads it to every device; the non-finite gradient norm then skips
the update everywhere (grad_transforms.finish_step), and the host names the argument, the
module, the op and the offending value (`first_violation`).

Followed from the batch: reshapes, broadcasts, dtype casts, transposes, slices of non-batch
dimensions, and the two rewrites the lowerings of torch ops apply to an index: wrapping a
negative index (`where(i < 0, i + n, i)`) and masking an ignore index (`where(i != c, i, 0)`).
An index computed otherwise from the batch (cumsum of a mask, arithmetic) is not checked and
the report says so; indices computed from activations (routers, sorts) are not the batch's and
are in range by construction. Which negative indices are valid follows the torch op, read
from the front end's markers (xtrain.ir.index_ops): advanced indexing wraps them, `embedding`,
`gather` and `nll_loss` targets refuse them.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from xtrain.errors import BatchTypeError
from xtrain.ir import index_ops, stacked, walk
from xtrain.lowering import precision

_SAME_SHAPE = frozenset({"convert_element_type", "copy", "copy_p"})
_RESHAPING = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose"})
_BODIES = frozenset(walk.CALLS) | {"custom_jvp_call", "custom_vjp_call", "checkpoint", "remat"}


@dataclasses.dataclass(frozen=True)
class Source:
    """Integer values that are batch argument `arg`'s (a region of it, rearranged)."""

    arg: int
    region: tuple[tuple[int, int] | None, ...]  # per dimension of the argument: the part read (None: all)
    reshaped: bool = False                  # no longer laid out as the argument
    wrapped: bool = False                   # negatives were wrapped by the op's lowering
    ignore: int | None = None               # a value masked out before the gather
    float_arg: bool = False                 # the batch argument is floating-point
    padded: tuple[tuple[int, int], ...] | None = None  # per dimension: constants before / after the region


@dataclasses.dataclass(frozen=True)
class _Derived:
    """A value computed from a batch argument in a way the checks do not follow."""

    arg: int
    how: str


@dataclasses.dataclass(frozen=True)
class _Test:
    """`of < 0` (kind "negative"), `of != value` ("ne") or `of + value` ("add")."""

    kind: str
    of: Source
    value: int


@dataclasses.dataclass(frozen=True)
class _Const:
    """A scalar constant (a literal, possibly passed into a call body)."""

    value: int


@dataclasses.dataclass(frozen=True)
class _Columns:
    """An index vector put together from columns (`x[rows, cols]`): each column's source."""

    parts: tuple


@dataclasses.dataclass(frozen=True)
class IndexCheck:
    """Batch argument `arg` (the `region` of it) indexes a dimension of `size` in `module`."""

    arg: int
    region: tuple[tuple[int, int] | None, ...]
    size: int
    negatives: bool
    ignore: int | None
    op: str
    module: str

    def valid(self, x):
        """Elementwise: whether each index is valid (jnp or numpy)."""
        ok = (x >= (-self.size if self.negatives else 0)) & (x < self.size)
        return ok if self.ignore is None else ok | (x == self.ignore)

    def describe(self, value: int) -> str:
        low = -self.size if self.negatives else 0
        ignore = "" if self.ignore is None else f", or the ignore index {self.ignore}"
        where = self.module or "<top level>"
        return (f"batch argument {self.arg} holds {value} where module {where!r} uses it as an index ({self.op}) into "
                f"a dimension of size {self.size}: valid values are {low}..{self.size - 1}{ignore}")


@dataclasses.dataclass
class Found:
    """The checks of one traced program, and the batch indices it cannot check (report notes)."""

    checks: list[IndexCheck] = dataclasses.field(default_factory=list)
    unchecked: list[str] = dataclasses.field(default_factory=list)

    def notes(self) -> list[str]:
        if not self.checks and not self.unchecked:
            return []
        uses = ", ".join(f"argument {c.arg} in {c.op} of {c.module or '<top level>'!r}" for c in self.checks)
        return [f"input checks: {len(self.checks)} index use(s) of the batch checked against their range"
                f"{': ' + uses if uses else ''}"] + [f"input checks: {note}" for note in self.unchecked]


# -- finding the checks in the traced graph ----------------------------------------------------
def _literal(var) -> _Const | None:
    """A scalar literal of integral value (index arithmetic: offsets, ignore indices)."""
    value = np.asarray(var.val) if isinstance(var, jcore.Literal) else None
    if value is None or value.ndim or value.dtype.kind not in "iuf" or not np.isfinite(value):  # complex: FFT mixers
        return None
    return _Const(int(value)) if float(value) == int(value) else None


def _batch(value) -> bool:
    """Whether an abstract value comes from the batch."""
    return isinstance(value, (Source, _Derived, _Test, _Columns))


def _const(value) -> int | None:
    return value.value if isinstance(value, _Const) else None


def _is_int(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.integer)


def _follow(eqn, ins: list) -> list:
    """Abstract values of an equation's outputs from its inputs' (None: not from the batch)."""
    name = str(eqn.primitive)
    parts = tuple(v if _batch(v) else None for v in ins)
    if name == "concatenate" and _is_columns(eqn) and any(p is not None for p in parts):
        return [_Columns(parts)]  # (a concatenation of columns none of which is from the batch is no index)
    tests = _tests(name, eqn, ins)
    src = next((v for v in ins if _batch(v)), None)
    if src is None and name in ("convert_element_type", "copy") and _const(ins[0]) is not None:
        return [ins[0]]
    if src is None or any(t is not None for t in tests):
        return tests
    if isinstance(src, Source) and len(eqn.outvars) == 1:
        moved = _moved(name, eqn, src)
        if moved is not None:
            return [moved]
    derived = _derived(src, name)
    return [derived if _is_int(v.aval) else None for v in eqn.outvars]


def _is_columns(eqn) -> bool:
    """A concatenation of single columns along the last dimension (an index vector)."""
    last = eqn.outvars[0].aval.ndim - 1
    return eqn.params["dimension"] == last and all(v.aval.shape[-1] == 1 for v in eqn.invars)


def _derived(value, how: str) -> "_Derived":
    """`value` (from the batch) taken by an op the checks do not follow."""
    if isinstance(value, _Derived):
        return value
    if isinstance(value, _Test):
        return _Derived(value.of.arg, f"{value.kind} {value.value}")
    if isinstance(value, _Columns):
        return _derived(next(v for v in value.parts if v is not None), how)
    return _Derived(value.arg, how)


def _moved(name: str, eqn, src: Source) -> Source | None:
    """`src` through a layout op (or a dtype cast); None for any other op."""
    if name in _SAME_SHAPE:
        return src
    if name in _RESHAPING:
        return dataclasses.replace(src, reshaped=True)
    if name == "pad" and not src.reshaped:
        config = eqn.params["padding_config"]
        if any(interior or lo < 0 or hi < 0 for lo, hi, interior in config) or config[0][:2] != (0, 0):
            return None
        padded = src.padded or ((0, 0),) * len(config)
        return dataclasses.replace(src, padded=tuple((int(a + lo), int(b + hi))
                                                     for (a, b), (lo, hi, _) in zip(padded, config)))
    if name == "slice" and not src.reshaped and set(eqn.params["strides"] or (1,)) == {1}:
        starts, limits, shape = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.invars[0].aval.shape
        if starts[0] != 0 or limits[0] != shape[0]:
            return None  # rows of the batch: no longer each device's rows
        return _sliced(src, starts, limits, shape)
    return None


def _sliced(src: Source, starts, limits, shape) -> Source:
    """`src` sliced to [starts, limits) of its current (padded) extent."""
    padded = src.padded or ((0, 0),) * len(shape)
    region, pads = [], []
    for r, (low, high), a, b, n in zip(src.region, padded, starts, limits, shape):
        lo, hi = r or (0, n - low - high)  # the argument's rows this dimension holds
        first, last = lo + max(a - low, 0), lo + min(b - low, hi - lo)
        whole = (first, last) == (0, n - low - high) and r is None
        region.append(None if whole else (int(first), int(max(first, last))))
        pads.append((int(max(0, min(low, b) - a)), int(max(0, b - max(a, low + hi - lo)))))
    return dataclasses.replace(src, region=tuple(region), padded=tuple(pads) if any(map(any, pads)) else None)


def _tests(name: str, eqn, ins: list) -> list:
    """Comparisons and offsets of a batch index by a constant; select_n of them (the wrap and
    ignore-index rewrites)."""
    if name in ("lt", "ne", "add") and isinstance(ins[0], Source) and _const(ins[1]) is not None:
        value = _const(ins[1])
        if name != "lt" or value == 0:
            return [_Test({"lt": "negative", "ne": "ne", "add": "add"}[name], ins[0], value)]
    if name == "select_n" and len(ins) == 3 and isinstance(ins[0], _Test):
        test, off, on = ins
        if test.kind == "negative" and off == test.of and isinstance(on, _Test) and on.kind == "add" and on.of == off:
            return [dataclasses.replace(off, wrapped=True)]
        if test.kind == "ne" and on == test.of:
            return [dataclasses.replace(on, ignore=test.value)]
    return [None] * len(eqn.outvars)


def _gathered_sizes(eqn) -> list[int]:
    """Per component of the gather's index vector: the size of the dimension it addresses."""
    numbers, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    return [eqn.invars[0].aval.shape[d] - sizes[d] + 1 for d in numbers.start_index_map]


class _Finder:
    def __init__(self, module_paths: frozenset[str]):
        self.module_paths, self.found = module_paths, Found()

    def run(self, jaxpr, values: list, stack: str) -> list:
        env = dict(zip(jaxpr.invars, values))
        read = lambda v: _literal(v) if isinstance(v, jcore.Literal) else env.get(v)
        for eqn in jaxpr.eqns:
            ins, here = [read(v) for v in eqn.invars], f"{stack}/{eqn.source_info.name_stack}"
            name = str(eqn.primitive)
            if name == "gather":
                self._gather(eqn, ins, here)
            from_batch = any(_batch(v) for v in ins)
            if name in _BODIES and from_batch:
                outs = self._body(eqn, ins, here)
            elif from_batch and any(True for _ in jcore.jaxprs_in_params(eqn.params)):
                outs = self._opaque(eqn, ins, here)
            else:
                outs = _follow(eqn, ins)
            env.update((v, o) for v, o in zip(eqn.outvars, outs) if o is not None)
        return [read(v) for v in jaxpr.outvars]

    def _body(self, eqn, ins, stack) -> list:
        body, _ = walk.call_body(eqn) if str(eqn.primitive) in walk.CALLS else _inner(eqn)
        if body is None or len(body.invars) != len(ins):
            return self._opaque(eqn, ins, stack)
        return self.run(body, ins, stack)

    def _opaque(self, eqn, ins, stack) -> list:
        ints = [x for x, v in zip(ins, eqn.invars) if _batch(x) and _is_int(v.aval)]
        if not ints:  # float batch values (features) are no indices
            return [None] * len(eqn.outvars)
        derived = _derived(ints[0], str(eqn.primitive))
        self.found.unchecked.append(f"batch argument {derived.arg} enters {eqn.primitive} in module "
                                    f"{self._module(stack) or '<top level>'!r}: indices inside it are not checked")
        return [derived if _is_int(v.aval) else None for v in eqn.outvars]

    def _module(self, stack: str) -> str:
        return walk.module_path(stack, self.module_paths)

    def _gather(self, eqn, ins, stack) -> None:
        index, marker, module = ins[1], index_ops.marker_in(stack), self._module(stack)
        op = marker or index_ops.ADVANCED_INDEXING
        where = module or "<top level>"
        if op.float_index:
            float_args = [v.arg for v in _parts(index) if isinstance(v, Source) and v.float_arg]
            if float_args:
                raise BatchTypeError(
                    f"batch argument {float_args[0]} is floating-point but module {where!r} uses it as "
                    f"the indices of {op.name}: pass integer labels/indices (torch.long or int32)")
            raise BatchTypeError(
                f"module {where!r}: the indices of {op.name} are floating-point; torch needs an integer "
                "tensor there (torch.long)")
        sizes = _gathered_sizes(eqn)
        parts = list(index.parts) if isinstance(index, _Columns) else [index] * len(sizes)
        if not isinstance(index, _Columns) and len(sizes) != 1:
            parts = [_derived(index, "an index vector") if index is not None else None] * len(sizes)
        for part, size in zip(parts, sizes):
            self._record(part, size, op, marker is not None, module)

    def _record(self, part, size: int, op: index_ops.IndexOp, marked: bool, module: str) -> None:
        if not _batch(part):
            return
        if not isinstance(part, Source):
            part = _derived(part, "")
            self.found.unchecked.append(f"{op.name} in module {module or '<top level>'!r} indexes with batch argument "
                                        f"{part.arg} through {part.how}: not checked")
            return
        if part.float_arg:
            raise BatchTypeError(
                f"batch argument {part.arg} is floating-point but module {module or '<top level>'!r} uses "
                f"it as the indices of {op.name}: pass integer indices (torch.long or int32)")
        negatives = op.negatives if marked else part.wrapped
        check = IndexCheck(part.arg, part.region, size, negatives, part.ignore, op.name, module)
        if check not in self.found.checks:
            self.found.checks.append(check)


def _parts(index) -> list:
    return list(index.parts) if isinstance(index, _Columns) else [index]


def _inner(eqn):
    closed = eqn.params.get("call_jaxpr") or eqn.params.get("jaxpr")
    if isinstance(closed, jcore.ClosedJaxpr):
        return closed.jaxpr, list(closed.consts)
    return (closed, []) if isinstance(closed, jcore.Jaxpr) else (None, [])


def _innermost(model):
    """The front end's model under the lowering's wrappers (stacked storage, precision policy),
    which change neither the batch nor how it is indexed."""
    while True:
        inner = model.inner if isinstance(model, stacked.StackedModel) else getattr(model, "_model", None)
        if inner is None or not isinstance(model, (stacked.StackedModel, precision.MixedPrecision)):
            return model
        model = inner


_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def for_model(model, buffers: Any, key: Any, batch: tuple) -> Found:
    """The checks of `model` (any wrapper of a front end's Model) for a batch of these shapes;
    traced once per model and batch signature (the plan search lowers many layouts)."""
    user = _innermost(model)
    shapes = tuple((tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else repr(x) for x in batch)
    per_model = _cache.setdefault(user, {})
    if shapes not in per_model:
        args = (user.param_shapes(), buffers, key, batch)
        closed = jax.make_jaxpr(lambda *a: user.apply(*a, training=True))(*args)
        per_model[shapes] = find(closed, len(jax.tree.leaves(args[:3])), batch, user.module_paths())
    return per_model[shapes]


def find(closed, n_state: int, batch: Sequence[Any], module_paths: frozenset[str]) -> Found:
    """The index checks of a model's traced forward, whose inputs are `n_state` state leaves
    (parameters, buffers, key) then the leaves of `batch`. Raises TypeError for a
    floating-point tensor used as indices."""
    values = [None] * n_state
    for arg, x in enumerate(batch):
        for leaf in jax.tree.leaves(x):
            shape = tuple(getattr(leaf, "shape", ()))
            numeric = shape and (_is_int(leaf) or jnp.issubdtype(leaf.dtype, jnp.floating))
            values.append(Source(arg, (None,) * len(shape), float_arg=not _is_int(leaf)) if numeric else None)
    finder = _Finder(module_paths)
    finder.run(closed.jaxpr, values, "")
    return finder.found


# -- checking ------------------------------------------------------------------------------
def _part(check: IndexCheck, x):
    """The check's region of `x`, a shard (rows) of its batch argument or the whole of it."""
    return x[tuple(slice(None) if r is None else slice(*r) for r in check.region)]


def checkable(check: IndexCheck, split_dims: frozenset[int]) -> bool:
    """Whether a device's shard holds the check's region whole in every dimension the batch is
    split over (dimension 0's region always is)."""
    return all(check.region[d] is None for d in split_dims if d < len(check.region))


def violated(checks: Sequence[IndexCheck], batch: tuple):
    """Whether any index of this (per-device or global) batch breaks its check: a bool scalar."""
    bad = jnp.zeros((), bool)
    for check in checks:
        bad = bad | ~jnp.all(check.valid(_part(check, batch[check.arg])))
    return bad


def first_violation(checks: Sequence[IndexCheck], shards: dict[int, list[np.ndarray]]
                    ) -> tuple[IndexCheck, int] | None:
    """On the host, after a step the checks skipped: the first check the given shards of each
    batch argument break, and the offending value of largest magnitude."""
    for check in checks:
        for shard in shards.get(check.arg, []):
            x = _part(check, np.asarray(shard))
            bad = x[~check.valid(x)]
            if bad.size:
                return check, int(bad.flat[np.argmax(np.abs(bad.astype(np.int64)))])
    return None

"""A model traced once per input signature, its jaxpr replayed after that.

A plan search lowers tens of candidate plans of one model, and every lowering traces the model's
`apply` (the explicit forward, the precision policy, stage balancing, Megatron's derivation,
input checks, FLOPs). Tracing a torch model through torchax costs seconds to minutes at real size
(Llama-3.1-8B at 8192 tokens: about 40 s on this machine); replaying its jaxpr costs a small
part of that. `Replay.apply(fn, args, extra)` traces `fn` the first time it sees an input
signature (each array's shape, dtype, weak type and varying mesh axes; every other leaf by value;
`extra`: what else the trace depends on, e.g. training mode and trace options; the abstract mesh
in context, where the trace was made under one) and replays the kept jaxpr, equation by equation
with their name stacks (module paths), on every later call.

What a trace reads from its context is recorded as it is read: a layer whose result depends on
context (xtrain.shard reads the mesh being compiled for) calls `depends_on(current)`, and a kept
trace is replayed only where each `current()` equals what it was at the trace. Calls with
concrete values (eager use) are not kept.

Every actual trace records MODEL_TRACE_EVENT through `jax.monitoring` (with the model's name), so
a caller can count them (tests: one trace per signature across a whole plan search).
"""
from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Callable, Hashable

import jax

from jax.extend import linear_util as lu

from xtrain.ir import walk

MODEL_TRACE_EVENT = "/xtrain/ir/model_trace"  # jax.monitoring: a model's apply traced (not replayed)

# custom_jvp / custom_vjp calls trace their derivative rule lazily, in a thunk that keeps the first
# jaxpr it traced, and a kept trace's thunks are shared by every replay of it: the first call under
# one lowering's mesh (a pipeline stage's Manual mesh) would hand that mesh to every later lowering.
# Called with no mesh in context, they keep a jaxpr as mesh-free as the kept trace, which each
# replay then evaluates under its own.
_RULE_THUNKS = {"custom_jvp_call": "jvp_jaxpr_fun", "custom_vjp_call": "fwd_jaxpr_thunk"}
_NO_MESH = jax.sharding.AbstractMesh((), ())
Dependency = tuple[Callable[[], Hashable], Hashable]  # (read the context now, its value at the trace)
_RECORDING: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar("xtrain_replay_recording", default=())


def depends_on(current: Callable[[], Hashable]) -> None:
    """Marks every trace in progress as depending on `current()` (its value now)."""
    for found in _RECORDING.get():
        found.append((current, current()))


@dataclasses.dataclass(frozen=True)
class _Kept:
    closed: Any                       # the ClosedJaxpr of the call on its array leaves
    out_tree: Any                     # the output's tree structure
    depends: tuple[Dependency, ...]   # context the trace read

    def valid(self) -> bool:
        return all(current() == value for current, value in self.depends)


def _is_array(x) -> bool:
    return isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct))


def _leaf_key(x) -> Hashable:
    if _is_array(x):
        aval = x.aval if isinstance(x, jax.core.Tracer) else x
        return ("array", tuple(x.shape), str(x.dtype), bool(getattr(aval, "weak_type", False)),
                tuple(sorted(getattr(aval, "vma", ()) or ())))
    try:
        hash(x)
    except TypeError:
        return ("unhashable", id(x))  # never equal to another object's: traced again
    return ("static", type(x).__name__, x)


class Replay:
    """The traces of one model's `apply`, kept by input signature (see the module docstring).

    Args:
        name: the model's name, for MODEL_TRACE_EVENT.
    """

    def __init__(self, name: str = ""):
        self.name = name
        self._kept: dict[Hashable, list[_Kept]] = {}
        self.traces = 0  # actual traces so far (MODEL_TRACE_EVENT counts them too)

    def apply(self, fn: Callable, args: tuple, extra: Hashable = ()) -> Any:
        """`fn(*args)`: traced once per signature of `args` and `extra`, replayed after that."""
        leaves, tree = jax.tree.flatten(args)
        dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.core.Tracer)]
        if any(hasattr(x, "shape") and not _is_array(x) for x in leaves):
            return fn(*args)  # concrete values: eager use, nothing to keep
        mesh = jax.sharding.get_abstract_mesh()
        key = (tree, extra, jax.default_backend(), tuple(_leaf_key(x) for x in leaves))
        # a trace kept with no mesh in context replays under any; one kept under a mesh, under it only
        kept = next((k for m in dict.fromkeys((_NO_MESH, mesh)) for k in self._kept.get(key + (m,), ())
                     if k.valid()), None)
        if kept is None:
            key += (mesh,)
            kept = self._trace(fn, leaves, tree, dynamic)
            if not any(isinstance(c, jax.core.Tracer) for c in kept.closed.consts):
                self._kept.setdefault(key, []).append(kept)  # one closing over an outer trace's values is not
        for current, value in kept.depends:  # an enclosing trace depends on the same context
            for found in _RECORDING.get():
                found.append((current, value))
        outs = walk.evaluate(kept.closed.jaxpr, kept.closed.consts, [leaves[i] for i in dynamic], _bind)
        return jax.tree.unflatten(kept.out_tree, outs)

    def _trace(self, fn: Callable, leaves: list, tree, dynamic: list[int]) -> _Kept:
        def call(*values):
            full = list(leaves)
            for i, v in zip(dynamic, values):
                full[i] = v
            return fn(*jax.tree.unflatten(tree, full))

        found: list[Dependency] = []
        token = _RECORDING.set(_RECORDING.get() + (found,))
        try:
            closed, out_shape = jax.make_jaxpr(call, return_shape=True)(*[leaves[i] for i in dynamic])
        finally:
            _RECORDING.reset(token)
        self.traces += 1
        jax.monitoring.record_event(MODEL_TRACE_EVENT, model=self.name)
        return _Kept(closed, jax.tree.structure(out_shape), tuple(dict.fromkeys(found)))


def _meshless(thunk: lu.WrappedFun) -> lu.WrappedFun:
    def call(*zeros):
        with jax.sharding.use_abstract_mesh(_NO_MESH):
            return thunk.call_wrapped(*zeros)
    return lu.wrap_init(call, debug_info=thunk.debug_info)


def _bind(eqn, values: list, _path: str) -> list:
    """A kept equation bound again, its derivative-rule thunk (if any) called with no mesh."""
    key = _RULE_THUNKS.get(eqn.primitive.name)
    return walk.bind_eqn(eqn, values, None if key is None else {**eqn.params, key: _meshless(eqn.params[key])})

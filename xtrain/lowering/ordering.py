"""One order for the collectives of a per-device program on XLA's CPU runtime.

XLA:CPU orders the collectives of a thunk sequence by "scheduling" edges: a collective may
start once the one before it has started. A collective finishes on the thread that starts
it, so that is enough between two collectives, but a while loop (a layer scan) is started
asynchronously: it returns as soon as an iteration waits on a parallel kernel, and whatever
comes after it in the schedule may then start while the loop's later iterations have not
yet entered their collectives. Emulated devices then enter independent collectives in
different orders, and since every collective of a jax program has the same rendezvous key
(channel_id=1), a device inside two at once joins one rendezvous twice: XLA aborts ("Id can't
be larger than the number of participating threads") or the devices wait in different
collectives forever. Seen with jax 0.10.2 on 8 emulated devices: ZeRO-3's re-gathers in the
backward scan next to the loss's token-count all-reduce, about one run in two.

`in_order(fn)` stages `fn` as one `xtrain_in_order` equation. On the CPU its lowering makes
each collective, and each loop or branch holding one, read a value computed from the result
of the one before (its input plus -0.0 derived from that result: same values, no extra bytes
on the wire, no extra collective), so the dataflow fixes one order and each starts only once
the previous one has finished. Other backends lower `fn` unchanged (their runtimes order
collectives themselves and serialising them would forbid overlapping them), and
`step.program()` shows `fn`'s own equations on every backend.

Calls (jit, checkpoint) are inlined so that their collectives join the one order; a loop or
branch is one link of the chain. Inside a body, plain collectives keep XLA's order (each
finishes where it starts); a body that holds a communicating loop or branch of its own is
ordered the same way, iteration by iteration.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import api_util, core
from jax._src import linear_util as lu
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from xtrain.ir import walk

# Primitives that communicate (jax 0.10 names, async start/done halves included).
COLLECTIVES = frozenset({
    "psum", "psum_invariant", "pmax", "pmin", "ppermute", "pbroadcast", "all_to_all", "ragged_all_to_all",
    "all_gather", "all_gather_invariant", "all_gather_reduced", "reduce_scatter", "psum_scatter",
    "unreduced_psum", "unreduced_reduce_scatter", "psend", "precv",
    "psum_start", "psum_done", "psum_invariant_start", "all_gather_start", "all_gather_done",
    "all_gather_reduced_start", "all_to_all_start", "all_to_all_done", "ppermute_start", "ppermute_done",
    "pbroadcast_start", "pbroadcast_done", "reduce_scatter_start", "reduce_scatter_done",
    "unreduced_psum_start", "unreduced_reduce_scatter_start",
})
# Call-like equations whose bodies are lowered inline: their collectives join the outer order.
_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint"})


# -- x after dep: x, computed only once dep exists ---------------------------------------------
after_p = core.Primitive("xtrain_after")
after_p.def_abstract_eval(lambda x, dep: x)  # x's type (vma included): dep's never leaks into it


def _after_lowering(ctx, x, dep):
    """x + z, z = -(|d| * 0) with d one element of dep (0 where not finite): -0.0, which
    leaves every x unchanged, bit for bit. XLA folds no float multiply by zero (NaN), so the
    read of dep stays in the program."""
    x_aval, dep_aval = ctx.avals_in
    f32 = ir.RankedTensorType.get([], ir.F32Type.get())
    d = dep
    if dep_aval.ndim:
        ones = ir.DenseI64ArrayAttr.get([1] * dep_aval.ndim)
        d = hlo.slice(d, ir.DenseI64ArrayAttr.get([0] * dep_aval.ndim), ones, ones)
        d = hlo.reshape(ir.RankedTensorType.get([], mlir.dtype_to_ir_type(dep_aval.dtype)), d)
    d = hlo.convert(f32, d)
    zero = mlir.ir_constant(np.float32(0))
    d = hlo.select(hlo.is_finite(d), d, zero)
    z = hlo.negate(hlo.multiply(hlo.abs(d), zero))
    z = hlo.convert(ir.RankedTensorType.get([], mlir.dtype_to_ir_type(x_aval.dtype)), z)
    z = mlir.broadcast_in_dim(ctx, z, x_aval, broadcast_dimensions=[])
    return [hlo.add(x, z)]


mlir.register_lowering(after_p, _after_lowering)


def _orderable(v) -> bool:
    """A value the dependency can be read from or added to (non-empty real number or integer)."""
    aval = jax.typeof(v)
    dtype = getattr(aval, "dtype", None)
    return (dtype is not None and getattr(aval, "size", 0) > 0
            and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)))  # bf16 too


# -- the rewrite --------------------------------------------------------------------------------
def _communicates(jaxpr) -> bool:
    return any(str(e.primitive) in COLLECTIVES or any(map(_communicates, core.jaxprs_in_params(e.params)))
               for e in jaxpr.eqns)


def _tie(invals: list, last) -> list:
    """`invals` with the first orderable one computed after `last`."""
    for i, v in enumerate(invals):
        if _orderable(v):
            return invals[:i] + [after_p.bind(v, last)] + invals[i + 1:]
    return invals


def _sequenced(jaxpr, consts, args, last):
    """Evaluates `jaxpr`, each communicating equation tied to the previous one's result.
    Returns (outputs, the last communicating equation's result or the incoming `last`)."""
    state = [last]

    def bind(eqn, invals, path):
        name = str(eqn.primitive)
        if name in _INLINE and _communicates(walk.call_body(eqn)[0]):
            if name in ("remat2", "checkpoint") and eqn.params.get("differentiated"):
                invals = _barrier(invals, eqn.params.get("prevent_cse", True))
            body, body_consts = walk.call_body(eqn)
            outs, state[0] = _sequenced(body, body_consts, invals, state[0])
            return outs
        if name in COLLECTIVES or any(map(_communicates, core.jaxprs_in_params(eqn.params))):
            outs = walk.bind_eqn(eqn, invals if state[0] is None else _tie(invals, state[0]),
                                 _sequenced_bodies(eqn.params))
            state[0] = next((o for o in outs if _orderable(o)), state[0])
            return outs
        return walk.bind_eqn(eqn, invals)

    return walk.evaluate(jaxpr, consts, args, bind), state[0]


_LOOPS = frozenset({"scan", "while", "cond"})  # started asynchronously by XLA:CPU


def _nests_loop(jaxpr) -> bool:
    """Whether `jaxpr` holds a loop or branch with collectives in it, at any depth: only then
    can its collectives start out of order."""
    return any((str(e.primitive) in _LOOPS and _communicates(s)) or _nests_loop(s)
               for e in jaxpr.eqns for s in core.jaxprs_in_params(e.params))


def _sequenced_bodies(params: dict) -> dict:
    """`params` of a loop or branch with each body that nests a communicating loop ordered too
    (same signature; the order restarts in every iteration, which starts after the last ends)."""

    def order(closed):
        if not (isinstance(closed, core.ClosedJaxpr) and _nests_loop(closed.jaxpr)):
            return closed
        fn = lambda *args: _sequenced(closed.jaxpr, closed.consts, args, None)[0]
        debug = api_util.debug_info("xtrain.in_order", fn, closed.in_avals, {})
        jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fn, debug_info=debug), closed.in_avals)
        return core.ClosedJaxpr(jaxpr, consts)

    return {k: tuple(map(order, v)) if isinstance(v, tuple) and v and isinstance(v[0], core.ClosedJaxpr)
            else order(v) for k, v in params.items()}


# remat's lowering puts a differentiated checkpoint's inputs through an optimization barrier so
# that XLA cannot merge the recomputation with the forward pass; inlined, it keeps it. (Own
# primitive: lax.optimization_barrier types every output as varying over all inputs' axes; also
# ZeRO-3's re-gather, xtrain.lowering.regather.)
_barrier_p = core.Primitive("xtrain_remat_barrier")
_barrier_p.multiple_results = True
_barrier_p.def_abstract_eval(lambda *xs: xs)
mlir.register_lowering(_barrier_p, lambda ctx, *xs: list(hlo.OptimizationBarrierOp(xs).results))


def barrier(values: list) -> list:
    """`values` through one optimization barrier, each keeping its own type (vma included)."""
    return list(_barrier_p.bind(*values)) if values else []


def _barrier(invals: list, prevent_cse) -> list:
    flags = prevent_cse if isinstance(prevent_cse, tuple) else (prevent_cse,) * len(invals)
    if not any(flags):
        return invals
    it = iter(_barrier_p.bind(*[v for v, f in zip(invals, flags) if f]))
    return [next(it) if f else v for v, f in zip(invals, flags)]


# -- the staged call ----------------------------------------------------------------------------
in_order_p = core.Primitive("xtrain_in_order")
in_order_p.multiple_results = True
in_order_p.def_effectful_abstract_eval(lambda *args, jaxpr: (jaxpr.out_avals, jaxpr.effects))
mlir.register_lowering(in_order_p, mlir.lower_fun(
    lambda *args, jaxpr: core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args), multiple_results=True))
mlir.register_lowering(in_order_p, mlir.lower_fun(
    lambda *args, jaxpr: _sequenced(jaxpr.jaxpr, jaxpr.consts, args, None)[0], multiple_results=True),
    platform="cpu")


def in_order(fn: Callable) -> Callable:
    """`fn` (a per-device function, called inside shard_map) whose collectives run in one
    order on every device of XLA's CPU runtime; unchanged elsewhere."""

    def staged(*args: Any):
        flat, tree = jax.tree.flatten(args)
        closed, out_shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), return_shape=True)(*flat)
        # closed-over values become operands: a primitive's parameters must not hold tracers; what
        # no output needs is left out (JAX's own pass stops at this primitive): the report counts the
        # collectives the program keeps, and XLA would drop a dead one after lowering
        jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
        jaxpr = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)[0]
        outs = in_order_p.bind(*closed.consts, *flat, jaxpr=core.ClosedJaxpr(jaxpr, ()))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return staged


def staged_body(jaxpr):
    """The jaxpr `in_order` staged when `jaxpr` is only that call (a shard_map body), else
    `jaxpr`: what a per-device cost model should read, not the call around it."""
    eqns = getattr(jaxpr, "jaxpr", jaxpr).eqns
    if len(eqns) == 1 and eqns[0].primitive is in_order_p:
        return eqns[0].params["jaxpr"]
    return jaxpr

"""Partition rules of control flow: calls (interpreted inline), the user's derivative rules
(custom_jvp / custom_vjp: primal and rule both interpreted on shards), scan and while loops
(carries keep one layout across iterations), conditionals (branches on shards, one output
layout), and the ops that always run replicated."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from xtrain.lowering.collectives import vma
from xtrain.lowering import sharded as C
from xtrain.lowering.explicit.interpreter import interpret
from xtrain.lowering.explicit.rules.attention import context_attention
from xtrain.lowering.explicit.layer_scan import scan_with_stable_carry
from xtrain.lowering.sharded import Layout
from xtrain.lowering.explicit.registry import call_rule_for, fallback, register, replicated, same_vma, wrap
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Sharded


def call(ctx: Context, eqn, args):
    """jit / closed_call: interpret the callee with the operands' layouts, unless a rule
    partitions calls of that name as a whole (registry.register_call)."""
    named = call_rule_for(str(eqn.params.get("name", "")))
    if named is not None:
        return named(ctx, eqn, args)
    closed = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    if isinstance(closed, jcore.ClosedJaxpr):
        return interpret(ctx, closed.jaxpr, closed.consts, args, inline=True)
    return interpret(ctx, closed, [], args, inline=True)


def _trace_jvp(eqn, jvp_fun, n: int):
    """The custom JVP rule's jaxpr, traced in the mesh context the model was traced in (the
    operands' abstract mesh, Auto axes). Traced under shard_map's Manual mesh instead, JAX
    reshards every use of a primal to that mesh, which this interpreter reads as a gather."""
    from jax._src import mesh as mesh_lib

    meshes = {getattr(getattr(v.aval, "sharding", None), "mesh", None) for v in eqn.invars}
    mesh = meshes.pop() if len(meshes) == 1 else None
    if not isinstance(mesh, mesh_lib.AbstractMesh):
        mesh = mesh_lib.empty_abstract_mesh
    with mesh_lib.use_abstract_mesh(mesh):
        return jvp_fun.call_wrapped(*[False] * n)


def custom_jvp(ctx: Context, eqn, args):
    """Keeps the user's derivative rule: the primal and its JVP are both interpreted."""
    call_jaxpr, jvp_fun = eqn.params["call_jaxpr"], eqn.params["jvp_jaxpr_fun"]
    consts, prims = args[: eqn.params["num_consts"]], args[eqn.params["num_consts"]:]
    path = ctx.path
    with_values = lambda xs, vals: [dataclasses.replace(x, value=v) for x, v in zip(xs, vals)]

    def primal(*vals):
        with ctx.cursor.at(path):
            return interpret(ctx, call_jaxpr.jaxpr, call_jaxpr.consts, consts + with_values(prims, vals))

    layouts: list = []  # output layouts, fixed by whichever of f / f_jvp is traced first

    @jax.custom_jvp
    def f(*vals):
        outs = primal(*vals)
        layouts[:] = [o.layout for o in outs]
        return [o.value for o in outs]

    @f.defjvp
    def f_jvp(primals, tangents):
        jaxpr, jconsts, out_zeros = _trace_jvp(eqn, jvp_fun, len(prims))
        with ctx.cursor.at(path):
            # remat='selective' tags nothing inside the rule: its tangents are linear, and a tag
            # (checkpoint_name) on them has no transpose; the rule's outputs are tagged outside
            outs = interpret(ctx.in_derivative_rule(), jaxpr, jconsts,
                             with_values(prims, primals) + with_values(prims, tangents))
            n = len(out_zeros)
            want = layouts or [o.layout for o in outs[:n]]
            p_out = [C.relayout(ctx, o, l) for o, l in zip(outs[:n], want)]
            t_out = [C.relayout(ctx, o, l) for o, l in zip(outs[n:], want)]
        layouts[:] = want
        return [o.value for o in p_out], [o.value for o in t_out]

    values = f(*[p.value for p in prims])
    return wrap(eqn, values, layouts)


def _instantiate(cts, avals):
    """bwd rules may return None / symbolic zeros for inputs without a cotangent."""
    out = []
    for ct, aval in zip(cts, avals):
        if ct is None or type(ct).__name__ in ("Zero", "SymbolicZero"):
            ct = jnp.zeros(aval.shape, aval.dtype)
        out.append(ct)
    return out


def _cotangent_for(ctx, ct: Sharded, primal: Sharded):
    """A cotangent in the primal's layout and type. A pending sum over an axis the primal
    varies on stays pending: each device's addend is its own contribution, which autodiff
    (or xtrain's gradient sync) sums later; summing it here would count it n times."""
    # (an axis the primal is split on is summed: a shard's cotangent is a slice of the sum)
    keep = vma(primal.value) - set(primal.layout.split_axes())
    # a shard of the cotangent of a primal whole over the shard's axes (a replicated value sliced
    # inside) is this device's addend of it: zeros elsewhere, pending; gathered, it would be
    # counted once per device
    for dim, axes in enumerate(ct.layout.dims):
        if axes and set(axes) <= keep and not primal.layout.dims[dim]:
            ct = C.unsplit_to_partial(ctx, ct, dim)
    # the rest summed: by a reduce-scatter where the primal is split over the pending axes (a
    # ZeRO-3 weight's gradient in an FP8 matmul's backward), else an all-reduce
    target = primal.layout.with_partial(tuple(a for a in ct.layout.partial if a in keep))
    wire = _gradient_wire(ctx, ct, primal)
    if wire is None:
        ct = C.relayout(ctx, ct, target)
    else:  # a ZeRO-3 weight's gradient crosses the wire in the policy's dtype, as the others do
        narrow = C.relayout(ctx, dataclasses.replace(ct, value=ct.value.astype(wire), dtype=jnp.dtype(wire)), target)
        ct = dataclasses.replace(narrow, value=narrow.value.astype(ct.dtype), dtype=ct.dtype)
    return same_vma(ctx, [ct.value, primal.value])[0]


def _gradient_wire(ctx, ct: Sharded, primal: Sharded):
    """The dtype a ZeRO-3 parameter's pending gradient sum is reduced in: GradSync's
    float comm_dtype where narrower than the gradient's, else None (as computed)."""
    wire = getattr(ctx.sync, "comm_dtype", None)
    if not primal.zero or not set(ct.layout.partial) & set(primal.zero) or wire not in ("bfloat16", "float16"):
        return None
    return wire if jnp.dtype(wire).itemsize < jnp.dtype(ct.dtype).itemsize else None


def _zeros_for(ct, aval):
    """A cotangent JAX passed as a symbolic zero, as an array of the local shape."""
    if type(ct).__name__ in ("SymbolicZero", "Zero"):
        return jnp.zeros(ct.aval.shape, ct.aval.dtype)
    return ct


def custom_vjp(ctx, eqn, args):
    """Keeps the user's VJP: primal, fwd and bwd are all interpreted on shards. Outputs and
    cotangents cross the boundary whole along pending sums (partial sums are resolved). fwd
    is traced knowing which inputs autodiff perturbs (a torch Function's needs_input_grad)."""
    ring = context_attention(ctx, eqn, args)
    if ring is not None:
        return ring
    p = eqn.params
    call, n_consts = p["call_jaxpr"], p["num_consts"]
    if n_consts:
        return fallback(ctx, eqn, args)
    prims, path = args, ctx.path
    layouts: dict = {}  # "out": the outputs' layouts, "res": the residuals (Sharded) as fwd left them

    @jax.custom_vjp
    def f(*vals):
        with ctx.cursor.at(path):
            outs = _resolved(ctx, interpret(ctx, call.jaxpr, call.consts, _with_values(prims, vals)))
        layouts.setdefault("out", [o.layout for o in outs])
        return [o.value for o in outs]

    def f_fwd(*primals):
        with ctx.cursor.at(path):
            return _vjp_fwd(ctx, p, prims, primals, layouts)

    def f_bwd(res, cts):
        with ctx.cursor.at(path):
            return _vjp_bwd(ctx, eqn, prims, res, cts, layouts)

    f.defvjp(f_fwd, f_bwd, symbolic_zeros=True)
    values = f(*[x.value for x in prims])
    return wrap(eqn, values, layouts["out"])


def _with_values(xs: list[Sharded], vals) -> list[Sharded]:
    return [dataclasses.replace(x, value=v) for x, v in zip(xs, vals)]


def _resolved(ctx: Context, outs: list[Sharded]) -> list[Sharded]:
    return [C.resolve(ctx, o) for o in outs]


def _vjp_fwd(ctx: Context, p, prims: list[Sharded], primals, layouts: dict):
    """custom_vjp's fwd on shards: (primal outputs, residuals) as values, their layouts kept in
    `layouts`."""
    vals = [x.value for x in primals]
    fwd_jaxpr, fwd_consts = p["fwd_jaxpr_thunk"].call_wrapped(*[x.perturbed for x in primals])
    # fwd returns [residuals not forwarded from inputs..., primal outputs...]; `forwards[i]` is
    # the input index residual i is forwarded from, or None (as JAX's own JVP rule reads it)
    _, res_tree, forwards = p["out_trees"]()
    n_res = sum(f is None for f in forwards)
    ins = _with_values(prims, vals)
    outs = interpret(ctx, fwd_jaxpr, fwd_consts, ins)
    primal = _resolved(ctx, outs[n_res:])
    want = layouts.setdefault("out", [o.layout for o in primal])
    primal = [C.relayout(ctx, o, l) for o, l in zip(primal, want)]
    own = iter(outs[:n_res])
    res = [next(own) if f is None else ins[f] for f in forwards]
    layouts["res"] = res
    return [o.value for o in primal], [r.value for r in res]


def _vjp_bwd(ctx: Context, eqn, prims: list[Sharded], res, cts, layouts: dict):
    """custom_vjp's bwd on shards: each input's cotangent in its primal's layout and type."""
    out_avals = [v.aval for v in eqn.outvars]
    prim_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in prims]
    cts = [_zeros_for(c, a) for c, a in zip(cts, out_avals)]
    res_structs = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in layouts["res"]]
    bwd = jax.make_jaxpr(lambda *a: _instantiate(eqn.params["bwd"].call_wrapped(*a), prim_avals))(
        *res_structs, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals])
    ins = ([dataclasses.replace(r, value=v) for r, v in zip(layouts["res"], res)]
           + [Sharded(v, l, tuple(a.shape), a.dtype) for v, l, a in zip(cts, layouts["out"], out_avals)])
    outs = interpret(ctx, bwd.jaxpr, bwd.consts, ins)
    return tuple(_cotangent_for(ctx, o, x) for o, x in zip(outs, prims))


def scan_rule(ctx: Context, eqn, args):
    """A scan of the traced graph: the scanned axis whole, carries at their initial layout."""
    p = eqn.params
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    consts, init, xs = args[:n_consts], args[n_consts:n_consts + n_carry], args[n_consts + n_carry:]
    init = C.resolve_all(ctx, init)  # carries hold whole values
    xs = [C.gather_dim(ctx, C.resolve(ctx, x), 0) for x in xs]
    body_jaxpr = p["jaxpr"]
    y_layouts: list = []
    path = ctx.path

    def body(carry, x_vals):
        ins = (consts + [dataclasses.replace(c, value=v) for c, v in zip(init, carry)]
               + [Sharded(v, Layout(x.layout.dims[1:]), x.shape[1:], x.dtype) for x, v in zip(xs, x_vals)])
        with ctx.cursor.at(path):
            outs = interpret(ctx, body_jaxpr.jaxpr, body_jaxpr.consts, ins)
            new = [C.relayout(ctx, o, c.layout) for o, c in zip(outs[:n_carry], init)]
        y_layouts[:] = [o.layout for o in outs[n_carry:]]
        return [o.value for o in new], [o.value for o in outs[n_carry:]]

    final, ys = scan_with_stable_carry(body, [c.value for c in init], [x.value for x in xs],
                                       length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    out_avals = [v.aval for v in eqn.outvars]
    carries = [dataclasses.replace(c, value=v) for c, v in zip(init, final)]
    stacked = [Sharded(v, Layout(((),) + l.dims, l.partial), tuple(a.shape), a.dtype)
               for v, l, a in zip(ys, y_layouts, out_avals[n_carry:])]
    return carries + stacked


def while_rule(ctx: Context, eqn, args):
    """A while loop: the predicate computed replicated, carries at their initial layout."""
    p = eqn.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    c_consts, b_consts = args[:p["cond_nconsts"]], args[p["cond_nconsts"]:p["cond_nconsts"] + p["body_nconsts"]]
    init = C.resolve_all(ctx, args[p["cond_nconsts"] + p["body_nconsts"]:])  # carries hold whole values
    path = ctx.path

    def as_sharded(vals):
        return [dataclasses.replace(c, value=v) for c, v in zip(init, vals)]

    def cond_fn(vals):
        with ctx.cursor.at(path):
            (pred,) = interpret(ctx, cond.jaxpr, cond.consts, c_consts + as_sharded(vals))
            return C.replicate(ctx, pred).value

    def body_fn(vals):
        with ctx.cursor.at(path):
            outs = interpret(ctx, body.jaxpr, body.consts, b_consts + as_sharded(vals))
            return [C.relayout(ctx, o, c.layout).value for o, c in zip(outs, init)]

    final = lax.while_loop(cond_fn, body_fn, [c.value for c in init])
    return as_sharded(final)


def cond_rule(ctx: Context, eqn, args):
    """lax.cond / lax.switch / torch.cond: the branch index computed replicated; each branch
    interpreted on the operands' shards, its outputs moved to the layouts of the branch traced
    first (so every branch returns one layout; JAX joins what the outputs vary over)."""
    index, ops = C.replicate(ctx, args[0]), args[1:]
    path, want = ctx.path, []

    def branch(closed):
        def run(*vals):
            with ctx.cursor.at(path):
                outs = interpret(ctx, closed.jaxpr, closed.consts, _with_values(ops, vals))
                if not want:
                    want.extend(o.layout for o in outs)
                return [C.relayout(ctx, o, l).value for o, l in zip(outs, want)]
        return run

    outs = lax.switch(index.value, [branch(b) for b in eqn.params["branches"]], *[o.value for o in ops])
    return wrap(eqn, outs, want)


register(call, "pjit", "jit", "closed_call", "core_call", "remat", "checkpoint")
register(custom_jvp, "custom_jvp_call")
register(custom_vjp, "custom_vjp_call")
register(scan_rule, "scan")
register(while_rule, "while")
register(cond_rule, "cond")
register(replicated, "iota", "random_seed", "random_bits", "random_split", "random_fold_in", "random_wrap",
         "random_unwrap", "threefry2x32", "rng_bit_generator")

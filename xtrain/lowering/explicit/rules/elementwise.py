"""Partition rules of elementwise primitives: operands aligned to one layout, pending partial
sums kept where the op is linear in them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from xtrain.lowering import sharded as C
from xtrain.lowering.sharded import Layout
from xtrain.lowering.explicit.registry import bind, out_avals, register, wrap
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Sharded


LINEAR_UNARY = {"neg", "copy", "copy_p", "reduce_precision", "real", "imag", "conj", "stop_gradient"}


ADDITIVE = {"add", "sub", "add_any"}


def _target_dims(args, out_shape: tuple) -> tuple:
    """Each output dim takes the split of the most split operand that has that dim at full
    size; size-1 (broadcasting) dims stay whole."""
    ranked = sorted((a for a in args if a.ndim), key=lambda a: -len(a.layout.split_axes()))
    dims, used = [], set()
    for d, size in enumerate(out_shape):
        split = next((a.layout.dims[d] for a in ranked if a.shape[d] == size and a.layout.dims[d]
                      and not set(a.layout.dims[d]) & used), ())
        used.update(split)
        dims.append(split)
    return tuple(dims)


def _align(ctx: Context, args, out_shape: tuple, keep: tuple | None = None,
           addends: bool = False) -> tuple[list[Sharded], tuple]:
    """Brings operands to one dims layout (`_target_dims`). Pending sums are kept if in
    `keep` (default: all) and the result is not split over their axis (an addend's slice is
    not a slice's addend); the others are resolved, by reduce-scatter where the result splits
    a dim over them. `addends`: every operand becomes addends over `keep` (a whole one all on
    device 0), for a sum that stays pending."""
    dims = _target_dims(args, out_shape)
    split = {a for d in dims for a in d}
    out = []
    for a in args:
        want = tuple(dims[d] if a.shape[d] == out_shape[d] else () for d in range(a.ndim))
        partial = tuple(p for p in a.layout.partial if p not in split and (keep is None or p in keep))
        partial = tuple(keep) if addends else partial
        out.append(C.relayout(ctx, a, Layout(want, partial)))
    return out, tuple(dims)


def _partial_after(prim: str, args) -> tuple | None:
    """The partial axes an elementwise op can keep, or None when all must be resolved."""
    partials = [a.layout.partial for a in args]
    if not any(partials):
        return ()
    if prim in LINEAR_UNARY or (prim == "convert_element_type" and args[0].dtype.kind == "f"):
        return partials[0]
    if (prim in ADDITIVE or prim == "complex") and len(set(partials)) == 1:
        return partials[0]
    if prim in ADDITIVE and _bias(args):
        return next(p for p in partials if p)
    if prim == "mul" and sum(bool(p) for p in partials) == 1:
        return next(p for p in partials if p)
    if prim == "div" and partials[0] and not partials[1]:
        return partials[0]
    return None


def _bias(args) -> bool:
    """A pending sum plus broadcast operands (a bias added to a row-parallel matmul's output):
    the sum stays pending, each broadcast operand added on one device (keeping the sum pending
    lets a sequence split reduce-scatter it); where the sum is reduced, the bias is added after
    the reduction instead, as Megatron does (`_defer`)."""
    partials = {a.layout.partial for a in args if a.layout.partial}
    full = max((a.shape for a in args), key=lambda shape: (len(shape), np.prod(shape)))
    return len(partials) == 1 and all(a.shape == full for a in args if a.layout.partial) and all(
        a.ndim < len(full) or any(s == 1 < f for s, f in zip(a.shape, full)) for a in args if not a.layout.partial)


def _known_zeros(x) -> bool:
    """Whether traced `x` is zeros the program built from a constant (jnp.zeros: a broadcast of
    a literal 0), read from JAX's tracing state (DynamicJaxprTracer.parent, get_const); False
    where that is not available."""
    for _ in range(4):
        if not isinstance(x, jax.core.Tracer):
            return np.size(x) > 0 and not np.any(x)
        eqn = getattr(x, "parent", None)
        if eqn is None:
            value = getattr(x, "get_const", lambda: None)()
            return value is not None and np.size(value) > 0 and not np.any(value)
        if eqn.primitive not in (lax.broadcast_in_dim_p, lax.convert_element_type_p, lax.reshape_p):
            return False
        x = eqn.in_tracers[0]
    return False


def _plus_zeros(eqn, args) -> Sharded | None:
    """A pending sum plus zeros (a running total that starts as torch.zeros, as HF's MoE
    load-balancing loss keeps one per layer): the sum itself, still pending. Resolving it first
    would all-reduce each addend of the total, which XLA reassociates into one all-reduce."""
    if str(eqn.primitive) not in SUMS or len(args) != 2:
        return None
    out = out_avals(eqn)[0]
    for a, b in (args, args[::-1]):
        if a.layout.partial and not b.layout.partial and a.shape == tuple(out.shape) and a.dtype == out.dtype \
                and _known_zeros(b.value):
            return a
    return None


def elementwise(ctx: Context, eqn, args):
    """Same-shape ops (scalars broadcast): align layouts; keep partial sums where linear (unless
    already summed for another reader)."""
    args = [C.resolved_before(ctx, a) for a in args]
    kept = _plus_zeros(eqn, args)
    if kept is not None:
        return [kept]
    keep = _partial_after(str(eqn.primitive), args)
    out_shape = tuple(out_avals(eqn)[0].shape)
    if keep is None or set(keep) & {a for d in _target_dims(args, out_shape) for a in d}:
        keep = ()
    addends = bool(keep) and str(eqn.primitive) in ADDITIVE and _bias(args)
    plain = _align(ctx, args, out_shape, keep)[0] if keep and str(eqn.primitive) in SUMS else None
    args, dims = _align(ctx, args, out_shape, keep, addends)
    outs = bind(ctx, eqn, [a.value for a in args])
    if plain is not None:
        _defer(ctx, outs[0], plain, keep)
    elif keep:
        _carry(ctx, eqn, outs[0], args)
    out = wrap(eqn, outs, [Layout(dims if a.shape else (), keep) for a in out_avals(eqn)])
    if len(args) == 1 and args[0].zero and str(eqn.primitive) in _CASTS and out[0].layout == args[0].layout:
        # a cast of a ZeRO-3 shard (bf16 compute's weight cast) is still that shard: gathered
        # where it is used, in the narrower dtype, and its gradient reduce-scattered back
        out[0].zero = args[0].zero
    return out


_CASTS = {"convert_element_type", "copy", "copy_p"}
SUMS = {"add", "add_any"}


def _carry(ctx: Context, eqn, out, args) -> None:
    """Deferred biases through an op linear in the pending sum (a scale, a cast, dropout's
    mask): the op applied to the plain sum and to each bias."""
    prim = str(eqn.primitive)
    held = [i for i, a in enumerate(args) if a.layout.partial]
    deferred = C.deferred_biases(ctx, args[held[0]]) if len(held) == 1 else None
    if deferred is None:
        return
    if prim in ("mul", "div") and len(args) == 2 and (prim == "mul" or held[0] == 0):
        other = args[1 - held[0]].value
        apply = (lambda v: v * other) if prim == "mul" else (lambda v: v / other)
    elif len(args) == 1 and (prim in LINEAR_UNARY or prim == "convert_element_type"):
        apply = lambda v: bind(ctx, eqn, [v])[0]
    else:
        return
    plain, biases = deferred
    C.defer_biases(ctx, out, apply(plain), [apply(b) for b in biases])


def _defer(ctx: Context, out, args, keep: tuple) -> None:
    """A pending sum plus whole biases (or pending sums that carry some): the biases are added
    after the reduction (C.defer_biases), the pending parts summed before it."""
    parts, biases = [], []
    for a in args:
        deferred = C.deferred_biases(ctx, a) if a.layout.partial else None
        if deferred is not None:
            parts.append(deferred[0])
            biases += deferred[1]
        elif a.layout.partial == keep:
            parts.append(a.value)
        else:
            biases.append(a.value)
    if biases and parts:
        C.defer_biases(ctx, out, sum(parts[1:], parts[0]), biases)


def pow_(ctx: Context, eqn, args):
    """x ** c with a literal whole exponent (RMSNorm's x.pow(2)) as integer_pow, which XLA
    emits as multiplies. As an operand the exponent is typed varying like x (a pcast), and in
    a layer scan JAX hoists that loop-invariant cast out of the loop: XLA then sees a pow by
    an unknown value and runs the generic exp/log form."""
    exponent = eqn.invars[1]
    if (isinstance(exponent, jcore.Literal) and np.ndim(exponent.val) == 0
            and jnp.issubdtype(args[0].dtype, jnp.floating)
            and float(exponent.val).is_integer() and abs(float(exponent.val)) <= 16):
        x = C.resolve(ctx, args[0])
        return [Sharded(lax.integer_pow(x.value, int(exponent.val)), x.layout, x.shape, x.dtype)]
    return elementwise(ctx, eqn, args)


register(pow_, "pow")
register(elementwise, "add", "sub", "mul", "div", "max", "min", "integer_pow", "neg", "exp", "exp2",
         "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "sqrt", "rsqrt", "cbrt", "abs",
         "sign", "floor", "ceil", "round", "is_finite", "erf", "erfc", "erf_inv", "lgamma", "digamma",
         "square", "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
         "rem", "atan2", "nextafter", "convert_element_type", "copy", "copy_p", "stop_gradient",
         "add_any", "reduce_precision", "shift_left", "shift_right_logical", "shift_right_arithmetic",
         "population_count", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
         "eq_to", "lt_to", "le_to",  # the total-order comparisons (sorts, histograms)
         "complex", "real", "imag", "conj",  # complex arithmetic (complex rotary embeddings, FFT mixers)
         "clz", "mulhi",  # integer bit tricks (hashing)
         "bessel_i0e", "bessel_i1e", "igamma", "igammac", "igamma_grad_a", "polygamma", "zeta",
         "regularized_incomplete_beta")  # special functions (distributions' log-densities)

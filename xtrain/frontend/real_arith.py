"""Complex arithmetic rewritten into real (re, im) pairs.

Meta's reference Llama and several training repositories rotate queries and keys with complex
numbers (`torch.view_as_complex`, a complex multiply, `torch.view_as_real`). Traced as is, the
program holds complex values: Neuron's compiler rejects complex dtypes (the conformance check
says so), and each complex primitive would need partition rules of its own. Rotary embeddings
need only a few complex operations, all exact in real arithmetic: `Realifier.apply` traces the
model's function once per input signature and, when the jaxpr holds complex values, evaluates
it again with every complex value as a `Pair` of real arrays (`_RULES`). Operations without a
pair rule (an FFT) get their complex operands rebuilt and their complex results split again, so
they stay in the program, and only they. Complex constants become pairs of real constants;
complex buffers enter and leave the model as real arrays with a trailing (re, im) dimension
(`to_real` / `to_complex`, used by the torch front end).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from xtrain.ir import walk


@dataclasses.dataclass(frozen=True)
class Pair:
    """A complex value as its real and imaginary parts (real arrays of one shape)."""

    re: Any
    im: Any


def is_complex(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.complexfloating)


def to_real(x: Pair):
    """A complex value as one real array with a trailing (re, im) dimension of 2 (a concatenate,
    which every lowering partitions, rather than a stack)."""
    last = x.re.ndim
    return lax.concatenate([lax.expand_dims(x.re, (last,)), lax.expand_dims(x.im, (last,))], last)


def to_complex(x):
    """The inverse of `to_real`."""
    return lax.complex(x[..., 0], x[..., 1])


def _pair(x) -> Pair:
    return x if isinstance(x, Pair) else Pair(x, jnp.zeros_like(x))


def _both(fn: Callable, *operands):
    """fn applied to the real parts and to the imaginary parts (operands other than pairs, such as
    indices and predicates, go to both as they are)."""
    pick = lambda part: [getattr(o, part) if isinstance(o, Pair) else o for o in operands]
    return Pair(fn(*pick("re")), fn(*pick("im")))


def _mul(a, b):
    if not isinstance(b, Pair):
        return Pair(a.re * b, a.im * b)
    if not isinstance(a, Pair):
        return Pair(a * b.re, a * b.im)
    return Pair(a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re)


def _div(a, b):
    if not isinstance(b, Pair):
        return _both(lambda x: x / b, a)
    scale = b.re * b.re + b.im * b.im
    num = _mul(a, Pair(b.re, -b.im))
    return Pair(num.re / scale, num.im / scale)


def _dot(eqn):
    def dot(a, b):
        prod = lambda x, y: walk.bind_eqn(eqn, [x, y], {**eqn.params, "preferred_element_type": None})[0]
        if not isinstance(b, Pair):
            return Pair(prod(a.re, b), prod(a.im, b))
        if not isinstance(a, Pair):
            return Pair(prod(a, b.re), prod(a, b.im))
        return Pair(prod(a.re, b.re) - prod(a.im, b.im), prod(a.re, b.im) + prod(a.im, b.re))
    return dot


def _convert(eqn):
    def convert(x):
        new = eqn.params["new_dtype"]
        if not is_complex(new):  # complex -> real keeps the real part, as JAX does
            return lax.convert_element_type(x.re if isinstance(x, Pair) else x, new)
        part = jnp.finfo(new).dtype
        return _both(lambda v: lax.convert_element_type(v, part), _pair(x))
    return convert


def _exp(z):
    mag = jnp.exp(z.re)
    return Pair(mag * jnp.cos(z.im), mag * jnp.sin(z.im))


# Ops that act on real and imaginary parts alike (structural ops, sums): the same equation on each.
_PARTWISE = frozenset({"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice",
                       "dynamic_slice", "dynamic_update_slice", "rev", "copy", "copy_p", "reduce_sum",
                       "concatenate", "select_n", "gather", "pad", "add", "sub", "neg", "cumsum",
                       "optimization_barrier"})

# primitive name -> (equation -> rule over the operand values); each rule returns one value
_RULES: dict[str, Callable] = {
    "complex": lambda eqn: Pair,
    "real": lambda eqn: lambda z: z.re,
    "imag": lambda eqn: lambda z: z.im,
    "conj": lambda eqn: lambda z: Pair(_pair(z).re, -_pair(z).im),
    "mul": lambda eqn: _mul,
    "div": lambda eqn: _div,
    "dot_general": _dot,
    "convert_element_type": _convert,
    "abs": lambda eqn: lambda z: jnp.sqrt(z.re * z.re + z.im * z.im),
    "exp": lambda eqn: _exp,
}


def _partwise(eqn):
    # a jaxpr gives an op's data operands one dtype: all complex (pairs) here; the others are
    # indices or predicates
    return lambda *values: _both(lambda *vs: walk.bind_eqn(eqn, list(vs))[0], *values)


def _materialized(value):
    return lax.complex(value.re, value.im) if isinstance(value, Pair) else value


def _opaque(eqn, values: list) -> list:
    """An op without a pair rule: complex operands rebuilt, complex results split again."""
    outs = walk.bind_eqn(eqn, [_materialized(v) for v in values])
    return [Pair(lax.real(o), lax.imag(o)) if is_complex(o.dtype) else o for o in outs]


def _has_complex(jaxpr) -> bool:
    avals = [v.aval for v in [*jaxpr.constvars, *jaxpr.invars, *jaxpr.outvars] if hasattr(v, "aval")]
    avals += [v.aval for eqn in jaxpr.eqns for v in [*eqn.invars, *eqn.outvars]]
    if any(is_complex(getattr(a, "dtype", np.float32)) for a in avals):
        return True
    return any(_has_complex(sub) for eqn in jaxpr.eqns for sub in jcore.jaxprs_in_params(eqn.params))


def _bind(eqn, values: list, _path: str = "") -> list:
    touches = any(isinstance(v, Pair) for v in values) or any(is_complex(v.aval.dtype) for v in eqn.outvars)
    if eqn.primitive.name in walk.CALLS and _has_complex(walk.call_body(eqn)[0]):
        body, consts = walk.call_body(eqn)
        return _evaluate(body, consts, values)
    if not touches:
        return walk.bind_eqn(eqn, values)
    name = eqn.primitive.name
    if name in _RULES:
        return [_RULES[name](eqn)(*values)]
    if name in _PARTWISE and not eqn.primitive.multiple_results:
        return [_partwise(eqn)(*values)]
    return _opaque(eqn, values)


def _split_constant(value):
    if is_complex(getattr(value, "dtype", np.float32)):
        return Pair(np.real(value), np.imag(value)) if isinstance(value, np.ndarray) else Pair(lax.real(value),
                                                                                            lax.imag(value))
    return value


def _evaluate(jaxpr, consts, args) -> list:
    literal = lambda var: _split_constant(np.asarray(var.val)) if is_complex(var.aval.dtype) else var.val
    return walk.evaluate(jaxpr, [_split_constant(c) for c in consts], [_split_constant(a) for a in args], _bind,
                         literal=literal)


def _signature(leaves, tree, extra) -> tuple:
    return (tree, extra, tuple((isinstance(x, jax.core.Tracer), tuple(getattr(x, "shape", ())),
                                str(getattr(x, "dtype", type(x).__name__))) for x in leaves))


class Realifier:
    """Per model: the input signatures whose trace holds no complex value (traced directly after
    their first probe)."""

    def __init__(self):
        self.real: set[tuple] = set()

    def apply(self, fn: Callable, args: tuple, extra=()):
        """fn(*args) with complex values computed as real pairs (see the module docstring);
        complex outputs come back as `to_real` arrays."""
        leaves, tree = jax.tree.flatten(args)
        signature = _signature(leaves, tree, extra)
        dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.core.Tracer)]
        if signature in self.real or not dynamic:
            return fn(*args)

        probe = walk.over_dynamic(fn, leaves, tree, dynamic)

        dynamic_values = [leaves[i] for i in dynamic]
        closed, out_shape = jax.make_jaxpr(probe, return_shape=True)(*dynamic_values)
        if not _has_complex(closed.jaxpr):
            self.real.add(signature)
            outs = walk.evaluate(closed.jaxpr, closed.consts, dynamic_values,
                                 lambda eqn, values, _path: walk.bind_eqn(eqn, values))
        else:
            outs = [to_real(o) if isinstance(o, Pair) else o
                    for o in _evaluate(closed.jaxpr, closed.consts, dynamic_values)]
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

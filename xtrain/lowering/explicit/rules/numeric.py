"""Partition rules of value-level primitives that are neither elementwise in shape nor
reductions: bit casts, Fourier transforms, optimization barriers, XLA's stateful RNG."""
from __future__ import annotations

import numpy as np

from xtrain.lowering import sharded as C
from xtrain.lowering.context import Context
from xtrain.lowering.explicit.registry import bind, out_avals, register, replicated, whole_dims_where, wrap
from xtrain.lowering.sharded import Layout


def bitcast_convert_type(ctx: Context, eqn, args):
    """Reinterprets the bits. Same width: elementwise, every split kept. A narrower type adds a
    trailing dim (the bytes of one element), a wider one consumes it: that dim whole."""
    x = C.resolve(ctx, args[0])
    (aval,) = out_avals(eqn)
    if len(aval.shape) < x.ndim:  # wider: the last input dim is eaten
        x = C.gather_dim(ctx, x, x.ndim - 1)
        dims = x.layout.dims[:-1]
    else:
        dims = x.layout.dims + ((),) * (len(aval.shape) - x.ndim)
    return wrap(eqn, bind(ctx, eqn, [x.value]), [Layout(dims)])


def fft(ctx: Context, eqn, args):
    """FFTs over the trailing len(fft_lengths) dims (FNet's token mixing): those whole, the
    leading dims (batch, or the hidden dim of a sequence FFT) keep their split. Linear: a
    pending sum stays pending."""
    x = args[0]
    first = x.ndim - len(eqn.params["fft_lengths"])
    x = whole_dims_where(ctx, x, lambda d: d >= first)
    return wrap(eqn, bind(ctx, eqn, [x.value]), [x.layout])


def optimization_barrier(ctx: Context, eqn, args):
    """Keeps XLA from moving computation across it: the values pass with their layouts."""
    return wrap(eqn, bind(ctx, eqn, [a.value for a in args]), [a.layout for a in args])


def rng_uniform(ctx: Context, eqn, args):
    """XLA's stateful RNG (lax.rng_uniform): scalar bounds and a static shape, so nothing is
    gathered to run it replicated. jax.random never emits it (it uses threefry or
    rng_bit_generator); its values are backend-defined and not reproducible, so no layout of it
    could match a single-device run anyway."""
    assert all(np.ndim(a.value) == 0 for a in args)
    return replicated(ctx, eqn, args)


register(bitcast_convert_type, "bitcast_convert_type")
register(fft, "fft")
register(optimization_barrier, "optimization_barrier")
register(rng_uniform, "rng_uniform")

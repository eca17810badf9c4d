"""An activation times a 2-D weight, with the weight's gradient computed in the orientation
the backend runs fastest.

XLA:CPU runs the weight-gradient product (tokens contracted: g^T x) on its Eigen path, whose
speed depends on the output's orientation: a weight of more rows than columns (an MLP's up
projection, a GPT-2 Conv1D's down projection) is computed 1.3-2x faster as the (columns, rows)
product, then transposed (the transpose is a copy of the weight's size, not of the tokens').
The optimization barrier keeps XLA's simplifier from folding the transpose back into the dot.
Only the CPU program takes that form (`lax.platform_dependent`): GPU and Neuron get the plain
product, whose orientation their own dot emitters choose.
"""
from __future__ import annotations

import jax
from jax import lax


def _product(a, b, contract: tuple[int, int], params: dict):
    """a . b contracting dim contract[0] of a with contract[1] of b, in a's dtype."""
    out = lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=params.get("precision"),
                          preferred_element_type=params.get("preferred_element_type"))
    return out.astype(a.dtype)


def _weight_grad(x, g, rc: int, params: dict, wide: bool):
    """The gradient of weight w (x contracted with w's dim `rc`; g the output's cotangent):
    (out, in) = g^T x when rc == 1, (in, out) = x^T g when rc == 0. `wide`: computed as its
    transpose first when it has more rows than columns."""
    first, second = (g, x) if rc == 1 else (x, g)
    if wide and first.shape[1] > second.shape[1]:
        return lax.optimization_barrier(_product(second, first, (0, 0), params)).T
    return _product(first, second, (0, 0), params)


def linear(x, w, rc: int, params: dict, forward):
    """`forward(x, w)` (x: (tokens, in), w 2-D contracted on its dim `rc`) with a derivative
    whose weight gradient takes the CPU's faster orientation (module docstring)."""

    @jax.custom_vjp
    def product(x, w):
        return forward(x, w)

    def fwd(x, w):
        return forward(x, w), (x, w)

    def bwd(residual, g):
        x, w = residual
        dx = _product(g, w, (1, 1 - rc), params).astype(x.dtype)
        dw = lax.platform_dependent(x, g, cpu=lambda x, g: _weight_grad(x, g, rc, params, True),
                                    default=lambda x, g: _weight_grad(x, g, rc, params, False))
        return dx, dw.astype(w.dtype)

    product.defvjp(fwd, bwd)
    return product(x, w)

"""Which jaxpr variables are parameters, and which parameter dimension each of their dimensions is.

A torch weight reaches its matmul through views: a transpose (F.linear), a dtype cast, a call
boundary (pjit, custom_jvp). `View` follows those, so the dimension-flow analysis
(xtrain.ir.analysis.dimflow) can say "this dot_general contracts dimension 1 of `layers.0.fc.weight`".
"""
from __future__ import annotations

import dataclasses

# Ops that keep a parameter a parameter: only the dtype or the dimension order changes.
SAME = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision", "optimization_barrier"})
# ... and, with a constant as the other operand (addmm's beta * bias), a scaled parameter
SCALED = frozenset({"mul", "div", "neg"})
# Elementwise functions of a parameter (Mamba's A = -exp(A_log)): split like the parameter itself
ELEMENTWISE = frozenset({"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "abs",
                         "sign", "sin", "cos", "square", "integer_pow", "erf", "softplus"})


@dataclasses.dataclass(frozen=True)
class View:
    """A variable that is parameter `name` seen through transposes and casts.

    Attributes:
        name: the canonical parameter name.
        dims: per dimension of the variable, the parameter's dimension (None: a dimension a
            broadcast added).
    """

    name: str
    dims: tuple[int | None, ...]

    def through(self, eqn) -> "View | None":
        """The view of `eqn`'s output, for an op of this view (and constants) that keeps it a
        parameter view."""
        prim = eqn.primitive.name
        if prim in SAME or prim in SCALED or prim in ELEMENTWISE:
            return self
        if prim == "squeeze":  # (a 1-D convolution's kernel made 2-D and back)
            return View(self.name, tuple(d for i, d in enumerate(self.dims) if i not in eqn.params["dimensions"]))
        if prim == "reshape" and (dims := _unit_reshape(self.dims, eqn.invars[0].aval.shape,
                                                        eqn.params["new_sizes"])) is not None:
            return View(self.name, dims)
        if prim == "transpose":
            return View(self.name, tuple(self.dims[p] for p in eqn.params["permutation"]))
        if prim == "broadcast_in_dim":  # a bias made (1, 1, out) to add to (B, T, out)
            dims: list[int | None] = [None] * len(eqn.params["shape"])
            for d, o in enumerate(eqn.params["broadcast_dimensions"]):
                dims[o] = self.dims[d]
            return View(self.name, tuple(dims))
        return None


def _unit_reshape(dims, old, new) -> tuple | None:
    """`dims` through a reshape that only adds or drops dims of size 1 (a bias made (1, C, 1)),
    else None."""
    kept = [d for d, n in zip(dims, old) if n != 1]
    if [n for n in old if n != 1] != [n for n in new if n != 1]:
        return None
    it = iter(kept)
    return tuple(next(it) if n != 1 else None for n in new)


def inputs(names: list[str], invars) -> dict:
    """{jaxpr input var: View} of the parameters, which are the first `len(names)` inputs (the
    params dict flattens first, in `names` order)."""
    return {v: View(n, tuple(range(len(v.aval.shape)))) for n, v in zip(names, invars)}

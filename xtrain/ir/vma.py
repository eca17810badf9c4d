"""The mesh axes a value varies over inside shard_map (JAX's varying-manual-axes type), read
the same way everywhere: JAX 0.10 keeps them in `aval.mat.varying`, older releases in `aval.vma`.
The kernels (a skipped block's zeros) and the lowering (collectives, branches) widen values with
`widen` so that the two sides of a conditional or a loop carry agree."""
from __future__ import annotations

import jax
from jax import lax


def of_aval(aval) -> frozenset:
    """Mesh axes an abstract value varies over."""
    mat = getattr(aval, "mat", None)
    return mat.varying if mat is not None else getattr(aval, "vma", frozenset())


def of(x) -> frozenset:
    """Mesh axes a value varies over inside shard_map (empty for constants and Python scalars)."""
    if not (isinstance(x, jax.Array) or hasattr(x, "aval")):
        return frozenset()
    return of_aval(jax.typeof(x))


def widen(x, axes: frozenset):
    """`x` cast to vary over `axes` too."""
    missing = tuple(sorted(axes - of(x)))
    return lax.pcast(x, missing, to="varying") if missing else x

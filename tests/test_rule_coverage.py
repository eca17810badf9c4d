"""Every primitive a training step can emit has a partition rule.

The set checked: every `jax.extend.core.Primitive` object that is an attribute of the installed
`jax.lax` module or of `jax.lax.linalg` (154 + 16 in JAX 0.10.2). Primitives of jax._src that
`jax.lax` does not export (the *_start/*_done async collectives, unreduced casts, composite,
platform_index, ...) are JAX-internal and are not traced from a model. A primitive with no rule
must stand in `WITHOUT_RULE` with the reason it never reaches the interpreter with a split
operand in a training step; there, a split operand raises UnsupportedOpError unless the plan
allows the replicated fallback (Plan(fallback="replicate") / fallback_modules).
"""
import pytest
from jax import lax
from jax.extend import core as jcore

from xtrain.lowering.explicit import rules  # noqa: F401  (registers the rules)
from xtrain.lowering.explicit.registry import RULES

COLLECTIVE = "a collective: xtrain emits collectives itself; the model is traced per global program, without them"
TOKEN = "an ordering token / side-effect marker of JAX's own effects, not a value a model computes"
FACTORIZATION = ("a linear-algebra factorization or solve, kept whole: no partition rule, so a split operand "
                 "raises (or replicates under Plan(fallback='replicate'))")

WITHOUT_RULE = {
    **dict.fromkeys(["all_gather", "all_to_all", "axis_index", "pmax", "pmin", "ppermute", "psum",
                     "ragged_all_to_all"], COLLECTIVE),
    **dict.fromkeys(["after_all", "create_token", "dce_sink"], TOKEN),
    **dict.fromkeys(["cholesky", "cholesky_update", "eig", "eigh", "hessenberg", "householder_product", "lu",
                     "lu_pivots_to_permutation", "ormqr", "qr", "schur", "svd", "symmetric_product",
                     "triangular_solve", "tridiagonal", "tridiagonal_solve", "custom_linear_solve"], FACTORIZATION),
    "device_put": "a placement request: xtrain places the step's values (offload, the state) around the "
                  "interpreted program; inside a model it would name the global mesh's devices",
    "stage": "JAX-internal staging marker (jax.lax.stage_p), not emitted by tracing a model",
}


def lax_primitives() -> dict[str, object]:
    """name -> Primitive of every Primitive attribute of jax.lax and jax.lax.linalg."""
    found = {}
    for module in (lax, lax.linalg):
        for name in dir(module):
            value = getattr(module, name)
            if isinstance(value, jcore.Primitive):
                found[value.name] = value
    return found


@pytest.mark.unit
def test_every_lax_primitive_has_a_rule_or_a_reason():
    prims = lax_primitives()
    assert len(prims) > 150  # the namespace was read (154 + 16 in JAX 0.10.2)
    missing = sorted(p for p in prims if p not in RULES and p not in WITHOUT_RULE)
    assert not missing, f"primitives without a partition rule or a listed reason: {missing}"


@pytest.mark.unit
def test_the_list_of_primitives_without_a_rule_is_current():
    """Each listed primitive exists and still has no rule (a rule makes its entry stale)."""
    prims = lax_primitives()
    assert sorted(p for p in WITHOUT_RULE if p not in prims) == []
    assert sorted(p for p in WITHOUT_RULE if p in RULES) == []
    assert all(reason for reason in WITHOUT_RULE.values())

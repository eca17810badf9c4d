"""ZeRO-3's backward re-gathers, one layer ahead.

ZeRO-3 gathers a layer's weight shards for its forward and, instead of keeping the gathered
weights to the backward pass, gathers them again there (`zero.RegatherPolicy`: a jax.checkpoint
policy saving every value but those gathers). Under plain `jax.checkpoint` JAX puts the layer's
recomputation behind an optimization barrier together with the layer's incoming cotangent, so
the re-gather cannot start before the backward pass reaches that layer, and the layer's first
backward GEMM then waits for it: in the compiled GPU program (deviceless H100, 4 unrolled
layers) no backward re-gather had a GEMM between its start and done.

`regathered(body, policy)` is the layer `body` (carry, xs) -> (carry, row) under that policy with
the barrier moved: the recomputation waits for the layer's saved values and for a token that
the next layer's backward pass emits as it begins. The re-gather of layer l may then run while
layer l+1's backward computes (a prefetch depth of one layer, as FSDP's backward prefetch: at
most one more layer's gathered weights alive), and it still cannot be merged with the forward's
gather (its input is the barrier's output). The token is a float scalar carried beside the
layer's carry; the last layer's has no successor, and its re-gather waits for its saved values
only (it can run during the head's backward).

Measured (deviceless H100 compile, tests/test_aot.py's ZeRO-3 family: 4 unrolled layers, with the
step's XLA options of xtrain.lowering.gpu_options): backward re-gathers with a GEMM in their window
0 of 4 -> 4 of 4, all-gather bytes overlapped 33% -> 80%, reduce-scatter bytes 24% -> 86%;
temporaries 131 -> 148 KB (one more layer's gathered weights, 12 KB each, and the in-flight pair).

The body is traced once (jax.make_jaxpr): its side effects (the interpreter's records) happen
once, as under jax.checkpoint; the custom VJP re-evaluates the traced program.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from xtrain.lowering import ordering


def token():
    """The first layer's token (a float scalar; its cotangent is dropped)."""
    return jnp.zeros((), jnp.float32)


def regathered(body, policy):
    """`body` (carry: list, xs) -> (carry: list, row) under jax.checkpoint(policy), taking and
    returning the token as its carry's last element (see the module docstring)."""
    checkpointed = jax.checkpoint(body, policy=policy, prevent_cse=False)

    def layer(carry, xs):
        *carry, tok = carry
        flat, tree = jax.tree.flatten((carry, xs))
        closed, shape = jax.make_jaxpr(lambda *v: checkpointed(*jax.tree.unflatten(tree, v)),
                                       return_shape=True)(*flat)
        out, tok = _apply(closed, flat, tok)
        new_carry, row = jax.tree.unflatten(jax.tree.structure(shape), out)
        return [*new_carry, tok], row
    return layer


def _apply(closed, flat, tok):
    def run(consts, values):
        return jax.core.eval_jaxpr(closed.jaxpr, consts, *values)

    @jax.custom_vjp
    def apply(consts, values, tok):
        return run(consts, values), tok

    def forward(consts, values, tok):
        out, pullback = jax.vjp(run, consts, values)
        return (out, tok), pullback

    def backward(pullback, cts):
        ct_out, ct_tok = cts
        # the token for the layer before: ready as this layer's backward begins (its cotangent arrives)
        arrived = [c for c in jax.tree.leaves(ct_out) if c.dtype != jax.dtypes.float0]  # integer outputs' are float0
        mine = ordering.barrier(arrived + [jnp.zeros_like(ct_tok)])[-1]
        # this layer's recomputation (the re-gather): after its saved values and the next layer's token
        saved, structure = jax.tree.flatten(pullback)
        saved = ordering.barrier(saved + [ct_tok])[:-1]
        ct_consts, ct_values = jax.tree.unflatten(structure, saved)(ct_out)
        return ct_consts, ct_values, mine

    apply.defvjp(forward, backward)
    return apply(list(closed.consts), list(flat), tok)

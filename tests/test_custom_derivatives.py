"""custom_vjp / custom_jvp functions keep their own derivative rules through the explicit
lowering, and training through them matches the same computation on one device."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import xtrain
from test_partition_rules import scaled_tanh

pytestmark = pytest.mark.e2e


def loss(params, x, y):
    h = scaled_tanh(x @ params["w1"], params["s"])   # custom_vjp
    h = jax.nn.relu(h @ params["w2"])                # custom_jvp
    return ((h @ params["w3"] - y) ** 2).mean()


def test_training_through_custom_derivatives_matches_one_device():
    rng = np.random.default_rng(1)
    params = {"w1": rng.normal(size=(6, 8)).astype(np.float32), "s": np.ones(8, np.float32),
              "w2": rng.normal(size=(8, 8)).astype(np.float32), "w3": rng.normal(size=(8, 2)).astype(np.float32)}
    batches = [(rng.normal(size=(16, 6)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32))
               for _ in range(4)]
    tx = optax.sgd(0.05, momentum=0.9)
    ref, state, ref_losses = params, tx.init(params), []
    for batch in batches:
        value, grads = jax.value_and_grad(loss)(ref, *batch)
        updates, state = tx.update(grads, state, ref)
        ref = optax.apply_updates(ref, updates)
        ref_losses.append(float(value))

    step = xtrain.compile(loss, xtrain.Mesh(data=8), params=params, optimizer=tx)
    losses = [step(*batch)["loss"] for batch in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    final = step.state_dict()
    for name in ref:
        np.testing.assert_allclose(np.asarray(final[name]), np.asarray(ref[name]), atol=1e-5)
    assert not any("no partition rule" in n for n in step.report().notes)


@jax.custom_vjp
def gate(q, k):
    return q * jnp.tanh(k)


gate.defvjp(lambda q, k: (gate(q, k), (q, k)),
            lambda res, g: (g * jnp.tanh(res[1]), g * res[0] * (1 - jnp.tanh(res[1]) ** 2)))


def learned_queries_loss(params, x, y):
    # learned queries broadcast over the batch (whole on every device, derived from a parameter)
    # meet batch-split keys inside a custom_vjp: its bwd returns the queries' cotangent split by
    # the batch, each device's own addend (gathered, it was counted once per device)
    q = jnp.broadcast_to(params["q"], (x.shape[0], params["q"].shape[0]))
    return ((gate(q, x @ params["w"]) - y) ** 2).mean()


def test_a_whole_input_of_a_custom_vjp_gets_each_devices_own_cotangent():
    rng = np.random.default_rng(2)
    params = {"q": rng.normal(size=(4,)).astype(np.float32), "w": rng.normal(size=(6, 4)).astype(np.float32)}
    x, y = rng.normal(size=(16, 6)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32)
    tx = optax.sgd(0.1)
    grads = jax.grad(learned_queries_loss)(params, x, y)
    step = xtrain.compile(learned_queries_loss, xtrain.Mesh(data=8), params=params, optimizer=tx)
    step(x, y)
    for name in params:
        np.testing.assert_allclose(np.asarray(step.state_dict()[name]), params[name] - 0.1 * np.asarray(grads[name]),
                                   atol=1e-6)

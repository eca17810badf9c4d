"""Benchmark worker: the same traced model as xtrain's (torchax) under a plain `jax.jit`, one
process on one core, no shard_map and no xtrain lowering: what XLA's CPU code generation alone
gives for this model. Beside xtrain's 1-process row it separates xtrain's lowering cost from
XLA-vs-torch kernel speed.

    python benchmarks/bench_jit.py --steps 30
"""
import bench_common

CORE = bench_common.pin_to_core()  # before jax starts its thread pools

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from xtrain.frontend.torch_module import TorchModel  # noqa: E402


def main() -> None:
    args = bench_common.parse_args()
    model = TorchModel(bench_common.build_model(args))
    buffers, key = model.initial_buffers(), jax.random.key_data(jax.random.key(0))
    tx = optax.adamw(args.lr, weight_decay=0.01)  # torch AdamW's update rule (eps, betas: defaults agree)
    params = {n: jnp.asarray(v) for n, v in model.initial_params().items()}
    opt_state = tx.init(params)

    @jax.jit
    def train(params, opt_state, x, y):
        def loss_of(p):
            return model.apply(p, buffers, key, (x, y), training=True)[0]

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = [params, opt_state]

    def step(x, y) -> float:
        state[0], state[1], loss = train(state[0], state[1], jnp.asarray(x), jnp.asarray(y))
        return float(loss)

    losses, seconds = bench_common.timed_loop(step, bench_common.batches(args), args.warmup)
    bench_common.emit("jit", losses, seconds, processes=1, core=CORE)


if __name__ == "__main__":
    main()

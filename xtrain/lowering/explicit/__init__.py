"""The explicit lowering: a re-tracing interpreter that turns the global-shape jaxpr into a
per-device program (inside `jax.shard_map`) with every collective inserted by xtrain.

    layout.py        Layout: which mesh axes split each dim, plus pending partial sums
    collectives.py   the collectives xtrain emits (and records for the report)
    interpreter.py   walks a jaxpr, applies one rule per equation, recurses into calls
    rules.py         the partition rule table: primitive -> rule
    step.py          the training step: per-device forward, autodiff, gradient sync, update
    gradient_sync.py bucketed (optionally bf16) gradient all-reduce
"""

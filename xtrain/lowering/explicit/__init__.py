"""The explicit lowering: a re-tracing interpreter that turns the global-shape jaxpr into a
per-device program (inside `jax.shard_map`) with every collective inserted by xtrain.

    interpreter.py   walks a jaxpr (xtrain.ir.walk), applies one rule per equation
    registry.py      the partition rule table: primitive -> rule, the replicated fallback
    rules/           the rules, one module per family (elementwise, shape, reductions,
                     contractions, indexing, routing, experts, control)
    blocks.py        repeated blocks (blocks.0, blocks.1, ...) found in the traced graph
    layer_scan.py    repeated blocks emitted as one scan (or one after another)
    forward.py       the strategy: per-device forward, autodiff, what the skeleton syncs
    check.py         differential check of the rules against whole-program execution
"""

"""Lowering: a model's traced program, its state layout and a mesh -> the compiled training step,
with every collective chosen and counted by xtrain.

    lower.py           the entry: picks the strategy (explicit, pipeline, XLA's partitioner)
    train_step.py      the one step skeleton: loss and gradients -> sync -> update -> outputs
    explicit/          the explicit lowering: interpreter, partition rules by family, repeated
                       blocks and the layer scan, the forward strategy
    pipeline/          pipeline parallelism: schedules, stage partition, stages, executors
    xla_partitioner.py the same step through XLA's SPMD partitioner (for comparison)
    sharded.py         values of the per-device program (Layout, Sharded) and their moves
    context.py         the interpreter's state: frozen LoweringOptions, a Cursor (module path,
                       layer, memo) moved by context managers, and the Record of what rules find
    findings.py        Findings: what one trace found (notes, fallbacks, counts, repeated blocks),
                       returned with the gradients and read as StepProgram.findings
    collectives.py     the collectives layer: every collective the program contains
    zero.py            ZeRO: flat gathers of stage 3, re-gather policy, sharded update of 1/2
    gradient_sync.py   bucketed (optionally hierarchical, narrower-dtype) gradient all-reduce
    int8_sync.py       int8 gradient exchange (all-to-all, fp32 sums, all-gather) with error feedback
    grad_transforms.py, clipping.py, accumulation.py, precision.py, remat.py, options.py
                       what happens between gradients and update; micro-batches; mixed
                       precision; activation checkpointing; step options
    state.py           the TrainState and its shardings
    offload.py         an offloaded optimizer state moved to the device for the update and back
    ordering.py        one order of collectives on XLA's CPU runtime
    accounting.py, report.py, nan_check.py   what the program communicates; the report; NaN locator
"""

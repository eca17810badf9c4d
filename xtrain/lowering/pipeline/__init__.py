"""Pipeline parallelism over a `pipe` mesh axis.

    schedule.py    the schedule tables (GPipe, 1F1B, interleaved, zero bubble): who does what at each tick
    partition.py   per-layer costs measured on the traced graph; cutting layers into stages
    graph.py       the traced model cut into prologue, repeated blocks, epilogue
    stage.py       one stage's work on one microbatch, as selects (no branches but zero bubble's)
    executors.py   the tables run as scans over ticks, with ppermute around the ring of stages
    zero_bubble.py the zero-bubble table's executor: each stage branches on its F, B or W
    split_backward.py  a stage's backward cut into B (input gradient) and W (weight gradients)
    branching.py   lax.switch inside shard_map (branches of different mesh-axis variance)
    program.py     the traced, cut and partitioned model; where each stage's layers are stored
    strategy.py    loss and gradients by the schedule, for the step skeleton (train_step.py)
"""

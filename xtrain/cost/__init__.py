"""Cost model: FLOPs and memory of a lowered step, hardware profiles, predicted step time, and
the plan search built on them.

    flops.py     FLOPs per device by op from a jaxpr (dot_general, conv, elementwise, reductions)
    hardware.py  hardware profiles (peak FLOP/s, HBM, links) and this machine's emulated mesh
    model.py     predicted step time (compute + exposed communication; a pipeline's bubble is in its compute), memory
    program.py   the explicit per-device program for an abstract mesh (no devices needed)
    search.py    candidate plans for a target, their predictions, the pick (`plan="auto"`)
"""

"""Cost model: FLOPs (xtrain.ir.analysis.flops) and memory of a lowered step, hardware profiles,
predicted step time, and the plan search built on them.

    hardware.py  hardware profiles (peak FLOP/s, HBM, links), this machine's emulated mesh, and
                 which profile a target or the current devices get
    model.py     predicted step time (compute + exposed communication; a pipeline's bubble is in its compute), memory
    program.py   the step's program for an abstract mesh (no devices needed): the same layout
                 resolution and step skeleton as the step itself
    candidates.py  the search space: one Candidate per plan point, and their enumeration
    placement.py the mesh-axis orders of a candidate whose program the target's checker accepts
    search.py    candidate plans for a target, their predictions, the pick (`plan="auto"`)
"""

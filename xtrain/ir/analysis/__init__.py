"""Analyses: what xtrain reads off a traced program (torch-free).

    flops.py       FLOPs per device of a jaxpr's equations, by kind, and the bytes data movement copies
    dimflow.py     which matmul output dimensions reach a matmul that contracts them (tensor
                   parallel's column -> row pairs)
    groups.py      what the dimension flow finds: groups of dimensions split together
    structural.py  grouped convolutions and stack/unstack in the dimension flow
    provenance.py  which jaxpr variables are parameters, and which parameter dimension each is
    detour.py      low-rank detours (LoRA) in the dimension flow
    per_head.py    attention kernels (cuDNN, NKI) that carry the dimension flow's head split
    reshapes.py    how a reshape's dimensions correspond, for the dimension flow
    depends.py     which outputs of a jaxpr depend on which inputs (forward data dependence)
"""

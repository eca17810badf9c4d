"""Kernels: pure JAX computations the front end traces and the lowering recognises (torch-free).

    blockwise.py          scaled-dot-product attention block by block (online softmax, own VJP)
    attention_dropout.py  attention dropout masks hashed from global coordinates (any blocking,
                          any mesh draws the same mask)
    neuron_attention.py   Neuron's NKI flash-attention kernels as primitives with a custom VJP
    moe.py                a mixture-of-experts layer's routed experts as one token-local function
"""

"""Front ends: the only part of xtrain that imports torch and torchax.

    torch_module.py   torch.nn.Module -> xtrain.ir.Model (named state + pure JAX loss function)
    torch_ops.py      torch ops xtrain lowers itself (derivative rules, fixes to torchax's table)
    higher_order.py   torch.cond as lax.cond (torchax has no rule for the higher-order op)
    sdpa.py           F.scaled_dot_product_attention: picks cuDNN's or Neuron's NKI fused kernels or the blockwise one
    options_scope.py  what a trace under xtrain.ir.trace_options installs on the module, for that trace only
    eager_attention.py  HF's eager matmul-softmax-matmul attention recognised as one attention call
    static_mask.py    a mask's static band; uniform_attention.py: one block structure per attention shape
                      (the blockwise kernel itself is torch-free: xtrain.ir.kernels.blockwise)
    moe.py            MoE experts (grouped matmuls, HF experts modules) as one routed-experts call
    autograd_function.py  torch.autograd.Function -> a custom VJP
    structure.py      the module tree as plain data (xtrain.ir.structure)
    jax_function.py   a JAX loss function + parameter pytree -> xtrain.ir.Model
    optim.py          torch.optim optimizers -> optax transformations
    large_batch.py    LARS and LAMB as torch optimizers (torch has neither)
    tensors.py        torch tensors <-> numpy arrays, torch state dicts and files

Nothing is imported here: `import xtrain.frontend.jax_function` does not load torch.
"""

"""Neuron's lowering of the roundings JAX's autodiff adds to rematerialised programs.

Differentiating through `jax.checkpoint` (xtrain's remat policies, ZeRO-3's re-gather in the
backward pass) makes JAX round every floating residual to its own type,
`reduce_precision(x, exponent_bits=finfo(x.dtype).nexp, mantissa_bits=finfo(x.dtype).nmant)`,
so that XLA's excess precision on CPU and GPU cannot make the recomputed forward differ from the
first one (jax-ml/jax pull request 22244). Neuron does not support `reduce_precision` (AWS
Neuron documentation, "JAX NeuronX" known issues): such a program is refused there even in fp32,
where the rounding is the identity. Lowered for Neuron, a rounding to the operand's own type is
left out; any other `reduce_precision` (one a model asks for) keeps JAX's lowering, and the
conformance checker (neuron_support.conformance) names it.
"""
from __future__ import annotations

from jax._src import dtypes
from jax._src.interpreters import mlir
from jax._src.lax import lax as lax_internal

_JAX_RULE = mlir._lowerings[lax_internal.reduce_precision_p].rule


def rounds_to_own_type(dtype, exponent_bits: int, mantissa_bits: int) -> bool:
    """True when reduce_precision with these bits leaves a value of `dtype` unchanged."""
    info = dtypes.finfo(dtype)
    return (exponent_bits, mantissa_bits) == (info.nexp, info.nmant)


def _neuron_reduce_precision(ctx, operand, *, exponent_bits: int, mantissa_bits: int):
    if rounds_to_own_type(ctx.avals_in[0].dtype, exponent_bits, mantissa_bits):
        return [operand]
    return _JAX_RULE(ctx, operand, exponent_bits=exponent_bits, mantissa_bits=mantissa_bits)


# mlir.register_lowering accepts only platforms with a JAX backend or plugin on this machine, and
# Neuron's is absent wherever xtrain lowers for Neuron without its devices: write the table entry
# that register_lowering writes (jax/_src/interpreters/mlir.py, JAX 0.10).
mlir._platform_specific_lowerings["neuron"][lax_internal.reduce_precision_p] = mlir.LoweringRuleEntry(
    _neuron_reduce_precision, inline=True)

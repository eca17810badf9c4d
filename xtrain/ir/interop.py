"""How a front end's tensors reach JAX functions.

Model code may call xtrain's JAX-level helpers (`xtrain.shard`) on its own tensors: torch
tensors that torchax traces. A front end registers, for the tensors it owns, how to apply a JAX
function to one (torchax: `interop.call_jax`); the layers that offer such helpers call `apply`
and never import the front end or torch.

The other way round, a front end that annotates activations for a plan (sequence-parallel
blocks, xtrain.ir.trace_options) calls `shard`, which is `xtrain.shard` (xtrain.sharding.annotate
registers it on import): the front end never imports the sharding layer.
"""
from __future__ import annotations

from typing import Any, Callable

Adapter = tuple[Callable[[Any], bool], Callable[[Callable, Any], Any]]
_ADAPTERS: list[Adapter] = []
_SHARD: list[Callable[[Any, tuple], Any]] = []


def register(owns: Callable[[Any], bool], call_jax: Callable[[Callable, Any], Any]) -> None:
    """For values `owns(x)` accepts, `apply(fn, x)` is `call_jax(fn, x)`."""
    _ADAPTERS.append((owns, call_jax))


def apply(fn: Callable, x: Any) -> Any:
    """`fn(x)` for a JAX value; for a front end's tensor, as that front end applies it."""
    for owns, call_jax in _ADAPTERS:
        if owns(x):
            return call_jax(fn, x)
    return fn(x)


def register_shard(fn: Callable[[Any, tuple], Any]) -> None:
    """Makes `fn(x, spec)` (xtrain.shard) what `shard` calls."""
    _SHARD[:] = [fn]


def shard(x: Any, spec: tuple) -> Any:
    """`xtrain.shard(x, spec)` when the sharding layer is loaded (it is, whenever a step is
    lowered), else `x` unchanged, as xtrain.shard outside a trace."""
    return _SHARD[0](x, spec) if _SHARD else x

"""What the front end installs on a torch module for one trace under `TraceOptions`.

Everything here lives only as long as the trace (a context manager around it): attention reads
the options (xtrain.frontend.sdpa.traced_under), and the sequence-parallel blocks get forward
hooks that annotate their hidden states, removed when the trace ends. The module keeps no hook,
attribute or state from it, so a later trace under other options (a DDP compile of the model a
Megatron plan was derived for) sees torch's own module.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from xtrain.frontend import sdpa
from xtrain.ir import interop
from xtrain.ir.trace_options import SequenceParallel, TraceOptions


@contextlib.contextmanager
def installed(module: torch.nn.Module, options: TraceOptions):
    """Traces of `module` inside follow `options`; nothing stays on `module` afterwards."""
    with sdpa.traced_under(options), _sequence_parallel(module, options.sequence_parallel):
        yield


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, tuple) else value


def _marked(value: Any, spec: tuple) -> Any:
    """`value` (a hidden state, or a tuple led by one) with the hidden state annotated `spec`;
    values of another rank (a block returning something else) pass unchanged."""
    if getattr(_first(value), "ndim", 0) != len(spec):
        return value
    x = interop.shard(_first(value), spec)
    return (x, *value[1:]) if isinstance(value, tuple) else x


@contextlib.contextmanager
def _sequence_parallel(module: torch.nn.Module, sp: SequenceParallel | None):
    """Forward hooks on the blocks of `sp` marking their hidden-state input and output with its
    spec (xtrain.shard), removed on exit."""
    if sp is None:
        yield
        return

    def before(_block, args, kwargs):
        if args:
            return (_marked(args[0], sp.spec), *args[1:]), kwargs
        key = next(iter(kwargs), None)  # HF passes hidden_states by keyword
        return args, ({**kwargs, key: _marked(kwargs[key], sp.spec)} if key is not None else kwargs)

    handles = []
    try:
        for path in sp.blocks:
            block = module.get_submodule(path)
            # first of the block's hooks: the marks sit outside the block's module scope on the
            # way in and inside it on the way out (the scope hooks are installed before these)
            handles.append(block.register_forward_pre_hook(before, with_kwargs=True, prepend=True))
            handles.append(block.register_forward_hook(lambda _block, _args, out: _marked(out, sp.spec), prepend=True))
        yield
    finally:
        for handle in handles:
            handle.remove()

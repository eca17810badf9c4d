"""torch's higher-order ops under torchax: `torch.cond` as `lax.cond`.

torchax 0.0.14 has no rule for the higher-order op `cond`, and eager `torch.cond` compiles
itself with dynamo, which cannot trace torchax tensors (nor run where torchax registered its
"jax" device). While xtrain traces a model (`traced`), `torch.cond` calls the higher-order op
directly, and the op's rule for torchax's dispatch mode (`_cond`) emits one `lax.cond` whose
branches are the torch functions traced on the operands; the explicit lowering partitions the
branches (explicit/rules/control.py).
"""
from __future__ import annotations

import contextlib

import jax.numpy as jnp
import torch
import torchax
from jax import lax


def _cond(mode, pred, true_fn, false_fn, operands):
    env = mode.env

    def branch(fn):
        def run(*values):
            with mode:  # the mode is popped while a higher-order op's rule runs
                return env.t2j_iso(fn(*env.j2t_iso(values)))
        return run

    pred = jnp.reshape(env.t2j_iso(pred), ()).astype(bool) if isinstance(pred, torch.Tensor) else bool(pred)
    out = lax.cond(pred, branch(true_fn), branch(false_fn), *env.t2j_iso(tuple(operands)))
    return env.j2t_iso(out)


def _direct_cond(pred, true_fn, false_fn, operands=()):
    return torch.ops.higher_order.cond(pred, true_fn, false_fn, tuple(operands))


@contextlib.contextmanager
def traced():
    """While inside, `torch.cond` runs as one `lax.cond` under torchax (idempotent registration)."""
    cond = torch.ops.higher_order.cond
    if torchax.tensor.XLADispatchMode not in cond.python_key_table:
        cond.py_impl(torchax.tensor.XLADispatchMode)(_cond)
    eager, torch.cond = torch.cond, _direct_cond
    try:
        yield
    finally:
        torch.cond = eager

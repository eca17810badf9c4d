"""Attention masks of packed documents in the blockwise kernel (xtrain.ir.kernels.blockwise).

A mask given as per-token comparisons (`Blocking.factors`: pairs of operands of q's rank,
each with a query or a key length of 1; xtrain.frontend.token_mask finds them) is built per
block from the block's rows and columns (`factor_mask`), and `block_visibility` says, from
each operand's range over a block, which blocks no pair can pass (other documents): the
kernel skips those with `lax.cond` and `executed_blocks` counts the rest for the step's outputs.
Each function's `b` is the call's Blocking.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _column_stack(x, start: int, count: int, bk: int):
    """Key blocks [start, start + count) of x (..., r, S) as (count, ..., r, bk)."""
    part = x[..., start * bk:(start + count) * bk]
    return jnp.moveaxis(part.reshape(*part.shape[:-1], count, bk), -2, 0)


COMPARE = {"eq": jnp.equal, "ne": jnp.not_equal, "lt": jnp.less, "le": jnp.less_equal,
           "gt": jnp.greater, "ge": jnp.greater_equal}


def factor_rows(mask, rows: slice):
    """Each factor operand's rows of one query block (an operand with one query row as it is)."""
    return tuple(x[..., rows, :] if x.shape[-2] > 1 else x for x in mask)


def factor_stack(parts, start: int, count: int, bk: int):
    """(stacked, fixed): the operands with a key length cut into key blocks (count, ..., r, bk)
    for the scan, None elsewhere; and those with one key column, as they are, None elsewhere."""
    stacked = tuple(_column_stack(x, start, count, bk) if x.shape[-1] > 1 else None for x in parts)
    return stacked, tuple(None if x.shape[-1] > 1 else x for x in parts)


def factor_block(b, stacked_j, fixed):
    """One key block's factor operands, the stacked and the fixed ones merged in order."""
    return tuple(f if s is None else s for s, f in zip(stacked_j, fixed))


def factor_mask(b, operands):
    """The boolean mask of factor operands (a0, b0, a1, b1, ...), broadcast over their shapes."""
    out = None
    for n, op in enumerate(b.factors):
        m = COMPARE[op](operands[2 * n], operands[2 * n + 1])
        out = m if out is None else out & m
    return out


def _block_spans(x, bq: int, bk: int):
    """(min, max) of an operand per (query block, key block), leading dims kept: (..., n_q|1, n_k|1)."""
    x = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
    rows, cols = x.shape[-2], x.shape[-1]
    nq, nk = (rows // bq, bq) if rows > 1 else (1, 1), (cols // bk, bk) if cols > 1 else (1, 1)
    x = x.reshape(*x.shape[:-2], nq[0], nq[1], nk[0], nk[1])
    return jnp.min(x, axis=(-3, -1)), jnp.max(x, axis=(-3, -1))


def block_visibility(b, operands):
    """(n_q, n_k) booleans: whether some (query, key) pair of the block may pass every factor.
    Per leading position (batch, heads) each factor's operand ranges over the block must allow
    it (equal: they overlap; less: the first's min below the second's max; ...), for some
    position. A block this says False for is masked everywhere (disjoint documents); True may
    still be (the test is per factor). Operands padded to whole blocks."""
    ok = None
    for n, op in enumerate(b.factors):
        (a_lo, a_hi), (c_lo, c_hi) = (_block_spans(x, b.block_q, b.block_k) for x in operands[2 * n:2 * n + 2])
        test = {"eq": (a_hi >= c_lo) & (a_lo <= c_hi), "ne": (a_lo != c_hi) | (a_hi != c_lo),
                "lt": a_lo < c_hi, "le": a_lo <= c_hi, "gt": a_hi > c_lo, "ge": a_hi >= c_lo}[op]
        ok = test if ok is None else ok & test
    ok = jnp.any(ok, axis=tuple(range(ok.ndim - 2)))
    return jnp.broadcast_to(ok, (b.n_q, b.n_k))


def executed_blocks(b, operands):
    """The (query block, key block) pairs a call with these factor operands (padded to whole
    blocks, as the kernel's call takes them) computes (int32): its static pairs, less those
    skipped at run time."""
    static = np.zeros((b.n_q, b.n_k), bool)
    for i in range(b.n_q):
        static[i, b.key_blocks(i).start:b.key_blocks(i).stop] = True
    if not b.skip_at_run_time:
        return jnp.asarray(static.sum(), jnp.int32)
    return jnp.sum(block_visibility(b, operands) & static, dtype=jnp.int32)

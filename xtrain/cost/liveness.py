"""Peak device memory of a step's intermediates, read from its program before any compile.

The program is walked in order and every value is live from the equation that makes it to its
last use. What XLA never writes to memory is left out, as its fusion passes leave it out of
buffer assignment (XLA's "loop" and "input" fusions: an elementwise chain, or one feeding a
reduction, is computed in registers inside its consumer's kernel; broadcasts, iotas and type
conversions are recomputed in every consumer rather than stored):

- an elementwise value (or a broadcast, an iota) whose every use is another elementwise op, a
  reduction or a layout change is *fused*: it takes no bytes, and its own operands live until
  its consumers run (XLA's GPU fusion duplicates such a producer into each consumer, or emits
  one multi-output kernel);
- a reshape (a bitcast in XLA's default row-major layouts) and shard_map's varying/invariant
  marks are their operand's buffer: no new bytes, the operand lives as long as they do;
- an elementwise op, scatter or dynamic update whose operand of the result's size dies there
  writes its result into that operand's buffer (XLA's buffer sharing with a dying operand: a
  scatter-add of a gradient into zeros takes the zeros' buffer).

Matmuls, convolutions, collectives, gathers/scatters and control flow always write their results.
Without the fusion rule the cross-entropy over a 128k vocabulary alone counted three f32 copies
of the logits that XLA never stores (Llama-3.1-8B's shapes: 19.2 GiB predicted for a step whose
compiled program needs 10.3 GiB).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.extend import core as jcore

# Primitives whose result is their operand's buffer (a change of type or shape only, or an
# optimization barrier, which XLA passes its operands through): no new bytes, and the operand lives
# as long as the result. Counted as copies, pvary alone added a whole replica of the parameters to a
# DDP step's peak, and ZeRO-3's barrier before a re-gather (xtrain.lowering.regather) a copy of
# every value a layer saves.
ALIASES = frozenset({"pvary", "pcast", "psum_invariant_to_varying", "reshape", "squeeze", "expand_dims",
                     "optimization_barrier", "xtrain_remat_barrier"})

# One output element from the same element of each operand: what XLA's loop fusion computes in
# registers.
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil", "clamp",
    "conj", "copy", "copy_p", "cos", "cosh", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor",
    "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lgamma", "digamma", "log", "log1p", "logistic", "lt", "max",
    "min", "mul", "ne", "neg", "nextafter", "not", "or", "population_count", "pow", "real", "reduce_precision", "rem",
    "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin",
    "sinh", "sqrt", "square", "sub", "tan", "tanh", "xor", "convert_element_type",
})
# Producers XLA fuses into their consumers besides elementwise ops (often much bigger than their operand)
EXPANDING = frozenset({"broadcast_in_dim", "iota"})
# Consumers whose kernel can compute a fused producer's elements in place.
ABSORBERS = ELEMENTWISE | EXPANDING | frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin",
    "transpose", "slice", "dynamic_slice", "pad", "concatenate", "reshape", "squeeze", "expand_dims", "rev",
})

# Results XLA writes into a dying operand's buffer of the same size (in-place updates)
IN_PLACE = ELEMENTWISE | frozenset({"dynamic_update_slice", "scatter", "scatter-add", "scatter_add", "scatter-mul",
                                    "scatter_mul", "scatter-min", "scatter_min", "scatter-max", "scatter_max",
                                    "scatter_sub", "scatter-sub"})


def nbytes(aval) -> int:
    """Device bytes of a value: none for one in host memory (offloaded activations, an
    offloaded optimizer state on its way back)."""
    shape = getattr(aval, "shape", None)
    if shape is None or getattr(aval, "memory_space", None) is jax.memory.Space.Host:
        return 0
    try:
        itemsize = np.dtype(aval.dtype).itemsize
    except TypeError:  # PRNG key arrays: two uint32 words per key
        itemsize = 8
    return math.prod(shape) * itemsize


def _fused(eqns: list, outvars: list, root: dict) -> dict:
    """The values XLA computes inside their consumers, each mapped to the operands it reads
    (a value's consumers are those of its aliases too: `root`)."""
    consumers: dict = {}
    for eqn in eqns:
        if all(o in root for o in eqn.outvars) and eqn.outvars:  # an alias: its consumers count
            continue
        for v in eqn.invars:
            if _var(v):
                consumers.setdefault(root.get(v, v), []).append(str(eqn.primitive))
    outputs = {root.get(v, v) for v in outvars if _var(v)}
    fused = {}
    for eqn in eqns:
        name = str(eqn.primitive)
        if len(eqn.outvars) != 1 or name not in ELEMENTWISE | EXPANDING:
            continue
        out, = eqn.outvars
        uses = consumers.get(out, [])
        if out in outputs or not uses or not all(u in ABSORBERS for u in uses):
            continue
        fused[out] = [v for v in eqn.invars if _var(v)]
    return fused


# Calls XLA inlines into their caller: their equations are the caller's (a final select of the new
# state against the old, in its own jit, is then an in-place elementwise op like any other)
INLINED = frozenset({"jit", "pjit", "closed_call", "core_call"})


class _Fresh:
    """A variable of one inlined call (hashed by identity, as jax's are)."""

    __slots__ = ("aval",)

    def __init__(self, aval):
        self.aval = aval


def _var(v) -> bool:
    return not isinstance(v, jcore.Literal)


@dataclasses.dataclass(frozen=True)
class _Eqn:
    primitive: str
    invars: list
    outvars: list
    params: dict


def _flat(jaxpr) -> tuple[list[_Eqn], list, set]:
    """(equations with INLINED calls replaced by theirs, the outputs, the inputs: the jaxpr's and
    the constants of inlined calls)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    eqns: list[_Eqn] = []
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    rename: dict = {}

    def named(v):
        return rename.get(v, v) if _var(v) else v

    def walk(body, inlined: bool):
        for eqn in body.eqns:
            inlined_call = str(eqn.primitive) in INLINED
            called = (eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")) if inlined_call else None
            if called is None:
                if inlined:  # a jaxpr called twice has the same variables twice: fresh ones per call
                    rename.update({v: _Fresh(v.aval) for v in eqn.outvars})
                eqns.append(_Eqn(str(eqn.primitive), [named(v) for v in eqn.invars],
                                 [named(v) for v in eqn.outvars], eqn.params))
                continue
            inner = getattr(called, "jaxpr", called)
            inputs.update(inner.constvars)
            rename.update({i: named(o) for i, o in zip(inner.invars, eqn.invars)})
            walk(inner, True)
            rename.update({o: named(i) for o, i in zip(eqn.outvars, inner.outvars)})
    walk(jaxpr, False)
    return eqns, [named(v) for v in jaxpr.outvars], inputs


def peak_live_bytes(jaxpr, donated: bool = False) -> int:
    """Largest sum of live intermediate values over a jaxpr's equations in program order
    (inputs excluded, outputs counted from where they are made; a call or loop adds its body's
    peak beyond the body's results while it runs; fused values and aliases as the module
    docstring says). `donated`: the caller donates the inputs that the outputs replace (a
    training step's state), so an output made in place may take a dying input's buffer (the
    optimizer's new moments and parameters, written over the old ones: no new bytes)."""
    eqns, outvars, inputs = _flat(jaxpr)
    root: dict = {}
    for eqn in eqns:
        if str(eqn.primitive) in ALIASES and len(eqn.invars) == len(eqn.outvars):
            root.update({o: root.get(v, v) for o, v in zip(eqn.outvars, eqn.invars) if _var(v)})
    fused = _fused(eqns, outvars, root)
    memo: dict = {}

    def sources(v) -> frozenset:
        """The stored buffers a use of `v` reads: `v`'s own, or a fused value's operands'."""
        v = root.get(v, v)
        if v not in fused:
            return frozenset((v,))
        if v not in memo:
            memo[v] = frozenset().union(*(sources(u) for u in fused[v]))
        return memo[v]

    last_use: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if _var(v):
                last_use.update(dict.fromkeys(sources(v), i))
    outputs = {root.get(v, v) for v in outvars if _var(v)}
    live = peak = 0
    for i, eqn in enumerate(eqns):
        inner = max((_above_outputs(s) for s in jcore.jaxprs_in_params(eqn.params)), default=0)
        made = [v for v in eqn.outvars if v not in root and v not in fused]
        created = sum(nbytes(v.aval) for v in made)
        dying = set()
        for v in eqn.invars:
            if _var(v):
                dying.update(s for s in sources(v) if last_use.get(s) == i)
        dying -= outputs
        over = dying & inputs if donated and made and made[0] in outputs else set()  # a donated input's buffer
        dying -= inputs
        taken = _reused(eqn, made, dying | over, sources)
        reused = nbytes(taken.aval) if taken is not None else 0
        peak = max(peak, live + created - reused + inner)
        live += sum(nbytes(v.aval) for v in made if v in last_use or v in outputs)
        live -= sum(nbytes(v.aval) for v in dying) + (reused if taken in over else 0)
    return peak


def _above_outputs(jaxpr) -> int:
    """A called jaxpr's peak beyond the results it returns (those are its caller's new values,
    counted there once: a call returning its whole activations is not two copies of them)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    made = {v for v in jaxpr.outvars if isinstance(v, jcore.Var) and v not in inputs}
    return max(0, peak_live_bytes(jaxpr) - sum(nbytes(v.aval) for v in made))


def _reused(eqn, made: list, dying: set, sources):
    """The dying operand whose buffer `eqn`'s result takes (IN_PLACE; None if none): a direct
    operand or, for an elementwise op, one its fused operands read at the same index."""
    if str(eqn.primitive) not in IN_PLACE or len(made) != 1:
        return None
    size = nbytes(made[0].aval)
    for v in eqn.invars:
        if _var(v):
            for s in sources(v):
                if s in dying and nbytes(s.aval) == size:
                    return s
    return None

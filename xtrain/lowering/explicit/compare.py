"""How numbered blocks are compared equation by equation (explicit/blocks.py), and the first
difference put in words: the module path and op where block k stops being block 0's twin."""
from __future__ import annotations

from jax.extend import core as jcore

from xtrain.ir import walk


# str() of a sub-jaxpr (a blockwise attention's custom_vjp body: thousands of equations) per
# equation per block dominated a plan search at real size; replayed blocks share the same
# sub-jaxpr objects, so each is printed once (the object is kept alive beside its text)
_PRINTED: dict[int, tuple[object, str]] = {}


def _printed(value) -> str:
    kept = _PRINTED.get(id(value))
    if kept is None or kept[0] is not value:
        if len(_PRINTED) > 4096:
            _PRINTED.clear()
        kept = _PRINTED[id(value)] = (value, str(value))
    return kept[1]


def _fingerprint(value) -> str:
    if isinstance(value, (jcore.Jaxpr, jcore.ClosedJaxpr)):
        return _printed(value)
    info = getattr(value, "debug_info", None)
    if info is not None and callable(value) or hasattr(value, "call_wrapped"):
        return f"fn:{getattr(info, 'func_name', '')}"
    if callable(value):  # e.g. custom_vjp's out_trees closure: identical code in every block
        return f"fn:{getattr(value, '__qualname__', type(value).__name__)}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_fingerprint(v) for v in value) + ")"
    return repr(value)


def _shapes(vars_) -> tuple:
    return tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in vars_)


def signature(eqn) -> tuple:
    """What two equations must share to be the same step of two blocks (literal values aside)."""
    return (str(eqn.primitive), tuple((k, _fingerprint(v)) for k, v in sorted(eqn.params.items())),
            _shapes(eqn.invars), _shapes(eqn.outvars))


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _where(eqn, paths) -> str:
    return walk.eqn_path(eqn, paths) or "<top level>"


def _how(a, b) -> str:
    """How equation `b` differs from `a`, in words."""
    if str(a.primitive) != str(b.primitive):
        return f"op {a.primitive} vs {b.primitive}"
    for key in sorted(set(a.params) | set(b.params)):
        x, y = _fingerprint(a.params.get(key)), _fingerprint(b.params.get(key))
        if x != y:
            return f"op {a.primitive}, parameter {key}: {_short(x)} vs {_short(y)}"
    return (f"op {a.primitive} on shapes {[s for s, _ in _shapes(a.invars)]} -> {[s for s, _ in _shapes(a.outvars)]} "
            f"vs {[s for s, _ in _shapes(b.invars)]} -> {[s for s, _ in _shapes(b.outvars)]}")


def first_difference(blocks: list[list], names: list[str], paths) -> str:
    """The first equation where some block differs from block 0 (after leaving out unused ones)."""
    first = blocks[0]
    for k, block in enumerate(blocks[1:], 1):
        for i, (a, b) in enumerate(zip(first, block)):
            if signature(a) != signature(b):
                return (f"{names[k]} differs from {names[0]} at its equation {i}: {_how(a, b)} "
                        f"(in {_where(a, paths)} vs {_where(b, paths)})")
        if len(block) != len(first):
            longer, other = (block, names[k]) if len(block) > len(first) else (first, names[0])
            extra = longer[min(len(block), len(first))]
            return (f"{names[k]} has {len(block)} equations, {names[0]} {len(first)}: the first extra one is op "
                    f"{extra.primitive} in {_where(extra, paths)} ({other})")
    raise AssertionError("first_difference called on matching blocks")


def input_counts(ins: list[list], names: list[str]) -> str:
    k = next(k for k, i in enumerate(ins) if len(i) != len(ins[0]))
    return f"{names[k]} reads {len(ins[k])} values from outside itself, {names[0]} {len(ins[0])}"


def _reader(block, var):
    return next(e for e in block if var in e.invars)


def input_source(blocks: list[list], ins: list[list], position: int, names: list[str], paths) -> str:
    """Why input `position` is neither shared, a parameter, the residual stream nor a selection
    among values computed before the blocks."""
    var = ins[0][position]
    eqn = _reader(blocks[0], var)
    return (f"operand {list(eqn.invars).index(var)} of op {eqn.primitive} in {_where(eqn, paths)} "
            f"({var.aval.str_short()}) reads, from block to block, values of different kinds (a parameter in "
            "some, a value computed inside the blocks or not the previous block's output in others)")


def produced(block: list, var, paths) -> str:
    """The value `var` of `block` in words: the op that computes it, its module path and type."""
    eqn = next(e for e in block if var in e.outvars)
    return f"the result of op {eqn.primitive} in {_where(eqn, paths)} ({var.aval.str_short()})"


def escape(blocks: list[list], names: list[str], paths, k: int, var) -> str:
    """Why a value block k computes leaves the block other than as the residual stream or a
    per-layer output read after the blocks."""
    return (f"{produced(blocks[k], var, paths)} is read by a block after {names[k]} other than as the next "
            "block's input")

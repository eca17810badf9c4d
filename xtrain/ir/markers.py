"""Typed markers in a traced program's names: one encoding for every kind.

The front end tells the lowering and the reports about a traced call by the name it traces the
call under: a `jax.named_scope` (an attention site, an index op's torch rule, a blockwise
kernel's blocking) or a jitted function's name (MoE's routed experts). A marker is a frozen
dataclass registered with a kind (`@marker("attention")`); `name(value)` encodes it and
`found(cls, name_stack)` decodes every marker of that type in a name stack, outermost first.

    xtrain_attention={'implementation':'blockwise','block':256,...}

The fields are JSON with `'` for `"` (HLO prints the name stack inside double quotes, and
xtrain.lowering.report reads them back with a regex) and no `/` (it separates name-stack levels).
Fields hold ints, floats, bools, strings, None, enums (by value) and tuples of them.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import json
import typing
from typing import Any, Callable, TypeVar

T = TypeVar("T")
_KINDS: dict[type, str] = {}


def marker(kind: str) -> Callable[[type[T]], type[T]]:
    """Registers a frozen dataclass as the marker `xtrain_<kind>=...`."""
    def register(cls: type[T]) -> type[T]:
        frozen = dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # decoded values are shared
        if not frozen or kind in _KINDS.values():
            raise TypeError(f"marker({kind!r}) takes a frozen dataclass, once per kind; got {cls.__name__}")
        _KINDS[cls] = kind
        return cls
    return register


def _prefix(cls: type) -> str:
    return f"xtrain_{_KINDS[cls]}="


def _plain(x: Any) -> Any:
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    return x


def name(value: Any) -> str:
    """The marker of `value` (a registered dataclass) as one name-stack level."""
    fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    text = json.dumps(fields, separators=(",", ":"), ensure_ascii=False)
    # "/" and "'" only occur inside JSON strings, where their \u escapes read back the same
    text = text.replace("/", "\\u002f").replace("'", "\\u0027").replace('"', "'")
    return _prefix(type(value)) + text


def _typed(hint: Any, x: Any) -> Any:
    """`x` read from JSON as the field type `hint` has it (enums by value, lists as tuples)."""
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(x)
    if isinstance(x, list):
        args = typing.get_args(hint)
        inner = args[0] if args and (len(args) == 1 or args[1] is Ellipsis) else None
        return tuple(_typed(inner, v) for v in x)
    return x


@functools.lru_cache(maxsize=4096)  # markers are frozen: one decoded value serves every equation naming it
def _decode(cls: type[T], text: str) -> T:
    fields = json.loads(text.replace("'", '"'))
    hints = typing.get_type_hints(cls)
    return cls(**{k: _typed(hints[k], v) for k, v in fields.items()})


def _unwrapped(part: str) -> str:
    """A name-stack level without JAX's transformation wrappers: 'transpose(jvp(x))' -> 'x'."""
    while part.endswith(")") and "(" in part and part[:part.index("(")].isidentifier():
        part = part[part.index("(") + 1:-1]
    return part


def found(cls: type[T], name_stack: Any) -> list[T]:
    """Every marker of type `cls` in a name stack (or one name), outermost first."""
    prefix = _prefix(cls)
    parts = map(_unwrapped, str(name_stack).split("/"))
    return [_decode(cls, part[len(prefix):]) for part in parts if part.startswith(prefix)]


def outermost(cls: type[T], name_stack: Any) -> T | None:
    markers = found(cls, name_stack)
    return markers[0] if markers else None


def innermost(cls: type[T], name_stack: Any) -> T | None:
    markers = found(cls, name_stack)
    return markers[-1] if markers else None

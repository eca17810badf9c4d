"""The traced graph: a jaxpr whose equations know their torch module path."""
from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
from jax.extend import core as jex_core

from xtrain.ir import walk
from xtrain.ir.model import Model


@dataclasses.dataclass(frozen=True)
class TracedGraph:
    """The closed jaxpr of `model.apply` for one batch shape, with module paths per equation."""

    jaxpr: jex_core.ClosedJaxpr
    module_paths: frozenset[str]

    def module_path(self, eqn, outer: str = "") -> str:
        """The torch module path an equation came from ("" for top-level code).

        Equations inside nested jaxprs (jit, custom_jvp, scan bodies) carry name stacks
        relative to their call site: pass the call site's path as `outer`.
        """
        return walk.eqn_path(eqn, self.module_paths, outer)

    def equations(self) -> Iterator[tuple[object, str]]:
        """Every equation, nested ones included, with its module path."""
        yield from walk.equations(self.jaxpr.jaxpr, self.module_paths)


def trace(model: Model, params, buffers, key, batch: tuple, *, training: bool = True) -> TracedGraph:
    """Traces `model.apply` to a jaxpr at global shapes (arrays or ShapeDtypeStructs)."""
    fn = lambda p, b, k, x: model.apply(p, b, k, x, training=training)
    closed = jax.make_jaxpr(fn)(params, buffers, key, batch)
    return TracedGraph(closed, model.module_paths())

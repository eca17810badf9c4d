"""Logical names of a state's arrays: each leaf of a pytree named by its key path, e.g.
"opt_state/0/mu/blocks.0.attn.q.weight". The names do not depend on the mesh, the plan or the
process, so checkpoints store tensors under them and state conversions find leaves by them."""
from __future__ import annotations

from typing import Any, Sequence

import jax


def _entry_name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    raise TypeError(f"unexpected pytree key {entry!r}")


def leaf_name(path: Sequence[Any]) -> str:
    """'opt_state/0/mu/blocks.0.attn.q.weight': stable across meshes, plans and processes."""
    return "/".join(_entry_name(e) for e in path)


def named_leaves(tree: Any) -> dict[str, Any]:
    """{logical name: leaf} of a pytree (a TrainState, or any nested dict of arrays)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {leaf_name(path): leaf for path, leaf in flat}


def rebuild(tree: Any, values: dict[str, Any]) -> Any:
    """`tree` with each leaf replaced by `values[its logical name]`."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.tree_unflatten(treedef, [values[leaf_name(p)] for p, _ in flat])

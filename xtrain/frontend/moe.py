"""Mixture-of-experts layers in the torch front end.

- `aten::_grouped_mm` (the grouped GEMM over per-expert token groups that HF's default
  experts implementation calls) is lowered to `lax.ragged_dot`, which JAX differentiates, so
  the backward needs no translation of its own.
- HF experts modules (classes decorated with `transformers.integrations.moe.
  use_experts_implementation`, running `experts_implementation="grouped_mm"`, the default: Mixtral,
  Qwen3-MoE, ...) are traced as one call of `xtrain.ir.kernels.moe.routed_experts`, the same arithmetic
  (tokens sorted by expert into a fixed, drop-free buffer, grouped matmuls, weighted sum), so the
  explicit lowering sees one token-local call it can run on each device's own tokens.
- `aten::histc` (HF's count of tokens per expert) is a compare-and-sum, no sort or scatter.
- Ops whose output shape depends on tensor values (`nonzero`, ...) get an error naming the op,
  the module and, for HF experts, the `experts_implementation` switch.
"""
from __future__ import annotations

import contextlib
import functools

import jax.numpy as jnp
from jax import lax
import torch
import torchax
from torchax import interop as torchax_interop
from torchax.ops import mappings, ops_registry

from xtrain.errors import TopKTooLarge, UnsupportedOpError  # TopKTooLarge: re-exported
from xtrain.frontend import torch_ops
from xtrain.ir.kernels import moe

aten = torch.ops.aten

# ops whose output shape is data-dependent: a static-shape compiler cannot trace them
DATA_DEPENDENT_SHAPE_OPS = ("aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique2",
                            "aten::unique_consecutive", "aten::nonzero_static", "aten::bincount")

# activation modules (by class name, so torch and transformers need not be imported here) -> spec key
_ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUActivation": "gelu", "NewGELUActivation": "gelu_tanh",
                "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh", "ReLU": "relu"}


def _group_ids(offs, rows: int):
    """Group of each row from cumulative group ends `offs` (E,): (rows,) int32."""
    return jnp.searchsorted(offs, jnp.arange(rows, dtype=offs.dtype), side="right").astype(jnp.int32)


def _grouped_mm(input, mat2, offs=None, bias=None, out_dtype=None):
    """aten._grouped_mm: (S, K) x (E, K, N) with cumulative group ends `offs` (E,) -> (S, N),
    rows of group g times mat2[g] (rows past offs[-1] are zero, where torch leaves them
    unwritten); (E, M, K) x (E, K, N) without offs is a batched matmul."""
    if input.ndim == 2 and mat2.ndim == 3 and offs is not None:
        offs = offs.astype(jnp.int32)
        sizes = jnp.diff(offs, prepend=jnp.zeros((1,), jnp.int32))  # (E,)
        out = lax.ragged_dot(input, mat2.astype(input.dtype), sizes)
        if bias is not None:
            out = out + bias[jnp.minimum(_group_ids(offs, input.shape[0]), mat2.shape[0] - 1)]
    elif input.ndim == 3 and mat2.ndim == 3 and offs is None:
        out = jnp.matmul(input, mat2)
        if bias is not None:
            out = out + bias[:, None, :]
    else:
        raise UnsupportedOpError(
            f"aten._grouped_mm of a {input.ndim}-D by {mat2.ndim}-D operand "
            f"{'with' if offs is not None else 'without'} offs: xtrain lowers (S, K) x (E, K, N) with offs "
            "(tokens grouped by expert) and (E, M, K) x (E, K, N) without")
    return out if out_dtype is None else out.astype(mappings.t2j_dtype(out_dtype))


def _histc(input, bins=100, min=0, max=0):
    """aten.histc (HF counts tokens per expert with it) as a compare against each bin and a sum
    over the elements: no sort and no scatter, so elements split over devices are counted where
    they are (torchax's histogram sorts them all together)."""
    x = input.reshape(-1)  # (n,)
    lo, hi = (x.min(), x.max()) if min == max else (jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype))
    lo, hi = jnp.where(lo == hi, lo - 1, lo), jnp.where(lo == hi, hi + 1, hi)
    index = jnp.floor((x - lo) * bins / (hi - lo)).astype(jnp.int32)
    index = jnp.where(x == hi, bins - 1, index)  # the upper edge belongs to the last bin, as in torch
    inside = (x >= lo) & (x <= hi)
    hits = (index[:, None] == jnp.arange(bins, dtype=jnp.int32)) & inside[:, None]  # (n, bins)
    return jnp.sum(hits, axis=0, dtype=input.dtype)


def _topk(input, k, dim=None, largest=True, sorted=True, *, out=None):
    """aten.topk as one lax.top_k (its values come sorted, largest first, ties by index: no
    re-sort, whose float comparator Neuron rejects); k above the dimension's size is refused
    with TopKTooLarge."""
    if input.ndim == 0:
        return input, jnp.zeros((), jnp.int32)
    dim = -1 if dim is None else dim
    if k > input.shape[dim]:
        raise TopKTooLarge(int(k), int(input.shape[dim]))
    x = jnp.moveaxis(input, dim, -1)
    values, indices = lax.top_k(x if largest else -x, k)
    values = values if largest else -values
    return jnp.moveaxis(values, -1, dim), jnp.moveaxis(indices, -1, dim)


def top_k_error(err: TopKTooLarge, where: str, model: str) -> str:
    """The message for TopKTooLarge raised in module `where`."""
    return (f"torch.topk in module {where!r} of {model} picks k={err.k} of {err.size} along its dimension; as an "
            f"MoE router's top_k that is more experts than the layer has: set top_k (num_experts_per_tok) to at "
            f"most {err.size}, the number of experts")


_LOWERINGS = {aten._grouped_mm.default: _grouped_mm, aten.histc.default: _histc, aten.topk.default: _topk}


def install(env: torchax.tensor.Environment) -> None:
    """Registers the MoE op lowerings on a torchax environment (idempotent)."""
    for op, impl in _LOWERINGS.items():
        env._ops[op] = ops_registry.Operator(op, impl, is_jax_function=True, is_user_defined=True,
                                             needs_env=False, is_view_op=False)


def _activation(module: torch.nn.Module) -> str | None:
    act = getattr(module, "act_fn", None)
    name = type(act).__name__
    if name == "GELU":
        return "gelu_tanh" if getattr(act, "approximate", "none") == "tanh" else "gelu"
    return _ACTIVATIONS.get(name)


def _is_default_gate(module: torch.nn.Module) -> bool:
    gate = getattr(type(module), "_apply_gate", None)
    return getattr(gate, "__name__", "") == "_default_apply_gate" and gate.__module__.startswith("transformers.")


def experts_spec(module: torch.nn.Module) -> moe.ExpertsSpec | None:
    """The spec of an HF experts module that runs the grouped_mm implementation with the default
    gate, no biases and no post-expert norm; else None (it is traced op by op)."""
    config = getattr(module, "config", None)
    needed = ("has_gate", "is_transposed", "is_concatenated", "has_bias", "has_post_expert_norm", "down_proj")
    if config is None or not all(hasattr(module, a) for a in needed):
        return None
    if getattr(config, "_experts_implementation", None) != "grouped_mm" or not _is_default_gate(module):
        return None
    if module.has_bias or module.has_post_expert_norm or _activation(module) is None:
        return None
    return moe.ExpertsSpec(activation=_activation(module), gated=bool(module.has_gate),
                           concatenated=bool(module.is_concatenated), transposed=bool(module.is_transposed))


def expert_params(root: torch.nn.Module, name_of) -> frozenset[str]:
    """Names (by `name_of`) of the expert weights of every HF experts module traced as one
    routed-experts call: stored (experts, ...), what an `expert` mesh axis splits."""
    out = set()
    for module in root.modules():
        spec = experts_spec(module)
        if spec is not None:
            up = module.gate_up_proj if spec.gated else module.up_proj
            out.update(name_of(p) for p in (up, module.down_proj))
    return frozenset(n for n in out if n is not None)


def _routed_forward(module, spec: moe.ExpertsSpec, hidden_states, top_k_index, top_k_weights):
    """The experts' forward as one traced call of xtrain.ir.kernels.moe.routed_experts."""
    up = module.gate_up_proj if spec.gated else module.up_proj
    return torchax_interop.call_jax(moe.traced_call(spec), hidden_states, top_k_index, top_k_weights, up,
                                    module.down_proj)


@contextlib.contextmanager
def module_rules(root: torch.nn.Module):
    """While tracing, HF experts modules (see `experts_spec`) run `_routed_forward`."""
    def replacement(module):
        spec = experts_spec(module)
        return functools.partial(_routed_forward, module, spec) if spec is not None else None

    with torch_ops.patched_forwards(root, replacement) as patched:
        yield patched


def data_dependent_shape_error(op: str, where: str, owner: torch.nn.Module | None, model: str) -> str:
    """The message for op `op` (e.g. aten::nonzero) traced in module `where`."""
    msg = (f"torch op {op} in module {where!r} of {model} returns a tensor whose shape depends on tensor "
           "values, which a static-shape compiler cannot trace")
    config = getattr(owner, "config", None)
    impl = getattr(config, "_experts_implementation", None)
    if impl is not None:
        return (msg + f"; this HF experts module runs experts_implementation={impl!r}: build the model with "
                "experts_implementation='grouped_mm' (the default; tokens sorted by expert into a fixed-size "
                "buffer, traced as one grouped matmul) or 'batched_mm'")
    return msg + "; compute with fixed shapes instead (masks and torch.where, sort into a fixed-size buffer)"

"""torch.nn.Module -> named parameters/buffers + a pure JAX loss function (through torchax)."""
from __future__ import annotations

import contextlib
import copy
import functools
import re
from typing import Any, Callable, Mapping

import jax
import numpy as np
import torch
import torchax
from torch.nn.utils import stateless
from torchax import interop as torchax_interop

from xtrain.errors import OptionsError
from xtrain.frontend import (autograd_function, higher_order, moe, optim, options_scope, real_arith, sdpa, structure,
                             torch_ops, uniform_attention)
from xtrain.ir import interop, replay
from xtrain.ir.model import Model, TraceError, Trainable
from xtrain.ir.trace_options import TraceOptions

LossFn = Callable[..., Any]


def _shard_torch(fn: Callable, x: torch.Tensor):
    """xtrain.shard on a torch tensor: through torchax while traced, a no-op in eager torch."""
    return torchax_interop.call_jax(fn, x) if isinstance(x, torchax.tensor.Tensor) else x


interop.register(lambda x: isinstance(x, torch.Tensor), _shard_torch)


@functools.cache
def torchax_env() -> torchax.tensor.Environment:
    # The environment draws a PRNG key when built; built inside the first trace, that key
    # would be a tracer cached (leaked) past the trace and an equation of that graph only.
    with jax.ensure_compile_time_eval():
        env = torchax.default_env()
    torch_ops.install(env)
    moe.install(env)
    return env


def _dedup(named: list[tuple[str, torch.Tensor]]) -> tuple[list[str], dict[str, str], dict[int, str]]:
    """Unique names in order, alias -> canonical name for tied tensors, id(tensor) -> name."""
    canonical: dict[int, str] = {}
    names, aliases = [], {}
    for name, tensor in named:
        if id(tensor) in canonical:
            aliases[name] = canonical[id(tensor)]
        else:
            canonical[id(tensor)] = name
            names.append(name)
    return names, aliases, canonical


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(jax.numpy.bfloat16)
    return t.numpy().copy()


def _real_shape(buffer: torch.Tensor) -> jax.ShapeDtypeStruct:
    """The shape a complex buffer is held in (initial_buffers): real, with a trailing (re, im) dim."""
    real = torch.view_as_real(torch.empty(0, dtype=buffer.dtype)).dtype
    return jax.ShapeDtypeStruct((*buffer.shape, 2), _np_dtype(real))


def _as_real(x: np.ndarray) -> np.ndarray:
    """A complex array as real_arith.to_real lays it out: a trailing (re, im) dimension."""
    return np.stack([x.real, x.imag], axis=-1)


def _as_complex(x) -> np.ndarray:
    x = np.asarray(x)
    return (x[..., 0] + 1j * x[..., 1]).astype(np.complex64 if x.dtype == np.float32 else np.complex128)


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype == torch.bfloat16:
        return np.dtype(jax.numpy.bfloat16)
    return torch.empty((), dtype=dtype).numpy().dtype


class _ModuleScopes:
    """Forward hooks that open a jax.named_scope per torch module, so every traced equation
    carries the module path it came from, and keep the current path for error messages."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.stack: list[tuple[str, Any]] = []

    def current(self) -> str:
        return self.stack[-1][0] if self.stack else ""

    def _enter(self, path: str, _module, _args):
        scope = jax.named_scope(path)
        scope.__enter__()
        self.stack.append((path, scope))

    def _exit(self, _module, _args, _out):
        self.stack.pop()[1].__exit__(None, None, None)

    @contextlib.contextmanager
    def active(self):
        handles = []
        for path, sub in self.module.named_modules():
            if path:
                handles.append(sub.register_forward_pre_hook(functools.partial(self._enter, path)))
                handles.append(sub.register_forward_hook(self._exit))  # on error the stack keeps the failing path
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            while self.stack:
                self.stack.pop()[1].__exit__(None, None, None)


@contextlib.contextmanager
def _training_mode(module: torch.nn.Module, training: bool):
    modes = {m: m.training for m in module.modules()}
    module.train(training)
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode


def _op_name(err: Exception) -> str:
    match = re.search(r"name (\S+) has no lowering", str(err))
    return match.group(1) if match else str(err)


# torchax passes ops outside the namespaces it intercepts (aten, ...), e.g. torch.library
# custom ops, through to torch, whose dispatch back to the torchax tensor fails with this.
_OUTSIDE_ENV = "torchax Tensors can only do math within the torchax environment"


def _dispatched_op(err: BaseException) -> str:
    """The torch op being dispatched where `err` was raised (innermost frame with one)."""
    name, tb = "<unknown op>", err.__traceback__
    while tb is not None:
        func = tb.tb_frame.f_locals.get("func")
        if isinstance(func, torch._ops.OpOverload):
            name = func.name()
        tb = tb.tb_next
    return name


def _is_sum_and_count(out) -> bool:
    return (isinstance(out, tuple) and len(out) == 2
            and all(isinstance(x, torch.Tensor) and x.ndim == 0 for x in out))


class TorchModel(Model):
    """A torch.nn.Module whose forward returns the loss (or is scored by `loss_fn`).

    Args:
        module: the model. Its parameters and buffers are copied at construction.
        loss_fn: optional `loss_fn(module, *batch) -> scalar tensor`, written in torch, for
            models whose forward does not return the loss.
    """

    def __init__(self, module: torch.nn.Module, loss_fn: LossFn | None = None):
        self.module = module
        self.loss_fn = loss_fn
        self.name = type(module).__name__
        named_params = list(module.named_parameters(remove_duplicate=False))
        self.param_names, self.param_aliases, self._param_ids = _dedup(named_params)
        self._buffer_names, self.buffer_aliases, _ = _dedup(list(module.named_buffers(remove_duplicate=False)))
        self._frozen = {n for n, p in named_params if not p.requires_grad}
        self._paths = frozenset(p for p, _ in module.named_modules() if p)
        self._state_keys = list(module.state_dict().keys())
        self._attention = uniform_attention.Tracer()  # one structure per attention shape (Gemma's window layers)
        self._real = real_arith.Realifier()  # complex arithmetic as real pairs (Meta's rotary embeddings)
        # complex buffers (rotary tables) are held as real arrays with a trailing (re, im) dimension
        self._complex_buffers = frozenset(n for n, b in module.named_buffers() if b.is_complex())
        self.options = TraceOptions()
        # traced once per input signature and trace options, replayed after (a plan search lowers
        # many plans of one model); shared with the specialised copies, which key it by their options
        self._replay = replay.Replay(self.name)

    def specialised(self, options: TraceOptions) -> "TorchModel":
        """This model traced under `options`; installed on the module only while it is traced."""
        if options == self.options:
            return self
        other = copy.copy(self)
        other.options, other._attention, other._real = options, uniform_attention.Tracer(), real_arith.Realifier()
        return other

    # -- state ---------------------------------------------------------------------------
    def initial_params(self) -> dict[str, np.ndarray]:
        named = dict(self.module.named_parameters())
        meta = [n for n in self.param_names if named[n].is_meta]
        if meta:
            raise OptionsError(
                f"{len(meta)} parameters of {self.name} are on the meta device (e.g. {meta[:3]}): they have shapes but "
                "no values. Load them while compiling with xtrain.compile(..., init_from='model.safetensors' or an HF "
                "checkpoint directory), or build the model on the CPU")
        return {n: _to_numpy(named[n]) for n in self.param_names}

    def param_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        # from shapes alone: works for a module built on the meta device
        named = dict(self.module.named_parameters())
        return {n: jax.ShapeDtypeStruct(tuple(named[n].shape), _np_dtype(named[n].dtype)) for n in self.param_names}

    def initial_buffers(self, stored=None) -> dict[str, np.ndarray]:
        """The module's buffers; those in `stored` (read from a checkpoint, for sharded init)
        taken from there. A buffer left on the meta device and not stored is an error."""
        named, stored = dict(self.module.named_buffers()), stored or {}
        out = {}
        for n in self._buffer_names:
            if n in stored:
                out[n] = np.asarray(stored[n]).astype(_np_dtype(named[n].dtype))
                out[n] = _as_real(out[n]) if n in self._complex_buffers else out[n]
            elif named[n].is_meta:
                raise OptionsError(f"buffer {n!r} of {self.name} is on the meta device and not in the checkpoint: "
                                 "build the model under `with xtrain.checkpoint.meta_params():` (parameters on meta, "
                                 "buffers real) instead of torch.device('meta'), or store the buffer in the file")
            else:
                out[n] = _as_real(_to_numpy(named[n])) if n in self._complex_buffers else _to_numpy(named[n])
        return out

    def buffer_names(self) -> list[str]:
        return list(self._buffer_names)

    def buffer_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        # from shapes alone: a buffer on the meta device (torch.device("meta")) plans too
        named = dict(self.module.named_buffers())
        return {n: _real_shape(named[n]) if n in self._complex_buffers else
                jax.ShapeDtypeStruct(tuple(named[n].shape), _np_dtype(named[n].dtype)) for n in self._buffer_names}

    def trainable(self) -> dict[str, bool]:
        return {n: n not in self._frozen for n in self.param_names}

    def name_of(self, tensor: torch.Tensor) -> str | None:
        """The canonical parameter name of a parameter tensor of this module."""
        return self._param_ids.get(id(tensor))

    def module_paths(self) -> frozenset[str]:
        return self._paths

    def export_state(self, params, buffers) -> dict[str, np.ndarray]:
        buffers = {n: _as_complex(b) if n in self._complex_buffers else b for n, b in buffers.items()}
        full = {**params, **buffers}
        for alias, name in {**self.param_aliases, **self.buffer_aliases}.items():
            full[alias] = full[name]
        return {k: full[k] for k in self._state_keys}

    # -- the pure function ---------------------------------------------------------------
    def apply(self, params: Mapping[str, Any], buffers: Mapping[str, Any], key, batch: tuple,
              *, training: bool) -> tuple[Any, dict[str, Any]]:
        trace = functools.partial(self._apply, training=training)
        attention = lambda *args: self._attention.apply(trace, args, extra=(training,))
        real = lambda *args: self._real.apply(attention, args, extra=(training,))
        return self._replay.apply(real, (params, buffers, key, batch), extra=(training, self.options, sdpa._backend()))

    def _apply(self, params, buffers, key, batch: tuple, *, training: bool):
        env = torchax_env()
        scopes = _ModuleScopes(self.module)
        # Factory calls without a device (torch.arange(t), torch.ones(...)) must build traced
        # arrays, not host tensors: make "jax" the default device while tracing.
        with env, torch.device("jax"), env.override_property(prng=key), scopes.active(), \
                _training_mode(self.module, training), torch_ops.module_rules(self.module), higher_order.traced(), \
                moe.module_rules(self.module), options_scope.installed(self.module, self.options), \
                autograd_function.honoured(env, scopes.current):
            buffers = {n: real_arith.to_complex(b) if n in self._complex_buffers else b for n, b in buffers.items()}
            t_params, t_buffers, t_batch = env.j2t_iso((dict(params), buffers, tuple(batch)))
            full = {**t_params, **t_buffers}
            for alias, name in {**self.param_aliases, **self.buffer_aliases}.items():
                full[alias] = full[name]
            with stateless._reparametrize_module(self.module, full):
                out = self._call(t_batch, scopes)
            loss = self._loss_of(out, t_batch)
            return env.t2j_iso(loss), env.t2j_iso({k: t_buffers[k] for k in buffers})

    def _call(self, batch: tuple, scopes: _ModuleScopes):
        try:
            if self.loss_fn is None:
                return self.module(*batch)
            return self.loss_fn(self.module, *batch)
        except torchax.tensor.OperatorNotFound as err:
            raise self._untranslatable(_op_name(err), scopes) from err
        except moe.TopKTooLarge as err:
            raise TraceError(moe.top_k_error(err, scopes.current() or f"{self.name}.forward", self.name)) from err
        except AssertionError as err:
            if _OUTSIDE_ENV not in str(err):
                raise
            raise self._untranslatable(_dispatched_op(err), scopes) from err
        except jax.errors.ConcretizationTypeError as err:
            where = scopes.current() or f"{self.name}.forward (top level)"
            op = _dispatched_op(err)
            if op in moe.DATA_DEPENDENT_SHAPE_OPS:
                owner = self.module.get_submodule(scopes.current()) if scopes.current() else self.module
                raise TraceError(moe.data_dependent_shape_error(op, where, owner, self.name)) from err
            raise TraceError(
                f"module {where!r} of {self.name} branches on tensor values (data-dependent "
                "Python control flow), which cannot be compiled; use torch.where or fixed "
                "shapes instead") from err

    def _untranslatable(self, op: str, scopes: _ModuleScopes) -> TraceError:
        where = scopes.current() or f"{self.name}.forward (top level)"
        return TraceError(
            f"xtrain cannot translate torch op {op} used in module {where!r} "
            f"({self.name}); replace it with supported torch ops there, or register a JAX "
            "lowering with torchax's env.override_op_definition")

    def _loss_of(self, out, batch: tuple):
        loss = out
        if not isinstance(out, torch.Tensor):
            loss = getattr(out, "loss", None)
            if loss is None and isinstance(out, Mapping):
                loss = out.get("loss")
        if isinstance(loss, torch.Tensor) and loss.ndim == 0:
            return loss
        if _is_sum_and_count(out):  # (loss sum, number of terms): exact under accumulation
            return tuple(out)
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        source = f"{self.name}.forward" if self.loss_fn is None else "loss_fn"
        raise TraceError(
            f"{source} returned {got}, not a scalar loss. Return the loss from forward (or an "
            "HF-style output with .loss), a (loss sum, term count) pair of scalars, or pass "
            "loss_fn=lambda model, *batch: <scalar> to xtrain.compile")


def wrap(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, loss_fn: LossFn | None = None) -> Trainable:
    """What `xtrain.compile(module, mesh, optimizer=torch.optim....)` trains: the module as a
    Model, its optimizer as optax with per-group learning rates, and its structure."""
    if optimizer is None:
        raise OptionsError("xtrain.compile of a torch module needs optimizer=torch.optim.<...>(model.parameters(), ...)")
    model = TorchModel(module, loss_fn=loss_fn)
    tx, groups = optim.from_torch(optimizer, model.name_of, model.trainable())
    return Trainable(model=model, tx=tx, optimized=frozenset(groups),
                     learning_rates=optim.LearningRates(optimizer, groups), structure=structure.describe(module),
                     experts=moe.expert_params(module, model.name_of))


def is_module(x) -> bool:
    return isinstance(x, torch.nn.Module)

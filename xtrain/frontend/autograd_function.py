"""torch.autograd.Function -> jax.custom_vjp: a Function's own `backward` defines its gradient,
as in torch, not autodiff of its `forward` (a straight-through estimator rounds in the forward
and passes the gradient through; autodiff of `round` would give zero).

While a module is traced, `Function.apply` on torchax tensors builds a custom VJP:

    primal   the Function's forward, traced (ctx.needs_input_grad all False)
    fwd      the forward again with ctx.needs_input_grad from JAX's perturbed inputs; its
             residuals are the tensors of ctx.save_for_backward and tensors kept on ctx
    bwd      the Function's backward, traced on the residuals and the output cotangents

Every tensor argument is an input of the custom VJP (tensors nested in lists get no gradient,
as in torch); other arguments are constants of the trace. Outputs marked with
ctx.mark_non_differentiable carry no gradient. The explicit lowering interprets the resulting
`custom_vjp_call` on shards like any other (xtrain.lowering.explicit.rules.control).

Refused, naming the Function and the module that called it: a forward that reads tensors it was
not passed (a closed-over parameter or random key: its gradient would be lost), in-place
changes of inputs (ctx.mark_dirty), non-tensor outputs, and a backward that returns the wrong
number of gradients or a gradient for a non-tensor input.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import torch
import torch.utils._pytree as torch_tree
from torch.autograd.function import Function, FunctionCtx
from torch.utils import checkpoint as torch_checkpoint

from xtrain.ir.model import TraceError

# Functions whose backward is the gradient of their forward by construction (torch's reentrant
# activation checkpointing recomputes the forward under autograd): traced as they are.
TRANSPARENT = (torch_checkpoint.CheckpointFunction,)


class _Context(FunctionCtx):
    """The `ctx` a Function's forward and backward see while traced."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.to_save: tuple = ()
        self.dirty_tensors: tuple = ()
        self.non_differentiable: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors):
        self.to_save = tensors

    def save_for_forward(self, *tensors):  # forward-mode AD only: nothing to keep here
        pass

    @property
    def saved_tensors(self) -> tuple:
        return self.to_save

    saved_variables = saved_tensors


_OWN = frozenset(vars(_Context(())))


@dataclasses.dataclass
class _Call:
    """One `Function.apply` call being lowered."""

    cls: type
    env: Any                          # the torchax environment
    module: str                       # the module path the call was made from
    flat: list                        # the arguments, flattened (torch pytree)
    spec: Any                         # their structure
    tensors: list[int]                # positions in `flat` of the tensor arguments
    direct: list[int]                 # per forward argument: its position in `flat`, or -1 (not a tensor)
    ctx: _Context | None = None       # the context of the latest forward trace
    kept: list = dataclasses.field(default_factory=list)  # ctx attributes holding tensors
    frozen: list[int] = dataclasses.field(default_factory=list)  # outputs marked non-differentiable
    single: bool = True               # forward returned one tensor (not a tuple)

    @property
    def name(self) -> str:
        return f"torch.autograd.Function {self.cls.__qualname__} (called in module {self.module or '<top level>'!r})"

    def refuse(self, why: str) -> TraceError:
        return TraceError(f"{self.name}: {why}")

    # -- running the user's code ---------------------------------------------------------
    @contextlib.contextmanager
    def _tracing(self):
        """torchax active, as when the model is traced (fwd and bwd are traced later, by autodiff)."""
        with self.env, torch.device("jax"), jax.named_scope(self.module or self.cls.__name__):
            yield

    def _args(self, arrays) -> list:
        flat = list(self.flat)
        for position, value in zip(self.tensors, self.env.j2t_iso(list(arrays))):
            flat[position] = value
        return torch_tree.tree_unflatten(flat, self.spec)

    def forward(self, arrays, needs: tuple[bool, ...]) -> list:
        """The forward on `arrays` (the tensor arguments); returns its outputs as arrays."""
        with self._tracing():
            args, ctx = self._args(arrays), _Context(needs)
            if _has_setup_context(self.cls):
                out = self.cls.forward(*args)
                self.cls.setup_context(ctx, tuple(args), out)
            else:
                out = self.cls.forward(ctx, *args)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            bad = [i for i, o in enumerate(outs) if not isinstance(o, torch.Tensor)]
            if bad:
                raise self.refuse(f"forward returned a {type(outs[bad[0]]).__name__} as output {bad[0]}; xtrain "
                                  "lowers Functions whose forward returns tensors (return other values outside apply)")
            if ctx.dirty_tensors:
                raise self.refuse("forward changes an input in place (ctx.mark_dirty), which a traced program cannot "
                                  "show its caller; return a new tensor instead")
            self.ctx = ctx
            self.frozen = [i for i, o in enumerate(outs) if any(o is t for t in ctx.non_differentiable)]
            self.single = not isinstance(out, (tuple, list))
            return [self.env.t2j_iso(o) for o in outs]

    def residuals(self) -> list:
        """Tensors the backward reads: ctx.save_for_backward's, then those kept on ctx."""
        saved = [t for t in self.ctx.to_save if isinstance(t, torch.Tensor)]
        self.kept = []
        for name, value in vars(self.ctx).items():
            leaves, spec = torch_tree.tree_flatten(value)
            if name not in _OWN and any(isinstance(x, torch.Tensor) for x in leaves):
                self.kept.append((name, spec, [isinstance(x, torch.Tensor) for x in leaves], leaves))
                saved += [x for x in leaves if isinstance(x, torch.Tensor)]
        return [self.env.t2j_iso(t) for t in saved]

    def backward(self, res: list, cts: list, needs: tuple[bool, ...]) -> list:
        """The user's backward on the residuals and output cotangents; one cotangent per tensor input."""
        with self._tracing():
            ctx = self._context_for_backward(self.env.j2t_iso(list(res)), needs)
            grads = [None if g is None else self.env.j2t_iso(g) for g in cts]
            try:
                out = self.cls.backward(ctx, *grads)
            except jax.errors.UnexpectedTracerError as err:
                raise self.refuse("backward reads a tensor it was not given (closed over, e.g. a module's "
                                  "parameter); save it with ctx.save_for_backward or pass it to apply") from err
            return self._input_grads(out)

    def _context_for_backward(self, res: list, needs) -> _Context:
        ctx = _Context(needs)
        for name, value in vars(self.ctx).items():
            if name not in _OWN:
                setattr(ctx, name, value)
        values = iter(res)
        ctx.to_save = tuple(next(values) if isinstance(t, torch.Tensor) else t for t in self.ctx.to_save)
        ctx.non_differentiable, ctx.materialize_grads = self.ctx.non_differentiable, self.ctx.materialize_grads
        for name, spec, is_tensor, leaves in self.kept:
            setattr(ctx, name, torch_tree.tree_unflatten([next(values) if t else x for t, x in zip(is_tensor, leaves)],
                                                         spec))
        return ctx

    def _input_grads(self, out) -> list:
        grads = list(out) if isinstance(out, (tuple, list)) else [out]
        n = len(self.direct)
        if len(grads) < n or any(g is not None for g in grads[n:]):
            raise self.refuse(f"backward returned {len(grads)} gradients but forward takes {n} inputs: return one "
                              "per forward input (None for those without a gradient)")
        by_position = {}
        for index, (position, grad) in enumerate(zip(self.direct, grads)):
            if grad is None:
                continue
            if position < 0:
                raise self.refuse(f"backward returned a gradient for input {index}, which is not a tensor; return "
                                  "None there")
            by_position[position] = self.env.t2j_iso(grad)
        return [by_position.get(p) for p in self.tensors]


def _has_setup_context(cls) -> bool:
    """The Function sets ctx up in `setup_context` (forward takes no ctx)."""
    return cls.setup_context is not Function.setup_context


def _fitted(grad, like: jax.ShapeDtypeStruct, call: _Call, index: int):
    """A gradient returned for a tensor input, summed down to its shape (as torch does for a
    broadcast gradient) and cast to its dtype; None -> None (zero)."""
    if grad is None:
        return None
    if not jnp.issubdtype(like.dtype, jnp.inexact):
        return None  # integer inputs have no gradient
    if grad.shape != like.shape:
        extra = grad.ndim - len(like.shape)
        if extra < 0 or any(g != n and n != 1 for g, n in zip(grad.shape[extra:], like.shape)):
            raise call.refuse(f"backward returned a gradient of shape {list(grad.shape)} for input {index} of shape "
                              f"{list(like.shape)}")
        grad = grad.sum(tuple(range(extra)))
        grad = grad.sum(tuple(d for d, n in enumerate(like.shape) if n == 1 and grad.shape[d] != 1), keepdims=True)
    return grad.astype(like.dtype)


def _instantiated(ct, materialize: bool):
    if type(ct).__name__ in ("SymbolicZero", "Zero"):
        return jnp.zeros(ct.shape, ct.dtype) if materialize else None
    return ct


def lower_call(call: _Call) -> Any:
    """`call` as a jax.custom_vjp applied to its tensor arguments; returns torch outputs."""
    arrays = [call.env.t2j_iso(call.flat[p]) for p in call.tensors]
    likes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    none = tuple(False for _ in call.direct)
    _refuse_closures(call, arrays, none)

    def needs(perturbed) -> tuple[bool, ...]:
        which = dict(zip(call.tensors, perturbed))
        return tuple(p >= 0 and bool(which.get(p)) for p in call.direct)

    flags: list = []  # needs_input_grad of the latest fwd trace (bools: not residuals)

    def fwd(*primals):
        flags[:] = needs([p.perturbed for p in primals])
        outs = call.forward([p.value for p in primals], tuple(flags))
        return outs, call.residuals()

    def bwd(res, cts):
        grads = call.backward(res, [_instantiated(c, call.ctx.materialize_grads) for c in cts], tuple(flags))
        return tuple(_fitted(g, like, call, i) for i, (g, like) in enumerate(zip(grads, likes)))

    fn = jax.custom_vjp(lambda *a: call.forward(a, none))
    _name(fwd, bwd, call)
    fn.defvjp(fwd, bwd, symbolic_zeros=True)
    outs = [jax.lax.stop_gradient(o) if i in call.frozen else o for i, o in enumerate(fn(*arrays))]
    torch_outs = call.env.j2t_iso(outs)
    return torch_outs[0] if call.single else tuple(torch_outs)


def _refuse_closures(call: _Call, arrays: list, none: tuple) -> None:
    """A forward that reads tensors it was not passed would lose their gradient (torch too runs
    the forward without autograd, but a silent zero is what this module exists to prevent)."""
    try:
        closed = jax.make_jaxpr(lambda *a: call.forward(a, none))(*arrays)
    except jax.errors.UnexpectedTracerError as err:
        raise call.refuse("forward reads a tensor it was not passed") from err
    if any(isinstance(c, jax.core.Tracer) for c in closed.consts):
        raise call.refuse("forward reads tensors it was not passed (closed over: a module's parameter, a random key "
                          "for dropout, ...), whose gradient through it would be lost; pass every tensor it uses to "
                          f"{call.cls.__name__}.apply(...)")


def _name(fwd: Callable, bwd: Callable, call: _Call) -> None:
    """Names the rules after the Function and its constant arguments: the layer scan treats two
    layers' calls as the same only when these match (the rules are opaque to it)."""
    statics = repr([x for i, x in enumerate(call.flat) if i not in call.tensors])
    tag = f"{call.cls.__qualname__}.{zlib.crc32(statics.encode()):08x}"
    fwd.__name__, bwd.__name__ = f"{tag}.forward", f"{tag}.backward"


def _traced(values) -> bool:
    return any(isinstance(x, torch.Tensor) and type(x).__module__.startswith("torchax")
               for x in torch_tree.tree_leaves(values))


@contextlib.contextmanager
def honoured(env, where: Callable[[], str]):
    """While tracing: `Function.apply` on torchax tensors is lowered as a custom VJP (`where()`
    names the module making the call, for errors)."""
    original = Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls in TRANSPARENT or not _traced((args, kwargs)):
            return original.__func__(cls, *args, **kwargs)
        if _has_setup_context(cls):  # as torch binds them: defaults filled in, keywords by position
            bound = inspect.signature(cls.forward).bind(*args, **kwargs)
            bound.apply_defaults()
            args, kwargs = bound.args, bound.kwargs
        if kwargs:
            raise TraceError(f"torch.autograd.Function {cls.__qualname__} (called in module {where()!r}): pass its "
                             "arguments by position (as Function.apply takes them)")
        flat, spec = torch_tree.tree_flatten(list(args))
        tensors = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        return lower_call(_Call(cls, env, where(), flat, spec, tensors, _direct(args)))

    Function.apply = classmethod(apply)
    try:
        yield
    finally:
        Function.apply = original


def _direct(args: tuple) -> list[int]:
    """Per top-level argument: its position among the flattened leaves if it is a tensor, else -1."""
    out, position = [], 0
    for a in args:
        n = len(torch_tree.tree_leaves(a))
        out.append(position if isinstance(a, torch.Tensor) else -1)
        position += n
    return out

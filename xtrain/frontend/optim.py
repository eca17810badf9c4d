"""torch.optim optimizers -> optax transformations with the same update rule.

Supported: SGD (momentum, nesterov, weight_decay), Adam (betas, eps, weight_decay as L2 added
to the gradient, as torch does), AdamW (decoupled weight decay), and xtrain's own LARS and
LAMB (xtrain.frontend.large_batch: momentum / Adam, then each layer's trust ratio, whose norms
the step sums across shards: xtrain.ir.trust_ratio), each with param groups.

The learning rate is not baked into the program: every supported rule ends in "multiply by
-lr", so the transformation is built with lr=1 and the step multiplies each group's update by
that group's current lr, read from `optimizer.param_groups` on the host before every step
(`LearningRates`). A torch LR scheduler stepping the optimizer's groups therefore works as in
torch, and a new lr value never recompiles the step.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np
import optax
import torch

from xtrain.errors import OptionsError, UnsupportedError
from xtrain.frontend.large_batch import LAMB, LARS
from xtrain.ir.stacked import member
from xtrain.ir.trust_ratio import scale_by_trust_ratio

# Options that change the update rule and that xtrain does not translate (value = torch default).
_UNSUPPORTED = {
    "SGD": {"dampening": 0, "maximize": False},
    "Adam": {"amsgrad": False, "maximize": False},
    "AdamW": {"amsgrad": False, "maximize": False},
    "LARS": {},
    "LAMB": {},
}
# Options that only select a torch kernel; they cannot change the result.
_IGNORED = {"foreach", "fused", "capturable", "differentiable", "initial_lr"}
_KNOWN = {
    "SGD": {"lr", "momentum", "nesterov", "weight_decay"},
    "Adam": {"lr", "betas", "eps", "weight_decay", "decoupled_weight_decay"},
    "AdamW": {"lr", "betas", "eps", "weight_decay", "decoupled_weight_decay"},
    "LARS": {"lr", "momentum", "weight_decay", "trust_coefficient", "eps", "nesterov", "adapt"},
    "LAMB": {"lr", "betas", "eps", "weight_decay", "trust_coefficient", "adapt"},
}
# The classes each name must be: torch's own, or xtrain's (another package's LAMB has other rules).
_CLASSES = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "LARS": LARS, "LAMB": LAMB}


def _sgd(g: Mapping) -> optax.GradientTransformation:
    parts = []
    if g["weight_decay"]:
        parts.append(optax.add_decayed_weights(g["weight_decay"]))
    if g["momentum"]:
        parts.append(optax.trace(decay=g["momentum"], nesterov=g["nesterov"]))
    parts.append(optax.scale(-g["lr"]))
    return optax.chain(*parts)


def _adam(g: Mapping) -> optax.GradientTransformation:
    if g.get("decoupled_weight_decay", False):  # torch's Adam(decoupled_weight_decay=True) is AdamW
        return _adamw(g)
    b1, b2 = g["betas"]
    parts = [optax.add_decayed_weights(g["weight_decay"])] if g["weight_decay"] else []
    parts += [optax.scale_by_adam(b1=b1, b2=b2, eps=g["eps"]), optax.scale(-g["lr"])]
    return optax.chain(*parts)


def _adamw(g: Mapping) -> optax.GradientTransformation:
    if not g.get("decoupled_weight_decay", True):
        return _adam(g)
    b1, b2 = g["betas"]
    return optax.adamw(g["lr"], b1=b1, b2=b2, eps=g["eps"], weight_decay=g["weight_decay"])


def _lars(g: Mapping) -> optax.GradientTransformation:
    parts = [optax.add_decayed_weights(g["weight_decay"])] if g["weight_decay"] else []
    if g["adapt"]:
        parts.append(scale_by_trust_ratio(g["trust_coefficient"], g["eps"]))
    if g["momentum"]:
        parts.append(optax.trace(decay=g["momentum"], nesterov=g["nesterov"]))
    return optax.chain(*parts, optax.scale(-g["lr"]))


def _lamb(g: Mapping) -> optax.GradientTransformation:
    b1, b2 = g["betas"]
    parts = [optax.scale_by_adam(b1=b1, b2=b2, eps=g["eps"])]
    parts += [optax.add_decayed_weights(g["weight_decay"])] if g["weight_decay"] else []
    parts += [scale_by_trust_ratio(g["trust_coefficient"], 0.0)] if g["adapt"] else []
    return optax.chain(*parts, optax.scale(-g["lr"]))


_BUILDERS: dict[str, Callable[[Mapping], optax.GradientTransformation]] = {
    "SGD": _sgd, "Adam": _adam, "AdamW": _adamw, "LARS": _lars, "LAMB": _lamb,
}


def _name(kind: str) -> str:
    return f"xtrain.optim.{kind}" if kind in ("LARS", "LAMB") else f"torch.optim.{kind}"


def _shown(cls: type) -> str:
    """A class as users import it (torch.optim.RMSprop, not torch.optim.rmsprop.RMSprop)."""
    module = "torch.optim" if cls.__module__.startswith("torch.optim") else cls.__module__
    return f"{module}.{cls.__qualname__}"


def _check_group(kind: str, index: int, group: Mapping) -> None:
    for option, default in _UNSUPPORTED[kind].items():
        if option in group and group[option] != default:
            raise UnsupportedError(
                f"{_name(kind)} option {option}={group[option]!r} (param group {index}) is not "
                f"supported by xtrain; supported {kind} options: {', '.join(sorted(_KNOWN[kind]))}")
    unknown = set(group) - _KNOWN[kind] - set(_UNSUPPORTED[kind]) - _IGNORED - {"params"}
    if unknown:
        raise UnsupportedError(
            f"{_name(kind)} option(s) {sorted(unknown)} (param group {index}) are not "
            f"supported by xtrain; supported {kind} options: {', '.join(sorted(_KNOWN[kind]))}")
    if float(group["lr"]) != group["lr"] or isinstance(group["lr"], torch.Tensor):
        raise OptionsError(f"{_name(kind)} lr must be a Python float (param group {index})")


def from_torch(optimizer: torch.optim.Optimizer, name_of: Callable[[torch.Tensor], str | None],
               trainable: Mapping[str, bool]) -> tuple[optax.GradientTransformation, dict[str, int]]:
    """Translates a torch optimizer.

    Args:
        optimizer: the user's torch optimizer over the model's parameters.
        name_of: maps a parameter tensor to its canonical name (None if not the model's).
        trainable: the model's parameters and whether each requires grad.

    Returns:
        (optax transformation over the dict of optimized parameters, name -> param group index).
        Parameters in no group are not optimized, as in torch.
    """
    kind = type(optimizer).__name__
    if kind not in _BUILDERS or not isinstance(optimizer, _CLASSES[kind]):
        raise UnsupportedError(
            f"optimizer {_shown(type(optimizer))} is not supported by xtrain; "
            f"supported: {', '.join(_name(k) for k in _BUILDERS)}")
    groups: dict[str, int] = {}
    transforms = {}
    for index, group in enumerate(optimizer.param_groups):
        _check_group(kind, index, group)
        transforms[str(index)] = _BUILDERS[kind]({**group, "lr": 1.0})  # lr enters per step
        for p in group["params"]:
            name = name_of(p)
            if name is None:
                raise OptionsError(
                    f"param group {index} of the optimizer holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the compiled model; build the optimizer over "
                    "model.parameters()")
            if trainable.get(name, False):
                groups[name] = index
    if len(transforms) == 1:
        return transforms["0"], groups
    labels = lambda params: {n: str(groups[member(n, 0)]) for n in params}  # a stacked family: its layer 0's
    return optax.multi_transform(transforms, labels), groups


@dataclasses.dataclass(frozen=True)
class LearningRates:
    """The current lr of each param group of a torch optimizer, read on the host every step.

    Attributes:
        optimizer: the user's optimizer; a torch LR scheduler writes `param_groups[i]["lr"]`.
        groups: parameter name -> param group index (from `from_torch`).
    """

    optimizer: torch.optim.Optimizer
    groups: Mapping[str, int]

    def current(self) -> np.ndarray:
        """(num_groups,) float32: the lr of every param group now."""
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        return np.asarray(lrs, dtype=np.float32)

    def mark_stepped(self) -> None:
        """Tells torch LR schedulers that the optimizer stepped (it steps inside the compiled
        program), so `scheduler.step()` after `step(*batch)` does not warn about call order."""
        self.optimizer._opt_called = True

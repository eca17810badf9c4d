"""LARS and LAMB as torch optimizers: the large-batch optimizers torch does not ship.

They are ordinary `torch.optim.Optimizer`s, so a script runs them eagerly in torch (which is
also xtrain's test oracle) and `xtrain.compile` translates them to optax like SGD and AdamW
(xtrain.frontend.optim; the trust ratio: xtrain.ir.trust_ratio).

Both scale each parameter's update d by its trust ratio

    r = trust_coefficient * ||w|| / (||d|| + eps),   r = 1 where ||w|| or ||d|| is 0,

    LARS (arXiv:1708.03888)   d = g + weight_decay * w;  buf = momentum * buf + r * d;
                              w -= lr * buf   (nesterov: w -= lr * (r * d + momentum * buf))
    LAMB (arXiv:1904.00962)   Adam's bias-corrected m_hat / (sqrt(v_hat) + eps), plus
                              weight_decay * w, is d;  w -= lr * r * d   (eps of Adam; the trust
                              ratio adds none)

The momentum buffer of LARS holds unscaled steps and the lr multiplies it, as torch's SGD
does: with a constant lr this is optax.lars (which scales by the lr before its momentum), and
an lr schedule changes the step at once rather than through the buffer.

Param groups with `adapt=False` skip the trust ratio (r = 1): the usual exclusion of biases and
normalisation weights, usually with weight_decay=0 too (`exclude_from_adaptation` builds such
groups).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from xtrain.errors import OptionsError


def _trust_ratio(w: torch.Tensor, d: torch.Tensor, coefficient: float, eps: float) -> torch.Tensor:
    w_norm, d_norm = torch.linalg.vector_norm(w), torch.linalg.vector_norm(d)
    ratio = coefficient * w_norm / (d_norm + eps)
    return torch.where((w_norm > 0) & (d_norm > 0), ratio, torch.ones_like(ratio))


def _check(name: str, value, ok: bool, valid: str) -> None:
    if not ok:
        raise OptionsError(f"{name}={value!r} is invalid: {valid}")


def _closure_loss(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class LARS(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling: SGD with momentum whose step per parameter is scaled by
    its trust ratio (module docstring for the rule).

    Args:
        params: parameters or param groups (a group may set any option below).
        lr: learning rate.
        momentum: momentum factor (0: none).
        weight_decay: L2 factor added to the gradient before the trust ratio.
        trust_coefficient: eta, the trust ratio's scale.
        eps: added to the update norm in the trust ratio.
        nesterov: Nesterov momentum.
        adapt: apply the trust ratio (False for biases and norm weights).
    """

    def __init__(self, params: Iterable, lr: float = 1.0, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 0.0, nesterov: bool = False, adapt: bool = True):
        _check("lr", lr, lr >= 0, "use a learning rate >= 0")
        _check("momentum", momentum, 0 <= momentum < 1, "use 0 <= momentum < 1")
        _check("weight_decay", weight_decay, weight_decay >= 0, "use weight_decay >= 0")
        _check("trust_coefficient", trust_coefficient, trust_coefficient > 0, "use a trust coefficient > 0")
        _check("eps", eps, eps >= 0, "use eps >= 0")
        _check("nesterov", nesterov, not nesterov or momentum > 0, "Nesterov momentum needs momentum > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov, adapt=adapt))

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        d = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad.clone()
        if group["adapt"]:
            d.mul_(_trust_ratio(p, d, group["trust_coefficient"], group["eps"]))
        if group["momentum"]:
            state = self.state[p]
            buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
            buf.mul_(group["momentum"]).add_(d)
            d = d.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
        p.add_(d, alpha=-group["lr"])


class LAMB(torch.optim.Optimizer):
    """Layer-wise Adaptive Moments for Batch training: Adam (decoupled weight decay) whose step
    per parameter is scaled by its trust ratio (module docstring for the rule).

    Args:
        params: parameters or param groups (a group may set any option below).
        lr: learning rate.
        betas: Adam's moment decays.
        eps: Adam's epsilon (added to sqrt(v_hat)).
        weight_decay: decoupled weight decay, added to the Adam step before the trust ratio.
        trust_coefficient: the trust ratio's scale (1 in the paper).
        adapt: apply the trust ratio (False for biases and norm weights).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, trust_coefficient: float = 1.0, adapt: bool = True):
        _check("lr", lr, lr >= 0, "use a learning rate >= 0")
        _check("betas", betas, len(betas) == 2 and all(0 <= b < 1 for b in betas), "use two decays in [0, 1)")
        _check("eps", eps, eps >= 0, "use eps >= 0")
        _check("weight_decay", weight_decay, weight_decay >= 0, "use weight_decay >= 0")
        _check("trust_coefficient", trust_coefficient, trust_coefficient > 0, "use a trust coefficient > 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, adapt=adapt))

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        (b1, b2), g = group["betas"], p.grad
        state = self.state[p]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] += 1
        t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        d = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + group["eps"])
        if group["weight_decay"]:
            d.add_(p, alpha=group["weight_decay"])
        if group["adapt"]:
            d.mul_(_trust_ratio(p, d, group["trust_coefficient"], 0.0))
        p.add_(d, alpha=-group["lr"])


def exclude_from_adaptation(model: torch.nn.Module, weight_decay: float,
                            exclude: Callable[[str, torch.nn.Parameter], bool] | None = None) -> list[dict]:
    """Param groups for LARS / LAMB: adapted and decayed parameters, then the excluded ones
    (`adapt=False, weight_decay=0`).

    Args:
        model: the module whose trainable parameters are grouped.
        weight_decay: the first group's weight decay.
        exclude: (name, parameter) -> True to exclude; default: 1-D parameters (biases and the
            weights of LayerNorm / RMSNorm / BatchNorm).

    Returns:
        Two param groups, for `LAMB(groups, lr=...)` or `LARS(groups, lr=...)`.
    """
    exclude = exclude or (lambda name, p: p.ndim <= 1)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if not exclude(n, p)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0, "adapt": False}]

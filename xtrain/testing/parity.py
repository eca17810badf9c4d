"""The correctness oracle: xtrain on a mesh vs plain torch eager on one device.

The parity standard (docs/testing.md, "Correctness"): same model, initial weights and batches, dropout off,
fp32, >= 4 optimizer steps; per-step loss relative difference <= 1e-5 and every parameter's
max absolute difference <= 5e-5 with AdamW/Adam (<= 1e-5 with SGD).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Sequence

import numpy as np
import torch

OptimizerFactory = Callable[[object], torch.optim.Optimizer]
LOSS_RTOL = 1e-5
# LARS's steps are proportional to the gradient (as SGD's); LAMB's are Adam's, about lr x sign(g)
PARAM_ATOL = {"SGD": 1e-5, "Adam": 5e-5, "AdamW": 5e-5, "LARS": 1e-5, "LAMB": 5e-5}


def _scalar_loss(out):
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    return out["loss"] if loss is None and isinstance(out, dict) else loss


@dataclasses.dataclass
class ParityResult:
    """Losses per step and final state of both runs, and their differences."""

    losses: list[float]
    reference_losses: list[float]
    state: dict[str, torch.Tensor]
    reference_state: dict[str, torch.Tensor]
    param_atol: float

    @property
    def loss_rel_diff(self) -> float:
        a, b = np.array(self.losses), np.array(self.reference_losses)
        return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))

    def param_diffs(self) -> dict[str, float]:
        return {k: float((self.state[k].double() - v.double()).abs().max()) if v.numel() else 0.0
                for k, v in self.reference_state.items() if v.is_floating_point()}


def torch_reference(model: torch.nn.Module, make_optimizer: OptimizerFactory, batches: Sequence[tuple],
                    loss_fn: Callable | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Trains a copy of `model` with plain torch on one device; returns (losses, state_dict)."""
    model = copy.deepcopy(model).train()
    optimizer = make_optimizer(model.parameters())
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        out = model(*batch) if loss_fn is None else loss_fn(model, *batch)
        loss = _scalar_loss(out)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_parity(model: torch.nn.Module, make_optimizer: OptimizerFactory, batches: Sequence[tuple], mesh,
               *, plan=None, loss_fn: Callable | None = None, reference=None, **compile_kwargs) -> ParityResult:
    """Trains `model` with xtrain on `mesh` and with torch on one device, from the same start.

    Args:
        reference: a precomputed `torch_reference(...)` result, to share between meshes.
    """
    import xtrain

    reference = reference or torch_reference(model, make_optimizer, batches, loss_fn)
    candidate = copy.deepcopy(model)
    optimizer = make_optimizer(candidate.parameters())
    step = xtrain.compile(candidate, mesh, optimizer=optimizer, plan=plan, loss_fn=loss_fn, **compile_kwargs)
    losses = [step(*batch)["loss"] for batch in batches]
    return ParityResult(losses, reference[0], step.state_dict(), reference[1],
                        PARAM_ATOL.get(type(optimizer).__name__, 5e-5))


def assert_parity(result: ParityResult, *, loss_rtol: float = LOSS_RTOL) -> None:
    """Fails with the worst offenders when `result` misses the parity standard."""
    assert len(result.losses) >= 4, "the parity standard needs at least 4 optimizer steps"
    assert result.loss_rel_diff <= loss_rtol, (
        f"loss differs from torch by {result.loss_rel_diff:.3g} (rel) > {loss_rtol}: "
        f"xtrain {result.losses} vs torch {result.reference_losses}")
    diffs = result.param_diffs()
    bad = {k: v for k, v in diffs.items() if v > result.param_atol}
    assert not bad, f"parameters differ from torch by more than {result.param_atol}: {bad}"
    assert set(result.state) == set(result.reference_state), "state_dict keys differ from torch's"

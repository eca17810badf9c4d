"""Automatic plan search: enumerate plans for a device count, predict each, pick the best.

    result = search(model, tx, batch, profile, devices=128)
    print(result)                      # one row per candidate; `*` marks the pick
    result.best.candidate.plan(module) # the Plan, result.best.candidate.mesh the Mesh sizes

Candidates (in the fixed order of torchtitan's parallelize: tensor, activation checkpointing,
data/ZeRO): tensor degree t over the "tensor" axis (Megatron preset; on Trainium only the
replica-group sizes a node supports), data degree n / (t x p) over "data" with ZeRO stage
0-3, activation checkpointing on/off. Pipeline degrees p > 1 with m microbatches are costed
by the model (bubble (p-1)/(m+p-1)) once a pipeline plan exists to lower them; this build has
none, so `pipe_degrees` other than (1,) is refused with that reason.

Each candidate is lowered for an abstract mesh (cost.program), never run. A candidate that
cannot be lowered (batch not divisible, no transformer blocks for tensor parallel) is listed
with the reason; one whose memory exceeds the device is marked as not fitting and never picked.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from xtrain.cost import flops as flops_mod
from xtrain.cost import model as cost_model
from xtrain.cost import program as program_mod
from xtrain.cost.hardware import HardwareProfile
from xtrain.lowering.explicit import accounting
from xtrain.sharding.plan import Plan

# Candidates within this share of the fastest count as tied; the simplest of them is picked
# (less tensor parallelism, lower ZeRO stage, no recomputation): the margin is about the
# model's error on elementwise traffic, which it counts unfused.
TIE = 0.10
SKIPPED_REMAT = "not lowered: fits without remat, which would only add recomputation"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One point of the search space.

    Attributes:
        data: data-parallel degree (mesh axis "data").
        tensor: Megatron tensor-parallel degree (mesh axis "tensor"; 1: none).
        zero: ZeRO stage over "data".
        remat: activation checkpointing of the layer stack.
        pipe, microbatches: pipeline stages and microbatches (1, 1: no pipeline).
    """

    data: int
    tensor: int = 1
    zero: int = 0
    remat: bool = False
    pipe: int = 1
    microbatches: int = 1

    @property
    def mesh(self) -> dict[str, int]:
        """Mesh axis sizes, "data" outermost, "tensor" innermost (neighbouring devices)."""
        sizes = {"data": self.data}
        sizes.update({"pipe": self.pipe} if self.pipe > 1 else {})
        sizes.update({"tensor": self.tensor} if self.tensor > 1 else {})
        return sizes

    @property
    def name(self) -> str:
        parts = [f"dp{self.data}"] + ([f"tp{self.tensor}"] if self.tensor > 1 else [])
        parts += [f"pp{self.pipe}x{self.microbatches}mb"] if self.pipe > 1 else []
        name = "x".join(parts) + (f" zero{self.zero}" if self.zero else "") + (" remat" if self.remat else "")
        return name

    def plan(self, module: Any = None) -> Plan:
        """The Plan: Megatron rules for tensor > 1 (needs the torch module), the ZeRO stage, remat."""
        base = Plan()
        if self.tensor > 1:
            from xtrain import plans

            if module is None or not hasattr(module, "named_modules"):
                raise ValueError(f"candidate {self.name}: tensor parallelism uses xtrain.plans.megatron, "
                                 "which needs a torch.nn.Module")
            base = plans.megatron(module, self.mesh)
        return dataclasses.replace(base, zero=self.zero, remat=self.remat)

    def simplicity(self) -> tuple:
        return (self.pipe, self.tensor, self.zero, self.remat)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One candidate's outcome: its prediction, or why it has none."""

    candidate: Candidate
    prediction: cost_model.Prediction | None = None
    cost: cost_model.StepCost | None = None
    reason: str = ""

    @property
    def usable(self) -> bool:
        return self.prediction is not None and self.prediction.fits


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """All candidates for one target and the pick."""

    target: str
    profile: HardwareProfile
    rows: list[Row]
    best: Row | None

    def __str__(self) -> str:
        head = (f"{'':2}{'plan':<24}{'memory/device':>14}{'fits':>6}{'step ms':>10}{'tokens/s':>12}{'MFU':>8}"
                f"{'compute ms':>12}{'comm ms':>10}  note")
        lines = [f"xtrain plan for {self.target} ({self.profile.name}: {self.profile.notes})", head]
        for i, row in enumerate(self.rows):
            mark = "* " if row is self.best else "  "
            p = row.prediction
            if p is None:  # one line for a run of candidates refused for the same reason
                if i and self.rows[i - 1].prediction is None and self.rows[i - 1].reason == row.reason:
                    continue
                same = sum(1 for _ in _run(self.rows[i:], row.reason))
                name = row.candidate.name.split(" ")[0] + f" ({same} variants)" if same > 1 else row.candidate.name
                lines.append(f"{mark}{name:<24}{'-':>14}{'-':>6}{'':>52}  {row.reason}")
                continue
            comm = sum(p.comm_s.values())
            lines.append(f"{mark}{row.candidate.name:<24}{_bytes(p.memory_bytes):>14}{'yes' if p.fits else 'NO':>6}"
                         f"{p.step_s * 1e3:>10.3f}{p.tokens_per_s:>12,.0f}{p.mfu:>8.1%}{p.compute_s * 1e3:>12.3f}"
                         f"{comm * 1e3:>10.3f}  {row.reason}")
        pick = f"pick: {self.best.candidate.name}" if self.best else "pick: none fits this device's memory"
        return "\n".join(lines + [pick, f"device memory: {_bytes(self.profile.hbm_bytes)}"])


def _run(rows: Sequence[Row], reason: str):
    for row in rows:
        if row.prediction is not None or row.reason != reason:
            return
        yield row


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(devices: int, profile: HardwareProfile, *, tensor_degrees: Sequence[int] | None = None,
               zero_stages: Sequence[int] = (0, 1, 2, 3), remat: Sequence[bool] = (False, True),
               pipe_degrees: Sequence[int] = (1,)) -> list[Candidate]:
    """Every (tensor, zero, remat) point for `devices` devices; tensor degrees divide the devices
    of one instance (and, on Trainium, are replica-group sizes a node supports)."""
    if tuple(pipe_degrees) != (1,):
        raise ValueError(f"pipe_degrees={tuple(pipe_degrees)}: this build has no pipeline plan to lower "
                         "(issue 5); the cost model's bubble term is ready for one")
    if tensor_degrees is None:
        from neuron_support import topology

        allowed = topology.INSTANCES.get(profile.name.split("[")[0])
        groups = allowed.node_group_sizes if allowed and allowed.node_group_sizes else None
        tensor_degrees = [t for t in _divisors(math.gcd(devices, profile.devices_per_node))
                          if groups is None or t in groups]
    out = []
    for t in tensor_degrees:
        data = devices // t
        for z in (zero_stages if data > 1 else (0,)):
            out += [Candidate(data=data, tensor=t, zero=z, remat=r) for r in remat]
    return out


def _tokens(batch: tuple) -> int:
    first = batch[0]
    return math.prod(first.shape[:2]) if len(first.shape) >= 2 else first.shape[0]


def step_cost(step: program_mod.AbstractStep, sizes: dict[str, int], tokens: int, module_paths=frozenset(),
              pipeline: cost_model.Pipeline = cost_model.Pipeline()) -> cost_model.StepCost:
    """The StepCost of a traced step: FLOPs, collectives and graph memory of its program."""
    body = program_mod.per_device_body(step.program)
    return cost_model.StepCost(
        flops=flops_mod.count(step.program),
        collectives=accounting.collectives(step.program, sizes, module_paths),
        mesh=sizes, data_axes=step.batch_axes,
        memory=cost_model.memory_from_graph(body if body is not None else step.program, step.state_bytes),
        tokens=tokens, pipeline=pipeline)


def evaluate(model, tx, module, candidate: Candidate, batch: tuple, profile: HardwareProfile, *,
             regather: bool = True) -> Row:
    """Lowers `candidate` for an abstract mesh and predicts it on `profile`."""
    sizes = candidate.mesh
    if batch[0].shape[0] % candidate.data:
        return Row(candidate=candidate, reason=f"global batch {batch[0].shape[0]} is not divisible by "
                                               f"data={candidate.data}")
    try:
        plan = candidate.plan(module)
        traced = program_mod.abstract_step(model, tx, sizes, plan, batch, regather=regather)
    except ValueError as err:
        return Row(candidate=candidate, reason=f"cannot lower: {err}")
    cost = step_cost(traced, sizes, _tokens(batch), model.module_paths(),
                     cost_model.Pipeline(stages=candidate.pipe, microbatches=candidate.microbatches))
    prediction = cost_model.predict(cost, profile)
    reason = "" if prediction.fits else f"needs {_bytes(prediction.memory_bytes)} > {_bytes(profile.hbm_bytes)}"
    return Row(candidate=candidate, prediction=prediction, cost=cost, reason=reason)


def _with_model_mfu(rows: list[Row], profile: HardwareProfile) -> list[Row]:
    """MFU of checkpointed plans counts the model's FLOPs, not the recomputation."""
    plain = {(r.candidate.data, r.candidate.tensor, r.candidate.zero): r.cost.flops.matmul
             for r in rows if r.cost is not None and not r.candidate.remat}
    out = []
    for r in rows:
        key = (r.candidate.data, r.candidate.tensor, r.candidate.zero)
        if r.cost is not None and r.candidate.remat and key in plain:
            r = dataclasses.replace(r, prediction=cost_model.predict(r.cost, profile, model_flops=plain[key]))
        out.append(r)
    return out


def pick(rows: Sequence[Row]) -> Row | None:
    """The fastest candidate that fits; among those within TIE of it, the simplest."""
    usable = [r for r in rows if r.usable]
    if not usable:
        return None
    fastest = min(r.prediction.step_s for r in usable)
    tied = [r for r in usable if r.prediction.step_s <= fastest * (1 + TIE)]
    return min(tied, key=lambda r: (r.candidate.simplicity(), r.prediction.step_s))


def search_torch(module, optimizer, batch: tuple, profile: HardwareProfile, devices: int, *,
                 loss_fn=None, **kwargs) -> SearchResult:
    """`search` for a torch module and its torch optimizer (as `xtrain.compile` takes them)."""
    from xtrain.api import _torch_model
    from xtrain.cost.auto import _host_batch

    wrapped, tx, _, _ = _torch_model(module, optimizer, loss_fn)
    return search(wrapped, tx, _host_batch(batch), profile, devices, module=module, **kwargs)


def search(model, tx, batch: tuple, profile: HardwareProfile, devices: int, *, module: Any = None,
           target: str | None = None, candidate_list: Sequence[Candidate] | None = None,
           regather: bool = True, prune_remat: bool = True) -> SearchResult:
    """Predicts every candidate for `devices` devices of `profile` and picks one.

    Args:
        model: xtrain's wrapped model (frontend.Model); tx: the optax transformation.
        batch: one global batch (arrays or jax.ShapeDtypeStruct).
        module: the torch module (for Megatron tensor-parallel candidates).
        candidate_list: the candidates (default: `candidates(devices, profile)`).
        regather: ZeRO-3 re-gathers weights in the backward pass (as the step does by default).
        prune_remat: lower a remat candidate only when its plan without remat does not fit.
    """
    todo = candidate_list if candidate_list is not None else candidates(devices, profile)
    done = {c: evaluate(model, tx, module, c, batch, profile, regather=regather) for c in todo if not c.remat}
    for c in todo:
        if c.remat:
            plain = done.get(dataclasses.replace(c, remat=False))
            # recomputation never makes a step faster: only worth lowering when memory is short
            skip = prune_remat and plain is not None and plain.usable
            done[c] = Row(candidate=c, reason=SKIPPED_REMAT) if skip else \
                evaluate(model, tx, module, c, batch, profile, regather=regather)
    rows = _with_model_mfu([done[c] for c in todo], profile)
    return SearchResult(target or f"{profile.name} ({devices} devices)", profile, rows, pick(rows))


def compiled_step_cost(step, *batch) -> cost_model.StepCost:
    """The StepCost of a compiled TrainStep (explicit lowering) for `batch`: its program's FLOPs
    and collectives, and memory from XLA's memory analysis of the compiled step."""
    if step.lowering != "explicit":
        raise ValueError(f"compiled_step_cost reads xtrain's emitted program; this step uses lowering={step.lowering!r}")
    rep = step.report(*batch)
    program = step.program(*batch)
    sizes = dict(step.mesh.shape)
    data_axes = tuple(a for e in step.batch_spec for a in ((e,) if isinstance(e, str) else (e or ())))
    memory = cost_model.memory_from_compiled(step.compiled(*batch), rep.state_memory)
    return cost_model.StepCost(flops=flops_mod.count(program), collectives=rep.collectives, mesh=sizes,
                               data_axes=data_axes, memory=memory, tokens=_tokens(batch))

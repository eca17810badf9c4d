"""The errors xtrain raises on purpose, by what went wrong.

Every class derives from `XtrainError` and from the builtin a caller would already catch
(`ValueError` for a bad request, `RuntimeError` for a bad state found at run time, `TypeError` /
`IndexError` where the builtin names the problem exactly), so `except ValueError` keeps working
and `except xtrain.errors.XtrainError` catches them all. The message names the module path,
tensor, shape or mesh axis involved and the fix; the class says which kind of fix.

    XtrainError
    ├── PlanError (ValueError)           a plan rule, spec or parallelism setting that does not fit
    ├── MeshError (ValueError)           mesh axes that do not fit the devices
    ├── OptionsError (ValueError)        an option, config field or argument with a bad value
    ├── InputError (ValueError)          a batch or data source the step cannot take
    │   ├── BatchTypeError (+TypeError)  a batch argument of the wrong kind
    │   └── BatchIndexError (+IndexError) a batch value out of range where it is an index
    ├── UnsupportedError (ValueError)    a valid request xtrain does not implement
    │   └── UnsupportedOpError           an op, or a form of an op, xtrain cannot lower
    ├── TraceError (ValueError)          the model could not be turned into a JAX function
    │   └── TopKTooLarge                 torch.topk asked for more elements than its dimension has
    ├── LaunchError (ValueError)         the job's launch (environment, processes, CLI) is inconsistent
    ├── ConformanceError (ValueError)    a program does not fit a Trainium target's rules
    ├── CheckpointError (RuntimeError)   a checkpoint that is incomplete, corrupt or does not fit
    ├── TargetCompileError (RuntimeError) XLA's deviceless GPU compile (xtrain.aot) failed or cannot run
    └── NotBuiltError (RuntimeError)     a step asked for what exists only once its first call built it

This module imports nothing of xtrain, so every layer (ir included) and neuron_support use it.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["XtrainError", "PlanError", "MeshError", "OptionsError", "InputError", "BatchTypeError",
           "BatchIndexError", "UnsupportedError", "UnsupportedOpError", "TraceError", "TopKTooLarge",
           "LaunchError", "ConformanceError", "CheckpointError", "TargetCompileError", "NotBuiltError"]


class XtrainError(Exception):
    """Base of every error xtrain raises on purpose (never raised itself)."""


class PlanError(XtrainError, ValueError):
    """A plan rule, sharding spec or parallelism setting (Plan, Pipeline, Precision, plans.*,
    xtrain.shard) that is malformed or does not fit the model or the mesh."""


class MeshError(XtrainError, ValueError):
    """A Mesh whose axes are malformed or do not fit the devices (or an emulated target's nodes)."""


class OptionsError(XtrainError, ValueError):
    """An option, config field or argument with an invalid or missing value (compile options,
    GradSync, CheckpointOptions, Loader, CLI flags, hardware profile names)."""


class InputError(XtrainError, ValueError):
    """A batch or data source the step cannot take: shapes, divisibility by the mesh, an empty
    batch, a new shape where recompiling is off, a data position that does not resume."""


class BatchTypeError(InputError, TypeError):
    """A batch argument of the wrong kind (floating-point where the model reads indices, a dict
    where the step takes positional arguments)."""


class BatchIndexError(InputError, IndexError):
    """A batch value the model uses as an index is out of range (found after the step ran)."""


class UnsupportedError(XtrainError, ValueError):
    """A valid request xtrain does not implement: a combination of features, a model structure a
    parallelism needs, or a device that lacks what the plan uses."""


class UnsupportedOpError(UnsupportedError):
    """An op, or a form of an op (an argument value, a layout), xtrain cannot lower.

    Raised for a primitive without a partition rule reached by a split operand, it also carries
    `primitive`, `module` (path), `splits` (each split operand's mesh axes per dimension) and
    `gathered_bytes` (what running it replicated would all-gather per call); else those are None/()."""

    def __init__(self, message: str, *, primitive: str | None = None, module: str | None = None,
                 splits: tuple = (), gathered_bytes: int | None = None):
        super().__init__(message)
        self.primitive, self.module, self.splits, self.gathered_bytes = primitive, module, splits, gathered_bytes


class TraceError(XtrainError, ValueError):
    """The model could not be turned into a JAX function (names the module path and op)."""


class TopKTooLarge(TraceError):
    """torch.topk asked for more elements than its dimension holds (an MoE router's top_k above
    its number of experts); the tracer names the module (`frontend.moe.top_k_error`)."""

    def __init__(self, k: int, size: int):
        super().__init__(f"topk of k={k} along a dimension of {size}")
        self.k, self.size = k, size


class LaunchError(XtrainError, ValueError):
    """The job's launch is inconsistent or incomplete: launcher environment variables (torchrun,
    Slurm, MPI, SageMaker) that are missing or disagree, processes that do not fit the devices,
    a CLI run whose script never reaches a training step."""


class ConformanceError(XtrainError, ValueError):
    """A compiled program breaks a Trainium target's rules (`neuron_support.conformance`)."""

    def __init__(self, findings: Sequence[object], target: str):
        self.findings = list(findings)  # neuron_support.conformance.Finding, one line each
        lines = "\n".join(f"  {f}" for f in self.findings)
        super().__init__(f"the program does not fit {target} ({len(self.findings)} findings):\n{lines}")


class CheckpointError(XtrainError, RuntimeError):
    """A checkpoint that is incomplete, corrupt, or does not fit the step loading it."""


class TargetCompileError(XtrainError, RuntimeError):
    """An ahead-of-time compile for a GPU cluster that is not here (xtrain.aot) could not run or
    was refused by XLA: the gpu-compile extra missing, the child compile failing (its stderr is in
    the message), or a program deviceless compilation cannot build."""


class NotBuiltError(XtrainError, RuntimeError):
    """A step deferred to its first call (plan="auto", a pending plans.megatron, a pipeline) was
    asked for its layout, state or program before that call gave it the batch shapes."""

"""The pipeline part of a plan: how many stages, microbatches, which schedule, where to cut."""
from __future__ import annotations

import dataclasses
from typing import Sequence, Union

from xtrain.errors import PlanError

Split = Union[str, tuple[str, ...]]
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")  # the tables of xtrain.lowering.pipeline.schedule


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pipeline:
    """Pipeline parallelism over the mesh axis `axis`.

    Attributes:
        stages: number of pipeline stages; must equal the size of the mesh axis `axis`.
        microbatches: m, the number of microbatches each data-parallel shard of the global
            batch is cut into (global batch = data degree x m x microbatch size).
        schedule: "gpipe" (all forwards, then all backwards), "1f1b" (one forward, one
            backward: at most p - s microbatches held at stage s) or "interleaved" (1F1B over
            `virtual_stages` chunks per stage; m must be divisible by `stages`) or "zbh1" (zero
            bubble: each backward split into its input-gradient and weight-gradient halves, the
            latter filling the ticks 1F1B idles; CPU and GPU, not Trainium, which has no
            conditionals) or "zbv" (zero bubble over two chunks per stage laid out as a V: stage s
            holds virtual stages s and 2p - 1 - s; virtual_stages is 2).
        split: "auto" (balance the stages by FLOPs and bytes measured on the traced graph) or
            the module paths where stages 1..p-1 start, e.g. ("blocks.2", "blocks.5").
        virtual_stages: chunks per stage for "interleaved" (v >= 2); 2 for "zbv"; 1 otherwise.
        axis: the mesh axis the stages are laid along.
        checkpoint: GPipe only: keep each stage's input per microbatch and recompute the
            stage's forward in the backward (activation checkpointing per stage) instead of
            keeping every activation. 1F1B and interleaved always work this way.
    """

    stages: int
    microbatches: int
    schedule: str = "1f1b"
    split: Split = "auto"
    virtual_stages: int = 1
    axis: str = "pipe"
    checkpoint: bool = False

    def __post_init__(self):
        if self.stages < 2:
            raise PlanError(f"Pipeline(stages={self.stages}): a pipeline needs at least 2 stages")
        if self.microbatches < 1:
            raise PlanError(f"Pipeline(microbatches={self.microbatches}): needs at least 1 microbatch")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"Pipeline(schedule={self.schedule!r}) is not one of {SCHEDULES}")
        if not isinstance(self.split, str):
            object.__setattr__(self, "split", tuple(self.split))
        elif self.split != "auto":
            raise PlanError(f"Pipeline(split={self.split!r}): pass 'auto' or a list of module paths")
        if self.schedule == "zbv" and self.virtual_stages in (1, 2):
            object.__setattr__(self, "virtual_stages", 2)  # the V: two chunks per stage
        elif self.schedule == "zbv":
            raise PlanError(f"Pipeline(schedule='zbv', virtual_stages={self.virtual_stages}): zbv lays two chunks "
                            "per stage as a V; leave virtual_stages at its default")
        elif self.schedule == "interleaved":
            self._check_interleaved()
        elif self.virtual_stages != 1:
            raise PlanError(f"Pipeline(virtual_stages={self.virtual_stages}) needs schedule='interleaved' "
                            f"(got {self.schedule!r})")
        if isinstance(self.split, tuple) and len(self.split) != self.stages * self.virtual_stages - 1:
            raise PlanError(f"Pipeline(split={list(self.split)}) names {len(self.split)} cut points; "
                            f"{self.stages * self.virtual_stages} stages need "
                            f"{self.stages * self.virtual_stages - 1} (where stages 1.. start)")

    def _check_interleaved(self) -> None:
        if self.virtual_stages < 2:
            raise PlanError(f"Pipeline(schedule='interleaved', virtual_stages={self.virtual_stages}): "
                            "interleaving needs virtual_stages >= 2 chunks per stage")
        if self.microbatches % self.stages:
            raise PlanError(f"Pipeline(schedule='interleaved'): microbatches={self.microbatches} is not "
                            f"divisible by stages={self.stages}; use a multiple of {self.stages}")

    @property
    def chunks(self) -> int:
        """Virtual stages in all (stages x virtual_stages)."""
        return self.stages * self.virtual_stages


def pipeline(stages: int, microbatches: int, schedule: str = "1f1b", split: Sequence[str] | str = "auto",
             virtual_stages: int = 1, axis: str = "pipe", checkpoint: bool = False) -> Pipeline:
    return Pipeline(stages=stages, microbatches=microbatches, schedule=schedule, split=split,
                    virtual_stages=virtual_stages, axis=axis, checkpoint=checkpoint)

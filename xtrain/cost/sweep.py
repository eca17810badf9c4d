"""The order in which the plan search lowers its candidates, and the ones it leaves unlowered.

Lowering a candidate (tracing its training step for an abstract mesh, xtrain.cost.program) is
what a search spends its time on: about ten seconds each for an 8B-parameter model on one core,
and an 8-GPU target has hundreds of candidates. A candidate is left unlowered only where a bound
shows it cannot be the pick (search.pick: the simplest usable candidate within TIE of the fastest):

- a memory-only variant (remat, 1F1B, offload) whose plain form fits: it only adds work;
- a memory-only variant whose plain form's compute alone is more than TIE slower than the fastest
  usable candidate's whole step: recomputation, lockstep ticks and host transfers only add to it;
- an optimizer-offload variant whose plain form, less its whole optimizer state, still does not
  fit the device: offload moves that state to the host and nothing else;
- an activation-offload variant whose remat form is usable: it recomputes each layer as remat does
  and adds the host transfers, so it is never faster, and remat is simpler;
- a zero-bubble schedule whose GPipe form, even without its bubble, is slower than the fastest
  (fitting or not: the bound is on time);
- a pipeline whose data-parallel twin (stages x data devices over "data", no pipeline), lowered,
  computes for longer than the fastest step even before the schedule's idle share is added: each
  device holds 1/stages of the layers for all its twin's rows, the same FLOPs in smaller
  microbatches, and the lockstep ticks run busy / (1 - bubble) at least (its variants and other
  schedules too: they only add to it);
- a context-parallel candidate (and its variants) whose data-parallel twin, data x context devices
  over "data" and the rest the same, is listed and lowered: the batch then divides over the twin's
  devices, which hold the same tokens each (rows / (data x context) whole sequences instead of
  1/context of rows / data sequences), with the same FLOPs and gradient sync but none of the ring's
  or all-to-all's transfers, and ZeRO shards the state over all of them. Splitting a sequence only
  pays where the batch has fewer rows than that, and there the twin is refused for its batch.

Each plain candidate is lowered with its memory-only variants right after it (in the list's
order), so that a usable candidate is known early. The fastest only gets faster as the sweep goes
on, so a bound that was over it stays over the final one; where the target's compiler later
says the fastest does not fit (search(verify=...)), `reopen` lowers what the bounds skipped
against the old fastest and now could win.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping, Sequence

from xtrain.cost import listing
from xtrain.cost.candidates import SKIPPED_REJECTED, SKIPPED_ZERO_BUBBLE, Candidate
from xtrain.cost.hardware import HardwareProfile
from xtrain.lowering.pipeline import schedule
from xtrain.sharding.offload import Offload

SLOWER_PLAIN = "not lowered: its plain form's compute alone ({floor}) is over {tie} more than the fastest step ({best})"
OFFLOAD_SHORT = "not lowered: its plain form less its whole optimizer state still needs {need} > {device}"
CONTEXT_DOMINATED = ("not lowered: {twin} holds the same tokens per device with the same FLOPs and none of the "
                     "sequence split's transfers")
PIPELINE_SLOWER = ("not lowered: its data-parallel twin {twin} computes for {twin_ms}; with this schedule's "
                   "{bubble:.1%} bubble that is at least {floor}, over {tie} more than the fastest step ({best})")
ACT_OFFLOAD_DOMINATED = ("not lowered: its remat form fits, which recomputes the same and needs no host transfers "
                         "for the activations")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def preferred(rows: Iterable) -> list:
    """The rows the pick is made from: the usable ones, those without replicated fallbacks when
    there is one."""
    usable = [r for r in rows if r.usable]
    return [r for r in usable if not r.fallbacks] or usable


def fastest(rows: Iterable) -> float | None:
    """The step seconds the pick is measured against (`preferred`'s fastest); None: none usable."""
    return min((r.prediction.step_s for r in preferred(rows)), default=None)


def _data_twin(c: Candidate) -> Candidate:
    """A context-parallel candidate's data-parallel twin: its context devices over "data" (the
    candidate itself when it splits no sequence)."""
    if c.context == 1:
        return c
    return dataclasses.replace(c, data=c.data * c.context, context=1, ulysses=1, order=())


@dataclasses.dataclass
class Sweep:
    """Lowers a candidate list through `lower` (search's: refusals, tracing, prediction) in the
    order above. `prune`: search(prune_remat=...): False lowers every candidate."""

    lower: Callable[[Candidate], object]
    profile: HardwareProfile
    tie: float
    row: Callable[..., object]  # search.Row, for the rows of candidates left unlowered
    prune: bool = True
    done: dict = dataclasses.field(default_factory=dict)
    floors: dict = dataclasses.field(default_factory=dict)  # candidate -> lower bound on its step seconds
    dominated: set = dataclasses.field(default_factory=set)  # plain candidates a lowered twin dominates

    def run(self, candidate_list: Sequence[Candidate]) -> dict:
        """{candidate: Row} for every candidate of the list."""
        variants: dict[Candidate, list[Candidate]] = {}
        for c in candidate_list:
            if c.saves_memory_only:
                variants.setdefault(c.plain, []).append(c)
        plain = [c for c in candidate_list if not c.saves_memory_only and not c.zero_bubble]
        for c in plain:
            twin = self._lowered_twin(c)
            if self.prune and twin is not None:
                self._skip(c, CONTEXT_DOMINATED.format(twin=twin.name))
                self.dominated.add(c)
            elif not self._pipeline_slower(c):
                self.done[c] = self.lower(c)
            for v in sorted(variants.pop(c, ()), key=lambda v: list(Offload).index(v.offload)):
                self._variant(v)
        for v in (v for vs in variants.values() for v in vs):  # variants whose plain form is not listed
            self.done[v] = self.lower(v)
        for c in (c for c in candidate_list if c.zero_bubble):
            self._zero_bubble(c)
        return self.done

    def reopen(self, rows: Sequence) -> Mapping[Candidate, object]:
        """Rows for the candidates skipped by a bound on time that no longer holds against the
        fastest of `rows` (after verification marked rows unusable), lowered now."""
        best = fastest(rows)
        due = [c for c, floor in self.floors.items() if best is None or floor <= best * (1 + self.tie)]
        for c in due:
            del self.floors[c]
            self.done[c] = self.lower(c)
        return {c: self.done[c] for c in due}

    def _lowered_twin(self, c: Candidate) -> Candidate | None:
        """`c`'s data-parallel twin where `c` splits sequences and the twin was lowered, else None."""
        twin = _data_twin(c)
        row = self.done.get(twin) if twin != c else None
        return twin if row is not None and row.prediction is not None else None

    def _best(self) -> float | None:
        return fastest(self.done.values()) if self.prune else None

    def _skip(self, c: Candidate, reason: str, floor: float | None = None, plain=None):
        placed = dataclasses.replace(c, order=plain.candidate.order) if plain is not None else c
        if floor is not None:
            self.floors[c] = floor
        self.done[c] = self.row(candidate=placed, reason=reason)

    def _variant(self, v: Candidate) -> None:
        plain, best, twin = self.done.get(v.plain), self._best(), self._lowered_twin(v)
        if self.prune and twin is not None:  # e.g. an offloaded sequence split whose plain form's state is refused
            self._skip(v, CONTEXT_DOMINATED.format(twin=twin.name))
        elif self.prune and v.plain in self.floors:  # a pipeline too slow already: the variant only adds to it
            self._skip(v, plain.reason, self.floors[v.plain])
        elif not self.prune or plain is None:
            self.done[v] = self.lower(v)
        elif plain.findings:  # same collectives as its plain form, which the target's checker rejects
            self._skip(v, SKIPPED_REJECTED, plain=plain)
        elif plain.usable:
            self._skip(v, v.skipped, plain=plain)
        elif v.plain in self.dominated:
            self._skip(v, plain.reason)
        elif plain.prediction is None:  # refused before lowering (state, batch): the variant may do better
            self.done[v] = self.lower(v)
        elif best is not None and plain.prediction.compute_s > best * (1 + self.tie):
            floor = plain.prediction.compute_s
            self._skip(v, SLOWER_PLAIN.format(floor=ms(floor), tie=f"{self.tie:.0%}", best=ms(best)), floor, plain)
        elif v.offload is Offload.OPTIMIZER and (short := self._still_short(plain)) is not None:
            self._skip(v, short, plain=plain)
        elif v.offload is Offload.ACTIVATIONS and self._remat_usable(v):
            self._skip(v, ACT_OFFLOAD_DOMINATED, plain=plain)
        else:
            self.done[v] = self.lower(v)

    def _still_short(self, plain) -> str | None:
        memory = plain.cost.memory
        need = memory.total - memory.optimizer
        if need <= self.profile.hbm_bytes:
            return None
        return OFFLOAD_SHORT.format(need=listing.size(need), device=listing.size(self.profile.hbm_bytes))

    def _remat_usable(self, v: Candidate) -> bool:
        remat = self.done.get(dataclasses.replace(v, offload=Offload.NONE, remat=True))
        return remat is not None and remat.usable

    def _zero_bubble(self, c: Candidate) -> None:
        # zero bubble can at best remove the GPipe form's bubble: worth lowering only if that could win
        gpipe, best = self.done.get(c.plain), self._best()
        if best is not None and gpipe is not None and gpipe.prediction is not None:
            floor = gpipe.prediction.step_s * (1 - gpipe.cost.pipeline.bubble_fraction)
            if floor > best:
                self._skip(c, SKIPPED_ZERO_BUBBLE, floor, plain=gpipe)
                return
        if not self._pipeline_slower(c):
            self.done[c] = self.lower(c)

    def _pipeline_slower(self, c: Candidate) -> bool:
        """Whether pipeline `c` was left unlowered: its data-parallel twin's compute over the
        schedule's busy share is more than TIE slower than the fastest (a row of the twin's
        plain forms, any ZeRO stage, the least compute: ZeRO only shrinks the optimizer's and
        the gradients' elementwise work, which the pipeline's stage does for more parameters)."""
        best = self._best()
        if best is None or c.pipe == 1:
            return False
        key = (c.data * c.pipe * c.context, c.tensor, c.expert, c.precision, c.capacity_factor)
        twins = [r for r in self.done.values() if r.prediction is not None and r.candidate.pipe == 1
                 and r.candidate.context == 1 and not r.candidate.saves_memory_only and key == (
                     r.candidate.data, r.candidate.tensor, r.candidate.expert, r.candidate.precision,
                     r.candidate.capacity_factor)]
        if not twins:
            return False
        twin = min(twins, key=lambda r: r.prediction.compute_s)
        bubble = schedule.build(c.schedule, c.pipe, c.microbatches).bubble()
        floor = twin.prediction.compute_s / (1 - bubble)
        if floor <= best * (1 + self.tie):
            return False
        self._skip(c, PIPELINE_SLOWER.format(twin=twin.candidate.name, twin_ms=ms(twin.prediction.compute_s),
                                             bubble=bubble, floor=ms(floor), tie=f"{self.tie:.0%}", best=ms(best)),
                   floor)
        return True

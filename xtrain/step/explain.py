"""`step.report()`: what a compiled step communicates and holds, and the notes that explain it.

For the explicit lowering the collectives are read from the program xtrain emits (accounting:
every one it asked for, with the module it serves); for XLA's partitioner from XLA's optimized
HLO. Memory comes from XLA's compiled memory analysis and the placed state's shardings.
"""
from __future__ import annotations

import dataclasses

from xtrain.cost import liveness
from xtrain.cost import program as cost_program
from xtrain.ir import attention
from xtrain.lowering import accounting, offload
from xtrain.lowering import report as report_mod
from xtrain.lowering.state import named
from xtrain.sharding import layout as layout_mod
from xtrain.sharding import presets


def _temporaries(step, batch: tuple, remat, compare: bool) -> int:
    """Device temporaries of `step` under another checkpointing policy: from XLA's memory analysis
    of that step compiled (`compare`), else the graph model's peak of its per-device program
    (a trace, no compile: cost.liveness.peak_live_bytes)."""
    if compare:
        return report_mod.memory_of(step.compiled(*batch, remat=remat))["temporaries"]
    return _graph_peak(step.program(*batch, remat=remat))


def _graph_peak(program) -> int:
    return liveness.peak_live_bytes(cost_program.per_device_body(program) or program, donated=True)


def _remat_note(step, batch: tuple, memory: dict[str, int], compare: bool) -> str:
    """What activation checkpointing saves: this step's temporaries vs the same step without it
    (both measured by XLA with `compare`, else both by the graph model)."""
    setting = step.plan.layer_remat().setting
    without = _temporaries(step, batch, None, compare)
    if compare:
        on = memory["temporaries"]
        return (f"activation checkpointing {setting}: temporaries {on} B per device vs {without} B without "
                f"(saves {without - on} B)")
    on = _graph_peak(step.program(*batch))
    return (f"activation checkpointing {setting}: graph estimate of temporaries {on} B per device vs {without} B "
            f"without (saves {without - on} B; report(compare=True) compiles both)")


def _offload_note(step, batch: tuple, memory: dict[str, int], compare: bool) -> str:
    """Offloaded activations: their host bytes, and this step's device temporaries vs the same
    checkpointing policy saving them on the device."""
    remat = step.plan.layer_remat()
    saved = _temporaries(step, batch, dataclasses.replace(remat, offload=False), compare)
    on = memory["temporaries"] if compare else _graph_peak(step.program(*batch))
    how = "" if compare else " (graph estimate; report(compare=True) compiles both)"
    where = (" (XLA:CPU keeps offloaded residuals in device buffers: JAX lowers the copies to host memory "
             "only for GPU and TPU)" if step.mesh.devices.flat[0].platform == "cpu" else "")
    return (f"{remat.setting}: {memory['activations_host']} B of saved activations per device go to host memory "
            f"each step; device temporaries {on} B vs {saved} B with remat={remat.mode.value!r} saving them on the "
            f"device{how}{where}")


def _layers_note(step) -> list[str]:
    layers = layout_mod.depth(step.user_model().param_shapes())
    if not layers:  # nothing numbered: nothing to say about repeated blocks
        return []
    if layers and not step.lowered.findings.repeated:  # the traced blocks are not one family
        return [f"the {layers} numbered layers run as traced, one after another: the program has no family of "
                "repeated blocks to scan"]
    how = "as one layer scan" if step.layout.scan_layers else "unrolled, one after another"
    return [f"repeated blocks ({layers} layers) run {how} (scan_layers={step.options.scan_layers!r})"]


def _attention_notes(step, batch) -> list[str]:
    """Which attention each call site of the emitted program got (xtrain.ir.attention)."""
    found = attention.sites(step.program(*batch).jaxpr, step.model.module_paths())
    return [f"attention in {path or '<top level>'!r}: {site.describe()}" for path, site in sorted(found.items())]


def _state_notes(step) -> list[str]:
    layout = step.layout
    replicated = layout.replicated()
    notes = [f"{len(replicated)} of {len(layout.param_specs)} parameters replicated on every device"]
    pipe = step.plan.pipeline.axis if step.plan.pipeline is not None else None
    for axis in layout.unused_axes(pipe):
        notes.append(f"mesh axis {axis!r} (size {layout.sizes[axis]}) splits nothing: the {layout.sizes[axis]} devices "
                     "along it hold and compute the same (give it to the batch or to parameters to use them)")
    whole = layout.zero_whole
    if whole:
        notes.append(f"ZeRO-{layout.zero} keeps {len(whole)} tensors whole (no dimension divisible by the data "
                     f"size): {list(whole[:8])}{' ...' if len(whole) > 8 else ''}")
    return notes


def collectives(step, *batch, compiled=None) -> list[report_mod.Collective]:
    """The collectives `report` lists: for the explicit lowering those of the program xtrain
    emits (`step.program`), for XLA's partitioner those of XLA's optimized HLO (`compiled`, or
    compiled now)."""
    sizes = dict(step.mesh.shape)
    if step.options.lowering == "explicit":
        return accounting.collectives(step.program(*batch), sizes, step.model.module_paths())
    compiled = compiled or step.compiled(*batch)
    return report_mod.collectives_from_hlo(compiled.as_text(), sizes)


def report(step, *batch, compare: bool = False) -> report_mod.Report:
    """Collectives and per-device memory of `step`'s compiled training step, for `batch`'s
    shapes or the last batch trained on. The step is compiled once and traced once; `compare`
    also compiles it without its activation checkpointing / offload for the notes' figures."""
    compiled = step.compiled(*batch)
    sizes, layout = dict(step.mesh.shape), step.layout
    notes, memory = _state_notes(step), report_mod.memory_of(compiled)
    remat = step.plan.layer_remat()
    if remat is not None and remat.offload:
        memory["activations_host"] = offload.offloaded_activation_bytes(step.program(*batch))
        notes.append(_offload_note(step, batch, memory, compare))
    if remat is not None:
        notes.append(_remat_note(step, batch, memory, compare))
    found = collectives(step, *batch, compiled=compiled)
    if step.options.lowering == "explicit":
        notes += _layers_note(step) if step.plan.pipeline is None else []
        notes += step.lowered.notes() + _attention_notes(step, batch)
    else:
        notes += step.lowered.inputs.notes()
    shapes = {n: tuple(v.shape) for n, v in {**step.state.params, **step.state.frozen}.items()}
    return report_mod.Report(step.options.lowering, sizes, found, memory, notes,
                             report_mod.state_memory(step.state, named(step.mesh, layout.grad_specs)),
                             list(step.plan.notes), presets.largest_replicated(layout.param_specs, shapes))

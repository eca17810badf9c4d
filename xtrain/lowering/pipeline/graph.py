"""The traced graph cut for a pipeline: prologue, repeated blocks, epilogue.

    prologue   equations before the first block (embeddings, masks, positions): stage 0
    blocks     the repeated blocks (layer_scan.RepeatedBlocks), split over the stages
    epilogue   equations after the last block (final norm, head, loss): the last stage

The epilogue ends in the loss. When the loss is `sum / count` (cross-entropy's mean over the
counted tokens), the epilogue returns the two separately, so the pipeline can divide the sum
over all microbatches by the count over all of them, as the full batch would.
"""
from __future__ import annotations

import dataclasses

from jax.extend import core as jcore

from xtrain.errors import UnsupportedError
from xtrain.lowering.explicit.blocks import Examined, RepeatedBlocks, examine

# ops that pass the loss through unchanged in value (a cast, a reshape of a scalar)
_PASS_THROUGH = {"convert_element_type", "reshape", "squeeze", "copy", "copy_p"}


@dataclasses.dataclass(frozen=True)
class Cut:
    """The traced model function cut around its repeated blocks."""

    blocks: RepeatedBlocks
    prologue: jcore.Jaxpr   # invars: the function's; outvars: carry init + shared + epilogue needs
    epilogue: jcore.Jaxpr   # invars: the function's + prologue outs + block outputs + each layer's collected
    #                         outputs (blocks.collected); outvars: (sum, count) or (loss,)
    layer_params: list[list[str]]  # per layer, parameter names in body order
    weighted: bool          # the loss is sum / count (exact accumulation over microbatches)


def _jaxpr(constvars, invars, outvars, eqns, part: str) -> jcore.Jaxpr:
    return jcore.Jaxpr(constvars=constvars, invars=invars, outvars=outvars, eqns=eqns,
                       effects=jcore.no_effects if hasattr(jcore, "no_effects") else set(),
                       debug_info=jcore.DebugInfo("xtrain pipeline", part, None, None))  # without one JAX warns


def _used(eqns, outvars) -> set:
    used = {v for e in eqns for v in e.invars if isinstance(v, jcore.Var)}
    return used | {v for v in outvars if isinstance(v, jcore.Var)}


def _loss_parts(eqns, loss) -> tuple[list, bool]:
    """(sum, count) vars when `loss` is computed as a division, else ([loss], False)."""
    producer = {v: e for e in eqns for v in e.outvars}
    var = loss
    while var in producer and str(producer[var].primitive) in _PASS_THROUGH:
        var = producer[var].invars[0]
    eqn = producer.get(var)
    if eqn is not None and str(eqn.primitive) == "div" and all(getattr(v.aval, "shape", None) == () for v in eqn.invars):
        return list(eqn.invars), True
    return [loss], False


def _pick_blocks(examined: Examined, where: str) -> RepeatedBlocks:
    if examined.notes and not examined.found:
        raise UnsupportedError(
            f"pipeline parallelism of {where} needs a family of repeated blocks to split into stages: "
            + "; ".join(examined.notes) + ". Blocks may differ in their parameters, in constants and "
            "in which value computed before them they read, not in their operations or shapes")
    if not examined.found:
        raise UnsupportedError(
            f"pipeline parallelism needs repeated blocks (e.g. blocks.0, blocks.1, ... with identical "
            f"structure) in the top level of {where}; none were found, so there is nothing to split into "
            "stages. Give the model an nn.ModuleList of identical layers")
    return max(examined.found, key=lambda b: b.length)


def cut(closed, module_paths: frozenset[str], param_names: list[str], num_buffers: int, where: str) -> Cut:
    """Cuts `closed` (the model's (loss, buffers) function over (params, buffers, key, batch))."""
    jaxpr = closed.jaxpr
    params = jaxpr.invars[:len(param_names)]
    blocks = _pick_blocks(examine(jaxpr, module_paths, params), where)
    loss, *new_buffers = jaxpr.outvars
    buffer_ins = jaxpr.invars[len(param_names):len(param_names) + num_buffers]
    if any(o is not i for o, i in zip(new_buffers, buffer_ins)):
        raise UnsupportedError(f"pipeline parallelism of {where}: the forward updates buffers (e.g. BatchNorm running "
                               "statistics), which the pipeline does not carry between microbatches; use a model "
                               "without buffer updates or no pipeline")
    pro_eqns, epi_eqns = jaxpr.eqns[:blocks.start], jaxpr.eqns[blocks.stop:]
    parts, weighted = _loss_parts(epi_eqns, loss)
    defined = {v for e in pro_eqns for v in e.outvars}
    epi_needs = [v for v in dict.fromkeys(v for e in epi_eqns for v in e.invars if isinstance(v, jcore.Var))
                 if v in defined and v not in blocks.outputs]
    epi_needs += [v for v in parts if v in defined and v not in epi_needs]
    pro_outs = list(dict.fromkeys([*blocks.init, *blocks.shared, *blocks.variants.inputs(), *epi_needs]))
    prologue = _jaxpr(jaxpr.constvars, jaxpr.invars, pro_outs, pro_eqns, "prologue")
    # a prologue output may be an input itself (a model whose blocks read the batch directly); each
    # layer's collected outputs (router logits read by the loss) reach the epilogue in the activation
    collected = [v for out in blocks.collected for v in out.per_layer]
    epi_ins = list(dict.fromkeys([*jaxpr.invars, *pro_outs, *blocks.outputs, *collected]))
    epilogue = _jaxpr(jaxpr.constvars, epi_ins, parts, epi_eqns, "epilogue")
    index = {v: i for i, v in enumerate(params)}
    layer_params = [[param_names[index[v]] for v in layer] for layer in blocks.per_layer]
    return Cut(blocks, prologue, epilogue, layer_params, weighted)

"""One pipeline stage's work on one microbatch, on local shards.

Every device runs the same program (SPMD over the `pipe` axis); what differs per stage is data:
which layers it holds (a row of `Layers`), whether it starts the pipeline (its input is the
prologue's output, not the neighbour's activation) and whether it ends it (it computes the loss).
Those choices are selects on values known per device, never branches: Trainium runs neither
`lax.cond` nor data-dependent loops. So every stage also evaluates the prologue and epilogue of
its microbatch and throws the result away unless it is the first / last stage: the price of
lockstep SPMD, small for a transformer (embedding lookup; final norm, head and loss).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xtrain.lowering import collectives
from xtrain.lowering import sharded as C
from xtrain.lowering.explicit.interpreter import interpret
from xtrain.lowering.explicit.layer_scan import layer_path, scan_with_stable_carry
from xtrain.lowering.explicit.variants import Picker
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Layout, Sharded
from xtrain.lowering.pipeline.branching import switch
from xtrain.lowering.pipeline.graph import Cut


@dataclasses.dataclass(frozen=True)
class Layers:
    """Layer of each (stage, chunk, slot); stages with fewer layers pad with masked slots."""

    index: np.ndarray   # (p, v, Lc) int: layer number (0 in padding slots)
    valid: np.ndarray   # (p, v, Lc) bool
    starts: tuple[int, ...]  # first layer of each virtual stage, in virtual-stage order

    @staticmethod
    def from_starts(starts: list[int], num_layers: int, stages: int, chunks: int, place=None) -> "Layers":
        """`place(vs)`: the (stage, chunk) of virtual stage vs (default: chunk c of stage s is
        virtual stage c * p + s; schedule.place)."""
        bounds = list(starts) + [num_layers]
        width = max(b - a for a, b in zip(bounds, bounds[1:]))
        index = np.zeros((stages, chunks, width), dtype=np.int32)
        valid = np.zeros((stages, chunks, width), dtype=bool)
        for vs in range(stages * chunks):
            s, c = place(vs) if place is not None else divmod(vs, stages)[::-1]
            n = bounds[vs + 1] - bounds[vs]
            index[s, c, :n] = np.arange(bounds[vs], bounds[vs + 1])
            valid[s, c, :n] = True
        return Layers(index, valid, tuple(starts))

    def of_stage(self, vs: int, num_layers: int) -> range:
        bounds = list(self.starts) + [num_layers]
        return range(bounds[vs], bounds[vs + 1])


class Stage:
    """Interprets the cut graph for one microbatch: prologue -> this chunk's layers -> epilogue.

    `conditionals`: the target runs branches (CPU, GPU: the zero-bubble executor), so only the
    last stage evaluates the epilogue (a branch on `last`) instead of every stage, masked."""

    def __init__(self, ctx: Context, cut: Cut, consts, conditionals: bool = False):
        self.ctx, self.cut, self.consts, self.conditionals = ctx, cut, consts, conditionals
        self.carry_layouts = None  # layouts of the activation passed between stages (set by `prologue`)

    def prologue(self, env: dict) -> list[Sharded]:
        """Runs the prologue into `env`; returns the block input (carries, whole values), then one
        buffer per collected output (`collected`)."""
        outs = interpret(self.ctx, self.cut.prologue, self.consts, [env[v] for v in self.cut.prologue.invars])
        env.update(zip(self.cut.prologue.outvars, outs))
        init = [C.resolve(self.ctx, env[v]) for v in self.cut.blocks.init] + self.collected()
        self.carry_layouts = [x.layout for x in init]
        return init

    def collected(self) -> list[Sharded]:
        """Zero buffers, one per value each layer computes and the loss reads after the blocks
        (blocks.collected: HF Mixtral's router logits), (layers, ...) whole: they travel with the
        activation, each stage writes its layers' rows, and the last stage's epilogue reads them
        (the stages pass on nothing else)."""
        body, n = self.cut.blocks.body, self.cut.blocks.num_carry
        layers = len(self.cut.layer_params)
        out = []
        for v in body.outvars[n:]:
            shape = (layers,) + tuple(v.aval.shape)
            out.append(Sharded(jnp.zeros(shape, v.aval.dtype), Layout.replicated(len(shape)), shape, v.aval.dtype))
        return out

    def layers(self, carry: list[Sharded], shared: list[Sharded], picker: Picker, params: list[Sharded],
               numbers, valid) -> tuple[list, dict]:
        """The chunk's layers as one scan; `params` hold (Lc, ...) stacked values, `numbers` (Lc,)
        the layer numbers (for what differs per layer: explicit/variants.py), `valid` (Lc,).
        Also the counts the rules recorded per slot ({(name, block 0's path): (Lc, ...)}, whole,
        zero in padding slots), e.g. each MoE layer's tokens per expert."""
        ctx, body, path, n = self.ctx, self.cut.blocks.body, self.ctx.path, self.cut.blocks.num_carry

        def step(values, xs):
            layer, number, ok = xs[:-2], xs[-2], xs[-1]
            ins = ([dataclasses.replace(x, value=v) for x, v in zip(carry[:n], values[:n])] + shared
                   + [dataclasses.replace(p, value=w) for p, w in zip(params, layer)] + picker.at(number))
            before = set(ctx.record.counts)
            with ctx.cursor.at(path):
                outs = interpret(ctx, body, [], ins)
                # collected outputs, whole, into row `number` of their buffers
                rows = [lax.dynamic_update_index_in_dim(b, C.replicate(ctx, o).value.astype(b.dtype), number, 0)
                        for o, b in zip(outs[n:], values[n:])]
                outs = [C.relayout(ctx, o, x.layout).value for o, x in zip(outs[:n], carry)] + rows
            counts = {key: C.replicate(ctx, c).value for key, c in ctx.record.take_counts(before).items()}
            counts = {key: jnp.where(ok, c, jnp.zeros_like(c)) for key, c in counts.items()}
            return [jnp.where(ok, o, v) for o, v in zip(outs, values)], counts  # padding slot: identity

        final, counts = scan_with_stable_carry(step, [x.value for x in carry],
                                               [p.value for p in params] + [numbers, valid])
        return [dataclasses.replace(x, value=v) for x, v in zip(carry, final)], counts

    def epilogue(self, env: dict) -> tuple:
        """(sum, count) of the loss over the microbatch, replicated (count 1 when unweighted)."""
        outs = interpret(self.ctx, self.cut.epilogue, self.consts, [env[v] for v in self.cut.epilogue.invars])
        outs = [C.replicate(self.ctx, o).value for o in outs]
        total = outs[0]
        count = outs[1].astype(total.dtype) if self.cut.weighted else jnp.ones((), total.dtype)
        return total, count

    def __call__(self, env: dict, x: list, params: list[Sharded], slots: tuple, first, last):
        """(activation out, loss sum, count, layer counts) of one microbatch. `x`: the incoming
        activation (local values); `slots`: (layer numbers, valid) of the chunk's slots; `first` /
        `last`: traced booleans; layer counts: see `layers`."""
        env = dict(env)
        init = self.prologue(env)
        carry = [dataclasses.replace(i, value=jnp.where(first, i.value, v)) for i, v in zip(init, x)]
        shared = [env[v] for v in self.cut.blocks.shared]
        picker = Picker(self.ctx, self.cut.blocks.variants, env.__getitem__, stacked=True)
        out, counts = self.layers(carry, shared, picker, params, *slots)
        n = self.cut.blocks.num_carry
        env.update(zip(self.cut.blocks.outputs, out[:n]))
        for collected, buffer in zip(self.cut.blocks.collected, out[n:]):  # layer k's value: row k
            env.update({v: Sharded(buffer.value[k], Layout.replicated(buffer.ndim - 1), buffer.shape[1:], buffer.dtype)
                        for k, v in enumerate(collected.per_layer)})
        if self.conditionals:
            closed, shapes = jax.make_jaxpr(lambda: self.epilogue(env), return_shape=True)()  # interpreted once
            epilogue = lambda: tuple(jax.core.eval_jaxpr(closed.jaxpr, closed.consts))
            nothing = lambda: tuple(jnp.zeros(a.shape, a.dtype) for a in shapes)
            total, count = switch(last.astype(jnp.int32), [nothing, epilogue])
            return [o.value for o in out], total, count, counts
        total, count = self.epilogue(env)
        zero = jnp.zeros((), total.dtype)
        return [o.value for o in out], jnp.where(last, total, zero), jnp.where(last, count, zero), counts


def ring(axis: str, size: int, shift: int):
    """ppermute around the ring of pipeline stages (Trainium permutes only around rings)."""
    perm = [(s, (s + shift) % size) for s in range(size)]
    return lambda x: collectives.permute(x, axis, perm)


def take(table: np.ndarray, index):
    """Row `index` (traced) of a static table."""
    return jnp.asarray(table)[index]


def microbatch(batch_leaves: list, i) -> list:
    """Microbatch `i` of leaves shaped (m, b, ...)."""
    return [lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False) for x in batch_leaves]


def stack_layers(values: dict, layer_params: list[list[str]]) -> list:
    """Per body parameter position: every layer's local value stacked, (L, ...)."""
    return [jnp.stack([values[layer[k]] for layer in layer_params]) for k in range(len(layer_params[0]))]


def stage_rows(stacked: list, layers: Layers, stage) -> list:
    """This stage's chunks of the stacked layers, (v, Lc, ...), by gathering rows."""
    index = take(layers.index, stage)  # (v, Lc)
    return [jnp.take(s, index, axis=0) for s in stacked]


def layer_counts(counts: dict, layers: Layers, stage, prefix: str, num_layers: int, axis: str, first: int = 0) -> dict:
    """{name: {module path: count}} of every layer, summed over the stages: `counts` holds this
    stage's {(name, block 0's path): (v, Lc, ...)} per chunk and slot (zero in padding slots)."""
    index = take(layers.index, stage).reshape(-1)  # (v * Lc,) layer of each slot
    out: dict = {}
    for (name, path), c in sorted(counts.items()):
        per_layer = jnp.zeros((num_layers,) + c.shape[2:], c.dtype).at[index].add(c.reshape((-1,) + c.shape[2:]))
        per_layer = collectives.all_reduce(per_layer, (axis,))
        for k in range(num_layers):
            out.setdefault(name, {})[layer_path(prefix, k, path, first)] = per_layer[k]
    return out

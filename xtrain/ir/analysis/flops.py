"""FLOPs per device of a (nested) jaxpr, by op class.

Counts the operations an op must do, not what a backend fuses away:
  dot_general     2 x output elements x contracted size (one multiply, one add per term)
  ragged_dot      2 x lhs elements x the rhs's free size: each row meets one group's matrix
                  (a routed token one expert's), so counted FLOPs are those of the active experts;
                  apart, `ragged_dense`: what the backends spend beyond that. JAX on CPU (and
                  Neuron) and XLA's GPU compiler (its ragged-dot rewriter) run a ragged dot as one
                  dense dot of every row against every group's matrix, the other groups' rows
                  masked to zero: (groups - 1) x the counted FLOPs more. xtrain's own grouped
                  matmul (xtrain.ir.kernels.grouped_matmul, a loop of tiles) counts the same:
                  its rows' share of the loop's matmuls, the rest in `ragged_dense`
  conv            2 x output elements x (kernel window x input features per group)
  elementwise     one per output element (add, mul, exp, select, ...); transcendentals also
                  counted apart, as XLA's cost analysis does
  reduce          one per input element (sum, max, argmax, cumulative ops)
and, apart from FLOPs, the bytes that data-movement ops copy (`moved_bytes`: concatenate, pad,
transpose, dynamic slices and updates, gathers and scatters, split, copy) and that a scan's
stacked operands cost (its per-iteration outputs written into (length, ...) buffers, which
are zero-filled first, and its stacked inputs read): memory traffic with no arithmetic.
Loops multiply their body by the trip count (scan's `length`); a `while` whose trip count is
not static counts its body once and is listed in `unknown_loops`, but the experts' FFN loop over
a padded buffer (grouped_matmul.grouped_ffn) counts the items its marker expects; a while loop's
body is counted without what nothing reads (XLA drops it). Inside `shard_map` shapes
are already per device, so xtrain's explicit program gives per-device FLOPs directly.

Model FLOPs and MFU have one definition here, used by `xtrain plan` (cost.search), the
training monitor (observe) and the benchmarks: model FLOPs of a step are the matmul and
convolution FLOPs of the model's forward and backward pass on the global batch, counted in
the model's own traced graph (`model_flops`), whatever the plan. For a transformer that is
6 x (parameters that enter matmuls) x tokens plus the attention matmuls (QK^T and AV: 12 x
layers x sequence x width per token, the causal mask not discounted), the usual "6N +
attention" of PaLM's MFU; no optimizer, no recomputation, no work a plan replicates or a
pipeline's bubble adds. One exception, as counted in the graph: attention through torch's SDPA
over more than one block (xtrain.ir.kernels.blockwise) counts the blocks it computes, so a causal
mask's skipped blocks are not counted and the backward's recomputed q.k is. MFU = model FLOPs per step / (step seconds x devices x the dense peak
FLOP/s of one device).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jcore

from xtrain.ir import attention, markers
from xtrain.ir.kernels import grouped_matmul, neuron_attention

TRANSCENDENTAL = frozenset({"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan",
                            "sqrt", "rsqrt", "cbrt", "pow", "erf", "erfc", "erf_inv", "atan2", "lgamma",
                            "digamma", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh"})
ELEMENTWISE = TRANSCENDENTAL | frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "max", "min", "abs", "sign", "floor", "ceil",
    "round", "integer_pow", "square", "select_n", "clamp", "nextafter", "is_finite", "exp2", "and", "or",
    "not", "xor", "eq", "ne", "lt", "le", "gt", "ge"})
REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                    "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
                    "reduce_precision"})
MOVEMENT = frozenset({"concatenate", "pad", "transpose", "dynamic_slice", "dynamic_update_slice", "gather",
                      "scatter", "scatter-add", "split", "copy", "copy_p"})


@dataclasses.dataclass
class Flops:
    """FLOPs of one program per device, by op class."""

    dot: float = 0.0
    conv: float = 0.0
    elementwise: float = 0.0
    transcendental: float = 0.0   # included in `elementwise` too
    reduce: float = 0.0
    moved_bytes: float = 0.0      # read + written by data movement (not FLOPs: not in `total`)
    unknown_loops: int = 0        # while loops counted once (trip count not static)
    matmul_dtypes: dict = dataclasses.field(default_factory=dict)  # operand dtype -> dot + conv FLOPs
    # of `elementwise + reduce` and `moved_bytes`: the part inside blockwise attention calls that a
    # CUDA host runs in cuDNN's fused kernel (Site.fused_on), where it never leaves the chip
    cuda_fused_elementwise: float = 0.0
    cuda_fused_moved_bytes: float = 0.0
    ragged_dense: float = 0.0     # matmul FLOPs a ragged dot runs beyond `dot` (module docstring)

    @property
    def matmul(self) -> float:
        """dot_general + convolution: the work a tensor engine does."""
        return self.dot + self.conv

    @property
    def total(self) -> float:
        return self.dot + self.conv + self.elementwise + self.reduce

    def add(self, other: "Flops", times: float = 1.0) -> None:
        for f in ("dot", "conv", "elementwise", "transcendental", "reduce", "moved_bytes", "cuda_fused_elementwise",
                  "cuda_fused_moved_bytes", "ragged_dense"):
            setattr(self, f, getattr(self, f) + times * getattr(other, f))
        self.unknown_loops += other.unknown_loops
        for dtype, value in other.matmul_dtypes.items():
            self.matmul_dtypes[dtype] = self.matmul_dtypes.get(dtype, 0.0) + times * value

    @property
    def matmul_dtype(self) -> str:
        """The operand dtype doing most matmul FLOPs ("float32" when there are none)."""
        return max(self.matmul_dtypes, key=self.matmul_dtypes.get) if self.matmul_dtypes else "float32"


def _size(aval) -> int:
    return math.prod(getattr(aval, "shape", ()))


def _bytes(avals) -> float:
    return float(sum(_size(a) * getattr(getattr(a, "dtype", None), "itemsize", 4) for a in avals))


def _dot(eqn) -> float:
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2.0 * _size(eqn.outvars[0].aval) * math.prod(lhs[d] for d in contract)


def _ragged_dot(eqn) -> float:
    dn = eqn.params["ragged_dot_dimension_numbers"]
    (_, r_contract), (_, r_batch) = dn.dot_dimension_numbers
    rhs = eqn.invars[1].aval.shape
    skip = set(r_contract) | set(r_batch) | set(dn.rhs_group_dimensions)
    return 2.0 * _size(eqn.invars[0].aval) * math.prod(n for d, n in enumerate(rhs) if d not in skip)


def _conv(eqn) -> float:
    rhs = eqn.invars[1].aval.shape
    out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
    # rhs holds (out features, in features / groups, *window): each output element reads
    # one kernel column of in/groups x window terms
    return 2.0 * _size(eqn.outvars[0].aval) * math.prod(rhs) / rhs[out_feature_dim]


def _trip_count(eqn) -> tuple[float, bool]:
    """(times the sub-jaxprs run, whether that is known)."""
    name = str(eqn.primitive)
    if name == "scan":
        return float(eqn.params["length"]), True
    if name == "while":
        return 1.0, False
    return 1.0, True


def _op(eqn, acc: Flops) -> None:
    name = str(eqn.primitive)
    if name in ("dot_general", "conv_general_dilated", "ragged_dot_general") or name in neuron_attention.PER_HEAD:
        value = {"dot_general": _dot, "ragged_dot_general": _ragged_dot}.get(
            name, neuron_attention.matmul_flops if name in neuron_attention.PER_HEAD else _conv)(eqn)
        if name == "ragged_dot_general":  # run dense against each of the groups (module docstring)
            acc.ragged_dense += (eqn.invars[2].aval.shape[-1] - 1) * value
        if name != "conv_general_dilated":
            acc.dot += value
        else:
            acc.conv += value
        dtype = str(eqn.invars[0].aval.dtype)
        acc.matmul_dtypes[dtype] = acc.matmul_dtypes.get(dtype, 0.0) + value
    elif name in ELEMENTWISE:
        n = sum(_size(v.aval) for v in eqn.outvars)
        acc.elementwise += n
        acc.transcendental += n if name in TRANSCENDENTAL else 0
    elif name in REDUCE:
        acc.reduce += sum(_size(v.aval) for v in eqn.invars)
    elif name in MOVEMENT:
        written = [v.aval for v in eqn.outvars]
        if name in ("dynamic_update_slice", "scatter", "scatter-add"):
            written = [eqn.invars[-1].aval]  # in place: the update
        acc.moved_bytes += 2 * _bytes(written)  # read and written
    elif name == "scan":
        carry, consts = eqn.params["num_carry"], eqn.params["num_consts"]
        ys = [v.aval for v in eqn.outvars[carry:]]
        xs = [v.aval for v in eqn.invars[consts + carry:]]
        acc.moved_bytes += 3 * _bytes(ys) + _bytes(xs)  # zero-fill, write, read back; read


def _live(jaxpr):
    """A loop body without its dead equations (JAX has no dead-code rule for while loops: a
    gradient taken inside one keeps the primal outputs it does not use)."""
    body = getattr(jaxpr, "jaxpr", jaxpr)
    return pe.dce_jaxpr(body, [True] * len(body.outvars), instantiate=True)[0]


def _fused_on_cuda(eqn, inside: bool) -> bool:
    """Whether `eqn` is inside a blockwise attention call that CUDA runs fused (Site.fused_on)."""
    if inside or "xtrain_attention=" not in str(eqn.source_info.name_stack):
        return inside
    site = markers.innermost(attention.Site, eqn.source_info.name_stack)
    return site is not None and site.fused_on == "cuda"


def of_eqn(eqn, fused: bool = False) -> Flops:
    """FLOPs of one equation, its sub-jaxprs included (scan bodies x length; `cond` counts its
    most expensive branch). `fused`: the equation is inside an attention call CUDA fuses."""
    acc = Flops()
    _op(eqn, acc)
    fused = _fused_on_cuda(eqn, fused)
    if fused:
        acc.cuda_fused_elementwise, acc.cuda_fused_moved_bytes = acc.elementwise + acc.reduce, acc.moved_bytes
    subs = list(jcore.jaxprs_in_params(eqn.params))
    if not subs:
        return acc
    if str(eqn.primitive) == "cond":
        acc.add(max((count(s, fused) for s in subs), key=lambda f: f.total))
        return acc
    times, known = _trip_count(eqn)
    if str(eqn.primitive) == "while":  # what the body computes and nothing reads (XLA drops it) is not run
        subs = [_live(s) for s in subs]
    tiles = markers.innermost(grouped_matmul.Tiles, eqn.source_info.name_stack)
    if tiles is not None and not known:  # the experts' FFN over a padded buffer: its expected items
        times, known = float(tiles.items), True
    for sub in subs:
        acc.add(count(sub, fused), times)
    acc.unknown_loops += 0 if known else 1
    tiles = tiles if times > 1 else None
    if tiles is not None:  # a grouped matmul's loop: its rows' share is the matmul (module docstring)
        extra = acc.dot * (1 - tiles.useful)
        acc.dot, acc.ragged_dense = acc.dot - extra, acc.ragged_dense + extra
        acc.matmul_dtypes = {k: v * tiles.useful for k, v in acc.matmul_dtypes.items()}
    return acc


def of_eqns(eqns, fused: bool = False) -> Flops:
    acc = Flops()
    for eqn in eqns:
        acc.add(of_eqn(eqn, fused))
    return acc


def count(jaxpr, fused: bool = False) -> Flops:
    """FLOPs of a jaxpr or ClosedJaxpr, sub-jaxprs included."""
    return of_eqns(getattr(jaxpr, "jaxpr", jaxpr).eqns, fused)


# -- model FLOPs and MFU (the one definition: module docstring) ---------------------------------
def training_flops(loss: Callable[..., Any], params: Any, *rest: Any) -> float:
    """Model FLOPs of one training step of `loss(params, *rest)` (a scalar): the matmul and
    convolution FLOPs of its value and its gradient with respect to `params`, traced at the
    shapes of the arguments (arrays or jax.ShapeDtypeStruct)."""
    return count(jax.make_jaxpr(jax.value_and_grad(loss))(params, *rest)).matmul


def _shaped(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, tree)


def model_flops(model, params: Mapping[str, Any], buffers: Mapping[str, Any], key, batch: tuple, *,
                frozen: Mapping[str, Any] | None = None) -> float:
    """Model FLOPs of one training step of an xtrain Model (xtrain.ir.model) on the global
    `batch`: forward and backward, gradients for `params` (not for `frozen` ones)."""
    frozen = frozen or {}

    def loss(trained, frozen, buffers, key, batch):
        value = model.apply({**trained, **frozen}, buffers, key, batch, training=True)[0]
        return value[0] if isinstance(value, tuple) else value  # (sum, count): the sum's FLOPs

    return training_flops(loss, *_shaped((dict(params), dict(frozen), dict(buffers), key, tuple(batch))))


def mfu(model_flops_per_step: float, step_s: float, devices: int, peak_per_device: float) -> float:
    """Model FLOPs utilisation: model FLOPs per step / (step seconds x devices x one device's peak)."""
    return model_flops_per_step / (step_s * devices * peak_per_device)

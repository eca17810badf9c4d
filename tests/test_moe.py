"""Mixture-of-experts layers: HF Mixtral and Qwen3-MoE (tiny configs, transformers 5 defaults,
random init) and an MoE written here (top-2 of 4 experts plus a shared expert, with its own
load-balancing loss) train on 8 emulated devices as single-device torch does (the parity
standard), with the same token-to-expert assignments, and run each device's own tokens through
the experts: no op of an MoE layer replicated, no collective in it beyond the loss's reductions."""
import copy
import dataclasses
import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
import pytest
import torch
from jax import lax
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import xtrain
from xtrain.errors import InputError, PlanError
from xtrain.ir.analysis import flops
from xtrain.ir.model import TraceError
from xtrain.testing import ParityResult, assert_parity, run_parity, torch_reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from moe_model import Experts  # noqa: E402  (SwiGLU experts as HF stores them: an HF experts module)

VOCAB = 101
TOP_K, EXPERTS = 2, 4


def lm_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def lm_batches(n=4, batch=8, seq=8, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(ids, ids) for ids in (torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n))]


def mixtral(**kw):
    # output_router_logits: the model's own load-balancing loss joins the LM loss
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=32,
        output_router_logits=True, router_aux_loss_coef=0.1, bos_token_id=0, eos_token_id=0, **kw))


def qwen3_moe(layers=2):
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=True, max_position_embeddings=32, bos_token_id=0, eos_token_id=0))


# -- an MoE written here ------------------------------------------------------------------------
@dataclasses.dataclass
class MoEConfig:
    d: int = 32
    ffn: int = 48
    experts: int = EXPERTS
    top_k: int = TOP_K
    aux: float = 0.1
    _experts_implementation: str = "grouped_mm"  # HF's experts switch (its default)


class Router(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.top_k = config.top_k
        self.weight = nn.Parameter(torch.randn(config.experts, config.d))  # large logits: a routing margin

    def forward(self, x):  # (N, d) -> logits (N, E), weights (N, k), indices (N, k)
        logits = nn.functional.linear(x, self.weight)
        top, idx = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), idx


class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.norm = nn.RMSNorm(config.d)
        self.gate, self.experts = Router(config), Experts(config)
        self.shared = nn.Sequential(nn.Linear(config.d, config.ffn), nn.SiLU(), nn.Linear(config.ffn, config.d))

    def forward(self, x):  # (B, T, d)
        h = self.norm(x).reshape(-1, x.shape[-1])
        logits, weights, idx = self.gate(h)
        out = self.experts(h, idx, weights) + self.shared(h)
        return x + out.reshape(x.shape), logits


class MoELM(nn.Module):
    """Embedding, 2 MoE blocks, head; loss = cross-entropy + aux x Switch load balancing."""

    def __init__(self, config: MoEConfig = MoEConfig()):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB, config.d)
        self.blocks = nn.ModuleList([MoEBlock(config) for _ in range(2)])
        self.head = nn.Linear(config.d, VOCAB)

    def forward(self, ids, labels):
        x, balance = self.embed(ids), 0.0
        for block in self.blocks:
            x, logits = block(x)
            probs = logits.softmax(-1)  # (N, E)
            chosen = nn.functional.one_hot(probs.topk(self.config.top_k, -1).indices, self.config.experts)
            share = chosen.float().sum(1).mean(0) / self.config.top_k  # fraction routed to each expert
            balance = balance + self.config.experts * (share * probs.mean(0)).sum()
        loss = nn.functional.cross_entropy(self.head(x).reshape(-1, VOCAB), labels.reshape(-1))
        return loss + self.config.aux * balance


def moe_loss(model, ids, labels):
    return model(ids, labels)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# SGD: differences stay proportional to gradient errors (AdamW moves router weights by lr x sign
# of rounding noise, which moves router logits by ~1e-4: within reach of a routing tie)
CASES = {"mixtral": (mixtral, sgd, lm_loss), "qwen3_moe": (qwen3_moe, sgd, lm_loss),
         "moe": (MoELM, sgd, moe_loss)}


def with_routing_margin(model):
    """Routers initialised at std 1 instead of HF's 0.02: near-uniform router probabilities put
    tokens within rounding of a tie between experts, where a discontinuous pick is not a fair test."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    return model


@functools.cache
def case(name):
    make_model, make_opt, loss_fn = CASES[name]
    torch.manual_seed(0)
    model, batches = with_routing_margin(make_model()), lm_batches()
    return model, make_opt, loss_fn, batches, torch_reference(model, make_opt, batches, loss_fn)


def routing(model, loss_fn, batches):
    """Per batch and router: its logits (N, E) and top-k expert indices (N, k)."""
    picks = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: picks.append(out)) for name, m in model.named_modules()
             if name.endswith("mlp.gate") or isinstance(m, Router)]
    with torch.no_grad():
        for batch in batches:
            loss_fn(model, *batch)
    for h in hooks:
        h.remove()
    return [(logits.float(), idx) for logits, _, idx in picks]


def assert_same_routing(model, result, loss_fn, batches):
    """The trained models (torch's, xtrain's) send every token to the same experts, and every
    token is 10x further from a tie between its k-th and next expert (in router logits; softmax
    keeps the order) than the two models' logits are apart."""
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    ours.load_state_dict(result.state)
    theirs.load_state_dict(result.reference_state)
    mine, ref = routing(ours, loss_fn, batches), routing(theirs, loss_fn, batches)
    assert len(mine) == len(ref) == 2 * len(batches)
    for (logits, idx), (ref_logits, ref_idx) in zip(mine, ref):
        top = ref_logits.topk(TOP_K + 1, -1).values
        margin = float((top[:, TOP_K - 1] - top[:, TOP_K]).min())
        apart = float((logits - ref_logits).abs().max())
        assert margin > 10 * apart, f"routing margin {margin:.2g} vs logits {apart:.2g} apart: a near tie"
        assert torch.equal(idx, ref_idx), "token-to-expert assignments differ from torch's"


def assert_moe_local(step):
    """No partition-rule fallback, no gather of activations, and over `data` only the loss's
    reductions: scalars, and the load-balancing loss's per-expert sums (EXPERTS floats); and the
    step's tokens per expert of both layers (2 x EXPERTS ints) in one all-reduce."""
    report = step.report()
    assert not [n for n in report.notes if "no partition rule" in n], report.notes
    moved = [c for c in report.collectives if "grad_sync" not in c.source and not _loss_reduction(c)]
    assert not moved, f"collectives beyond the loss's reductions: {moved}"


MESHES = {"data8": dict(data=8), "fsdp": dict(data=8), "expert": dict(data=2, expert=4),
          "fsdp_expert": dict(data=2, expert=4), "megatron": dict(data=4, tensor=2),
          "expert_tensor": dict(data=2, expert=2, tensor=2), "zero1_expert": dict(data=2, expert=4),
          "zero2_expert": dict(data=2, expert=4), "zero3_expert": dict(data=2, expert=4)}


def layout_plan(layout, model, mesh, batch, loss_fn):
    """The plan of a layout of the parity matrix; Megatron's splits each expert's FFN over `tensor`."""
    if "fsdp" in layout:
        return xtrain.plans.fsdp(model, mesh)
    if layout.startswith("zero"):
        return xtrain.Plan(zero=int(layout[4]))
    if layout not in ("megatron", "expert_tensor"):
        return None
    plan = xtrain.plans.megatron(model, mesh, example=batch, loss_fn=loss_fn)
    assert plan.params["blocks.*.experts.gate_up_proj"] == (None, "tensor", None), plan
    assert plan.params["blocks.*.experts.down_proj"] == (None, None, "tensor"), plan
    xtrain.plans.assert_sharded(plan, model, mesh, max_replicated=0.2)  # embedding and head: vocab 101
    return plan


@pytest.mark.e2e
@pytest.mark.parametrize("name,layout", [("mixtral", "data8"), ("qwen3_moe", "data8"), ("moe", "data8"),
                                         ("moe", "fsdp"), ("moe", "expert"), ("mixtral", "expert"),
                                         ("qwen3_moe", "expert"), ("moe", "fsdp_expert"), ("moe", "zero1_expert"),
                                         ("moe", "zero2_expert"), ("mixtral", "zero3_expert"), ("moe", "megatron"),
                                         ("moe", "expert_tensor")])
def test_moe_parity(name, layout):
    model, make_opt, loss_fn, batches, reference = case(name)
    mesh = xtrain.Mesh(**MESHES[layout])
    plan = layout_plan(layout, model, mesh, batches[0], loss_fn)
    result = run_parity(model, make_opt, batches, mesh, plan=plan, loss_fn=loss_fn, reference=reference)
    assert_parity(result)
    assert_same_routing(model, result, loss_fn, batches)


@pytest.mark.e2e
def test_expert_parallel_inside_pipeline_stages():
    """Qwen3-MoE (no router loss read after the blocks) on 2 stages x data=2 x expert=2: each
    stage stores its layers' experts split over `expert` and moves tokens by all-to-all."""
    model, make_opt, loss_fn, batches, reference = case("qwen3_moe")
    mesh, plan = xtrain.Mesh(pipe=2, data=2, expert=2), xtrain.Plan().with_pipeline(2, 2)
    m = copy.deepcopy(model)
    step = xtrain.compile(m, mesh, optimizer=make_opt(m.parameters()), loss_fn=loss_fn, plan=plan)
    result = ParityResult([step(*b)["loss"] for b in batches], reference[0], step.state_dict(), reference[1], 1e-5)
    assert_parity(result)
    assert_same_routing(model, result, loss_fn, batches)
    assert step.layout.param_specs["model.layers.*.mlp.experts.down_proj"] == ("pipe", "expert", None, None)
    assert any(c.kind == "all-to-all" and c.axes == ("expert",) for c in step.report().collectives)


@pytest.mark.e2e
def test_moe_layers_run_on_local_tokens():
    model, make_opt, loss_fn, batches, _ = case("mixtral")
    m = copy.deepcopy(model)
    step = xtrain.compile(m, xtrain.Mesh(data=8), optimizer=make_opt(m.parameters()), loss_fn=loss_fn)
    step(*batches[0])
    assert_moe_local(step)


class OwnGateExperts(Experts):
    """Experts with a gate of their own (same arithmetic): not recognised as HF's default
    experts, so HF's grouped_mm code runs op by op (sort, histc, cumsum, aten::_grouped_mm)."""

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


@pytest.mark.e2e
def test_grouped_mm_op_traced_op_by_op_matches_torch():
    torch.manual_seed(1)
    model = MoELM()
    for block in model.blocks:
        own = OwnGateExperts(model.config)
        own.load_state_dict(block.experts.state_dict())
        block.experts = own
    batches = lm_batches(seed=7)
    result = run_parity(model, sgd, batches, xtrain.Mesh(data=8), loss_fn=moe_loss)
    assert_parity(result)
    assert_same_routing(model, result, moe_loss, batches)


@pytest.mark.e2e
def test_eager_experts_error_names_op_module_and_switch():
    torch.manual_seed(0)
    model = mixtral(experts_implementation="eager")
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()), loss_fn=lm_loss)
    with pytest.raises(TraceError, match=r"aten::nonzero in module 'model\.layers\.0\.mlp\.experts'.*"
                                         r"experts_implementation='eager'.*'grouped_mm'"):
        step(*lm_batches(n=1)[0])


@pytest.mark.e2e
def test_expert_axis_on_a_model_without_moe_is_an_error():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    with pytest.raises(PlanError, match=r"mesh axis 'expert' \(size 4\) splits the experts of MoE layers, but "
                                        r"Sequential has none"):
        xtrain.compile(model, xtrain.Mesh(data=2, expert=4), optimizer=sgd(model.parameters()),
                       loss_fn=lambda m, x: m(x).sum())(torch.ones(8, 4))


@pytest.mark.e2e
def test_experts_not_divisible_by_expert_axis_is_an_error():
    model = MoELM()
    with pytest.raises(PlanError, match=r"expert weight 'blocks\.0\.experts\.down_proj' of shape \(4, 32, 48\) "
                                        r"holds 4 experts, not divisible by the mesh axis 'expert' of size 8"):
        xtrain.compile(model, xtrain.Mesh(expert=8), optimizer=sgd(model.parameters()),
                       loss_fn=moe_loss)(*lm_batches(n=1)[0])


@pytest.mark.e2e
def test_top_k_above_the_number_of_experts_is_an_error_naming_the_router():
    model = MoELM(MoEConfig(top_k=5))
    with pytest.raises(TraceError, match=r"torch\.topk in module 'blocks\.0\.gate' of MoELM picks k=5 of 4 .*"
                                         r"set top_k \(num_experts_per_tok\) to at most 4, the number of experts"):
        xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()),
                       loss_fn=moe_loss)(*lm_batches(n=1)[0])


@pytest.mark.e2e
def test_batch_not_divisible_by_data_times_expert_is_an_error():
    model = MoELM()
    with pytest.raises(InputError, match=r"global batch 4 is not divisible by mesh axis data=2 x expert=4; use a "
                                         r"global batch that is a multiple of 8"):
        xtrain.compile(model, xtrain.Mesh(data=2, expert=4), optimizer=sgd(model.parameters()),
                       loss_fn=moe_loss)(*lm_batches(n=1, batch=4)[0])


@pytest.mark.e2e
def test_bf16_plan_keeps_experts_one_local_call():
    """Under a bf16 policy the grouped matmuls run in bf16 and the routed-experts call stays one
    call (the policy would otherwise inline it and the sort by expert would gather tokens)."""
    model, _, loss_fn, batches, (reference_losses, _) = case("moe")
    m = copy.deepcopy(model)
    step = xtrain.compile(m, xtrain.Mesh(data=8), optimizer=sgd(m.parameters()), loss_fn=loss_fn,
                          plan=xtrain.Plan(precision="bf16"))
    losses = [float(step(*b)["loss"]) for b in batches]
    assert max(abs(a - b) / b for a, b in zip(losses, reference_losses)) < 1e-2
    assert losses != pytest.approx(reference_losses, rel=1e-6), "bf16 changed nothing: did the policy apply?"
    assert_moe_local(step)


@pytest.mark.e2e
def test_expert_parallel_moves_tokens_by_two_all_to_alls_per_layer_each_way():
    """Mesh(data=2, expert=4): experts split over `expert` (assert_sharded), per MoE layer one
    dispatch and one combine all-to-all over `expert` in the forward pass and their two
    transposes in the backward, each of capacity (tokens x top_k per device) rows per peer;
    expert gradients summed over `data` only, the rest over data x expert."""
    model, make_opt, loss_fn, batches, _ = case("moe")
    m = copy.deepcopy(model)
    step = xtrain.compile(m, xtrain.Mesh(data=2, expert=4), optimizer=make_opt(m.parameters()), loss_fn=loss_fn,
                          scan_layers=False)  # each layer's all-to-alls in the program
    step(*batches[0])
    xtrain.plans.assert_sharded(step, max_replicated=0.3)  # the experts: 3/4 of the parameters
    stored = [n for n in step.layout.param_specs if ".experts." in n]
    assert len(stored) == 4 and all(step.layout.split_axes(n) == ("expert",) for n in stored), stored  # per layer
    report = step.report()
    tokens = batches[0][0].numel() // 8  # per device
    for layer in ("blocks.0.experts", "blocks.1.experts"):
        moved = [c for c in report.collectives if c.kind == "all-to-all" and layer in c.source]
        assert len(moved) == 4 and all(c.axes == ("expert",) for c in moved), moved
        forward = [c for c in moved if "transpose" not in c.source]
        assert sorted(c.payload_bytes for c in forward) == [4 * tokens * TOP_K * 32 * 4,
                                                            4 * tokens * TOP_K * 33 * 4]  # + the expert id column
    assert [c.kind for c in report.collectives].count("all-to-all") == 8
    capacity = f"capacity of {tokens * TOP_K} rows per peer"
    assert len([n for n in report.notes if capacity in n and "blocks." in n]) == 2, report.notes  # one per layer
    expert_sync = [c for c in report.collectives if "experts.gate_up_proj" in c.source and "grad_sync" in c.source]
    assert expert_sync and all(c.axes == ("data",) for c in expert_sync), expert_sync
    assert_moe_local_router(report)


@pytest.mark.e2e
def test_fsdp_with_expert_axis_splits_experts_over_both():
    """plans.fsdp on Mesh(data=2, expert=4): expert weights split over `expert` (experts dim) and
    `data` (FSDP's dim, gathered per use); tokens still move by all-to-all."""
    model, make_opt, loss_fn, batches, _ = case("moe")
    m, mesh = copy.deepcopy(model), xtrain.Mesh(data=2, expert=4)
    step = xtrain.compile(m, mesh, optimizer=make_opt(m.parameters()), plan=xtrain.plans.fsdp(m, mesh),
                          loss_fn=loss_fn)
    step(*batches[0])
    stored = [n for n in step.layout.param_specs if ".experts." in n]
    assert stored and all(set(step.layout.split_axes(n)) == {"expert", "data"} for n in stored)
    assert [c.kind for c in step.report().collectives].count("all-to-all") == 8


@pytest.mark.e2e
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_with_expert_axis_splits_expert_state_over_data(stage):
    """Plan(zero=stage) on Mesh(data=2, expert=4): the expert weights, split over `expert` by
    expert parallelism, have their ZeRO split over `data` (the batch axis they leave free):
    optimizer state (and, stage 3, the weights) held by 1/8 of the devices each, not 1/4; ZeRO-1
    and 2 move the expert weights' shards over `data` alone; ZeRO-3 gathers each layer's other
    weights over data x expert (never per use, with an all-reduce of their gradients)."""
    model, make_opt, loss_fn, batches, _ = case("moe")
    m = copy.deepcopy(model)
    step = xtrain.compile(m, xtrain.Mesh(data=2, expert=4), optimizer=make_opt(m.parameters()),
                          plan=xtrain.Plan(zero=stage), loss_fn=loss_fn)
    step(*batches[0])
    axes = lambda specs, n: {a for e in specs[n] for a in (e if isinstance(e, tuple) else (e,)) if a}
    stored = [n for n in step.layout.param_specs if ".experts." in n]
    assert stored
    for n in stored:
        assert axes(step.layout.optimizer_specs, n) == {"expert", "data"}, (n, step.layout.optimizer_specs[n])
        assert axes(step.layout.param_specs, n) == ({"expert", "data"} if stage == 3 else {"expert"})
    report = step.report().collectives
    if stage in (1, 2):
        zero = [c for c in report if "xtrain.zero" in c.source or "in_backward" in c.source]
        assert zero and {c.axes for c in zero} == {("data", "expert"), ("data",)}, zero
    else:  # every layer weight gathered flat, its gradient reduce-scattered: the experts' over data alone
        scattered = {c.axes for c in report if c.kind == "reduce-scatter" and "zero3_flat_gather" in c.source}
        assert scattered == {("data", "expert"), ("data",)}, report


def _loss_reduction(c) -> bool:
    """An all-reduce of the loss's reductions (scalars, a layer's per-expert sums) or of the
    step's tokens per expert (both layers' in one all-reduce)."""
    return c.kind == "all-reduce" and c.payload_bytes <= 4 * EXPERTS * (2 if "xtrain.counts" in c.source else 1)


def assert_moe_local_router(report):
    assert not [n for n in report.notes if "no partition rule" in n], report.notes
    routed = [c for c in report.collectives if "grad_sync" not in c.source and c.kind != "all-to-all"
              and not _loss_reduction(c)]
    assert not routed, f"collectives beyond the loss's reductions and the dispatch: {routed}"


@pytest.mark.unit
def test_grouped_matmul_flops_count_active_experts():
    """Model FLOPs (MFU) count each routed row once, through one expert, forward and backward;
    apart, what the backend runs beyond that: JAX lowers a ragged dot off TPU as one dense dot of
    every row against every expert's matrix (the others' rows masked), `experts - 1` times more
    (the cost model's compute time counts it)."""
    rows, k, n, experts = 12, 6, 5, 4
    sizes = jnp.array([3, 0, 7, 2], jnp.int32)
    loss = lambda a, b: jnp.sum(lax.ragged_dot(a, b, sizes) ** 2)
    args = jnp.ones((rows, k)), jnp.ones((experts, k, n))
    grads = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(*args)
    assert flops.count(grads).dot == 3 * 2 * rows * k * n
    assert flops.count(grads).ragged_dense == (experts - 1) * 3 * 2 * rows * k * n
    lowered = jax.jit(lambda a, b: lax.ragged_dot(a, b, sizes)).lower(*args).as_text()
    dense = re.search(r"dot_general .*: \(tensor<(\d+)x(\d+)x(\d+)xf32>, tensor<4x6x5xf32>\)", lowered)
    assert dense and tuple(map(int, dense.groups())) == (experts, rows, k), lowered



"""Presets (xtrain.plans): what each one chooses, and parity with single-device torch for each
on 8 emulated devices (SGD: differences stay proportional to gradient errors)."""
import dataclasses
import functools

import numpy as np
import pytest
import torch

import xtrain
from xtrain import errors
from models import GPT, token_batches
from test_hf_models import gpt2, llama, lm_batches, lm_loss
from xtrain import plans
from xtrain.errors import PlanError
from xtrain.testing import assert_parity, run_parity, torch_reference

TP2, TP4 = dict(data=4, tensor=2), dict(data=2, tensor=4)


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


@functools.cache
def case(name):
    """(model, batches, loss_fn, torch reference) built once per model."""
    torch.manual_seed(0)
    if name == "gpt":
        model, batches, loss_fn = GPT(), token_batches(n=4), None
    elif name == "llama-512":  # attention by the blockwise kernel: 2 key blocks of 256 (CPU), a scan
        model, batches, loss_fn = llama(), lm_batches(seq=512), lm_loss
    else:
        model, batches, loss_fn = {"gpt2": gpt2, "llama": llama}[name](), lm_batches(), lm_loss
    return model, batches, loss_fn, torch_reference(model, sgd, batches, loss_fn)


def tp(model, mesh, **kwargs):
    """plans.megatron traced on an example batch of `model` (the test GPT or an HF LM)."""
    if isinstance(model, GPT):
        return plans.megatron(model, mesh, example=token_batches(n=1)[0], **kwargs)
    return plans.megatron(model, mesh, example=lm_batches(n=1)[0], loss_fn=lm_loss, **kwargs)


def parity(name, mesh, plan, **kwargs):
    model, batches, loss_fn, reference = case(name)
    result = run_parity(model, sgd, batches, xtrain.Mesh(**mesh), plan=plan, loss_fn=loss_fn,
                        reference=reference, **kwargs)
    assert_parity(result)
    return result


# -- what the presets choose (no compile) ---------------------------------------------------
@pytest.mark.unit
def test_ddp_is_the_default_plan():
    assert plans.ddp().params == {} and plans.ddp().batch is None
    assert plans.ddp("replica").batch == ("replica",)


@pytest.mark.unit
def test_megatron_on_test_gpt_splits_attention_mlp_and_vocab():
    plan = tp(GPT(), TP2)
    assert plan.params == {
        "blocks.*.attn.q.weight": ("tensor", None), "blocks.*.attn.q.bias": ("tensor",),
        "blocks.*.attn.k.weight": ("tensor", None),
        "blocks.*.attn.v.weight": ("tensor", None), "blocks.*.attn.v.bias": ("tensor",),
        "blocks.*.attn.out.weight": (None, "tensor"),
        "blocks.*.mlp.0.weight": ("tensor", None), "blocks.*.mlp.0.bias": ("tensor",),
        "blocks.*.mlp.2.weight": (None, "tensor"),
        "tok.weight": ("tensor", None)}
    assert any("lm_head computes the logits with the embedding table tok.weight (tied)" in n for n in plan.notes)
    assert any(n.startswith("pos.weight (16, 32): a lookup table whose rows are no logits'") for n in plan.notes)


@pytest.mark.unit
def test_megatron_on_gpt2_conv1d_fused_qkv_and_odd_vocab():
    plan = tp(gpt2(), TP2)
    h = "transformer.h.*."
    # Conv1D weights are (in, out): column-parallel splits dim 1, row-parallel dim 0.
    assert plan.params[h + "mlp.c_fc.weight"] == (None, "tensor")
    assert plan.params[h + "mlp.c_fc.bias"] == ("tensor",)
    assert plan.params[h + "mlp.c_proj.weight"] == ("tensor", None)
    # the fused q | k | v output (and its bias) split per segment: each device its slice of q, k and v
    qkv = xtrain.Segments("tensor", (32, 32, 32))
    assert plan.params[h + "attn.c_attn.weight"] == (None, qkv) and plan.params[h + "attn.c_attn.bias"] == (qkv,)
    assert plan.params[h + "attn.c_proj.weight"] == ("tensor", None)
    assert h + "mlp.c_proj.bias" not in plan.params  # added once, after the all-reduce
    assert "transformer.wte.weight" not in plan.params
    assert any(n.startswith("transformer.h.*.attn.c_attn: fused output sliced into 3 segments [32, 32, 32]; split per "
                            "segment over tensor=2") for n in plan.notes)
    assert any("vocab 101 not divisible by tensor=2" in n for n in plan.notes)


@pytest.mark.unit
def test_megatron_on_llama_swiglu_and_gqa():
    plan = tp(llama(), TP2)
    layer = "model.layers.*."
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert plan.params[f"{layer}{name}.weight"] == ("tensor", None), name
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert plan.params[f"{layer}{name}.weight"] == (None, "tensor"), name
    assert "lm_head.weight" not in plan.params  # vocab 101


@pytest.mark.unit
def test_megatron_splits_the_queries_when_kv_groups_do_not_divide():
    model = llama()
    tp(model, TP2)  # planned for tensor=2 first (kv heads divisible): the next plan traces for 4
    plan = tp(model, TP4)  # 4 query heads over 2 kv heads, tensor=4: one query head per device
    layer = "model.layers.*."
    assert plan.params[layer + "self_attn.q_proj.weight"] == ("tensor", None)
    assert plan.params[layer + "self_attn.o_proj.weight"] == (None, "tensor")
    assert not any(p.startswith(layer + "self_attn." + kv) for p in plan.params for kv in ("k_proj", "v_proj"))
    assert plan.params[layer + "mlp.down_proj.weight"] == (None, "tensor")
    assert ("model.layers.*.self_attn.k_proj kept whole: at model.layers.*.self_attn: 2 ((8, 16, 16) -> (8, 16, 2, "
            "8)) its output splits into key/value heads not divisible by tensor=4, while the query heads that read "
            "them split (GQA/MQA): each device computes every key/value head and its query heads read theirs; the "
            "gradient of model.layers.*.self_attn.k_proj gathers every device's query heads") in plan.notes


@pytest.mark.unit
def test_megatron_keeps_attention_whole_when_heads_do_not_divide():
    plan = tp(GPT(heads=2), TP4)
    assert not any(".attn." in p for p in plan.params)
    assert plan.params["blocks.*.mlp.0.weight"] == ("tensor", None)
    assert any(n.startswith("blocks.*.attn.q kept whole: at blocks.*.attn: 2 ") for n in plan.notes)


class Probe(torch.nn.Module):
    """One linear layer: nothing contracts its output (no column -> row pair)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 5)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.fc(x), y)


@pytest.mark.unit
def test_megatron_errors_name_the_fix():
    with pytest.raises(PlanError, match=r"mesh \(data=8\) has no axis 'tensor'"):
        plans.megatron(GPT(), dict(data=8))
    with pytest.raises(PlanError, match="found no column -> row matmul pairs in the traced program"):
        plans.megatron(Probe(), TP2, example=(torch.zeros(8, 12), torch.zeros(8, dtype=torch.long)))
    assert "pending" in str(plans.megatron(GPT(), TP2)).splitlines()[1]
    with pytest.raises(PlanError, match="pass example=<a batch> to plans.megatron to derive them now"):
        plans.assert_sharded(plans.megatron(GPT(), TP2), GPT(), TP2)


@pytest.mark.unit
def test_fsdp_splits_largest_divisible_dim_and_notes_the_rest():
    plan = plans.fsdp(gpt2(), dict(data=8))
    assert plan.params["transformer.wte.weight"] == (None, "data")  # vocab 101: the width instead
    assert plan.params["transformer.h.*.mlp.c_fc.weight"] == (None, "data")  # (32, 128)
    assert plan.params["transformer.h.*.mlp.c_proj.weight"] == ("data", None)  # (128, 32)
    assert not any("ln_" in p or p.endswith("bias") for p in plan.params)
    assert any(n.startswith("18 tensors under min_size=1024 elements not split over data") for n in plan.notes)
    odd = plans.fsdp({"w": (101, 7), "b": (3,)}, dict(data=8), min_size=1)
    assert odd.params == {} and "w (101, 7): no dimension divisible by data=8; not split over data" in odd.notes
    assert plans.zero(3, gpt2(), dict(data=8)) == plan and plans.zero(0) == plans.ddp()
    assert plans.zero(1).zero == 1 and plans.zero(2).zero == 2 and plans.zero(3).zero == 3
    with pytest.raises(PlanError, match="must be 0, 1, 2 or 3"):
        plans.zero(4)


@pytest.mark.unit
def test_fsdp_accepts_jax_params_pytrees():
    params = {"layers": [{"w": np.zeros((64, 32))}, {"w": np.zeros((64, 32))}], "b": np.zeros(32)}
    assert plans.fsdp(params, dict(data=8)).params == {"layers.*.w": ("data", None)}


@pytest.mark.unit
def test_hybrid_shards_within_a_group_and_batches_over_both():
    plan = plans.hybrid(GPT(), dict(replica=2, data=4))
    assert plan.batch == (("replica", "data"),)
    assert plan.params["blocks.*.mlp.0.weight"] == ("data", None)
    assert all("replica" not in str(s) for s in plan.params.values())


@pytest.mark.unit
def test_fsdp_on_top_of_megatron_adds_data_to_every_large_tensor():
    model = GPT()
    plan = plans.fsdp(model, TP2, base=tp(model, TP2))
    assert plan.params["blocks.*.attn.q.weight"] == ("tensor", "data")
    assert plan.params["blocks.*.mlp.2.weight"] == (None, ("tensor", "data"))
    assert plan.params["blocks.*.attn.q.bias"] == ("tensor",)  # small: tensor only
    assert any("vocab-parallel" in n for n in plan.notes) and any("FSDP" in n for n in plan.notes)


@pytest.mark.unit
def test_printed_plan_lists_rules_and_notes():
    text = str(tp(llama(), TP4))
    assert text.splitlines()[0] == "Plan(batch=default (the mesh's 'data' axis), zero=0)"
    assert "  model.layers.*.mlp.down_proj.weight     (None, 'tensor')" in text  # padded to q_proj's rule
    assert "  note: model.layers.*.self_attn.k_proj kept whole: at model.layers.*.self_attn: 2 " in text
    assert str(xtrain.Plan()) == "Plan(batch=default (the mesh's 'data' axis), zero=0)\n  (every parameter replicated)"


@pytest.mark.unit
def test_a_preset_plan_is_an_editable_plan():
    plan = tp(GPT(), TP2)
    edited = dataclasses.replace(plan, params={**plan.params, "pos.weight": (None, "tensor")})
    specs = edited.param_specs({n: tuple(p.shape) for n, p in GPT().named_parameters()}, TP2)
    assert specs["pos.weight"] == (None, "tensor") and specs["blocks.1.attn.q.weight"] == ("tensor", None)


# -- the plan after sharding (STYLE.md point 9) ---------------------------------------------
@pytest.mark.unit
def test_assert_sharded_names_the_largest_replicated_tensors():
    model = gpt2()
    derived = tp(model, TP2)
    assert plans.largest_replicated(derived, model, TP2, top=2) == [
        ("transformer.wte.weight", (101, 32)), ("transformer.wpe.weight", (32, 32))]
    with pytest.raises(errors.PlanError, match=r"replicated on every device .*largest: transformer.wte.weight \(101, 32\)"):
        plans.assert_sharded(derived, model, TP2)
    assert plans.assert_sharded(plans.fsdp(model, TP2, base=derived), model, TP2) < 0.05
    with pytest.raises(errors.PlanError, match="100.0% of the parameter elements"):
        plans.assert_sharded(plans.ddp(), model, dict(data=8))


@pytest.mark.e2e
def test_largest_replicated_of_a_compiled_step():
    model = GPT()
    step = xtrain.compile(model, xtrain.Mesh(**TP2), optimizer=sgd(model.parameters()),
                          plan=tp(model, TP2))
    assert plans.largest_replicated(step, top=1) == [("pos.weight", (16, 32))]
    assert plans.assert_sharded(step, max_replicated=0.1) < 0.1


# -- parity ---------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("mesh", [TP2, TP4], ids=["tp2xdp4", "tp4xdp2"])
def test_megatron_gpt_parity(mesh):
    parity("gpt", mesh, plans.megatron(case("gpt")[0], mesh))  # vocab-parallel embedding and head


@pytest.mark.e2e
def test_megatron_gpt_vocab_parallel_parity_xla():
    parity("gpt", TP2, tp(case("gpt")[0], TP2), lowering="xla")


@pytest.mark.e2e
def test_megatron_gpt_without_vocab_parallel_parity():
    parity("gpt", TP2, tp(case("gpt")[0], TP2, vocab_parallel=False))


@pytest.mark.e2e
@pytest.mark.parametrize("name,mesh", [("gpt2", TP2), ("llama", TP2), ("llama", TP4)],
                         ids=["gpt2-tp2", "llama-tp2", "llama-tp4-kv-whole"])
def test_megatron_hf_parity(name, mesh):
    parity(name, mesh, plans.megatron(case(name)[0], mesh))


@pytest.mark.e2e
def test_megatron_splits_heads_through_the_blockwise_key_loop_parity():
    # the heads' split passes through the kernel's scan over key blocks, as at 16 tokens (no loop);
    # it used to read the loop's stacked key blocks one dimension off and keep attention whole
    model, batches, _, _ = case("llama-512")
    plan = plans.megatron(model, TP2, example=batches[0], loss_fn=lm_loss)
    layer = "model.layers.*.self_attn."
    assert plan.params[layer + "q_proj.weight"] == ("tensor", None)
    assert plan.params[layer + "o_proj.weight"] == (None, "tensor")
    parity("llama-512", TP2, plan)


@pytest.mark.e2e
def test_fsdp_parity_data8():
    parity("gpt2", dict(data=8), plans.fsdp(case("gpt2")[0], dict(data=8)))


@pytest.mark.e2e
def test_hybrid_parity_replica2_data4():
    mesh = dict(replica=2, data=4)
    parity("gpt", mesh, plans.hybrid(case("gpt")[0], mesh))


@pytest.mark.e2e
def test_tp2_fsdp4_parity_and_lowerings_agree():
    model = case("gpt")[0]
    plan = plans.fsdp(model, TP2, base=tp(model, TP2))  # vocab split over tensor x data
    explicit = parity("gpt", TP2, plan)
    unrolled = parity("gpt", TP2, plan, scan_layers=False)  # the blocks one after another
    xla = parity("gpt", TP2, plan, lowering="xla")
    np.testing.assert_allclose(explicit.losses, xla.losses, rtol=1e-5)
    np.testing.assert_allclose(unrolled.losses, xla.losses, rtol=1e-5)


@pytest.mark.e2e
def test_vocab_parallel_moves_activations_not_the_table():
    """Embedding lookup and the cross-entropy's target pick run on the local vocab shard (a
    masked lookup whose partial sum is all-reduced); FSDP's data split of the table is gathered
    alone, not the whole table. The only tensor-axis all-gather left is the softmax's shard maxima."""
    model, batches, _, _ = case("gpt")
    plan = plans.fsdp(model, TP2, base=tp(model, TP2))
    step = xtrain.compile(model, xtrain.Mesh(**TP2), optimizer=sgd(model.parameters()), plan=plan)
    found = step.report(*batches[0]).collectives
    table = model.tok.weight.numel() * 4
    lookups = [c for c in found if ("embedding" in c.source or "nll_loss" in c.source) and "tensor" in c.axes]
    assert lookups and all(c.kind == "all-reduce" for c in lookups), lookups
    gathers = [c for c in found if c.kind == "all-gather" and "tensor" in c.axes]
    tokens = batches[0][0].numel() // TP2["data"]
    assert all(c.payload_bytes <= tokens * 4 * TP2["tensor"] for c in gathers), gathers
    tied = [c for c in found if c.source.startswith("tok") and c.kind == "all-gather"]
    assert tied and all(c.axes == ("data",) and c.payload_bytes == table // TP2["tensor"] for c in tied), tied
    # FSDP's flat parameter under TP: each layer's data-split weights (their tensor shards) are
    # gathered by one all-gather, in the forward pass and again in the backward pass, and their
    # gradients leave by one reduce-scatter
    layer = sum(p.numel() // TP2["tensor"] for p in model.blocks[0].parameters() if p.ndim == 2) * 4
    flat = sorted((c.kind, c.axes, c.payload_bytes) for c in found if "zero3_flat_gather" in c.source)
    n = len(model.blocks)
    assert flat == [("all-gather", ("data",), layer)] * 2 * n + [("reduce-scatter", ("data",), layer)] * n, flat


# -- randomised plans -----------------------------------------------------------------------
RANDOM_MESHES = [dict(data=2, tensor=4), dict(a=2, b=2, c=2)]


def random_plan(rng, shapes, sizes):
    """Each dim: whole, or split over one axis that divides it; each axis once per tensor."""
    rules = {}
    for name, shape in shapes.items():
        free, spec = list(sizes), []
        for dim, size in enumerate(shape):
            options = [a for a in free if size % sizes[a] == 0]
            axis = rng.choice(options + [None] * len(options)) if options else None
            spec.append(axis)
            if axis:
                free.remove(axis)
        if any(spec):
            rules[name] = tuple(spec)
    batch = ("data",) if "data" in sizes else (str(rng.choice(list(sizes))),)
    return xtrain.Plan(params=rules, batch=batch)


@pytest.mark.e2e
@pytest.mark.parametrize("seed", range(3))
def test_random_plans_parity(seed):
    rng = np.random.default_rng(seed)
    sizes = RANDOM_MESHES[seed % len(RANDOM_MESHES)]
    shapes = {n: tuple(p.shape) for n, p in case("gpt")[0].named_parameters()}
    plan = random_plan(rng, shapes, sizes)
    assert plan.params, "drew an all-replicated plan"
    parity("gpt", sizes, plan)


@pytest.mark.e2e
def test_a_pending_plan_is_derived_at_the_first_step_and_user_rules_win():
    model, batches, _, _ = case("gpt")
    pending = plans.megatron(model, TP2)
    edited = dataclasses.replace(pending, params={"blocks.*.attn.q.weight": (None, "tensor")}, zero=1)
    assert "pending" in str(edited) and "blocks.*.attn.q.weight  (None, 'tensor')" in str(edited)
    step = xtrain.compile(model, xtrain.Mesh(**TP2), optimizer=sgd(model.parameters()), plan=edited)
    with pytest.raises(errors.NotBuiltError, match="plans.megatron derives its rules at the first step"):
        step.param_specs
    step(*batches[0])
    assert step.plan.zero == 1 and not isinstance(step.plan, type(pending))
    assert step.layout.layer_specs["blocks.0.attn.q.weight"][1] == "tensor"  # the user's rule, not the derived column
    assert step.layout.layer_specs["blocks.0.attn.k.weight"][0] == "tensor"  # derived
    assert "user rule 'blocks.*.attn.q.weight': (None, 'tensor') wins over the derived rules" in step.plan.notes

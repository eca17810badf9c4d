"""Tensor-parallel plans derived from the traced program (xtrain.plans.megatron): the structures
the module-name rules got wrong get a Megatron plan, train with parity on Mesh(data=4, tensor=2)
against single-device torch (SGD), pass plans.assert_sharded, and communicate as Megatron does:
per block, one all-reduce over `tensor` after attention and one after the MLP in the forward pass,
and no gather over `tensor` inside a block."""
import collections
import functools

import pytest
import torch

import xtrain
from tp_models import BiasedMLP, DictLlama, MoE, batches, hf, lm_loss
from xtrain import plans
from xtrain.testing import assert_parity, run_parity, torch_reference

MESH = dict(data=4, tensor=2)
COL, ROW = ("tensor", None), (None, "tensor")


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


MODELS = {
    "gpt_neox": (lambda: hf("gpt_neox"), lm_loss),
    "phi3": (lambda: hf("phi3"), lm_loss),
    "gpt2": (lambda: hf("gpt2"), lm_loss),
    "bert": (lambda: hf("bert"), lm_loss),
    "dict_llama": (DictLlama, None),
    "mqa": (lambda: DictLlama(kv=1), None),
    "gqa3": (lambda: hf("gqa3"), lm_loss),
    "t5": (lambda: hf("t5"), lm_loss),
    "moe": (MoE, None),
    "deepseek_v3": (lambda: hf("deepseek_v3"), lm_loss),
}


@functools.cache
def case(name):
    make, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model, data = make(), batches()
    return model, loss_fn, data, plans.megatron(model, MESH, example=data[0], loss_fn=loss_fn)


# -- what the graph finds (no compile) ------------------------------------------------------
@pytest.mark.unit
def test_gpt_neox_fused_qkv_is_split_by_heads():
    _, _, _, plan = case("gpt_neox")
    layer = "gpt_neox.layers.*."
    assert plan.params[layer + "attention.query_key_value.weight"] == COL
    assert plan.params[layer + "attention.query_key_value.bias"] == ("tensor",)
    assert plan.params[layer + "attention.dense.weight"] == ROW
    assert plan.params[layer + "mlp.dense_h_to_4h.weight"] == COL and plan.params[layer + "mlp.dense_4h_to_h.weight"] == ROW
    assert ("gpt_neox.layers.*.attention.dense contracts the 4 heads of gpt_neox.layers.*.attention.query_key_value's "
            "output: gpt_neox.layers.*.attention.query_key_value column-parallel, gpt_neox.layers.*.attention.dense "
            "row-parallel over tensor=2 (2 of 4 heads per device)") in plan.notes
    # NeoX interleaves q, k, v per head: the heads are the outer factor, no segments to respect
    assert not any("segments" in n for n in plan.notes)


@pytest.mark.unit
def test_phi3_fused_gate_up_and_qkv_are_segments():
    _, _, _, plan = case("phi3")
    layer = "model.layers.*."
    assert plan.params[layer + "mlp.gate_up_proj.weight"] == (xtrain.Segments("tensor", (128, 128)), None)
    assert plan.params[layer + "self_attn.qkv_proj.weight"] == (xtrain.Segments("tensor", (32, 32, 32)), None)
    assert plan.params[layer + "mlp.down_proj.weight"] == ROW and plan.params[layer + "self_attn.o_proj.weight"] == ROW
    assert any(n.startswith("model.layers.*.mlp.gate_up_proj: fused output sliced into 2 segments [128, 128]; split "
                            "per segment over tensor=2") for n in plan.notes)


@pytest.mark.unit
def test_gpt2_c_attn_and_its_bias_are_split_per_segment():
    _, _, _, plan = case("gpt2")
    qkv = xtrain.Segments(("tensor",), (32, 32, 32))  # a Conv1D: (in, out) weight, the fused dim last
    assert plan.params["transformer.h.*.attn.c_attn.weight"] == (None, qkv)
    assert plan.params["transformer.h.*.attn.c_attn.bias"] == (qkv,)


@pytest.mark.unit
def test_bert_sibling_output_modules_pair_by_dataflow():
    _, _, _, plan = case("bert")
    layer = "bert.encoder.layer.*."
    for name in ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"):
        assert plan.params[layer + name + ".weight"] == COL, name
    assert plan.params["bert.encoder.layer.0.output.dense.weight"] == ROW  # the MLP's, a sibling module
    assert plan.params[layer + "attention.output.dense.weight"] == ROW
    # the MLM transform (64x64, then LayerNorm) is no LM head; the tied decoder is
    assert not any(p.startswith("cls.predictions.transform") for p in plan.params)
    assert plan.params["bert.embeddings.word_embeddings.weight"] == COL
    assert plan.params["cls.predictions.bias"] == ("tensor",)


@pytest.mark.unit
def test_a_meaningless_twin_gets_the_same_plan():
    named, _, data, plan = case("dict_llama")
    torch.manual_seed(0)
    twin = DictLlama(meaningless=True)
    twin_plan = plans.megatron(twin, MESH, example=data[0])
    shapes = lambda m: {n: tuple(p.shape) for n, p in m.named_parameters()}
    ours, theirs = plan.param_specs(shapes(named), MESH), twin_plan.param_specs(shapes(twin), MESH)
    assert list(ours.values()) == list(theirs.values())  # parameter by parameter, in definition order
    assert ours["layers.1.wq.weight"] == COL
    assert ours["layers.0.w2.weight"] == ROW and ours["embed.weight"] == COL and ours["out.weight"] == COL


@pytest.mark.unit
def test_gqa_with_fewer_kv_heads_than_tensor_keeps_kv_whole():
    model, _, _, plan = case("mqa")  # one kv head, tensor=2
    specs = plan.param_specs({n: tuple(p.shape) for n, p in model.named_parameters()}, MESH)
    assert specs["layers.0.wq.weight"] == COL and specs["layers.0.wo.weight"] == ROW
    assert specs["layers.0.wk.weight"] == () and specs["layers.0.wv.weight"] == ()
    assert ("layers.*.wk kept whole: at layers.*: 1 ((8, 16, 8) -> (8, 16, 1, 8)) its output splits into key/value "
            "heads not divisible by tensor=2, while the query heads that read them split (GQA/MQA): each device "
            "computes every key/value head and its query heads read theirs; the gradient of layers.*.wk gathers "
            "every device's query heads") in plan.notes


@pytest.mark.unit
def test_gqa_with_kv_heads_the_axis_does_not_divide_splits_the_queries():
    # HF Llama, 6 query heads over 3 key/value heads on tensor=2: the query heads split 3 per device
    # (sdpa repeats keys and values per query head under this split instead of grouping the queries)
    model, _, _, plan = case("gqa3")
    specs = plan.param_specs({n: tuple(p.shape) for n, p in model.named_parameters()}, MESH)
    attn = "model.layers.0.self_attn."
    assert specs[attn + "q_proj.weight"] == COL and specs[attn + "o_proj.weight"] == ROW
    assert specs[attn + "k_proj.weight"] == () and specs[attn + "v_proj.weight"] == ()
    assert any(n.startswith("model.layers.*.self_attn.o_proj contracts the 6 heads of model.layers.*.self_attn.q_proj"
                            "'s output") and n.endswith("(3 of 6 heads per device)") for n in plan.notes)
    assert any(n.startswith("model.layers.*.self_attn.k_proj kept whole: at model.layers.*.self_attn: 3 ") and
               "while the query heads that read them split" in n for n in plan.notes)


@pytest.mark.unit
def test_expert_weights_split_on_the_expert_ffn_dimension():
    model, _, _, plan = case("moe")
    specs = plan.param_specs({n: tuple(p.shape) for n, p in model.named_parameters()}, MESH)
    assert specs["moe.0.w_in"] == (None, None, "tensor")   # (experts, d, ffn): column
    assert specs["moe.0.w_out"] == (None, "tensor", None)  # (experts, ffn, d): row
    assert specs["moe.1.gate.weight"] == ()  # its output meets the gate's softmax: no pair


@pytest.mark.unit
def test_latent_attention_up_projection_is_column_parallel():
    """DeepSeek-V3's keys are built by copying into slices of a new tensor (a scatter of the
    heads' non-rotary part and of the shared rotary part): the heads' split passes through it,
    so the latent's up-projection splits by heads with q_proj; the down-projection stays whole."""
    model, _, _, plan = case("deepseek_v3")
    specs = plan.param_specs({n: tuple(p.shape) for n, p in model.named_parameters()}, MESH)
    attention = "model.layers.0.self_attn."
    assert specs[attention + "kv_b_proj.weight"] == COL and specs[attention + "q_proj.weight"] == COL
    assert specs[attention + "o_proj.weight"] == ROW and specs[attention + "kv_a_proj_with_mqa.weight"] == ()


# -- parity, sharding and communication ------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("name", list(MODELS))
def test_derived_plan_parity_and_sharded(name):
    model, loss_fn, data, plan = case(name)
    # gqa3 keeps its key/value projections whole by design (6.4% of its elements, with the norms);
    # DeepSeek-V3's latent down-projection (kv_a_proj_with_mqa) stays whole, as in Megatron-Core's MLA (4.5%)
    plans.assert_sharded(plan, model, MESH, max_replicated=0.07 if name == "gqa3" else 0.05)
    reference = torch_reference(model, sgd, data, loss_fn)
    result = run_parity(model, sgd, data, xtrain.Mesh(**MESH), plan=plan, loss_fn=loss_fn, reference=reference)
    assert_parity(result)


def tensor_collectives(name, by_stack=False):
    """{(block, kind): count} of the forward pass's collectives over `tensor` inside blocks
    (`by_stack`: blocks named by their path, `encoder.block.0`)."""
    model, loss_fn, data, plan = case(name)
    step = xtrain.compile(model, xtrain.Mesh(**MESH), optimizer=sgd(model.parameters()), plan=plan,
                          loss_fn=loss_fn, scan_layers=False)
    counts = collections.Counter()
    for c in step.report(*data[0]).collectives:
        path = c.source.split(" ")[0].split(".")
        layer = next((p for p in path if p.isdigit()), None)
        if "tensor" in c.axes and layer is not None and "transpose(" not in c.source:
            counts[(".".join(path[:path.index(layer) + 1]) if by_stack else int(layer), c.kind)] += 1
    return dict(counts)


@pytest.mark.e2e
@pytest.mark.parametrize("name,per_block", [("gpt_neox", 1), ("bert", 2), ("dict_llama", 2), ("mqa", 2),
                                           ("gqa3", 2), ("phi3", 2), ("gpt2", 2), ("deepseek_v3", 2)])
def test_one_all_reduce_after_attention_and_one_after_the_mlp(name, per_block):
    # GPT-NeoX's parallel residual (x + attn(x) + mlp(x)) adds both pending sums before one
    # all-reduce (their row-parallel biases are added after it)
    assert tensor_collectives(name) == {(0, "all-reduce"): per_block, (1, "all-reduce"): per_block}


@pytest.mark.e2e
def test_t5_cross_attention_is_column_row_and_reduces_once_per_sublayer():
    _, _, _, plan = case("t5")
    cross = "decoder.block.*.layer.1.EncDecAttention."
    # queries from the decoder, keys and values from the encoder's output: all split by heads
    assert all(plan.params[cross + w + ".weight"] == COL for w in "qkv") and plan.params[cross + "o.weight"] == ROW
    assert plan.params["decoder.block.*.layer.2.DenseReluDense.wo.weight"] == ROW
    # per block one all-reduce per sublayer (encoder: attention, MLP; decoder: self-attention,
    # cross-attention, MLP); block 0's first is the vocab-parallel embedding's sum, read by its norm
    assert tensor_collectives("t5", by_stack=True) == {
        ("encoder.block.0", "all-reduce"): 3, ("encoder.block.1", "all-reduce"): 2,
        ("decoder.block.0", "all-reduce"): 4, ("decoder.block.1", "all-reduce"): 3}


@pytest.mark.e2e
@pytest.mark.parametrize("conv1d", [False, True])
def test_a_row_parallel_bias_gradient_is_not_reduced_over_tensor(conv1d):
    # the bias is added after the row-parallel sum (as Megatron does), so its gradient is whole on
    # every device; added as one device's addend, it took an all-reduce over tensor in the backward
    torch.manual_seed(0)
    model = BiasedMLP(conv1d=conv1d)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 1, 16, generator=g), torch.randn(8, 1, 16, generator=g)) for _ in range(4)]
    plan = plans.megatron(model, MESH, example=data[0])
    assert plan.params["fc2.weight"] == ROW and "fc2.bias" not in plan.params
    assert_parity(run_parity(model, sgd, data, xtrain.Mesh(**MESH), plan=plan))
    step = xtrain.compile(model, xtrain.Mesh(**MESH), optimizer=sgd(model.parameters()), plan=plan)
    over_tensor = [c.payload_bytes for c in step.report(*data[0]).collectives if "tensor" in c.axes]
    assert 2 * 16 * 4 in over_tensor and 16 * 4 not in over_tensor, over_tensor  # the forward's sum; no bias


# -- sequence parallel on the derived plan ----------------------------------------------------
@functools.cache
def sp_case(name, sequence_parallel):
    from test_hf_models import gpt2, llama, lm_batches
    from test_hf_models import lm_loss as hf_loss

    torch.manual_seed(0)
    model, data = {"gpt2": gpt2, "llama": llama}[name](), lm_batches()
    plan = plans.megatron(model, MESH, sequence_parallel=sequence_parallel, example=data[0], loss_fn=hf_loss)
    return model, data, plan, hf_loss


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_sequence_parallel_parity_and_collectives(name):
    model, data, plan, loss_fn = sp_case(name, True)
    assert any(n.startswith("sequence parallel: the inputs and outputs of") for n in plan.notes)
    reference = torch_reference(model, sgd, data, loss_fn)
    result = run_parity(model, sgd, data, xtrain.Mesh(**MESH), plan=plan, loss_fn=loss_fn, reference=reference)
    assert_parity(result)
    step = xtrain.compile(model, xtrain.Mesh(**MESH), optimizer=sgd(model.parameters()), plan=plan,
                          loss_fn=loss_fn, scan_layers=False)
    counts, report = collections.Counter(), step.report(*data[0])
    for c in report.collectives:
        path = c.source.split(" ")[0].split(".")
        layer = next((p for p in path if p.isdigit()), None)
        if c.axes == ("tensor",) and layer is not None and "transpose(" not in c.source:
            counts[(int(layer), c.kind)] += 1
    # GPT-2's fused c_attn is split per segment: its q, k, v slices are local, no gather for them;
    # its row-parallel biases are added to the reduce-scattered sums (each device its slice of them)
    assert counts == {(b, k): 2 for b in range(2) for k in ("reduce-scatter", "all-gather")}, counts
    if name == "gpt2":
        return
    # the activations between the blocks are a tensor-th of the sequence: less temporary memory
    plain_model, _, plain_plan, _ = sp_case(name, False)
    plain = xtrain.compile(plain_model, xtrain.Mesh(**MESH), optimizer=sgd(plain_model.parameters()),
                           plan=plain_plan, loss_fn=loss_fn, scan_layers=False)
    assert report.memory["temporaries"] < plain.report(*data[0]).memory["temporaries"]


# -- checkpoints keep torch's order under fused splits ------------------------------------------
@pytest.mark.e2e
def test_a_fused_split_checkpoint_at_tensor2_loads_at_tensor1_and_4(tmp_path):
    model, loss_fn, data, plan = case("phi3")  # fused qkv_proj and gate_up_proj, split over tensor
    step = xtrain.compile(model, xtrain.Mesh(**MESH), optimizer=sgd(model.parameters()), plan=plan, loss_fn=loss_fn)
    step(*data[0])
    step.save(tmp_path / "tp2")
    saved = step.state_dict()
    # torch's order: the fused weights equal torch's own after the same step
    reference = torch_reference(model, sgd, data[:1], loss_fn)[1]
    for name in ("model.layers.0.mlp.gate_up_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"):
        torch.testing.assert_close(torch.as_tensor(saved[name]), reference[name], atol=1e-5, rtol=0)
    for sizes in (dict(data=8), dict(data=2, tensor=4)):
        other = plans.megatron(model, sizes, example=data[0], loss_fn=loss_fn) if "tensor" in sizes else None
        restored = xtrain.compile(model, xtrain.Mesh(**sizes), optimizer=sgd(model.parameters()), plan=other,
                                  loss_fn=loss_fn)
        restored.load(tmp_path / "tp2")
        state = restored.state_dict()
        assert all(torch.equal(torch.as_tensor(state[k]), torch.as_tensor(saved[k])) for k in saved), sizes
        # the optimizer state (momentum, stored like its parameter) came back in order too: the next
        # step matches torch's second step
        restored(*data[1])
        state, second = restored.state_dict(), torch_reference(model, sgd, data[:2], loss_fn)[1]
        for name in ("model.layers.0.mlp.gate_up_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"):
            torch.testing.assert_close(torch.as_tensor(state[name]), second[name], atol=1e-5, rtol=0)


@pytest.mark.e2e
def test_fused_segments_under_fsdp_on_top():
    # ZeRO-3 splits the fused weights over data on their other dimension (never the per-segment one)
    model, loss_fn, data, plan = case("phi3")
    both = plans.fsdp(model, MESH, base=plan)
    assert both.params["model.layers.*.self_attn.qkv_proj.weight"] == (xtrain.Segments("tensor", (32, 32, 32)),
                                                                       "data")
    reference = torch_reference(model, sgd, data, loss_fn)
    assert_parity(run_parity(model, sgd, data, xtrain.Mesh(**MESH), plan=both, loss_fn=loss_fn, reference=reference))

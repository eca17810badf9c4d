"""Blocks that differ only in constants or in which shared value they read are one family of
repeated blocks: HF Gemma-3 (sliding-window and full attention layers: per-type masks and rotary
tables; longer than one attention block, one block structure for both kinds of attention) trains
as one layer scan and under a 2-stage pipeline like torch; blocks that differ in
structure run unrolled with a note naming the first difference, and the pipeline says why."""
import copy
import functools

import jax
from jax.extend import core as jcore
import numpy as np
import pytest
import torch
from torch import nn
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import xtrain
from xtrain import errors
from xtrain.errors import UnsupportedError
from xtrain.frontend.torch_module import TorchModel
from xtrain.ir import attention as markers
from xtrain.lowering.explicit.blocks import find_repeated_blocks
from xtrain.testing import assert_parity, torch_reference

from models import mlp_batches
from test_hf_models import VOCAB, lm_batches, lm_loss
from test_layer_scan import scan_lengths
from test_pipeline import train

KINDS = ["sliding_attention"] * 5 + ["full_attention"]  # Gemma-3: 5 sliding : 1 full


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def gemma3(kinds=tuple(KINDS)):
    # sliding_window 4 < the batches' 16 or 32 tokens: the sliding layers' mask really differs
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=len(kinds), num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=4, layer_types=list(kinds),
        attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=0))


@pytest.fixture
def blocks_of_8(monkeypatch):
    # 32 tokens span 4 query and 4 key blocks: a window of 4 visits 1-2 key blocks per query block,
    # the full layer every one up to the diagonal
    monkeypatch.setitem(markers.DEFAULT_BLOCK, "cpu", 8)


@functools.cache
def gemma_case():
    torch.manual_seed(0)
    model, batches = gemma3(), lm_batches(seq=32)
    return model, batches, torch_reference(model, sgd, batches, lm_loss)


@pytest.mark.e2e
def test_gemma3_mixed_attention_is_one_layer_scan_and_trains_like_torch(blocks_of_8):
    """Longer than one attention block, the window layers' and the full layer's attention calls
    share one block structure (the union of their key-block ranges, each with its own mask)."""
    model, batches, reference = gemma_case()
    result, step = train(model, sgd, batches, dict(data=8), None, reference, loss_fn=lm_loss)
    assert_parity(result)
    assert step.scan_layers is True  # the default on 8 emulated devices
    assert scan_lengths(step.program(*batches[0])).count(6) == 2  # the layer scan and its transpose
    (blocks,) = step.lowered.findings.repeated
    assert (blocks.prefix, blocks.length) == ("model.layers", 6)
    # the mask and the rotary cos / sin: each layer reads its type's
    assert [s.choice for s in blocks.variants.selections] == [(0, 0, 0, 0, 0, 1)] * 3
    notes = step.report(*batches[0]).notes
    assert any(n.startswith("model.layers.0 .. model.layers.5: one family of repeated blocks; 3 shared input(s) "
                            "chosen per layer") for n in notes), notes
    attention = [n for n in notes if n.startswith("attention")]
    assert attention == ["attention in 'model.layers.0.self_attn': blockwise (block 8, 10 block pairs, 6 of 16 "
                         "blocks skipped by the causal mask); HF eager attention recognised"], attention


@pytest.mark.e2e
def test_gemma3_mixed_attention_trains_on_two_pipeline_stages_like_torch(blocks_of_8):
    model, batches, reference = gemma_case()
    plan = xtrain.Plan().with_pipeline(stages=2, microbatches=2)
    result, step = train(model, sgd, batches, dict(pipe=2, data=4), plan, reference, loss_fn=lm_loss)
    assert_parity(result)
    # stage 0 runs 3 sliding attention layers, stage 1 2 sliding and the full one
    assert list(step.lowered.findings.stage_layers) == [3, 3]
    assert "  model.layers: one family; 3 shared input(s) chosen per layer" in " ".join(step.report().notes)


@pytest.mark.e2e
def test_gemma3_mixed_attention_under_context_parallel_rings_each_layer_with_its_own_mask(blocks_of_8):
    """Under the shared structure every layer's call is causal with a mask; the ring over `context`
    then runs with the mask alone (the causal ring would drop the window layers' masks)."""
    torch.manual_seed(0)
    model, batches = gemma3(), lm_batches(seq=64)  # 2 x context chunks of whole blocks
    result, step = train(model, sgd, batches, dict(data=2, context=4), None,
                         torch_reference(model, sgd, batches, lm_loss), loss_fn=lm_loss)
    assert_parity(result)
    assert [b.length for b in step.lowered.findings.repeated] == [6]
    assert "attention in 'model.layers.0.self_attn': ring attention over 'context'=4" in step.report().notes


def traced(model, batch, count):
    """The jaxpr of the model's loss at `batch`, counting the model's traces in `count`."""
    wrapped = TorchModel(model, lm_loss)
    inner = wrapped._apply

    def counted(*args, **kwargs):
        count.append(1)
        return inner(*args, **kwargs)

    wrapped._apply = counted
    shapes = lambda d: {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in d.items()}
    args = (shapes(wrapped.initial_params()), shapes(wrapped.initial_buffers()), jax.random.PRNGKey(0),
            tuple(jax.ShapeDtypeStruct(tuple(x.shape), np.int32) for x in batch))
    # a new function each time: JAX would reuse the trace of the same one
    return wrapped, [jax.make_jaxpr(lambda *a: wrapped.apply(*a, training=False))(*args) for _ in range(2)]


def families(wrapped, closed):
    return [(b.prefix, b.length) for b in find_repeated_blocks(closed.jaxpr, wrapped.module_paths(),
                                                                closed.jaxpr.invars[:len(wrapped.param_names)])]


@pytest.mark.e2e
@pytest.mark.parametrize("seq,traces", [(8, 1), (32, 2)])
def test_the_model_is_traced_again_only_when_attention_calls_of_one_shape_differ(blocks_of_8, seq, traces):
    """One block (8 tokens): the calls agree, the first trace is the probe's. Four blocks: the probe
    finds the window and full layers' ranges differ and traces again; the second trace of the same
    input signature replays the first (xtrain.ir.replay) and runs no torch code."""
    torch.manual_seed(0)
    count = []
    wrapped, closed = traced(gemma3(), lm_batches(1, seq=seq)[0], count)
    assert len(count) == traces
    assert [families(wrapped, c) for c in closed] == [[("model.layers", 6)]] * 2


@pytest.mark.e2e
def test_sdpa_causal_call_without_a_mask_gets_a_constant_one_and_keeps_torchs_loss(blocks_of_8):
    """HF's sdpa passes the full layer no mask (is_causal); under the shared structure it reads a
    constant causal mask of the window layers' shape, and the loss stays torch's."""
    torch.manual_seed(0)
    config = gemma3(("sliding_attention", "full_attention")).config
    config.num_key_value_heads, config._attn_implementation = 4, "sdpa"  # sdpa repeats GQA heads only with a mask
    model, (batch,) = Gemma3ForCausalLM(config), lm_batches(1, seq=32)
    wrapped, (closed, _) = traced(model, batch, [])
    assert families(wrapped, closed) == [("model.layers", 2)]
    params, buffers = wrapped.initial_params(), wrapped.initial_buffers()
    loss = jax.jit(jcore.jaxpr_as_fun(closed))(*jax.tree.leaves(
        (params, buffers, jax.random.PRNGKey(0), tuple(np.asarray(x, np.int32) for x in batch))))[0]
    with torch.no_grad():
        assert float(loss) == pytest.approx(lm_loss(model.eval(), *batch).item(), rel=1e-5)


class Block(nn.Module):
    """A residual block with a per-layer scale and active width written as Python numbers."""

    def __init__(self, scale=1.0, width=16, act=torch.tanh):
        super().__init__()
        self.lin, self.scale, self.width, self.act = nn.Linear(16, 16), scale, width, act

    def forward(self, x):
        h = self.lin(x) * self.scale
        keep = torch.arange(x.shape[-1]) < self.width
        return x + self.act(torch.where(keep, h, torch.zeros_like(h)))


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.inp, self.blocks, self.head = nn.Linear(12, 16), nn.ModuleList(blocks), nn.Linear(16, 5)

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h), y)


def sgd_small(params):
    return torch.optim.SGD(params, lr=0.2)


@pytest.mark.e2e
def test_blocks_differing_in_constants_are_one_scan_and_train_like_torch():
    torch.manual_seed(0)
    model = Stack([Block(s, w) for s, w in [(0.5, 16), (1.5, 8), (0.5, 8), (2.0, 16)]])
    batches = mlp_batches(4)
    result, step = train(model, sgd_small, batches, dict(data=8), None, torch_reference(model, sgd_small, batches))
    assert_parity(result)
    assert scan_lengths(step.program(*batches[0])) == [4, 4]
    (blocks,) = step.lowered.findings.repeated
    assert sorted(t.tolist() for t in blocks.variants.literals) == [[0.5, 1.5, 0.5, 2.0], [16, 8, 8, 16]]


def different():
    torch.manual_seed(0)
    return Stack([Block(), Block(act=torch.sigmoid), Block()])


@pytest.mark.e2e
def test_structurally_different_blocks_run_unrolled_with_a_note_naming_the_difference():
    model, batches = different(), mlp_batches(4)
    result, step = train(model, sgd_small, batches, dict(data=8), None, torch_reference(model, sgd_small, batches))
    assert_parity(result)
    notes = step.report(*batches[0]).notes
    assert step.lowered.findings.repeated == ()
    assert "the 3 numbered layers run as traced, one after another: the program has no family of repeated " \
           "blocks to scan" in notes
    (note,) = [n for n in notes if "not one family" in n]
    assert note.startswith("blocks.0 .. blocks.2 are not one family of repeated blocks, so they run unrolled")
    assert "blocks.1 differs from blocks.0 at its equation" in note and ": op tanh vs logistic (in blocks.0 vs " \
        "blocks.1)" in note, note


@pytest.mark.unit
def test_pipeline_error_names_the_first_difference():
    model = different()
    step = xtrain.compile(model, xtrain.Mesh(pipe=2, data=4), optimizer=sgd_small(model.parameters()),
                          plan=xtrain.Plan().with_pipeline(stages=2, microbatches=2))
    with pytest.raises(UnsupportedError, match=r"pipeline parallelism of Stack needs a family of repeated blocks.* "
                                               r"blocks.1 differs from blocks.0 at its equation \d+: op tanh vs logistic"):
        step(*mlp_batches(1, batch=16)[0])


@pytest.mark.unit
def test_layer_remat_error_names_the_first_difference():
    model = different()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd_small(model.parameters()),
                          plan=xtrain.Plan(remat="full"))
    with pytest.raises(errors.PlanError, match=r"checkpoints each layer of the model's repeated blocks, but .* has none "
                                         r"\(blocks.0 .. blocks.2 are not one family .*op tanh vs logistic"):
        step(*mlp_batches(1)[0])


@pytest.mark.e2e
def test_gemma3_with_dropout_is_one_scan_with_the_dropout_streams_of_xlas_partitioner():
    """Dropout keys run through the layers as a carry; the last layer's next key and the sliding
    layers' KV cache are unread: left out when the layers are matched, the layers stay one family,
    and the losses equal those of XLA's partitioner on the same model (no layer scan there)."""
    torch.manual_seed(0)
    model, batches = gemma3(("sliding_attention", "full_attention")), lm_batches(1)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    losses = {}
    for lowering in ("explicit", "xla"):
        candidate = copy.deepcopy(model)
        step = xtrain.compile(candidate, xtrain.Mesh(data=8), optimizer=sgd(candidate.parameters()), loss_fn=lm_loss,
                              lowering=lowering)
        losses[lowering] = [step(*b)["loss"] for b in batches]
        if lowering == "explicit":
            assert scan_lengths(step.program(*batches[0])) == [2, 2]
    assert losses["explicit"] == pytest.approx(losses["xla"], rel=1e-5)
    with torch.no_grad():  # the masks do change the loss
        assert losses["xla"][0] != pytest.approx(lm_loss(model, *batches[0]).item(), rel=1e-4)

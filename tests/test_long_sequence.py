"""Long sequences: HF models train through the blockwise attention with parity, and the step's
temporaries grow about linearly with the sequence (the measured config of the issue)."""
import functools

import pytest
import torch
from transformers import FalconConfig, FalconForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import xtrain
from xtrain import plans
from xtrain.ir import attention as markers
from xtrain.testing import assert_parity, run_parity, torch_reference

pytestmark = pytest.mark.e2e

VOCAB = 101


def llama(vocab=VOCAB, layers=2, positions=64, attention="sdpa"):
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
        bos_token_id=0, eos_token_id=0, attn_implementation=attention))


def llama_eager():
    # HF's eager attention: matmul -> scale -> + additive mask -> softmax -> matmul, as torch ops
    return llama(attention="eager")


def falcon():
    # multi-query attention: one key/value head, SDPA called without enable_gqa
    return FalconForCausalLM(FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        new_decoder_architecture=False, alibi=False, hidden_dropout=0.0, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=0))


def mistral():
    # a sliding window of 16 over 64 tokens: HF passes a boolean mask built from positions
    return MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=16, bos_token_id=0, eos_token_id=0))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def padded_loss(model, ids, mask):
    labels = ids.masked_fill(mask == 0, -100)
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def batches(seq, padded=False, n=4, batch=8):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        if not padded:
            out.append((ids,))
            continue
        lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=g)
        out.append((ids, (torch.arange(seq)[None, :] < lengths[:, None]).long()))
    return out


@pytest.fixture
def blocks_of_16(monkeypatch):
    # sequences of 64 span 4 query and 4 key blocks: the online softmax and the skipping run
    monkeypatch.setitem(markers.DEFAULT_BLOCK, "cpu", 16)


@functools.cache
def reference(name, padded):
    torch.manual_seed(0)
    model = {"llama": llama, "falcon": falcon, "mistral": mistral, "llama-eager": llama_eager}[name]()
    data = batches(64, padded)
    loss = padded_loss if padded else lm_loss
    return model, data, loss, torch_reference(model, adamw, data, loss)


@pytest.mark.parametrize("name,padded,mesh", [
    ("llama", False, dict(data=8)), ("llama", True, dict(data=8)),
    ("falcon", False, dict(data=8)), ("falcon", False, dict(data=4, tensor=2)), ("mistral", True, dict(data=8)),
    ("llama-eager", False, dict(data=8)), ("llama-eager", True, dict(data=8))])
def test_blockwise_attention_trains_like_torch(blocks_of_16, name, padded, mesh):
    model, data, loss, want = reference(name, padded)
    plan = plans.megatron(model, mesh) if "tensor" in mesh else None
    assert_parity(run_parity(model, adamw, data, xtrain.Mesh(**mesh), plan=plan, loss_fn=loss, reference=want))


def attention_notes(name, padded):
    """The report's attention lines of one data=8 step of a reference model."""
    model, data, loss, _ = reference(name, padded)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()), loss_fn=loss)
    step(*data[0])
    return [n for n in step.report().notes if n.startswith("attention")]


def test_report_names_each_attention(blocks_of_16):
    notes = attention_notes("llama", False)
    assert notes == ["attention in 'model.layers.0.self_attn': blockwise (block 16, 10 block pairs, "
                     "6 of 16 blocks skipped by the causal mask)"], notes


def test_report_names_the_sliding_window_skip(blocks_of_16):
    """Window 16 in blocks of 16: each query block sees itself and the one before (7 of 16 pairs)."""
    notes = attention_notes("mistral", True)
    assert notes == ["attention in 'model.layers.0.self_attn': blockwise (block 16, 7 block pairs, 9 of 16 "
                     "blocks skipped by the mask's static band)"], notes


@pytest.mark.parametrize("padded,want", [
    (False, "10 block pairs, 6 of 16 blocks skipped by the causal mask); HF eager attention recognised, its "
            "constant mask is causal"),
    (True, "16 block pairs); HF eager attention recognised")])
def test_report_names_the_recognised_eager_attention(blocks_of_16, padded, want):
    """Without padding HF's additive mask is a constant of the program: causal, so the kernel skips
    blocks and drops the L x S mask; with padding the mask depends on the batch and is added."""
    model, data, loss, _ = reference("llama-eager", padded)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()), loss_fn=loss)
    step(*data[0])
    notes = [n for n in step.report().notes if n.startswith("attention")]
    assert notes == [f"attention in 'model.layers.0.self_attn': blockwise (block 16, {want}"], notes


def test_eager_attention_with_dropout_is_left_as_written_with_the_reason():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64,
                                       attn_pdrop=0.1, attn_implementation="eager"))
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()), loss_fn=lm_loss)
    step(*batches(64, n=1)[0])
    notes = [n for n in step.report().notes if n.startswith("attention")]
    assert notes == ["attention in 'transformer.h.0.attn': eager matmul-softmax-matmul left as written (full score "
                     "matrix): the weights are multiplied after the softmax: dropout (the eager pattern draws its own "
                     "mask)"], notes


def _temporaries(seq: int, attention="sdpa") -> int:
    """The measured config: HF Llama, 1 layer, hidden 32, 4 heads (2 kv), vocab 256, batch 8."""
    torch.manual_seed(0)
    model = llama(vocab=256, layers=1, positions=seq, attention=attention)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()), loss_fn=lm_loss)
    return step.compiled(torch.zeros(8, seq, dtype=torch.long)).memory_analysis().temp_size_in_bytes


def test_temporaries_grow_about_linearly_with_the_sequence():
    """Full score matrices: 53 MB at 1024 and 817 MB at 4096 (15.4x). Blockwise: linear."""
    short, long = _temporaries(1024), _temporaries(4096)
    assert long / short <= 6, (short, long)
    assert long <= 48 * 2**20, long  # a score matrix per head at 4096 alone is 64 MiB


def test_eager_attention_temporaries_grow_about_linearly():
    """HF's eager attention, recognised: no L x S weights kept (quadratic would be 16x for 4x)."""
    short, long = _temporaries(512, "eager"), _temporaries(2048, "eager")
    assert long / short <= 6, (short, long)


def test_t5_eager_attention_with_its_learned_position_bias_trains_like_torch():
    """T5's scores are q.k^T + a learned position bias + the mask: the bias reaches the kernel as an
    additive mask and its gradient comes back through the kernel's mask cotangent."""
    from tp_models import VOCAB as T5_VOCAB, batches as t5_batches, lm_loss as t5_loss
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(
        vocab_size=T5_VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation="eager"))
    data = t5_batches(n=4)
    want = torch_reference(model, adamw, data, t5_loss)
    result = run_parity(model, adamw, data, xtrain.Mesh(data=8), loss_fn=t5_loss, reference=want)
    assert_parity(result)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()), loss_fn=t5_loss)
    step(*data[0])
    notes = [n for n in step.report().notes if n.startswith("attention")]
    assert len(notes) == 3 and all(n.endswith("HF eager attention recognised") for n in notes), notes

"""Packed sequences: several documents in one batch row, each attending only to itself.

HF builds the mask of a packed batch from `position_ids` that restart at each document (called
with use_cache=False); xtrain reads it as per-token comparisons (xtrain.frontend.token_mask),
so the blockwise kernel builds each block's mask from its tokens (no L x S array) and skips the
key blocks of other documents at run time (lax.cond). The oracle: torch training the same
documents as separate rows (labels of each document's first token left out, as the separate
rows cannot predict it), under the parity standard, on data parallel, a ring, Ulysses and the
hybrid; the step's count of computed block pairs is the block-diagonal count exactly."""
import copy
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

import xtrain
from xtrain.frontend import token_mask
from xtrain.ir import attention as markers
from xtrain.ir.kernels import blockwise as bw
from xtrain.ir.kernels import documents
from xtrain.testing import ParityResult, assert_parity, torch_reference

VOCAB, DOCS, DOC = 101, 3, 64
SEQ = DOCS * DOC           # 192 tokens: 12 blocks of 16, each document 4 of them
BLOCK = 16
CAUSAL_PAIRS = 12 * 13 // 2                  # 78 block pairs of a causal call
DOCUMENT_PAIRS = DOCS * (4 * 5 // 2)         # 30: the causal pairs within each document
PATH = "model.layers.0.self_attn"


@pytest.fixture
def blocks_of_16(monkeypatch):
    monkeypatch.setitem(markers.DEFAULT_BLOCK, "cpu", BLOCK)


def llama():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, use_cache=False))


def mistral():
    # a sliding window of 24 inside documents of 64: the window and the documents in one mask
    return MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, sliding_window=24, bos_token_id=0, eos_token_id=0,
        use_cache=False))


def qwen3():
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
        use_cache=False))


def phi3():
    return Phi3ForCausalLM(Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        use_cache=False))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def packed_loss(model, ids, positions):
    """HF's packed batch: positions restart at each document; a document's first token is not
    predicted from the one before it (another document)."""
    return model(input_ids=ids, position_ids=positions, labels=ids.masked_fill(positions == 0, -100)).loss


def document_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def packed_batches(n=4, batch=8):
    g = torch.Generator().manual_seed(3)
    positions = torch.arange(DOC).repeat(DOCS)[None].expand(batch, -1)
    return [(torch.randint(0, VOCAB, (batch, SEQ), generator=g), positions) for _ in range(n)]


@functools.cache
def reference(name):
    """(model, packed batches, torch's losses and parameters training the documents as rows)."""
    torch.manual_seed(0)
    model = {"llama": llama, "mistral": mistral, "qwen3": qwen3, "phi3": phi3}[name]()
    data = packed_batches()
    separate = [(ids.reshape(-1, DOC),) for ids, _ in data]  # each row's 3 documents as 3 rows
    return model, data, torch_reference(model, adamw, separate, document_loss)


def train(name, mesh, plan=None):
    model, data, want = reference(name)
    model = copy.deepcopy(model)
    step = xtrain.compile(model, mesh, optimizer=adamw(model.parameters()), loss_fn=packed_loss, plan=plan)
    outs = [step(*b) for b in data]
    return ParityResult([o["loss"] for o in outs], want[0], step.state_dict(), want[1], 5e-5), step, outs


@pytest.mark.e2e
@pytest.mark.parametrize("mesh,context,calls,balanced", [
    (dict(data=8), "ring", 8, None),                          # 8 devices, each the whole sequence of its rows
    (dict(data=2, context=4), "ulysses", 8, None),            # each device the whole sequence of one head
    (dict(data=2, context=4), "ring", 2, False),              # each ring of 4 computes one call's blocks
    (dict(data=4, context=2), "ring", 4, True),               # rings of 2: 4 chunks of 48 tokens (whole blocks)
    (dict(context=8), xtrain.ContextParallel(ulysses=2), 2, False),  # 2 head groups, each a ring of 4
    (dict(context=8), xtrain.ContextParallel(ulysses=4), 4, True),   # 4 head groups, each a ring of 2
], ids=["data", "ulysses", "ring", "balanced ring", "hybrid", "balanced hybrid"])
def test_packed_documents_train_like_separate_documents(blocks_of_16, mesh, context, calls, balanced):
    result, step, outs = train("llama", xtrain.Mesh(**mesh), xtrain.Plan(context=context))
    assert_parity(result)
    # the block pairs computed: the documents' causal pairs (30 of 78, 38%) on every call, each step
    assert DOCUMENT_PAIRS / CAUSAL_PAIRS <= 0.4
    assert [int(o["attention_blocks"][PATH]) for o in outs] == [calls * DOCUMENT_PAIRS] * len(outs)
    notes = [n for n in step.report().notes if n.startswith(f"attention in {PATH!r}: blockwise")]
    assert notes and "packed documents" in notes[0] and "skipped at run time" in notes[0], notes
    if "context" not in mesh:  # each device decides its blocks from its own rows: no collective for it
        assert not [c for c in step.report().collectives if c.source.startswith(PATH + " ")
                    and c.axes == ("data",) and c.kind != "all-reduce"], step.report()
    if balanced is not None:  # a ring: balanced where its 2 x ring chunks are whole blocks, else says why not
        ring = [n for n in step.report().notes if n.startswith(f"attention in {PATH!r}:") and "ring attention" in n]
        assert ring and ("(packed documents, ordered within each: load-balanced chunks)" in ring[0]) == balanced
        assert balanced or "does not cut into 8 chunks of whole attention blocks (16); a multiple of 128" in ring[0]


@pytest.mark.e2e
def test_packed_documents_inside_pipeline_stages(blocks_of_16):
    """A 2-layer Llama on data=4 x pipe=2: each stage's attention runs the documents' kernel on its
    rows of each microbatch; the counts sum over microbatches and devices per layer."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, use_cache=False))
    data = packed_batches()
    want = torch_reference(model, adamw, [(ids.reshape(-1, DOC),) for ids, _ in data], document_loss)
    m = copy.deepcopy(model)
    step = xtrain.compile(m, xtrain.Mesh(data=4, pipe=2), optimizer=adamw(m.parameters()), loss_fn=packed_loss,
                          plan=xtrain.Plan().with_pipeline(stages=2, microbatches=2))
    outs = [step(*b) for b in data]
    assert_parity(ParityResult([o["loss"] for o in outs], want[0], step.state_dict(), want[1], 5e-5))
    assert {p: int(n) for p, n in outs[0]["attention_blocks"].items()} == {
        f"model.layers.{k}.self_attn": 8 * DOCUMENT_PAIRS for k in (0, 1)}  # 4 devices x 2 microbatches


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["qwen3", "phi3"])
def test_other_families_pack_documents_too(blocks_of_16, name):
    """Qwen3 (q/k norms) and Phi-3 (fused qkv): the documents' mask read the same way."""
    result, _, outs = train(name, xtrain.Mesh(data=8))
    assert_parity(result)
    assert {p: int(n) for p, n in outs[0]["attention_blocks"].items()} == {PATH: 8 * DOCUMENT_PAIRS}


@pytest.mark.e2e
def test_packed_documents_with_a_sliding_window(blocks_of_16):
    """Mistral: window and documents in one mask, both per-token comparisons."""
    result, step, outs = train("mistral", xtrain.Mesh(data=8))
    assert_parity(result)
    blocks = int(outs[0]["attention_blocks"][PATH])
    assert 0 < blocks < 8 * DOCUMENT_PAIRS  # the window hides more blocks inside each document


def _mask_factors(build, *args):
    """The factors token_mask reads from the mask `build` traces, as (ops, operand shapes)."""
    found = {}

    def f(*xs):
        m = token_mask.factors(build(*xs))
        found["m"] = m
        return m.operands if m is not None else ()

    jax.make_jaxpr(f)(*args)
    m = found["m"]
    return None if m is None else (m.ops, [tuple(x.shape) for x in m.operands])


@pytest.mark.unit
def test_the_mask_of_documents_is_read_as_per_token_comparisons():
    positions = jnp.tile(jnp.arange(4), 3)[None].repeat(2, 0)               # (2, 12)
    docs = jnp.cumsum(jnp.diff(positions, prepend=-1, axis=-1) != 1, axis=-1)

    def packed(p, d):  # HF's: causal over positions, and the same document
        return (p[:, None, None, :] <= p[:, None, :, None]) & (d[:, None, :, None] == d[:, None, None, :])

    assert _mask_factors(packed, positions, docs) == (
        ("le", "eq"), [(2, 1, 1, 12), (2, 1, 12, 1), (2, 1, 12, 1), (2, 1, 1, 12)])

    def padded_causal(keep):  # no document equality: the mask is kept as it is
        return jnp.tril(jnp.ones((12, 12), bool))[None, None] & keep[:, None, None, :]

    assert _mask_factors(padded_causal, positions > 0) is None

    def pairwise(d):  # a comparison of two values of both tokens: not per-token
        both = d[:, None, :, None] + d[:, None, None, :]
        return (both == both) & (d[:, None, :, None] == d[:, None, None, :])

    assert _mask_factors(pairwise, docs) is None


@pytest.mark.unit
@pytest.mark.parametrize("skip", [True, False], ids=["run-time skip", "every block (Neuron)"])
def test_kernel_with_document_factors_equals_the_dense_mask(skip):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 2, 2, 48, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 2, 48, 8)), jnp.float32) for _ in range(2))
    pos = jnp.asarray(np.tile(np.arange(16), 3)[None].repeat(2, 0))
    doc = jnp.asarray(np.repeat(np.arange(3), 16)[None].repeat(2, 0))
    rows, cols = (lambda x: x[:, None, None, :, None]), (lambda x: x[:, None, None, None, :])
    dense = (cols(pos) <= rows(pos)) & (rows(doc) == cols(doc))
    plain = bw.blocking_for(48, 48, 8, scale=0.3, causal=False)
    b = dataclasses.replace(plain, factors=("le", "eq"), skip_at_run_time=skip)
    operands = (cols(pos), rows(pos), rows(doc), cols(doc))
    loss = lambda f: lambda *a: (f(*a) ** 2).sum()
    with_factors = lambda q, k, v: bw.blockwise(q, k, v, operands, None, b)
    with_mask = lambda q, k, v: bw.blockwise(q, k, v, dense, None, plain)
    np.testing.assert_allclose(with_factors(q, k, v), with_mask(q, k, v), atol=1e-6)
    for got, want in zip(jax.grad(loss(with_factors), (0, 1, 2))(q, k, v), jax.grad(loss(with_mask), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    # 6 blocks of 8, documents of 2 blocks: 3 x 3 lower-triangle pairs computed, or all 36
    assert int(documents.executed_blocks(b, operands)) == (9 if skip else 36)
    if skip:
        assert "cond" in str(jax.make_jaxpr(with_factors)(q, k, v))


@pytest.mark.unit
def test_a_ring_over_packed_documents_is_balanced_and_exact():
    """Rows of 3 documents of 4 blocks (HF's factors: key position <= query position, same
    document) on a ring of 2 devices: contiguous chunks leave the devices 13 and 17 of the 30 block
    pairs, balanced chunks (0 and 3, 1 and 2 of 4) 15 each; both equal the whole call with
    dropout, forward and gradients."""
    from xtrain.ir.kernels import attention_dropout
    from xtrain.lowering import ring_attention as ra
    c, key = 2, jax.random.key(5)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 2, 2, SEQ, 8))  # (B, Hk, G, L, D)
    k, v = (jax.random.normal(x, (1, 2, SEQ, 8)) for x in keys[1:])
    pos, doc = jnp.tile(jnp.arange(DOC), DOCS)[None], jnp.repeat(jnp.arange(DOCS), DOC)[None]
    rows, cols = (lambda x: x[:, None, None, :, None]), (lambda x: x[:, None, None, None, :])
    mask = (cols(pos), rows(pos), rows(doc), cols(doc))
    b = dataclasses.replace(bw.blocking_for(SEQ, SEQ, BLOCK, scale=0.3, causal=False, dropout=0.2),
                            factors=("le", "eq"), skip_at_run_time=True)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:c]), ("context",))
    whole = lambda q, k, v: bw.blockwise(q, k, v, mask, key, b)
    loss = lambda f: jax.jit(jax.value_and_grad(lambda *x: jnp.sum(jnp.sin(f(*x))), argnums=(0, 1, 2)))
    want, want_grads = loss(whole)(q, k, v)
    for balanced, blocks in [(False, [13, 17]), (True, [15, 15])]:
        ring = ra.Ring(b, "context", c, balanced=balanced)

        def local(q, k, v, ring=ring):
            drop = (key, attention_dropout.flat_index(q.shape[:-2]))
            m = tuple(ra.mask_rows(ring, x) for x in mask)
            if ring.balanced:
                q, k, v = ra.balance(q, ring, 3), ra.balance(k, ring, 2), ra.balance(v, ring, 2)
            out = ra.ring_attention(ring, q, k, v, m, drop)
            out = ra.unbalance(out, ring, 3) if ring.balanced else out
            return out, ra.executed_blocks(ring, q.shape[-2], m)[None]

        seq = P(None, None, None, "context")
        split = jax.shard_map(local, mesh=mesh, in_specs=(seq, P(None, None, "context"), P(None, None, "context")),
                              out_specs=(seq, P("context")))
        assert [int(n) for n in jax.jit(split)(q, k, v)[1]] == blocks
        got, got_grads = loss(lambda *x: split(*x)[0])(q, k, v)
        np.testing.assert_allclose(got, want, rtol=5e-6)
        for g, w in zip(got_grads, want_grads):
            np.testing.assert_allclose(g, w, atol=1e-5)


@pytest.mark.e2e
def test_on_neuron_every_block_is_computed_masked(blocks_of_16, monkeypatch):
    """Neuron has no conditionals: the documents' mask is built per block and every pair computed,
    and the report says so."""
    from xtrain.frontend import sdpa
    monkeypatch.setattr(sdpa, "_backend", lambda: "neuron")
    monkeypatch.setitem(markers.DEFAULT_BLOCK, "neuron", BLOCK)
    model, data, want = reference("llama")
    model = copy.deepcopy(model)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()), loss_fn=packed_loss)
    out = step(*data[0])
    assert out["loss"] == pytest.approx(want[0][0], abs=5e-5)
    assert int(out["attention_blocks"][PATH]) == 8 * 12 * 12
    notes = [n for n in step.report().notes if n.startswith(f"attention in {PATH!r}: blockwise")]
    assert notes and "packed documents: each block's mask from its tokens, every block computed" in notes[0], notes


class DocumentModel(torch.nn.Module):
    """A model written by hand taking document ids: attention within each document, causal."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, ids, docs):
        b, t = ids.shape
        x = self.embed(ids)
        q, k, v = (y.reshape(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        order = torch.arange(t, device=ids.device)
        mask = (docs[:, None, :, None] == docs[:, None, None, :]) & (order[None, None, None, :] <= order[None, None, :, None])
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(x + self.out(y.transpose(1, 2).reshape(b, t, -1)))


def document_id_loss(model, ids, docs):
    return torch.nn.functional.cross_entropy(model(ids, docs).reshape(-1, VOCAB), ids.roll(-1, 1).reshape(-1))


@pytest.mark.e2e
def test_a_document_id_argument_of_a_model_written_by_hand(blocks_of_16):
    """The mask built from a document-id batch argument is read the same way: parity with torch
    (which computes the masked attention itself) and the documents' block pairs only."""
    torch.manual_seed(0)
    model = DocumentModel()
    g = torch.Generator().manual_seed(1)
    docs = torch.arange(DOCS).repeat_interleave(DOC)[None].expand(8, -1)
    data = [(torch.randint(0, VOCAB, (8, SEQ), generator=g), docs) for _ in range(4)]
    want = torch_reference(model, adamw, data, document_id_loss)
    model = copy.deepcopy(model)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()), loss_fn=document_id_loss)
    outs = [step(*b) for b in data]
    assert_parity(ParityResult([o["loss"] for o in outs], want[0], step.state_dict(), want[1], 5e-5))
    assert {p: int(n) for p, n in outs[0]["attention_blocks"].items()} == {"<top level>": 8 * DOCUMENT_PAIRS}

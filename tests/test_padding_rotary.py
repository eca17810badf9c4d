"""An embedding with padding_idx (its backward is a `scatter` into the table) and GPT-J-style
rotary (`stack` of the rotated halves) under DDP and FSDP: parity with torch under the default
Plan(fallback="error"), so neither primitive may reach the replicated fallback."""
import functools

import pytest
import torch
from torch import nn

import xtrain
from xtrain.testing import assert_parity, run_parity, torch_reference

pytestmark = pytest.mark.e2e

VOCAB, DIM, HEADS, SEQ, BATCH = 32, 16, 2, 8, 8


def rotate_every_two(x):
    """GPT-J's rotation: pairs (x0, x1) -> (-x1, x0), interleaved back with stack + flatten."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


class PaddedRotaryLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        hd = DIM // HEADS
        angles = torch.arange(SEQ)[:, None] * (1.0 / 100 ** (torch.arange(0, hd, 2) / hd))[None]
        self.register_buffer("sin", angles.sin().repeat_interleave(2, -1), persistent=False)
        self.register_buffer("cos", angles.cos().repeat_interleave(2, -1), persistent=False)

    def forward(self, ids, labels):
        b, t = ids.shape
        x = self.embed(ids)
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        q, k = [y * self.cos[:, None] + rotate_every_two(y) * self.sin[:, None] for y in (q, k)]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (DIM // HEADS) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        y = torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, DIM)
        logits = self.head(x + self.out(y))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


@functools.cache
def case():
    torch.manual_seed(0)
    model = PaddedRotaryLM()
    batches = []
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        ids[:, -2:] = 0  # padding tokens: their row of the table gets no gradient
        batches.append((ids, torch.randint(0, VOCAB, (BATCH, SEQ))))
    return model, batches, torch_reference(model, adamw, batches)


@pytest.mark.parametrize("zero", [0, 3], ids=["ddp", "fsdp"])
def test_padding_embedding_and_stacked_rotary_keep_parity_without_fallback(zero):
    model, batches, reference = case()
    result = run_parity(model, adamw, batches, xtrain.Mesh(data=8), plan=xtrain.Plan(zero=zero),
                        reference=reference)
    assert_parity(result)
    assert torch.equal(result.state["embed.weight"][0], reference[1]["embed.weight"][0])

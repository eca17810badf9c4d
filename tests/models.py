"""Small models for tests: an MLP, a CNN with BatchNorm, and a GPT."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import xtrain


class MLP(nn.Module):
    def __init__(self, d_in=12, hidden=32, classes=5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, y):
        h = torch.tanh(self.fc2(F.gelu(self.fc1(x))))
        return F.cross_entropy(self.head(h), y)


class CNN(nn.Module):
    def __init__(self, channels=6, classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=2)
        self.bn2 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x, y):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return F.cross_entropy(self.head(h.mean((2, 3))), y)


class Attention(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.heads = heads
        # No key bias: its exact gradient is zero (softmax ignores a per-query constant), so
        # under Adam its rounding noise would become lr-sized updates (see the parity standard).
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        split = lambda z: z.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # (B, H, T, Dh)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)  # (B, H, T, T)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = self.drop(scores.softmax(-1)) @ v  # (B, H, T, Dh)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer with tied token embedding / LM head."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2, seq=16, dropout=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.tok.weight
        self.drop = nn.Dropout(dropout)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t)))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class SequenceParallelGPT(GPT):
    """GPT whose residual stream is annotated sequence-parallel between blocks (batch over
    "data", sequence over "tensor": Megatron sequence parallelism under a Megatron plan).

    Row-parallel projections (attn.out, mlp.2) have no bias, as Megatron-LM adds theirs
    after the reduce-scatter: a bias added to a pending partial sum forces it to be resolved."""

    def __init__(self, sequence_parallel=True, **kwargs):
        super().__init__(**kwargs)
        self.sequence_parallel = sequence_parallel
        for block in self.blocks:
            block.attn.out.register_parameter("bias", None)
            block.mlp[2].register_parameter("bias", None)

    def annotate(self, x):
        return xtrain.shard(x, ("data", "tensor", None)) if self.sequence_parallel else x

    def forward(self, idx, targets):
        x = self.annotate(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = self.annotate(block(x))
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mlp_batches(n=5, batch=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)) for _ in range(n)]


def cnn_batches(n=5, batch=16, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 5, (batch,), generator=g)) for _ in range(n)]


def token_batches(n=5, batch=16, seq=16, vocab=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


class Stack(nn.Module):
    """A deep stack of wide linear layers (16 x 2048 x 2048, 268 MB in fp32): large enough to
    see in a process's memory, cheap to run on a small batch."""

    def __init__(self, d=2048, layers=16):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return (x * x).mean()


def stack_batch(batch=8, d=2048, seed=4):
    return (torch.randn(batch, d, generator=torch.Generator().manual_seed(seed)),)

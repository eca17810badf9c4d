"""A small nanoGPT-style GPT in plain PyTorch, and the example's default corpus.

The model knows nothing about xtrain: token + position embeddings, pre-LayerNorm blocks with
causal self-attention and a GELU MLP, an LM head tied to the token embedding, optional dropout.
`forward(idx, targets)` returns the mean cross-entropy loss, which is all `xtrain.compile` needs.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model.

    Attributes:
        vocab: number of token ids (256 for the byte-level corpus).
        seq: longest sequence the position embedding covers.
        layers: number of transformer blocks.
        d_model: width of the residual stream.
        heads: attention heads; must divide d_model.
        dropout: dropout probability on embeddings, attention weights and block outputs.
    """

    vocab: int = 256
    seq: int = 64
    layers: int = 2
    d_model: int = 128
    heads: int = 4
    dropout: float = 0.0

    def __post_init__(self):
        if self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by heads={self.heads}; "
                             f"use a d_model that is a multiple of {self.heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} is not in [0, 1)")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        split = lambda z: z.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # (B, H, T, Dh)
        q, k, v = split(q), split(k), split(v)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)  # (B, H, T, T)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        weights = self.attn_drop(scores.masked_fill(~causal, float("-inf")).softmax(-1))
        y = (weights @ v).transpose(1, 2).reshape(b, t, d)  # (B, T, D)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; `forward(idx, targets)` returns the loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one tensor, two names
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # a tied tensor counts once

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(t)))  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# -- data ---------------------------------------------------------------------------------

def default_corpus() -> np.ndarray:
    """CPython's own documentation text (`pydoc_data.topics`, ~0.5 MB, in every install) as
    UTF-8 bytes: a byte-level corpus with vocabulary 256 and nothing to download."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def corpus_from_dir(directory) -> np.ndarray:
    """A byte-level corpus from a directory (e.g. a SageMaker input channel): every regular file
    under it, in sorted path order, read as raw bytes (UTF-8 text is the intended content; any
    file works, each byte is a token of the vocabulary of 256) and joined by blank lines."""
    from pathlib import Path

    files = sorted(p for p in Path(directory).rglob("*") if p.is_file())
    if not files:
        raise ValueError(f"{directory} holds no files to train on; put UTF-8 text files in it")
    data = b"\n\n".join(p.read_bytes() for p in files)
    return np.frombuffer(data, dtype=np.uint8)


def split_corpus(tokens: np.ndarray, held_out: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the last `held_out` fraction is never trained on."""
    cut = int(len(tokens) * (1.0 - held_out))
    return tokens[:cut], tokens[cut:]


def sample_batch(tokens: np.ndarray, rng: np.random.Generator, batch: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Random windows of `seq + 1` tokens -> (inputs, next-token targets), each (batch, seq) int64.

    Every process draws from an identically seeded generator, so all pass the same global batch.
    """
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    windows = np.stack([tokens[s: s + seq + 1] for s in starts]).astype(np.int64)  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]

"""An MoE language model written here (no transformers model class): pre-norm blocks of causal
attention and a routed MoE, trained without an auxiliary loss. Its router chooses the top-k
experts on sigmoid scores plus a per-expert selection bias (the `e_score_correction_bias` buffer,
named as in HF DeepSeek-V3) and weights them by the scores alone (DeepSeek-V3, arXiv:2412.19437,
section 2.1.2): `xtrain.Plan(router_bias_rate=...)` finds the buffer beside the experts and moves
it towards balance after every step. The experts are an HF experts module
(`transformers.integrations.moe.use_experts_implementation`), so xtrain runs them as one routed
call that expert parallelism can split.

    model = MoELM(MoEConfig())
    loss = model(ids, labels)   # (B, T) int64 each
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers.integrations.moe import use_experts_implementation


@dataclasses.dataclass
class MoEConfig:
    vocab: int = 256
    d: int = 64
    ffn: int = 32
    experts: int = 16
    top_k: int = 4
    layers: int = 4
    heads: int = 4
    _experts_implementation: str = "grouped_mm"  # HF's experts switch: its grouped_mm path


@use_experts_implementation
class Experts(nn.Module):
    """SwiGLU experts stored (experts, out, in), gate and up concatenated, as HF's."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.num_experts = config.experts
        self.gate_up_proj = nn.Parameter(torch.randn(config.experts, 2 * config.ffn, config.d) / config.d ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(config.experts, config.d, config.ffn) / config.ffn ** 0.5)
        self.act_fn = nn.SiLU()

    def forward(self, x, top_k_index, top_k_weights):  # (N, d), (N, k), (N, k) -> (N, d); HF's "eager" path
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            gate, up = nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
            out = out + y * (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True)
        return out


class Router(nn.Module):
    """Sigmoid scores; experts chosen on the scores plus a selection bias, weighted by the scores."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.top_k = config.top_k
        self.weight = nn.Parameter(torch.randn(config.experts, config.d) / config.d ** 0.5)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.experts))

    def forward(self, x):  # (N, d) -> weights (N, k), experts (N, k)
        scores = nn.functional.linear(x, self.weight).sigmoid()
        chosen = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        return weights / weights.sum(-1, keepdim=True), chosen


class Block(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.heads = config.heads
        self.attn_norm, self.moe_norm = nn.RMSNorm(config.d), nn.RMSNorm(config.d)
        self.qkv, self.out = nn.Linear(config.d, 3 * config.d, bias=False), nn.Linear(config.d, config.d, bias=False)
        self.gate, self.experts = Router(config), Experts(config)

    def forward(self, x):  # (B, T, d)
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        h = self.moe_norm(x).reshape(-1, d)
        weights, chosen = self.gate(h)
        return x + self.experts(h, chosen, weights).reshape(b, t, d)


class MoELM(nn.Module):
    def __init__(self, config: MoEConfig = MoEConfig()):
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.d)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.layers)])
        self.norm, self.head = nn.RMSNorm(config.d), nn.Linear(config.d, config.vocab, bias=False)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

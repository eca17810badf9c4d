"""Tiny models for the tensor-parallel plans derived from the traced graph (tests/test_tp_derived.py):
HF structures the module-name rules got wrong (GPT-NeoX, Phi-3, BERT), a Llama whose layers live in
an nn.ModuleDict, and its twin with meaningless names, a custom container and no head-count
attributes."""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 64, 16


def lm_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def batches(n=4, batch=8, seq=SEQ, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        out.append((ids, ids))
    return out


def hf(name):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=SEQ * 2)
    if name == "gpt_neox":
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
                                                      eos_token_id=0, **common))
    if name == "gpt2":  # fused c_attn (a Conv1D, q | k | v with a bias), tied LM head
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "phi3":
        return tf.Phi3ForCausalLM(tf.Phi3Config(pad_token_id=0, bos_token_id=0, eos_token_id=0, **common))
    if name == "gqa3":  # 6 query heads over 3 key/value heads: tensor=2 splits the queries, not the groups
        return tf.LlamaForCausalLM(tf.LlamaConfig(**{**common, "hidden_size": 48, "intermediate_size": 192,
                                                     "num_attention_heads": 6}, num_key_value_heads=3,
                                                  bos_token_id=0, eos_token_id=0))
    if name == "t5":  # encoder-decoder: self-attention, cross-attention (queries from the decoder), MLP
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    if name == "bert":
        config = tf.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                               **{**common, "intermediate_size": 256, "max_position_embeddings": SEQ})
        return tf.BertForMaskedLM(config)
    if name == "deepseek_v3":  # multi-head latent attention: q, the latent's up-projection (kv_b_proj), o
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **common, num_key_value_heads=4, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, bos_token_id=0, eos_token_id=0, use_cache=False))
    raise ValueError(name)


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    """Pre-norm Llama block (GQA attention, SwiGLU MLP); `names` name its nine modules. Head
    counts are kept in a tuple, not in attributes a name rule could read."""

    def __init__(self, d, heads, kv, ffn, names):
        super().__init__()
        self._shape = (heads, kv)
        self.names = names
        hd = d // heads
        sizes = [(d, heads * hd), (d, kv * hd), (d, kv * hd), (heads * hd, d), (d, ffn), (d, ffn), (ffn, d)]
        for name, (i, o) in zip(names[:7], sizes):
            self.add_module(name, nn.Linear(i, o, bias=False))
        self.add_module(names[7], RMSNorm(d))
        self.add_module(names[8], RMSNorm(d))

    def part(self, i):
        return getattr(self, self.names[i])

    def attention(self, x):
        b, t, d = x.shape
        heads, kv = self._shape
        hd = d // heads
        q = self.part(0)(x).view(b, t, heads, hd).transpose(1, 2)
        k = self.part(1)(x).view(b, t, kv, hd).transpose(1, 2).repeat_interleave(heads // kv, dim=1)
        v = self.part(2)(x).view(b, t, kv, hd).transpose(1, 2).repeat_interleave(heads // kv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.part(3)(out.transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = x + self.attention(self.part(7)(x))
        h = self.part(8)(x)
        return x + self.part(6)(F.silu(self.part(4)(h)) * self.part(5)(h))


WELL_NAMED = ("wq", "wk", "wv", "wo", "w1", "w3", "w2", "attention_norm", "ffn_norm")
MEANINGLESS = ("p", "r", "s", "t", "u", "x", "y", "z0", "z1")


class Stack(nn.Module):
    """A custom container: children added one by one under made-up names, run in order."""

    def __init__(self, blocks):
        super().__init__()
        for i, block in enumerate(blocks):
            self.add_module(f"k{i}", block)

    def forward(self, x):
        for block in self.children():
            x = block(x)
        return x


class DictLlama(nn.Module):
    """A Llama whose layers live in an nn.ModuleDict (as torchtitan writes it); with
    `meaningless=True` its twin: the same computation, meaningless names, a custom container."""

    def __init__(self, d=32, heads=4, kv=4, ffn=128, layers=2, meaningless=False):
        super().__init__()
        names = MEANINGLESS if meaningless else WELL_NAMED
        blocks = [Block(d, heads, kv, ffn, names) for _ in range(layers)]
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = Stack(blocks) if meaningless else nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        self.norm = RMSNorm(d)
        self.out = nn.Linear(d, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        if isinstance(self.layers, nn.ModuleDict):
            for block in self.layers.values():
                x = block(x)
        else:
            x = self.layers(x)
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class Experts(nn.Module):
    """A mixture of experts with 3-D expert weights (experts, in, out), run as batched matmuls
    over every expert and combined by a softmax gate (dense routing: every token visits every
    expert, weighted)."""

    def __init__(self, d, ffn, experts):
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, d, ffn) * d ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, ffn, d) * ffn ** -0.5)

    def forward(self, x):
        b, t, d = x.shape
        tokens = x.reshape(1, b * t, d).expand(self.w_in.shape[0], b * t, d)   # (E, N, d)
        hidden = F.gelu(torch.bmm(tokens, self.w_in))                           # (E, N, ffn)
        out = torch.bmm(hidden, self.w_out)                                     # (E, N, d)
        weights = self.gate(x).softmax(-1).reshape(b * t, -1).T.unsqueeze(-1)   # (E, N, 1)
        return (out * weights).sum(0).reshape(b, t, d)


class MoE(nn.Module):
    """Embedding, blocks of (norm, experts) with residuals, a head."""

    def __init__(self, d=32, ffn=64, experts=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.norms = nn.ModuleList(RMSNorm(d) for _ in range(layers))
        self.moe = nn.ModuleList(Experts(d, ffn, experts) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for norm, moe in zip(self.norms, self.moe):
            x = x + moe(norm(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class BiasedMLP(nn.Module):
    """Two linears with biases (column, row) and a squared error: the row-parallel bias alone;
    `conv1d`: the second as GPT-2's Conv1D writes it (a 2-D addmm, then a view back)."""

    def __init__(self, d=16, f=64, conv1d=False):
        super().__init__()
        self.fc1, self.fc2, self.conv1d = nn.Linear(d, f), nn.Linear(f, d), conv1d

    def forward(self, x, y):
        h = F.gelu(self.fc1(x))
        if self.conv1d:
            out = torch.addmm(self.fc2.bias, h.reshape(-1, h.shape[-1]), self.fc2.weight.T).reshape(y.shape)
        else:
            out = self.fc2(h)
        return ((out - y) ** 2).mean()

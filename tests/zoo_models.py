"""The zoo (tests/test_zoo.py): tiny random-init models of the classes real training scripts use,
one per failure class the issue measured, each with its batches and loss function.

From transformers (no download): GPT-2 and Llama causal LMs, a RoBERTa encoder (padding_idx),
T5, Mixtral (MoE), ViT, Mamba (pure-torch path), Jamba (attention + state space + MoE).
Written here: a Llama with Meta's complex rotary embeddings, an FNet-style FFT mixer, a
ResNet-style CNN (conv stem, max pooling, BatchNorm, residuals), a MobileNet-style CNN
(depthwise convs, BatchNorm, ReLU6), a wav2vec2-style strided-conv feature extractor with
GroupNorm, and a model branching with torch.cond.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, D = 61, 8, 32  # an odd vocabulary no mesh axis divides


def lm_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def t5_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def vision_loss(model, pixels, labels):
    return model(pixel_values=pixels, labels=labels).loss


def token_batches(n=4, batch=8, seq=SEQ, seed=3, low=0):
    g = torch.Generator().manual_seed(seed)
    return [(ids, ids) for ids in (torch.randint(low, VOCAB, (batch, seq), generator=g) for _ in range(n))]


def padded_batches(n=4, batch=8, seq=SEQ, seed=4, pad=1):
    """Token batches whose last positions are padding (RoBERTa's padding_idx)."""
    out = []
    for ids, _ in token_batches(n, batch, seq, seed, low=2):
        ids = ids.clone()
        ids[::2, -2:] = pad
        out.append((ids, ids))
    return out


def image_batches(n=4, batch=8, channels=3, size=8, classes=5, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, channels, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(n)]


def audio_batches(n=4, batch=8, samples=64, classes=5, seed=6):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, samples, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(n)]


# ---- a Llama written as Meta's reference code writes it: complex rotary embeddings ----

def rope_frequencies(head_dim: int, seq: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)  # (T, Dh/2)
    return torch.polar(torch.ones_like(angles), angles)  # complex64


def apply_rotary(xq, xk, freqs_cis):
    """Meta's apply_rotary_emb: pairs of channels as complex numbers, rotated by a complex multiply."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))  # (B, T, H, Dh/2)
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MetaAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.wq, self.wk = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.wv, self.wo = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x, freqs_cis):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim)
        k = self.wk(x).view(b, t, self.heads, self.head_dim)
        v = self.wv(x).view(b, t, self.heads, self.head_dim)
        q, k = apply_rotary(q, k, freqs_cis)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, D)


class MetaBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.attention = MetaAttention(d, heads)
        self.w1, self.w3 = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.w2 = nn.Linear(2 * d, d, bias=False)

    def forward(self, x, freqs_cis):
        x = x + self.attention(self.attention_norm(x), freqs_cis)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ComplexRopeLlama(nn.Module):
    def __init__(self, d=D, heads=4, layers=2, seq=SEQ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(MetaBlock(d, heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.output = nn.Linear(d, VOCAB, bias=False)
        self.register_buffer("freqs_cis", rope_frequencies(d // heads, seq), persistent=False)

    def forward(self, ids, labels):
        h = self.tok_embeddings(ids)
        freqs = self.freqs_cis[: ids.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


# ---- FNet: token mixing by the real part of a 2-D FFT ----

class FNetBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = self.norm1(x + torch.fft.fft2(x).real)  # (B, T, D): FFT over sequence and hidden
        return self.norm2(x + self.ff(x))


class FNet(nn.Module):
    def __init__(self, d=D, layers=2, classes=5):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(FNetBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, ids, labels):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h.mean(1)), labels[:, 0] % self.head.out_features)


# ---- CNNs: ResNet-style and MobileNet-style ----

class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                         if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    """HF/torchvision ResNet's shape: conv stem, BatchNorm, max pooling, residual stages, average pool."""

    def __init__(self, width=8, classes=5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.stages = nn.Sequential(BasicBlock(width, width, 1), BasicBlock(width, 2 * width, 2))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x, y):
        h = self.stages(self.stem(x))
        return F.cross_entropy(self.head(F.adaptive_avg_pool2d(h, 1).flatten(1)), y)


class InvertedResidual(nn.Module):
    """MobileNetV2's block: pointwise expand, depthwise 3x3 (stride), pointwise project; BatchNorm
    after each conv, ReLU6 after the first two, a residual where shapes allow."""

    def __init__(self, c_in, c_out, stride, expand=4):
        super().__init__()
        hidden = expand * c_in
        self.expand = nn.Sequential(nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6())
        self.depthwise = nn.Sequential(nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                                       nn.BatchNorm2d(hidden), nn.ReLU6())
        self.project = nn.Sequential(nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        h = self.project(self.depthwise(self.expand(x)))
        return x + h if self.residual else h


class MobileNet(nn.Module):
    """MobileNetV2's shape, down to 1x1 feature maps (BatchNorm over the batch alone there)."""

    def __init__(self, width=8, classes=5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU6())
        self.blocks = nn.Sequential(InvertedResidual(width, width, 1), InvertedResidual(width, 2 * width, 2),
                                    InvertedResidual(2 * width, 2 * width, 2))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x, y):
        h = self.blocks(self.stem(x))  # (B, 2 * width, 1, 1) from 8x8 images
        return F.cross_entropy(self.head(h.mean((2, 3))), y)


# ---- wav2vec2's feature extractor: strided 1-D convs, GroupNorm on the first ----

class AudioEncoder(nn.Module):
    def __init__(self, channels=16, classes=5):
        super().__init__()
        self.conv0 = nn.Conv1d(1, channels, 10, 5, bias=False)
        self.norm0 = nn.GroupNorm(channels, channels)  # wav2vec2: one group per channel
        self.conv1 = nn.Conv1d(channels, channels, 3, 2, bias=False)
        self.norm1 = nn.GroupNorm(4, channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, wave, y):
        h = F.gelu(self.norm0(self.conv0(wave[:, None])))  # (B, C, T')
        h = F.gelu(self.norm1(self.conv1(h)))
        return F.cross_entropy(self.head(h.mean(-1)), y)


# ---- torch.cond: a data-dependent branch ----

class CondMLP(nn.Module):
    def __init__(self, d=16, classes=5):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, y):
        h = torch.tanh(self.fc1(x))
        h = torch.cond(h.sum() > 0, lambda t: self.fc2(t), lambda t: -self.fc2(t), (h,))
        return F.cross_entropy(self.head(h), y)


def vector_batches(n=4, batch=8, d=16, classes=5, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]


# ---- transformers ----

def _tf():
    import transformers
    return transformers


def gpt2():
    tf = _tf()
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=D, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def llama():
    tf = _tf()
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0))


def roberta():
    tf = _tf()
    return tf.RobertaForMaskedLM(tf.RobertaConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=SEQ + 2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1))


def t5():
    tf = _tf()
    return tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=D, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def mixtral():
    tf = _tf()
    return tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
        router_aux_loss_coef=0.0, bos_token_id=0, eos_token_id=0))


def vit():
    tf = _tf()
    return tf.ViTForImageClassification(tf.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=D, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def mamba():
    tf = _tf()
    return tf.MambaForCausalLM(tf.MambaConfig(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=1,
                                              expand=2, conv_kernel=2, use_mambapy=False, bos_token_id=0,
                                              eos_token_id=0, pad_token_id=0))


def jamba():
    tf = _tf()
    return tf.JambaForCausalLM(tf.JambaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=2, mamba_expand=2,
        mamba_dt_rank=2, use_mamba_kernels=False, max_position_embeddings=SEQ, router_aux_loss_coef=0.0,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))


@dataclasses.dataclass(frozen=True)
class Zoo:
    """One zoo model: its constructor, batches, loss function (None: the forward returns it) and
    whether it has matmuls for Megatron to split."""

    make: Callable[[], nn.Module]
    batches: Callable[..., list]
    loss_fn: Callable | None = None
    megatron: bool = True


ZOO = {
    "gpt2": Zoo(gpt2, token_batches, lm_loss),
    "llama": Zoo(llama, token_batches, lm_loss),
    "roberta": Zoo(roberta, padded_batches, lm_loss),
    "t5": Zoo(t5, token_batches, t5_loss),
    "mixtral": Zoo(mixtral, token_batches, lm_loss),
    "vit": Zoo(vit, image_batches, vision_loss),
    "mamba": Zoo(mamba, token_batches, lm_loss),
    "jamba": Zoo(jamba, token_batches, lm_loss),
    "complex_rope_llama": Zoo(ComplexRopeLlama, token_batches),
    "fnet": Zoo(FNet, token_batches),
    "resnet": Zoo(ResNet, image_batches, megatron=False),
    "mobilenet": Zoo(MobileNet, image_batches, megatron=False),
    "audio": Zoo(AudioEncoder, audio_batches, megatron=False),
    "cond": Zoo(CondMLP, vector_batches),
}


def hf_mobilenet():
    tf = _tf()
    return tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config(
        num_channels=3, image_size=32, depth_multiplier=0.25, min_depth=4, num_labels=5,
        classifier_dropout_prob=0.0))


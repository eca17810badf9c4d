"""Fine-tune a small HF Llama with LoRA adapters (peft) under xtrain, on text that ships with Python.

    python examples/finetune_lora.py                          # 8 emulated CPU devices, data parallel
    python examples/finetune_lora.py --layout megatron        # Mesh(data=4, tensor=2), frozen base split too
    python examples/finetune_lora.py --layout fsdp --out runs/finetune_lora/adapter

The model is wrapped with `peft.get_peft_model` exactly as for a torch training loop and passed
to `xtrain.compile` unchanged: only the adapters (LoRA on q/v/o/up/down) are trained, so only
they get gradients, gradient sync and AdamW state; the base weights are frozen (split over the
mesh under fsdp and megatron). At the end the trained weights go back into the peft model
(`step.state_dict()`), `save_pretrained` writes the adapter alone, and the script reloads it
with `PeftModel.from_pretrained` onto a fresh copy of the base and checks its held-out loss.

The base here is a randomly initialised tiny Llama over bytes (vocabulary 256) so that nothing
is downloaded; with a real checkpoint, build the base with `AutoModelForCausalLM.from_pretrained`
and feed its tokenizer's ids instead of bytes. The data is the embedded corpus of
examples/train_gpt.py (CPython's pydoc topics).
"""
from __future__ import annotations

import argparse
import pathlib

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import xtrain
from gpt_model import default_corpus, sample_batch, split_corpus

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--seq", type=int, default=64, help="tokens (bytes) per sequence")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the base model")
    p.add_argument("--d-model", type=int, default=64, help="width of the base model")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (the adapters' output is scaled by alpha/r)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate of the adapters")
    p.add_argument("--layout", default="data", choices=["data", "fsdp", "megatron"],
                   help="data: Mesh(data=8); fsdp: the same mesh, the frozen base split over it; "
                        "megatron: Mesh(data=4, tensor=2) with plans.megatron")
    p.add_argument("--cpu-devices", type=int, default=8, help="emulated CPU devices (CPU only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--out", default="runs/finetune_lora/adapter", help="directory for the adapter")
    return p.parse_args(argv)


def base_model(args) -> LlamaForCausalLM:
    torch.manual_seed(args.seed)  # the same base every time: the saved adapter applies to it
    heads = max(2, args.d_model // 16)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=args.seq, bos_token_id=0, eos_token_id=0))


def lm_loss(model, ids, targets):
    # targets are the next bytes already (sample_batch shifts), so the loss is computed here, not by HF
    logits = model(input_ids=ids).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def layout(name: str, model) -> tuple[xtrain.Mesh, xtrain.Plan | None]:
    if name == "megatron":
        mesh = xtrain.Mesh(data=-1, tensor=2)
        return mesh, xtrain.plans.megatron(model, mesh)
    mesh = xtrain.Mesh(data=-1)
    return mesh, xtrain.plans.fsdp(model, mesh) if name == "fsdp" else None


def held_out_loss(model, batch) -> float:
    with torch.no_grad():
        return float(lm_loss(model.eval(), *(torch.as_tensor(x) for x in batch)))


def main(argv=None) -> None:
    args = parse_args(argv)
    xtrain.init(cpu_devices=args.cpu_devices)
    import jax

    model = get_peft_model(base_model(args), LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=TARGETS,
                                                        lora_dropout=0.0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    mesh, plan = layout(args.layout, model)
    step = xtrain.compile(model, mesh, optimizer=torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0),
                          plan=plan, loss_fn=lm_loss)
    train_tokens, val_tokens = split_corpus(default_corpus())
    total = sum(p.numel() for p in model.parameters())
    print(f"Llama {total / 1e6:.2f}M parameters, {sum(p.numel() for p in trainable):,} trainable (LoRA r={args.rank}); "
          f"{jax.device_count()} devices, layout {args.layout}", flush=True)

    rng = np.random.default_rng(args.seed)
    losses = [step(*sample_batch(train_tokens, rng, args.batch, args.seq))["loss"] for _ in range(args.steps)]
    state = step.report().state_memory
    print(f"per device: parameters {state['parameters']:,} B, gradients {state['gradients']:,} B, "
          f"optimizer {state['optimizer']:,} B (the adapters only)", flush=True)

    val = sample_batch(val_tokens, np.random.default_rng(args.seed + 1), args.batch, args.seq)
    eval_loss = step.eval(*val)["loss"]
    model.load_state_dict(step.state_dict())  # the trained adapters back into the peft model
    out = pathlib.Path(args.out)
    model.save_pretrained(out)  # adapter_config.json + adapter_model.safetensors, adapters only
    reloaded = PeftModel.from_pretrained(base_model(args), out)
    reloaded_loss = held_out_loss(reloaded, val)
    print(f"adapter: {out} ({(out / 'adapter_model.safetensors').stat().st_size:,} bytes), reloaded with "
          f"PeftModel.from_pretrained: held-out loss {reloaded_loss:.4f}", flush=True)
    print(f"done: steps={args.steps} first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f} "
          f"eval_loss={eval_loss:.4f} reloaded_eval_loss={reloaded_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()

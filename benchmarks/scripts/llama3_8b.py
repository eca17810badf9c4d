"""Llama-3.1-8B as a training script for a p5.48xlarge (8 x H100), built without weights.

On a machine without the GPUs, the plan search for it, with the best candidates compiled by XLA's
GPU compiler (what benchmarks/real_configs.py times):

    xtrain plan --target p5.48xlarge:1 --precision bf16 --compile 3 benchmarks/scripts/llama3_8b.py

On the instance itself it trains from a checkpoint (`--checkpoint DIR`, the weights of the
Hugging Face release in safetensors): the parameters are built on the meta device and each device
reads only its own shard.
"""
import argparse

import numpy as np
import torch
import transformers

import xtrain

p = argparse.ArgumentParser()
p.add_argument("--checkpoint", default=None, help="a directory of safetensors weights to start from")
p.add_argument("--seq", type=int, default=8192)
p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
p.add_argument("--steps", type=int, default=10)
args = p.parse_args()

xtrain.init()
config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                                  rope_theta=500000.0)
with xtrain.checkpoint.meta_params():
    model = transformers.LlamaForCausalLM(config)
step = xtrain.compile(model, xtrain.Mesh(data=-1), optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
                      loss_fn=lambda m, ids, labels: m(input_ids=ids, labels=labels).loss, init_from=args.checkpoint)
rng = np.random.default_rng(0)
for _ in range(args.steps):
    ids = rng.integers(0, config.vocab_size, (args.batch, args.seq), dtype=np.int64)
    print(step(ids, ids)["loss"])

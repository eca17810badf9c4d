"""Does auxiliary-loss-free balancing balance the experts? HF DeepSeek-V3 (tiny), or an MoE written
here (`--model moe_lm`), with and without Plan(router_bias_rate=...).

    python benchmarks/router_bias.py                  # 8 emulated CPU devices, ~15 min on 2 cores
    python benchmarks/router_bias.py --model moe_lm   # the MoE written here (results/router_bias_moe_lm.md)
    python benchmarks/router_bias.py --steps 5        # a smoke run (writes nothing)
    python benchmarks/router_bias.py --rates 1e-3     # one rate

A 4-layer DeepSeek-V3 (the first dense, then shared + 16 routed experts, top-4 of 2 of 4 groups,
sigmoid scores, no auxiliary loss) trained on the example's byte-level corpus (examples/gpt_model.py)
from the same weights and batches under each plan, on Mesh(data=8). Per step, each MoE layer's
load imbalance is max / mean tokens per expert (`step(...)["expert_tokens"]`); reported: its
mean over the layers and the last 50 steps, and the loss. The bar: with the bias, the imbalance
is at most 1.3 and at most 0.8x that without. Writes benchmarks/results/router_bias.md (and
.json with every step's figures) for runs of 100 steps or more.

The MoE written here (examples/moe_model.py's `MoELM`): 4 pre-norm blocks of causal attention and an MoE of 16 SwiGLU
experts, top-4 on sigmoid scores plus the selection bias (its router's `e_score_correction_bias`
buffer: xtrain finds it beside the experts and updates it), gate weights from the scores alone,
no shared expert and no auxiliary loss; hidden 64, expert FFN 32. Its experts are an HF experts
module (`use_experts_implementation`), so they run as xtrain's routed-experts call. Measured (200
steps, 128 x 64 tokens): without the bias 2.33, rate 5e-3 1.11 (0.48x), 7e-3 1.12: PASS.

The batch is 128 x 64 tokens: a step's max / mean also measures how unevenly one batch's tokens
fall, whatever the bias; at smaller batches the same rates end higher (measured, 200 steps: batch
32, rate 1e-2: 1.44, 5e-3: 1.35; batch 64, 5e-3: 1.31, 1e-2: 1.37; larger rates overshoot: 3e-2
2.00, 1e-1 3.46 at batch 32).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import bench_common  # noqa: E402 - benchmarks/ (it puts examples/ on the path)
import numpy as np
import torch
import xtrain  # noqa: E402
from gpt_model import default_corpus, sample_batch, split_corpus  # noqa: E402
from moe_model import MoEConfig, MoELM  # noqa: E402

TAIL = 50


def model():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
        n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=0, use_cache=False))


def lm_loss(m, x, y):
    return m(input_ids=x, labels=y).loss


def moe_lm():
    torch.manual_seed(0)
    return MoELM(MoEConfig())


MODELS = {"deepseek_v3": (model, lm_loss), "moe_lm": (moe_lm, lambda m, x, y: m(x, y))}


def run(args, rate: float | None, tokens) -> dict:
    make, loss_fn = MODELS[args.model]
    m = make()
    step = xtrain.compile(m, xtrain.Mesh(data=8), optimizer=torch.optim.AdamW(m.parameters(), lr=args.lr),
                          loss_fn=loss_fn, plan=dataclasses.replace(xtrain.Plan(), router_bias_rate=rate))
    rng, losses, imbalance = np.random.default_rng(args.seed), [], []
    for _ in range(args.steps):
        x, y = sample_batch(tokens, rng, args.batch, args.seq)
        out = step(torch.as_tensor(x), torch.as_tensor(y))
        losses.append(out["loss"])
        imbalance.append(float(np.mean([c.max() / c.mean() for c in map(np.asarray, out["expert_tokens"].values())])))
    tail = slice(-min(TAIL, args.steps), None)
    return {"losses": losses, "imbalance": imbalance, "tail_imbalance": float(np.mean(imbalance[tail])),
            "tail_loss": float(np.mean(losses[tail]))}


def table(runs: dict, args) -> str:
    off = runs["off"]
    every = max(1, args.steps // 4)
    trend = lambda r: " / ".join(f"{np.mean(r['imbalance'][i:i + every]):.2f}" for i in range(0, args.steps, every))
    model_text = {
        "deepseek_v3": ("HF DeepSeek-V3 (tiny), 16 experts top-4", "4 layers (1 dense), hidden 64, 16 routed + "
                        "1 shared experts, top-4 of 2 of 4 groups, sigmoid scores", 3),
        "moe_lm": ("the MoE written here (MoELM), 16 experts top-4", "4 layers of causal attention + MoE, hidden "
                   "64, 16 SwiGLU experts (FFN 32), top-4 on sigmoid scores + selection bias, no shared expert", 4)}
    title, what, moe_layers = model_text[args.model]
    flag = " --model moe_lm" if args.model == "moe_lm" else ""
    lines = [f"# Auxiliary-loss-free balancing: {title}", "",
             f"`python benchmarks/router_bias.py{flag} --steps {args.steps}`: {what}, no auxiliary loss, byte "
             f"corpus, batch {args.batch} x {args.seq}, AdamW lr {args.lr}, Mesh(data=8) on 8 emulated CPU devices. "
             f"Imbalance = max / mean tokens per expert, mean over the {moe_layers} MoE layers; 'last {TAIL}': over "
             f"the last {TAIL} steps; 'trend': the mean over each quarter of the run. The bar: imbalance <= 1.3 and "
             "<= 0.8x the run without.",
             "",
             "| router_bias_rate | imbalance, last steps | x without | trend | loss, last steps | verdict |",
             "|---|---|---|---|---|---|",
             f"| None | {off['tail_imbalance']:.3f} | 1.00x | {trend(off)} | {off['tail_loss']:.4f} | |"]
    for rate in args.rates:
        r = runs[f"{rate:g}"]
        ratio = r["tail_imbalance"] / off["tail_imbalance"]
        ok = r["tail_imbalance"] <= 1.3 and ratio <= 0.8
        lines.append(f"| {rate:g} | {r['tail_imbalance']:.3f} | {ratio:.2f}x | {trend(r)} | {r['tail_loss']:.4f} "
                     f"| {'PASS' if ok else 'FAIL'} |")
    return "\n".join(lines + [""])


def main() -> None:
    p = bench_common.long_run_args(__doc__.splitlines()[0])
    p.set_defaults(steps=200, batch=128, seq=64)
    p.add_argument("--rates", type=float, nargs="+", default=[5e-3, 7e-3],
                   help="router_bias_rate values (DeepSeek-V3 used 1e-3 over 14.8T tokens)")
    p.add_argument("--model", choices=sorted(MODELS), default="deepseek_v3")
    args = p.parse_args()
    xtrain.init(cpu_devices=8)
    tokens, _ = split_corpus(default_corpus())
    runs = {"off": run(args, None, tokens), **{f"{rate:g}": run(args, rate, tokens) for rate in args.rates}}
    text = table(runs, args)
    print(text)
    if args.steps >= 100:
        results = pathlib.Path(__file__).resolve().parent / "results"
        name = "router_bias" if args.model == "deepseek_v3" else f"router_bias_{args.model}"
        (results / f"{name}.md").write_text(text)
        (results / f"{name}.json").write_text(json.dumps({"args": vars(args), "runs": runs}))


if __name__ == "__main__":
    main()

"""Tokens/s and MFU of a ~1B Llama in bf16 on whatever accelerator this host has.

    python benchmarks/accelerator_step.py                  # 1.1B Llama (TinyLlama's shape), seq 2048, on the GPUs
    python benchmarks/accelerator_step.py --tiny --steps 2 # a few-MB config: the CPU check the tests run

Runs, side by side in one process, on the same model (HF LlamaForCausalLM traced through
xtrain's front end), weights, batches and AdamW:
  xtrain fsdp        xtrain's explicit lowering, plans.fsdp (ZeRO-3) over every device, bf16
  xtrain tp          plans.megatron over `tensor` (several devices only), data over the rest
  xla <plan>         the same plans through XLA's partitioner (lowering="xla")
  jax.jit            the model's pure JAX function (xtrain's front end) under plain jax.jit and
                     optax: parameters cast to bf16 in the loss, batch split over the devices

MFU uses xtrain's one definition (xtrain.ir.analysis.flops: model FLOPs per step = the forward and
backward matmuls of the model's traced graph, 6N + attention per token, the same for every
row) and the dense bf16 peak of the device (xtrain.cost.hardware.peak_flops, cited there).
Writes a Markdown table and JSON to benchmarks/results/ (`accelerator_step_<device>.md`),
the device named in the file and its title.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from transformers import LlamaForCausalLM

import xtrain
from xtrain import plans
from xtrain.cost.hardware import peak_flops
from xtrain.frontend.torch_module import wrap
from xtrain.ir.analysis import flops

import gpu_step  # noqa: E402 - benchmarks/: the Llama's shape, config and loss
from gpu_step import Shape, lm_loss  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LR = 1e-4


TINY = dataclasses.replace(gpu_step.TINY, batch=8)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu_step.add_shape_args(p)
    p.add_argument("--tiny", action="store_true", help=f"a tiny model for a CPU check: {TINY}")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--tensor", type=int, default=None, help="tensor-parallel degree of the tp row (default: "
                   "min(devices, 8))")
    p.add_argument("--runs", default="", help="comma-separated rows to run, e.g. 'xtrain fsdp,jax.jit' (default: all)")
    p.add_argument("--out", default=str(RESULTS), help="directory for the table and JSON ('' = none)")
    return p.parse_args(argv)


def shape_of(args) -> Shape:
    return gpu_step.shape_of(args, TINY)


def llama(shape: Shape) -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(gpu_step.llama_config(shape))


def batches(shape: Shape, n: int) -> list[tuple]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        ids = torch.from_numpy(rng.integers(0, shape.vocab, size=(shape.batch, shape.seq)))
        out.append((ids, ids))
    return out


# -- the runs -------------------------------------------------------------------------------------
def _timed(step, data) -> tuple[float, float]:
    """(median seconds of the steps after two warm-up steps, seconds of the first one)."""
    start = time.perf_counter()
    step(*data[0])
    compile_s = time.perf_counter() - start
    step(*data[1])
    times = []
    for batch in data[2:]:
        start = time.perf_counter()
        step(*batch)  # returns a float: the step has finished
        times.append(time.perf_counter() - start)
    return statistics.median(times), compile_s


def xtrain_run(shape: Shape, data, mesh: dict, plan_of, lowering: str) -> dict:
    model = llama(shape)
    plan = dataclasses.replace(plan_of(model, mesh), precision="bf16")
    step = xtrain.compile(model, xtrain.Mesh(**mesh), optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                          plan=plan, loss_fn=lm_loss, lowering=lowering)
    seconds, compile_s = _timed(step, data)
    return {"step_s": seconds, "compile_s": compile_s, "model_flops": xtrain.observe.model_flops(step)}


def jax_jit_run(shape: Shape, data) -> dict:
    """The same model's pure JAX function, jitted as a JAX user would: data parallel over the
    devices by the batch's sharding, parameters replicated, bf16 compute by casting them."""
    module = llama(shape)
    model = wrap(module, torch.optim.AdamW(module.parameters(), lr=LR), lm_loss).model
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    params = {n: jnp.asarray(v) for n, v in model.initial_params().items()}
    buffers = {n: jnp.asarray(v) for n, v in model.initial_buffers().items()}
    key, tx = jax.random.key(0), optax.adamw(LR, weight_decay=0.01)

    def loss(params, buffers, key, batch):
        half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        return model.apply(half, buffers, key, batch, training=True)[0].astype(jnp.float32)

    @jax.jit
    def train(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, buffers, key, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    state = {"params": params, "opt": tx.init(params)}

    def step(*batch):
        batch = tuple(jax.device_put(np.asarray(x), split) for x in batch)
        state["params"], state["opt"], value = train(state["params"], state["opt"], batch)
        return float(value)

    seconds, compile_s = _timed(step, data)
    shaped = tuple(jax.ShapeDtypeStruct(tuple(x.shape), jnp.int64 if x.dtype == torch.int64 else x.dtype)
                   for x in data[0])
    return {"step_s": seconds, "compile_s": compile_s,
            "model_flops": flops.training_flops(loss, params, buffers, key, shaped)}


def runs(shape: Shape, devices: int, tensor: int):
    """(name, thunk) of every row."""
    fsdp_mesh = {"data": devices}
    out = [("xtrain fsdp", lambda d: xtrain_run(shape, d, fsdp_mesh, plans.fsdp, "explicit")),
           ("xla fsdp", lambda d: xtrain_run(shape, d, fsdp_mesh, plans.fsdp, "xla"))]
    if devices > 1 and tensor > 1:
        tp_mesh = {"data": devices // tensor, "tensor": tensor}
        out += [("xtrain tp", lambda d: xtrain_run(shape, d, tp_mesh, plans.megatron, "explicit")),
                ("xla tp", lambda d: xtrain_run(shape, d, tp_mesh, plans.megatron, "xla"))]
    return out + [("jax.jit", lambda d: jax_jit_run(shape, d))]


# -- the table ------------------------------------------------------------------------------------
def row(name: str, result: dict, shape: Shape, devices: int, peak: float | None) -> dict:
    tokens = shape.batch * shape.seq
    mfu = flops.mfu(result["model_flops"], result["step_s"], devices, peak) if peak else None
    return {"run": name, "step_ms": 1e3 * result["step_s"], "tokens_per_s": tokens / result["step_s"],
            "tflops_per_device": result["model_flops"] / result["step_s"] / devices / 1e12, "mfu": mfu,
            "compile_s": result["compile_s"], "model_flops": result["model_flops"]}


def table(rows: list[dict], title: str) -> str:
    lines = [f"# {title}", "", "| run | step ms | tokens/s | TFLOP/s per device | MFU (bf16 peak) | first step s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(f"| {r['run']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['tflops_per_device']:.3g} | "
                     f"{mfu} | {r['compile_s']:.1f} |")
    return "\n".join(lines) + "\n"


def describe(shape: Shape, devices: int, kind: str, params: int) -> str:
    size = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"
    return (f"Llama {size} ({shape.layers} layers, d={shape.hidden}, GQA {shape.heads}/{shape.kv_heads}, "
            f"vocab {shape.vocab}), bf16, batch {shape.batch} x {shape.seq}, {devices} x {kind} "
            f"({jax.devices()[0].platform}), jax {jax.__version__}")


def write(out: str, kind: str, text: str, rows: list[dict], shape: Shape) -> Path | None:
    if not out:
        return None
    slug = re.sub(r"[^A-Za-z0-9]+", "-", kind).strip("-").lower()
    path = Path(out) / f"accelerator_step_{slug}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.with_suffix(".json").write_text(json.dumps({"device": kind, "shape": dataclasses.asdict(shape),
                                                     "rows": rows}, indent=1))
    return path


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    xtrain.init()
    shape, devices = shape_of(args), jax.device_count()
    kind = jax.devices()[0].device_kind
    peak = peak_flops(kind, "bf16")
    data = batches(shape, args.steps + 2)
    rows = []
    wanted = {r.strip() for r in args.runs.split(",") if r.strip()}
    for name, run in runs(shape, devices, args.tensor or min(devices, 8)):
        if wanted and name not in wanted:
            continue
        rows.append(row(name, run(data), shape, devices, peak))
        print(json.dumps(rows[-1]), flush=True)
    title = describe(shape, devices, kind, sum(p.numel() for p in llama(shape).parameters()))
    text = table(rows, title)
    print(text)
    path = write(args.out, kind, text, rows, shape)
    if path:
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()

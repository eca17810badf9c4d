"""xtrain's blockwise attention kernel on a GPU, forward + backward, by block size, beside cuDNN's
fused kernel and XLA's plain attention: the measurement behind DEFAULT_BLOCK["gpu"].

    python benchmarks/gpu_attention.py prepare --bundle DIR    # any host (xtrain): one export per kernel
    python benchmarks/gpu_attention.py run --bundle DIR --out DIR   # the GPU host: JAX with its CUDA plugin

The shapes are benchmarks/gpu_step.py's Llama (TinyLlama's: 32 query heads, 4 key/value heads,
head dim 64) at batch 8 x 2048 tokens, bf16, causal. Each program is the gradient of
sum(attention(q, k, v) * cotangent) with respect to q, k and v (forward, then backward), jitted and
exported for CUDA here; `run` compiles each on the GPU and times it (median of 20 calls after 3).
Writes gpu_attention.json and gpu_attention.md to --out.
"""
from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from pathlib import Path

BATCH, LENGTH, HEADS, KV_HEADS, DIM = 8, 2048, 32, 4, 64
BLOCKS = (64, 128, 256, 512, 1024, 2048)


def _flops() -> float:
    """Causal attention's matmul FLOPs, forward (2) + backward (5, as FlashAttention-2 counts:
    the recomputed scores included), half of the square visible."""
    return 7 * 2 * BATCH * HEADS * LENGTH * LENGTH * DIM / 2


def _exports(cudnn_too: bool = True) -> dict:
    import jax
    import jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    from xtrain.aot.request import CUDNN_TARGETS
    from xtrain.ir.kernels import blockwise as kernel

    groups = HEADS // KV_HEADS
    scale = kernel.default_scale(DIM)
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (
        (BATCH, KV_HEADS, groups, LENGTH, DIM), (BATCH, KV_HEADS, LENGTH, DIM), (BATCH, KV_HEADS, LENGTH, DIM),
        (BATCH, KV_HEADS, groups, LENGTH, DIM))]

    def grads(attend):
        def loss(q, k, v, cot):
            return jnp.sum(attend(q, k, v).astype(jnp.float32) * cot.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    def blockwise(block):
        b = kernel.blocking_for(LENGTH, LENGTH, block, scale=scale, causal=True)
        return lambda q, k, v: kernel.blockwise(q, k, v, None, None, b)

    def library(implementation):  # jax.nn.dot_product_attention takes (batch, length, heads, dim)
        def attend(q, k, v):
            q2 = q.reshape(BATCH, HEADS, LENGTH, DIM).transpose(0, 2, 1, 3)
            out = jax.nn.dot_product_attention(q2, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), scale=scale,
                                               is_causal=True, implementation=implementation)
            return out.transpose(0, 2, 1, 3).reshape(q.shape)
        return attend

    out = {}
    for block in BLOCKS:
        out[f"blockwise {block}"] = jax.export.export(grads(blockwise(block)), platforms=("cuda",))(*shapes)
    out["xla"] = jax.export.export(grads(library("xla")), platforms=("cuda",))(*shapes)
    if not cudnn_too:
        return {name: e.serialize() for name, e in out.items()}
    saved = cudnn.check_cudnn_version, cudnn.check_compute_capability
    cudnn.check_cudnn_version, cudnn.check_compute_capability = (lambda: 91000), (lambda *a: True)
    try:  # traced here as on a GPU host (cuDNN's checks need its library); compiled on the GPU
        out["cudnn"] = jax.export.export(grads(library("cudnn")), platforms=("cuda",), disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(t) for t in CUDNN_TARGETS])(*shapes)
    finally:
        cudnn.check_cudnn_version, cudnn.check_compute_capability = saved
    return {name: e.serialize() for name, e in out.items()}


def prepare(args) -> None:
    bundle = Path(args.bundle)
    bundle.mkdir(parents=True, exist_ok=True)
    exports = _exports()
    (bundle / "attention.pkl").write_bytes(pickle.dumps(exports))
    print({k: len(v) for k, v in exports.items()})


def _time(name: str, blob: bytes, calls: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    exported = jax.export.deserialize(blob)
    start = time.perf_counter()
    compiled = jax.jit(exported.call).lower(*exported.in_avals).compile()
    compile_s = time.perf_counter() - start
    keys = jax.random.split(jax.random.key(0), len(exported.in_avals))
    args = [jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype) for k, a in zip(keys, exported.in_avals)]
    for _ in range(3):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    grads = [np.asarray(g, np.float32) for g in compiled(*args)]
    return {"ms": seconds * 1e3, "tflops": _flops() / seconds / 1e12, "compile_s": compile_s,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "grad_norms": [float(np.linalg.norm(g)) for g in grads]}


def run(args) -> None:
    import jax

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    exports = pickle.loads((Path(args.bundle) / "attention.pkl").read_bytes())
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": {}, "errors": {}}
    for name, blob in exports.items():
        print(name, flush=True)
        try:
            results["rows"][name] = _time(name, blob, args.calls)
        except Exception as e:  # noqa: BLE001 - the table says what failed
            results["errors"][name] = f"{type(e).__name__}: {str(e)[:2000]}"
        (out / "gpu_attention.json").write_text(json.dumps(results, indent=1))
    (out / "gpu_attention.md").write_text(table(results))
    print(table(results))


def table(r: dict) -> str:
    lines = [f"# Causal attention forward + backward on one {r['device']} (jax {r['jax']})", "",
             f"batch {BATCH} x {LENGTH} tokens, {HEADS} query / {KV_HEADS} key-value heads, head dim {DIM}, bf16; "
             "TFLOP/s count the causal half (forward 2, backward 5 matmuls' worth).", "",
             "| kernel | ms | TFLOP/s | temporaries MiB | compile s | grad norm (q) |", "|---|---|---|---|---|---|"]
    for name, x in r["rows"].items():
        lines.append(f"| {name} | {x['ms']:.2f} | {x['tflops']:.0f} | {x['temp_bytes'] / 2**20:.0f} | "
                     f"{x['compile_s']:.1f} | {x['grad_norms'][0]:.4g} |")
    lines += [f"\n{name} failed: `{e.splitlines()[0]}`" for name, e in r["errors"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--bundle", required=True)
    b = sub.add_parser("run")
    b.add_argument("--bundle", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--calls", type=int, default=20)
    args = p.parse_args(argv)
    prepare(args) if args.command == "prepare" else run(args)


if __name__ == "__main__":
    main()

"""xtrain's training step, built on a CPU host, compiled and run on one GPU: the deviceless compile
beside the on-device one, MFU, and PyTorch on the same GPU.

    python benchmarks/gpu_step.py prepare --bundle DIR [--tiny] [--layers N ...]   # any host, no GPU
    python benchmarks/gpu_step.py run --bundle DIR --out DIR [--steps N]          # the GPU host

`prepare` (xtrain, torch and JAX here) builds the model of benchmarks/accelerator_step.py (a 1.1B
Llama, TinyLlama's shape, on the meta device: no weights are made) and its step as `xtrain.aot`
does for one GPU of a p5e.48xlarge (an H200): the one assembly function, Plan(precision="bf16"),
exported for CUDA by jax.export. Two exports: with xtrain's blockwise attention (what a deviceless
compile builds) and with cuDNN's fused attention (what `xtrain.compile` picks on a GPU host; here
the CPU host stands in for the GPU's backend while tracing). It also writes the cost model's
prediction for this step on an H200 and the model FLOPs (xtrain.ir.analysis.flops).

`run` needs only JAX with its CUDA plugin, numpy, torch and transformers: the GPU host's own
releases (jax.export artifacts load in later JAX releases). It
  1. compiles the blockwise step without the GPU (xtrain/aot/_child.py in a child process with
     JAX_PLATFORMS=cpu and xtrain's GPU XLA flags, as `xtrain.aot.compile` does),
  2. compiles both steps on the GPU (the same flags) and compares memory and schedule with (1),
  3. runs each for `--steps` steps on random weights and batches: step time, tokens/s, MFU,
  4. trains the same Llama in PyTorch as its users do (bf16 autocast, AdamW, SDPA), eager and
     under torch.compile, for the ratio.
Writes gpu_step.json and gpu_step.md to --out.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHILD = HERE.parent / "xtrain" / "aot" / "_child.py"
LR = 1e-4


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """The Llama and batch (benchmarks/accelerator_step.py's)."""

    layers: int = 22
    hidden: int = 2048
    intermediate: int = 5632
    heads: int = 32
    kv_heads: int = 4
    vocab: int = 32000
    seq: int = 2048
    batch: int = 8


TINY = Shape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256, seq=32, batch=2)


def llama_config(shape: Shape):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.seq, bos_token_id=0,
                       eos_token_id=0)


def lm_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


# -- prepare (the CPU host) -----------------------------------------------------------------------
@contextlib.contextmanager
def _cudnn_stand_in():
    """Traces as on a GPU host: sdpa sees the GPU backend and cuDNN's checks pass (only the trace
    runs here; the export is compiled on the GPU)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    from xtrain.frontend import sdpa

    stand_ins = [(sdpa, "_backend", lambda: "gpu"), (cudnn, "check_cudnn_version", lambda: 91000),
                 (cudnn, "check_compute_capability", lambda *a: True)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in stand_ins]
    try:
        for module, name, value in stand_ins:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _export(shape: Shape, on_device: bool, precision: str = "bf16") -> dict:
    import jax
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM

    import xtrain
    from xtrain.aot import request
    from xtrain.aot.targets import GpuTarget
    from xtrain.frontend.torch_module import wrap
    from xtrain.ir.analysis import flops

    with torch.device("meta"):
        module = LlamaForCausalLM(llama_config(shape))
    trainable = wrap(module, torch.optim.AdamW(module.parameters(), lr=LR), lm_loss)
    ids = jax.ShapeDtypeStruct((shape.batch, shape.seq), np.int32)
    gpu = GpuTarget("p5e.48xlarge (one GPU)", "p5e.48xlarge", 1, 1, "h200")
    start = time.perf_counter()
    prepared = request.prepare(trainable, xtrain.Mesh(data=1), xtrain.Plan(precision=precision), (ids, ids), gpu,
                               on_device=on_device)
    seconds = time.perf_counter() - start
    args = (prepared.built.placed_state, prepared.batch)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    out = jax.eval_shape(prepared.built.program.train, *args, _lrs(prepared))
    state_out = len(jax.tree.leaves(out[0]))
    out_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(out)[0]]
    loss_index = next(i for i, p in enumerate(out_paths) if p.endswith("['loss']"))
    model = trainable.model
    model_flops = flops.model_flops(model, model.param_shapes(), model.buffer_shapes(), jax.random.key(0),
                                    (ids, ids))
    exported = prepared.job["exported"]
    return {"job": prepared.job, "paths": paths, "state_out": state_out, "loss_index": loss_index,
            "buffers": _buffers(shape),
            "model_flops": model_flops, "prepare_s": seconds, "plan": repr(prepared.built.plan),
            "cudnn_calls": jax.export.deserialize(exported).mlir_module().count("__cudnn$fmha")}


def _buffers(shape: Shape) -> dict:
    """The model's buffers' values (the rotary frequencies: a model on the meta device has none)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(llama_config(shape))
    return {f"model.rotary_emb.{name}": b.numpy() for name, b in rotary.named_buffers()}


def _lrs(prepared):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from xtrain.lowering import assembly

    lrs = assembly.lrs_shape(prepared.trainable)
    return jax.ShapeDtypeStruct(lrs.shape, lrs.dtype, sharding=NamedSharding(prepared.built.mesh, PartitionSpec()))


def _predicted(shape: Shape) -> dict:
    """The cost model's step for one H200 (the p5e profile, one device)."""
    import jax
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM

    from xtrain.cost import hardware, search
    from xtrain.frontend.torch_module import wrap

    with torch.device("meta"):
        module = LlamaForCausalLM(llama_config(shape))
    t = wrap(module, torch.optim.AdamW(module.parameters(), lr=LR), lm_loss)
    profile, _ = hardware.target("p5e.48xlarge")
    ids = jax.ShapeDtypeStruct((shape.batch, shape.seq), np.int32)
    result = search.search(t.model, t.tx, (ids, ids), profile, 1, structure=t.structure, prune_remat=False,
                           candidate_list=[search.Candidate(data=1, precision="bf16")])
    p = result.rows[0].prediction
    return {"step_s": p.step_s, "memory_bytes": p.memory_bytes, "mfu": p.mfu, "tokens_per_s": p.tokens_per_s,
            "reason": result.rows[0].reason}


# what `prepare` can export: the deviceless compile's step and the GPU host's (cuDNN attention)
# under each precision policy
VARIANTS = {"blockwise": "bf16", "cudnn": "bf16", "fp8": "fp8"}


def prepare(args) -> None:
    import jax
    import torch

    import xtrain
    from xtrain.runtime import backends

    xtrain.init()
    shape = shape_of(args)
    bundle = Path(args.bundle)
    bundle.mkdir(parents=True, exist_ok=True)
    wanted = set(args.variants.split(","))
    unknown = wanted - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: {sorted(unknown)} are not among {list(VARIANTS)}")
    variants = {"blockwise": _export(shape, on_device=False)} if "blockwise" in wanted else {}
    with _cudnn_stand_in():
        for name in (n for n in VARIANTS if n != "blockwise" and n in wanted):
            variants[name] = _export(shape, on_device=True, precision=VARIANTS[name])
    with _cudnn_stand_in():  # the cost model on the step the GPU host builds (cuDNN attention)
        predicted = _predicted(shape)
    meta = {"shape": dataclasses.asdict(shape), "flags": list(backends.cuda_xla_flags()), "predicted": predicted,
            "predicted_blockwise": _predicted(shape) if "blockwise" in wanted else None,
            "host": {"jax": jax.__version__, "torch": torch.__version__}}
    (bundle / "steps.pkl").write_bytes(pickle.dumps(variants))
    (bundle / "meta.json").write_text(json.dumps(meta, indent=1))
    for name, v in variants.items():
        print(f"{name}: prepared in {v['prepare_s']:.1f} s, {len(v['job']['exported']) / 1e6:.1f} MB exported, "
              f"{v['cudnn_calls']} cuDNN calls, model FLOPs {v['model_flops']:.4g}, plan {v['plan']}")
    print(json.dumps(meta["predicted"]))


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """--layers, --hidden, ... (every Shape field), each overriding the base shape."""
    for field in dataclasses.fields(Shape):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=None)


def shape_of(args, tiny: Shape = TINY) -> Shape:
    """The Shape of parsed arguments: `tiny` under --tiny, else the default, with the fields given."""
    base = tiny if args.tiny else Shape()
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Shape) if getattr(args, f.name) is not None}
    return dataclasses.replace(base, **given)


# -- run (the GPU host) ---------------------------------------------------------------------------
def _flags_accepted(flags: list[str]) -> list[str]:
    """The flags this XLA knows: one CPU start in a child per rejected flag dropped."""
    kept = list(flags)
    while kept:
        env = {**os.environ, "XLA_FLAGS": " ".join(kept), "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                              text=True, timeout=300)
        if proc.returncode == 0:
            return kept
        bad = [f for f in kept if f.split("=")[0].lstrip("-") in proc.stderr]
        if not bad:
            raise RuntimeError(f"XLA refuses the flags {kept}:\n{proc.stderr[-2000:]}")
        print(f"this XLA does not take {bad[0]}: dropped", flush=True)
        kept.remove(bad[0])
    return kept


def _deviceless(job: dict, flags: list[str], work: Path) -> dict:
    jobs, results = work / "jobs.pkl", work / "results.pkl"
    jobs.write_bytes(pickle.dumps([job]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags), TF_CPP_MIN_LOG_LEVEL="2")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(CHILD), str(jobs), str(results)], env=env, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode or not results.exists():
        return {"error": proc.stderr[-3000:]}
    result = pickle.loads(results.read_bytes())[0]
    result.pop("executable", None)
    result["wall_s"] = time.perf_counter() - start
    return result


def schedule_facts(text: str) -> dict:
    """What the scheduled per-device HLO is made of: GEMM kinds, fusions, custom calls, the peak."""
    entry = text[text.rfind("ENTRY"):]
    calls = Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    fusions = Counter(re.findall(r'kind=(k\w+)', entry))
    return {"instructions": entry.count("\n"), "fusions": dict(fusions), "custom_calls": dict(calls),
            "cublas_gemms": sum(n for t, n in calls.items() if "cublas" in t),
            "triton_gemms": len(re.findall(r'"kind":"__triton(?:_nested)?_gemm(?:_fusion)?"', text)),
            "triton_fusions": text.count('"kind":"__triton"'),
            "cudnn_attention": sum(n for t, n in calls.items() if "fmha" in t),
            "fp8_gemms": sum(n for t, n in calls.items() if "f8" in t) + _fp8_fusions(text),
            "while_loops": entry.count(" while(")}


def _fp8_fusions(text: str) -> int:
    """GEMM fusions (Triton's) with an FP8 operand."""
    types = dict(re.findall(r"%([\w.\-]+) = ([a-z0-9]+)\[", text))
    count = 0
    for line in text.splitlines():
        if re.search(r'"kind":"__triton(?:_nested)?_gemm(?:_fusion)?"', line):
            operands = re.search(r"fusion\(([^)]*)\)", line)
            names = re.findall(r"%([\w.\-]+)", operands.group(1)) if operands else []
            count += any(types.get(n, "").startswith("f8") for n in names)
    return count


def _state_values(avals, paths, buffers: dict, key):
    """Random initial state: weights N(0, 0.02), norms 1, the buffers' values, optimizer state
    and counters 0 (what HF's initialisation does, up to the seed)."""
    import jax
    import jax.numpy as jnp

    values = []
    for i, (aval, path) in enumerate(zip(avals, paths)):
        name = re.search(r"\['([^']+)'\]", path)
        if path.startswith("[0].buffers"):
            values.append(jnp.asarray(buffers[name.group(1)], aval.dtype))
        elif not path.startswith("[0].params") or not jnp.issubdtype(aval.dtype, jnp.floating):
            values.append(jnp.zeros(aval.shape, aval.dtype))  # optimizer moments, step counters, the key's data
        elif name.group(1).endswith("norm.weight"):
            values.append(jnp.ones(aval.shape, aval.dtype))
        else:
            values.append((0.02 * jax.random.normal(jax.random.fold_in(key, i), aval.shape)).astype(aval.dtype))
    return values


def _on_device(variant: dict, shape: Shape, steps: int, peak: float | None, model_flops: float) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    job = variant["job"]
    exported = jax.export.deserialize(job["exported"])
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(job["shape"]), job["axes"])
    shardings = [NamedSharding(mesh, spec, memory_kind=kind) for spec, kind in job["specs"]]
    avals = exported.in_avals
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(avals, shardings)]
    start = time.perf_counter()
    compiled = jax.jit(exported.call, donate_argnums=tuple(range(job["donated"]))).lower(*structs).compile(
        compiler_options=job.get("compiler_options"))
    compile_s = time.perf_counter() - start
    stats = compiled.memory_analysis()
    memory = {name: int(getattr(stats, f"{name}_size_in_bytes")) for name in (
        "argument", "output", "alias", "temp", "generated_code")}
    text = compiled.as_text()
    donated, n_state = job["donated"], variant["state_out"]
    state = [jax.device_put(v, s) for v, s in zip(
        _state_values(avals[:donated], variant["paths"], variant["buffers"], jax.random.key(0)), shardings[:donated])]
    rng = np.random.default_rng(0)
    rest_avals, rest_shardings = avals[donated:], shardings[donated:]

    def batch():
        ids = rng.integers(0, shape.vocab, size=(shape.batch, shape.seq)).astype(np.int32)
        out = []
        for a, s in zip(rest_avals, rest_shardings):
            value = ids if tuple(a.shape) == ids.shape else np.full(a.shape, LR, a.dtype)  # the lrs
            out.append(jax.device_put(value, s))
        return out

    losses, times = [], []
    for i in range(steps + 2):
        b = batch()
        t0 = time.perf_counter()
        outs = compiled(*state, *b)
        state = outs[:n_state]
        loss = float(outs[variant["loss_index"]])  # the user's step returns the loss: waits for the step
        if i >= 2:
            times.append(time.perf_counter() - t0)
        losses.append(loss)
    step_s = statistics.median(times)
    peak_bytes = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    tokens = shape.batch * shape.seq
    return {"compile_s": compile_s, "memory": memory, "schedule": schedule_facts(text), "step_s": step_s,
            "tokens_per_s": tokens / step_s, "tflops": model_flops / step_s / 1e12,
            "mfu": model_flops / step_s / peak if peak else None, "losses": losses,
            "peak_bytes_in_use": peak_bytes, "text_bytes": len(text)}, text


def _torch_run(shape: Shape, steps: int, compiled: bool, model_flops: float, peak: float | None) -> dict:
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    model = LlamaForCausalLM(llama_config(shape)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    forward = torch.compile(model) if compiled else model
    rng = np.random.default_rng(0)
    times, losses, first = [], [], None
    for i in range(steps + 2):
        ids = torch.from_numpy(rng.integers(0, shape.vocab, size=(shape.batch, shape.seq))).cuda()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if i == 0:
            first = time.perf_counter() - t0
        if i >= 2:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    out = {"step_s": step_s, "tokens_per_s": shape.batch * shape.seq / step_s, "first_step_s": first,
           "tflops": model_flops / step_s / 1e12, "mfu": model_flops / step_s / peak if peak else None,
           "losses": losses, "peak_bytes_in_use": torch.cuda.max_memory_allocated(),
           "attention": model.config._attn_implementation}
    del model, opt, forward
    torch.cuda.empty_cache()
    return out


# dense bf16 peak of the GPUs this runs on (NVIDIA datasheets; xtrain.cost.hardware holds the same)
PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def run(args) -> None:
    bundle, out = Path(args.bundle), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((bundle / "meta.json").read_text())
    variants = pickle.loads((bundle / "steps.pkl").read_bytes())
    shape = Shape(**meta["shape"])
    saved = out / "gpu_step.json"  # each part may run in a process of its own (GPU memory, peaks): merged
    results: dict = json.loads(saved.read_text()) if saved.exists() else {"meta": meta, "errors": {}}

    def save():
        (out / "gpu_step.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "gpu_step.md").write_text(table(results))

    flags = _flags_accepted(meta["flags"])
    results["flags"] = flags
    ptxas = subprocess.run("which ptxas; ptxas --version | tail -1", shell=True, capture_output=True, text=True)
    results["ptxas"] = ptxas.stdout.strip()
    parts = set(args.parts.split(","))
    if "deviceless" in parts:
        print("deviceless compile ...", flush=True)
        with tempfile.TemporaryDirectory() as work:
            r = _deviceless(variants["blockwise"]["job"], flags, Path(work))
        if "error" in r:
            results["errors"]["deviceless"] = r["error"]
        else:
            text = r.pop("text")
            if args.keep_text:
                (out / "deviceless.hlo.txt").write_text(text)
            results["deviceless"] = {**r, "schedule": schedule_facts(text)}
        save()
    if not parts & {*VARIANTS, "torch_eager", "torch_compile"}:  # no GPU needed: done
        print(table(results))
        return
    os.environ["XLA_FLAGS"] = " ".join(flags)
    import torch

    results["device"] = torch.cuda.get_device_name()  # torch does not hold the GPU's memory as JAX does
    peak = next((v for k, v in PEAKS.items() if k in results["device"]), None)
    results["peak"] = peak
    flops_of = next(iter(variants.values()))["model_flops"]  # the same model in every variant
    for name in VARIANTS:
        if name not in parts or name not in variants:
            continue
        import jax

        results["jax"] = jax.__version__
        print(f"xtrain {name} on the GPU ...", flush=True)
        try:
            r, text = _on_device(variants[name], shape, args.steps, peak, flops_of)
            if args.keep_text:
                (out / f"{name}.hlo.txt").write_text(text)
            results[f"xtrain {name}"] = r
        except Exception as e:  # noqa: BLE001 - the table says what failed
            results["errors"][f"xtrain {name}"] = f"{type(e).__name__}: {str(e)[:3000]}"
        jax.clear_caches()
        save()
    for name, compiled in (("torch eager", False), ("torch.compile", True)):
        if name.replace(" ", "_").replace(".", "_") not in parts:
            continue
        print(f"{name} ...", flush=True)
        try:
            results[name] = _torch_run(shape, args.steps, compiled, flops_of, peak)
        except Exception as e:  # noqa: BLE001
            results["errors"][name] = f"{type(e).__name__}: {str(e)[:3000]}"
        save()
    print(table(results))


def _gib(b) -> str:
    return "" if b is None else f"{b / 2**30:.2f}"


def table(r: dict) -> str:
    meta, s = r["meta"], r["meta"]["shape"]
    lines = [f"# xtrain's step on one {r.get('device', 'GPU')}: deviceless and on-device compile, MFU, PyTorch beside it",
             "", f"Llama {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads ({s['kv_heads']} kv), "
             f"vocab {s['vocab']}, batch {s['batch']} x {s['seq']} tokens, bf16 compute, fp32 AdamW state. "
             f"GPU host: jax {r.get('jax')}, ptxas {r.get('ptxas', '').splitlines()[-1:] or ''}; steps built on a CPU "
             f"host with jax {meta['host']['jax']}. XLA flags: `{' '.join(r.get('flags', []))}`.", "",
             "| run | step ms | tokens/s | TFLOP/s | MFU | peak GiB | compile s (torch: first step) |", "|---|---|---|---|---|---|---|"]
    for name in (*(f"xtrain {v}" for v in VARIANTS), "torch eager", "torch.compile"):
        x = r.get(name)
        if x:
            mfu = f"{x['mfu']:.1%}" if x.get("mfu") else ""
            lines.append(f"| {name} | {x['step_s'] * 1e3:.1f} | {x['tokens_per_s']:,.0f} | {x['tflops']:.0f} | {mfu} | "
                         f"{_gib(x.get('peak_bytes_in_use'))} | {x.get('compile_s', x.get('first_step_s', 0)):.1f} |")
    p = meta["predicted"]
    lines += ["", f"Cost model (p5e profile, one H200), the cuDNN step: {p['step_s'] * 1e3:.1f} ms, "
              f"{p['tokens_per_s']:,.0f} tokens/s, MFU {p['mfu']:.1%}, memory {_gib(p['memory_bytes'])} GiB."]
    if meta.get("predicted_blockwise"):
        q = meta["predicted_blockwise"]
        lines.append(f"The blockwise step (as traced on a CPU host): {q['step_s'] * 1e3:.1f} ms, memory "
                     f"{_gib(q['memory_bytes'])} GiB.")
    d, b = r.get("deviceless"), r.get("xtrain blockwise")
    if d and b:
        lines += ["", "| memory (GiB) | deviceless | on the GPU | ratio |", "|---|---|---|---|"]
        for k in ("argument", "output", "alias", "temp"):
            ratio = d["memory"][k] / b["memory"][k] if b["memory"][k] else float("nan")
            lines.append(f"| {k} | {_gib(d['memory'][k])} | {_gib(b['memory'][k])} | {ratio:.3f} |")
        if d.get("schedule"):
            lines += ["", "| schedule | deviceless | on the GPU |", "|---|---|---|"]
            for k in ("instructions", "cublas_gemms", "triton_gemms", "triton_fusions", "fp8_gemms", "while_loops"):
                lines.append(f"| {k} | {d['schedule'][k]} | {b['schedule'][k]} |")
            lines.append(f"| fusions | {d['schedule']['fusions']} | {b['schedule']['fusions']} |")
        lines.append(f"\nDeviceless compile {d['seconds']:.1f} s, on the GPU {b['compile_s']:.1f} s.")
    for name, e in r.get("errors", {}).items():
        lines.append(f"\n{name} failed: `{e.splitlines()[-1] if e else ''}`")
    return "\n".join(lines) + "\n"


def report(args) -> None:
    """The table again from a run's gpu_step.json, schedules re-read from its HLO texts."""
    out = Path(args.out)
    results = json.loads((out / "gpu_step.json").read_text())
    for name, key in (("deviceless", "deviceless"), *((v, f"xtrain {v}") for v in VARIANTS)):
        text = out / f"{name}.hlo.txt"
        if text.exists() and key in results:
            results[key]["schedule"] = schedule_facts(text.read_text())
    (out / "gpu_step.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "gpu_step.md").write_text(table(results))
    print(table(results))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--bundle", required=True)
    a.add_argument("--tiny", action="store_true")
    a.add_argument("--variants", default="blockwise,cudnn,fp8", help=f"which of {list(VARIANTS)} to export")
    add_shape_args(a)
    b = sub.add_parser("run")
    b.add_argument("--bundle", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--parts", default="deviceless,blockwise,cudnn,fp8,torch_eager,torch_compile",
                   help="what to run (each in a process of its own gives each its own GPU memory peak)")
    b.add_argument("--keep-text", action="store_true", help="write the scheduled HLO texts")
    c = sub.add_parser("report")
    c.add_argument("--out", required=True, help="a run's --out (its gpu_step.json and, with --keep-text, HLO)")
    args = p.parse_args(argv)
    {"prepare": prepare, "run": run, "report": report}[args.command](args)


if __name__ == "__main__":
    main()

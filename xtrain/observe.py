"""Training observability: progress bar, metrics log (JSONL, TensorBoard), MFU, plots, profiles.

    monitor = xtrain.observe.Monitor(step, total_steps=300, metrics="runs/metrics.jsonl")
    for i, batch in zip(range(300), loader):
        with monitor.step(tokens=batch_tokens) as rec:
            rec.update(step(*batch))                # floats: the step has finished
    monitor.close()

An MoE model's step also returns its tokens per expert per layer ("expert_tokens"); the monitor
logs their max and mean over experts and the worst layer's max / mean (`expert_load`).
    xtrain.observe.plot(monitor.history, "runs/train.png")

MFU = model FLOPs per step / (step time x devices x dense peak FLOP/s of one device), with
model FLOPs as xtrain.ir.analysis.flops defines them for `xtrain plan` and the benchmarks too: counted
in the traced graph of the model's forward and backward pass on the global batch
(`model_flops`): 2·M·N·K per matmul (dot_general) and the equivalent per convolution, scan
bodies times their length, i.e. 6N + attention per token for a transformer (no optimizer, no
recompute, nothing counted twice for replicated work). XLA's compiled cost analysis is not
used: it counts a `scan` body once, not once per layer. Where the peak is unknown (CPU), the
achieved TFLOP/s is shown instead.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import numpy as np

from xtrain.errors import OptionsError
from xtrain.ir.analysis import flops
from xtrain.cost.hardware import peak_flops


# -- model FLOPs from the traced graph --------------------------------------------------------

def matmul_flops(jaxpr) -> float:
    """FLOPs of every dot_general and convolution in `jaxpr` (a Jaxpr or ClosedJaxpr), nested
    calls included; a scan body counts `length` times (xtrain.ir.analysis.flops)."""
    return flops.count(jaxpr).matmul


def model_flops(step, *batch: Any) -> float:
    """Global model FLOPs of one training step (forward + backward over the whole global
    batch) of a compiled xtrain step, for `batch`'s shapes or the last batch trained on: the
    one definition of xtrain.ir.analysis.flops, shared with `xtrain plan` and the benchmarks."""
    shapes = step.batch_shapes(batch)  # builds a plan="auto" step first
    state = step.state
    return flops.model_flops(step.model, state.params, state.buffers, state.key, shapes, frozen=state.frozen)


# -- utilisation --------------------------------------------------------------------------

def utilisation(flops_per_step: float, seconds: float, devices: int, peak_per_device: float | None) -> dict:
    """{"tflops_s": achieved TFLOP/s over all devices, "mfu": fraction of peak, or None}."""
    mfu = flops.mfu(flops_per_step, seconds, devices, peak_per_device) if peak_per_device else None
    return {"tflops_s": flops_per_step / seconds / 1e12, "mfu": mfu}


def detect_peak(dtype: str = "float32") -> float | None:
    """Dense peak FLOP/s of one device of this backend (None on CPU and unknown devices)."""
    return peak_flops(jax.devices()[0].device_kind, dtype)


# -- the monitor ----------------------------------------------------------------------------

class Monitor:
    """Times steps and reports loss, tokens/s, step time and MFU to a progress bar, a JSONL file
    and TensorBoard; starts and stops a profiler trace over a range of steps.

    Args:
        step: the compiled xtrain step (for its FLOPs and device count), or None.
        total_steps: the progress bar's length.
        flops_per_step: model FLOPs of one step; default: `model_flops(step)` after the first step.
        dtype: the compute dtype whose peak MFU is measured against ("float32", "bfloat16",
            "tfloat32": XLA runs float32 matmuls on A100/H100 tensor cores as TF32 by default).
        metrics: path of the JSONL log (one object per step), or None; rewritten by a run that
            starts at step 0, appended to by a resumed one (`start` > 0).
        tensorboard: directory for TensorBoard event files, or None (needs `tensorboard` installed).
        progress: show a tqdm bar (only process 0 shows or writes anything).
        profile_steps: (first, last) step indices, inclusive, to trace with jax.profiler.
        profile_dir: where the trace goes.
        start: the index of the first step (a resumed run continues its numbering).
    """

    def __init__(self, step=None, *, total_steps: int | None = None, flops_per_step: float | None = None,
                 dtype: str = "float32", metrics: str | Path | None = None, tensorboard: str | Path | None = None,
                 progress: bool = True, profile_steps: tuple[int, int] | None = None,
                 profile_dir: str | Path = "runs/profile", start: int = 0):
        self.train_step, self.flops_per_step = step, flops_per_step
        self.devices = step.mesh.size if step is not None else jax.device_count()
        self.peak = detect_peak(dtype)
        self.lead = jax.process_index() == 0
        self.index, self.history = start, []
        self.profile_steps, self.profile_dir, self._tracing = _check_range(profile_steps), Path(profile_dir), False
        self._log = _open_log(metrics, append=start > 0) if metrics and self.lead else None
        self._board = _open_board(tensorboard) if tensorboard and self.lead else None
        self._bar = _open_bar(total_steps, start) if progress and self.lead else None

    @contextlib.contextmanager
    def step(self, tokens: int | None = None, lr: float | None = None) -> Iterator[dict]:
        """Times the block as one step. Set rec["loss"] inside (a float, so the step has
        finished when the block ends); `tokens` processed and `lr` are logged if given."""
        self._profile_start()
        rec: dict[str, Any] = {"step": self.index}
        start = time.perf_counter()
        yield rec
        rec["step_time_s"] = time.perf_counter() - start
        self._profile_stop()
        self._finish(rec, tokens, lr)

    def _finish(self, rec: dict, tokens: int | None, lr: float | None) -> None:
        if rec.get("expert_tokens"):
            rec.update(expert_load(rec["expert_tokens"]))
            rec["expert_tokens"] = {p: [int(c) for c in counts] for p, counts in rec["expert_tokens"].items()}
        for name in ("expert_dropped", "attention_blocks"):  # per-layer counts: plain ints for the log
            if isinstance(rec.get(name), dict):
                rec[name] = {p: np.asarray(c).tolist() for p, c in rec[name].items()}
        if tokens is not None:
            rec["tokens_per_s"] = tokens / rec["step_time_s"]
        if lr is not None:
            rec["lr"] = lr
        if self.flops_per_step is None and self.train_step is not None:
            self.flops_per_step = model_flops(self.train_step)
        if self.flops_per_step:
            rec.update(utilisation(self.flops_per_step, rec["step_time_s"], self.devices, self.peak))
        self.history.append(rec)
        self.index += 1
        self._emit(rec)

    def _emit(self, rec: dict) -> None:
        if self._log is not None:
            self._log.write(json.dumps(rec) + "\n")
            self._log.flush()
        if self._board is not None:
            for key, value in rec.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._board.add_scalar(key, value, rec["step"])
        if self._bar is not None:
            self._bar.set_postfix_str(format_postfix(rec), refresh=False)
            self._bar.update(1)

    def _profile_start(self) -> None:
        if self.profile_steps and self.index == self.profile_steps[0] and self.lead:
            self.profile_dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.profile_dir))
            self._tracing = True

    def _profile_stop(self) -> None:
        if self._tracing and self.index == self.profile_steps[1]:
            self._end_trace()

    def _end_trace(self) -> None:
        jax.profiler.stop_trace()
        self._tracing = False
        first, last = self.profile_steps
        # the trace lands in a per-run folder under profile_dir; TensorBoard's profile plugin
        # (or Perfetto, from the .trace.json.gz) opens it
        note = (f"profile of steps {first}-{last} written under {self.profile_dir.resolve()} "
                f"(tensorboard --logdir {self.profile_dir})")
        if self._bar is not None:
            self._bar.write(note, file=sys.stderr)  # above the progress bar, not through it
        else:
            print(note, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stops an open trace and closes the bar, the log and TensorBoard."""
        if self._tracing:
            self._end_trace()
        for handle in (self._bar, self._log, self._board):
            if handle is not None:
                handle.close()


def expert_load(tokens: Mapping[str, Any]) -> dict:
    """Routing balance of one step from its tokens per expert per MoE layer (`step(...)
    ["expert_tokens"]`): the most and the mean tokens any expert got, and max / mean of the
    worst layer (1.0: every expert got as many)."""
    counts = [np.asarray(c, np.float64) for c in tokens.values()]
    return {"expert_tokens_max": float(max(c.max() for c in counts)),
            "expert_tokens_mean": float(np.mean([c.mean() for c in counts])),
            "expert_imbalance": float(max(c.max() / max(c.mean(), 1e-12) for c in counts))}


def format_postfix(rec: dict) -> str:
    """The progress bar's text for one step record."""
    parts = [f"loss={rec['loss']:.4f}" if "loss" in rec else None,
             f"tok/s={rec['tokens_per_s']:,.0f}" if "tokens_per_s" in rec else None,
             f"step={1e3 * rec['step_time_s']:.1f}ms"]
    if "expert_imbalance" in rec:
        parts.append(f"experts max/mean={rec['expert_imbalance']:.2f}")
    if rec.get("mfu") is not None:
        parts.append(f"MFU={100 * rec['mfu']:.1f}%")
    elif "tflops_s" in rec:
        parts.append(f"{rec['tflops_s']:.3f} TFLOP/s")
    return " ".join(p for p in parts if p)


def _check_range(steps: tuple[int, int] | None) -> tuple[int, int] | None:
    if steps is not None and not (len(steps) == 2 and 0 <= steps[0] <= steps[1]):
        raise OptionsError(f"profile_steps={steps!r}: give (first, last) step indices with 0 <= first <= last")
    return tuple(steps) if steps is not None else None


def _open_log(path: str | Path, append: bool):
    """A run from step 0 starts a new log; a resumed run continues its log."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("a" if append else "w")


class _Board:
    """Scalars to TensorBoard event files, with TensorBoard's own writer (no torch involved)."""

    def __init__(self, directory: str | Path):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as err:
            raise ImportError(f"Monitor(tensorboard={str(directory)!r}) needs the tensorboard package "
                              f"(pip install tensorboard); or leave tensorboard=None ({err})") from None
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._writer = EventFileWriter(str(directory))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
        self._writer.add_event(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def close(self) -> None:
        self._writer.close()


def _open_board(directory: str | Path) -> _Board:
    return _Board(directory)


def _open_bar(total: int | None, start: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step")


# -- reading logs and plotting ----------------------------------------------------------------

def read_metrics(path: str | Path) -> list[dict]:
    """The records of a JSONL metrics log, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot(history: list[dict], path: str | Path, title: str = "training") -> Path:
    """Writes a PNG of loss and throughput (tokens/s, from the second step: the first one
    compiles) over steps; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, (ax_loss, ax_speed) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_loss.plot(steps, [r.get("loss", math.nan) for r in history], color="tab:blue")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(title)
    timed = history[1:] or history  # the first step of a run includes compilation
    ax_speed.plot([r["step"] for r in timed], [r.get("tokens_per_s", math.nan) for r in timed], color="tab:green")
    ax_speed.set_ylabel("tokens / s")
    ax_speed.set_xlabel("step")
    for ax in (ax_loss, ax_speed):
        ax.grid(alpha=0.3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

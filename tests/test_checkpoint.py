"""Checkpoints: resume in a new process bit-identically, restore onto other meshes and plans
(continuing under the parity standard), atomic saves (a save killed mid-write), async saves,
keep-last-N, export to torch, and the errors a wrong checkpoint gives."""
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import xtrain
from xtrain import plans
from xtrain.checkpoint import CheckpointError, CheckpointManager, CheckpointOptions, read_manifest
from xtrain.errors import OptionsError
from xtrain.testing import assert_parity, torch_reference
from xtrain.testing.parity import ParityResult

from models import GPT, MLP, mlp_batches, token_batches

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 240


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def compile_gpt(mesh: dict, plan=None):
    torch.manual_seed(0)  # the initial weights of the saved run (overwritten on load)
    model = GPT()
    return model, xtrain.compile(model, xtrain.Mesh(**mesh), optimizer=adamw(model.parameters()),
                                 plan=plan(model, mesh) if plan else None)


@functools.cache
def saved_run(root: str):
    """4 steps under data=8, saved after step 2 (the save leaves the run untouched)."""
    _, step = compile_gpt({"data": 8})
    batches = token_batches(n=8)
    losses = [step(*b)["loss"] for b in batches[:2]]
    step.save(Path(root) / "step_2", extra={"next_batch": 2, "note": "dp8"})
    losses += [step(*b)["loss"] for b in batches[2:4]]
    return step, losses, step.state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    step, losses, state = saved_run(str(root))
    return root / "step_2", step, losses, state


def worker_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.pop("JAX_NUM_CPU_DEVICES", None)
    # XLA_FLAGS stays: conftest's compile flags (LLVM -O0) shorten the workers' compiles too
    return env


def run_worker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TESTS / "_ckpt_worker.py"), *map(str, args)], env=worker_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)


# -- resume ----------------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_resume_in_a_new_process_is_bit_identical(saved, tmp_path):
    path, _, losses, state = saved
    out = tmp_path / "resumed.json"
    proc = run_worker("resume", path, out, "--steps", 2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["extra"] == {"next_batch": 2, "note": "dp8"} and result["step_count"] == 4
    assert result["losses"] == losses[2:], (result["losses"], losses)
    resumed = load_file(str(out.with_suffix(".safetensors")))
    assert resumed.keys() == state.keys()
    different = [k for k in state if not torch.equal(resumed[k], state[k])]
    assert not different, f"parameters differ after resuming: {different}"


@pytest.mark.e2e
def test_checkpoint_holds_every_train_state_field_under_logical_names(saved):
    manifest = read_manifest(saved[0])
    names = set(manifest["tensors"])
    assert {"step", "key", "params/tok.weight", "params/blocks.0.attn.q.weight",
            "opt_state/0/mu/tok.weight", "opt_state/0/nu/blocks.1.mlp.2.weight"} <= names
    assert manifest["step"] == 2 and manifest["processes"] == 1
    assert manifest["tensors"]["params/tok.weight"]["shape"] == [64, 32]
    # replicated under data=8: each tensor is stored once, not once per device
    assert all(len(t["pieces"]) == 1 for t in manifest["tensors"].values())


# -- resharding ------------------------------------------------------------------------------
@functools.cache
def reference():
    torch.manual_seed(0)
    return torch_reference(GPT(), adamw, token_batches(n=8)[:4])


def fsdp(model, mesh):
    return plans.fsdp(model, mesh)


def megatron(model, mesh):
    return plans.megatron(model, mesh, example=token_batches(n=1)[0])


@pytest.mark.e2e
@pytest.mark.parametrize("mesh,plan", [({"data": 4, "tensor": 2}, megatron), ({"data": 8}, fsdp)],
                         ids=["tp2xdp4", "zero3"])
def test_restore_under_another_mesh_and_plan_continues_under_parity(saved, mesh, plan):
    path, _, losses, _ = saved
    model, step = compile_gpt(mesh, plan)
    assert step.load(path)["next_batch"] == 2 and step.step_count == 2
    specs = {n: s for n, s in step.param_specs.items() if s}
    assert specs, "the plan must shard some parameters for this test to reshard"
    after = [step(*b)["loss"] for b in token_batches(n=8)[2:4]]
    result = ParityResult(losses[:2] + after, reference()[0], step.state_dict(), reference()[1], 5e-5)
    assert_parity(result)


# -- atomic saves ----------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    proc = run_worker("killed", tmp_path, tmp_path / "unused.json")
    output = proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGXFSZ, output  # killed by the kernel inside the write
    assert "saving step 4" in output and "was not killed" not in output
    manager = CheckpointManager(tmp_path)
    assert manager.latest() == tmp_path / "step_00000002"
    partial = tmp_path / "step_00000004.partial"
    assert partial.is_dir()
    with pytest.raises(CheckpointError, match=r"step_00000004\.partial is a partial checkpoint .* missing "
                                              r"shards-00000\.safetensors and index-00000\.json \(process 0 did not finish writing its shards\); "
                                              r"manifest\.json; COMMITTED"):
        read_manifest(partial)
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*step_00000004; an unfinished save of it is at "
                                              r".*step_00000004\.partial"):
        read_manifest(tmp_path / "step_00000004")
    _, step = compile_gpt({"data": 8})
    assert manager.restore(step) == {"next_batch": 2} and step.step_count == 2


def stop_mid_save(proc: subprocess.Popen, root: Path) -> Path:
    """Stops `proc` (SIGSTOP) at a moment when a save has started and not committed; returns
    the partial directory. Running saves back to back, it is mid-save most of the time."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if (root / "step_00000001" / "COMMITTED").exists():
            proc.send_signal(signal.SIGSTOP)
            partial = [p for p in root.glob("*.partial") if any(p.glob("shards-*"))]
            if partial:
                return partial[0]
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.002)
    raise AssertionError(f"never caught the saving process mid-save: {proc.communicate()}")


@pytest.mark.multiprocess
def test_a_save_killed_by_the_test_is_rejected_and_the_last_complete_one_loads(saved, tmp_path):
    cmd = [sys.executable, str(TESTS / "_ckpt_worker.py"), "save-loop", str(tmp_path), str(tmp_path / "unused.json")]
    proc = subprocess.Popen(cmd, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        partial = stop_mid_save(proc, tmp_path)
        proc.kill()
    finally:
        proc.kill()
        proc.communicate()
    with pytest.raises(CheckpointError, match=rf"{partial.name} is a partial checkpoint .* missing "):
        read_manifest(partial)
    latest = CheckpointManager(tmp_path).latest()
    assert latest is not None and latest.name < partial.name
    step = saved[1]
    step.load(saved[0])
    expected = step.state_dict()
    assert step.load(latest) == {"next_batch": 2} and step.step_count == 2
    got = step.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.e2e
def test_async_save_and_keep_last_n(tmp_path):
    mlp = MLP()
    step = xtrain.compile(mlp, xtrain.Mesh(data=8), optimizer=adamw(mlp.parameters()))
    manager = CheckpointManager(tmp_path, CheckpointOptions(keep=2, async_save=True))
    for batch in mlp_batches(n=3):
        step(*batch)
        handle = manager.save(step, extra={"seen": step.step_count})
    assert handle.wait() == tmp_path / "step_00000003"
    manager.wait()
    assert [p.name for p in manager.complete()] == ["step_00000002", "step_00000003"]
    expected = step.state_dict()
    mlp2 = MLP()
    restored = xtrain.compile(mlp2, xtrain.Mesh(data=8), optimizer=adamw(mlp2.parameters()))
    assert manager.restore(restored) == {"seen": 3}
    got = restored.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


# -- export ----------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_loads_into_the_torch_module_with_the_same_loss(saved, tmp_path, suffix):
    step = saved[1]
    path = step.export(tmp_path / f"model{suffix}")
    state = load_file(str(path)) if suffix == ".safetensors" else torch.load(path, weights_only=True)
    module = GPT()
    module.load_state_dict(state, strict=True)
    batch = token_batches(n=8)[5]
    with torch.no_grad():
        torch_loss = module(*batch).item()
    assert abs(torch_loss - step.eval(*batch)["loss"]) <= 1e-6 * abs(torch_loss)


# -- errors ----------------------------------------------------------------------------------
@pytest.mark.e2e
def test_loading_into_a_different_model_names_the_tensors(saved):
    model = GPT(d=64)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()))
    with pytest.raises(CheckpointError, match=r"params/blocks.0.attn.k.weight was saved as float32\[32, 32\] but "
                                              r"this step holds float32\[64, 64\]"):
        step.load(saved[0])
    mlp = MLP()
    other = xtrain.compile(mlp, xtrain.Mesh(data=8), optimizer=adamw(mlp.parameters()))
    with pytest.raises(CheckpointError, match=r"does not hold this step's state: missing \['opt_state/0/mu/fc1.bias'"):
        other.load(saved[0])


@pytest.mark.e2e
def test_extra_must_be_json(saved, tmp_path):
    with pytest.raises(OptionsError, match="checkpoint extra must be JSON-serialisable"):
        saved[1].save(tmp_path / "x", extra={"loader": object()})
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()


@pytest.mark.e2e
def test_a_tensor_the_pieces_do_not_cover_is_named(saved, tmp_path):
    import shutil

    copy_ = tmp_path / "cut"
    shutil.copytree(saved[0], copy_)
    manifest = json.loads((copy_ / "manifest.json").read_text())
    manifest["tensors"]["params/pos.weight"]["pieces"][0]["region"][0] = [0, 8]  # rows 8-15 lost
    (copy_ / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"the stored pieces of params/pos.weight cover 256 of the 512 "
                                              r"elements .* the checkpoint is missing part of this tensor"):
        saved[1].load(copy_)


@pytest.mark.unit
@pytest.mark.parametrize("field,value,message", [
    ("keep", -1, "CheckpointOptions.keep=-1 must be >= 0"),
    ("save_every", -5, "CheckpointOptions.save_every=-5 must be >= 0"),
    ("sigterm_grace_s", 0, "CheckpointOptions.sigterm_grace_s=0 must be > 0")])
def test_checkpoint_options_name_the_bad_field(field, value, message):
    with pytest.raises(OptionsError, match=message):
        CheckpointOptions(**{field: value})

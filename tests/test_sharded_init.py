"""Sharded initialisation: a model built on the meta device is loaded from a safetensors file
straight into the shards each process holds, never whole in one process."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import xtrain
from xtrain import errors
from xtrain.checkpoint import CheckpointError
from xtrain.cli import free_port_pair

from models import Stack, stack_batch
from test_checkpoint import TESTS, TIMEOUT_S, worker_env
from test_hf_models import gpt2, llama, lm_batches, lm_loss


@pytest.mark.multiprocess
def test_meta_model_loads_zero3_shards_within_a_fraction_of_its_size_per_process(tmp_path):
    torch.manual_seed(0)
    model = Stack()
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    with torch.no_grad():
        expected = model(*stack_batch()).item()
    del model
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port_pair()}",
           str(TESTS / "_sharded_init_worker.py"), str(tmp_path / "model.safetensors"), str(tmp_path / "out.json")]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    # every weight and bias split over 8 (the 16 layers' tensors stored stacked: one per family)
    assert result["processes"] == 2 and result["sharded"] and not result["whole"], result
    assert abs(result["loss"] - expected) <= 1e-5 * abs(expected), (result["loss"], expected)
    # Each process holds 4 of the 8 shards (half the model: its CPU "devices" are host memory)
    # and must not have held the whole model at any point while loading.
    for gained in result["gained"]:
        assert model_bytes / 2 <= gained < model_bytes, (
            f"a process gained {gained / 1e6:.0f} MB loading a {model_bytes / 1e6:.0f} MB model")
    print(f"peak host memory gained per process {[g // 2**20 for g in result['gained']]} MiB, "
          f"model {model_bytes // 2**20} MiB")


def meta_model(model, how: str):
    if how == "meta device":
        with torch.device("meta"):
            return type(model)(model.config)
    with xtrain.checkpoint.meta_params():
        return type(model)(model.config)


@pytest.mark.e2e
@pytest.mark.parametrize("name,how,mesh,plan", [
    ("gpt2", "meta device", dict(data=8), xtrain.plans.fsdp),
    ("llama", "meta_params", dict(data=4, tensor=2), xtrain.plans.megatron)])
def test_hf_checkpoint_loads_into_a_meta_model_and_trains_like_torch(tmp_path, name, how, mesh, plan):
    torch.manual_seed(0)
    model = {"gpt2": gpt2, "llama": llama}[name]()
    model.save_pretrained(tmp_path)  # HF stores the tied lm_head.weight of GPT-2 once, as transformer.wte.weight
    meta = meta_model(model, how)
    assert all(p.is_meta for p in meta.parameters())
    step = xtrain.compile(meta, xtrain.Mesh(**mesh), optimizer=torch.optim.SGD(meta.parameters(), lr=0.1),
                          plan=plan(meta, mesh), loss_fn=lm_loss, init_from=tmp_path)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in lm_batches():
        optimizer.zero_grad()
        loss = lm_loss(model, *batch)
        loss.backward()
        optimizer.step()
        got = step(*batch)["loss"]
        assert abs(got - loss.item()) <= 1e-5 * loss.item(), (got, loss.item())
    # and back: the exported weights load with HF's from_pretrained and score like xtrain
    model.config.save_pretrained(tmp_path / "export")
    step.export(tmp_path / "export" / "model.safetensors")
    reloaded = type(model).from_pretrained(tmp_path / "export")
    with torch.no_grad():
        want = lm_loss(reloaded.eval(), *lm_batches(seed=9)[0]).item()
    got = step.eval(*lm_batches(seed=9)[0])["loss"]
    assert abs(got - want) <= 1e-5 * want, (got, want)


@pytest.mark.e2e
def test_a_buffer_left_on_the_meta_device_is_named(tmp_path):
    torch.manual_seed(0)
    model = llama()
    model.save_pretrained(tmp_path)  # the rotary tables are non-persistent buffers: not in the file
    meta = meta_model(model, "meta device")
    with pytest.raises(errors.OptionsError, match=r"buffer 'model.rotary_emb.inv_freq' of LlamaForCausalLM is on the meta "
                                         r"device and not in .*: build the model under `with "
                                         r"xtrain.checkpoint.meta_params\(\):`"):
        xtrain.compile(meta, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(meta.parameters(), lr=0.1),
                       loss_fn=lm_loss, init_from=tmp_path)


@pytest.mark.e2e
def test_missing_or_misshapen_tensors_are_named(tmp_path):
    torch.manual_seed(0)
    state = Stack(d=64, layers=2).state_dict()
    save_file({k: v for k, v in state.items() if k != "blocks.1.bias"}, str(tmp_path / "a.safetensors"))
    state["blocks.0.weight"] = torch.zeros(64, 32)
    save_file(state, str(tmp_path / "b.safetensors"))
    with torch.device("meta"):
        model = Stack(d=64, layers=2)
    compile = lambda file: xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          init_from=file)
    with pytest.raises(CheckpointError, match=r"a.safetensors has no tensor 'blocks.1.bias'; it has 3 tensors"):
        compile(tmp_path / "a.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor 'blocks.0.weight' has shape \[64, 32\] but the model's "
                                              r"blocks.0.weight has \[64, 64\]"):
        compile(tmp_path / "b.safetensors")

"""LoRA fine-tuning through `peft`: a tiny HF Llama wrapped with `peft.get_peft_model` compiles
unchanged under data parallel, FSDP and megatron, matches single-device torch (the parity
standard), keeps gradients and optimizer state for the adapters only, and its trained adapter
saves with `save_pretrained` and loads back with `PeftModel.from_pretrained`."""
import copy
import functools
import math
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import xtrain
from test_example import EXAMPLE, child_env, final_line
from xtrain.testing import ParityResult, assert_parity, torch_reference

VOCAB = 128  # divisible by tensor=2: megatron splits the embedding and head as without peft
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
RANK = 4


def lm_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def lm_batches(n=4, batch=8, seq=16, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(ids, ids) for ids in (torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n))]


def base_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0))


def lora_llama():
    # gaussian init: peft's default zeroes B, whose first gradients alone would leave A untested
    config = LoraConfig(r=RANK, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights="gaussian")
    torch.manual_seed(1)
    return get_peft_model(base_llama(), config)


def adamw(params):
    # peft's usual loop: the optimizer over the trainable (adapter) parameters only
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-3, weight_decay=0.01)


@functools.cache
def reference():
    return torch_reference(lora_llama(), adamw, lm_batches(), lm_loss)


def layout(name: str, model):
    if name == "data8":
        return xtrain.Mesh(data=8), None
    if name == "fsdp":
        mesh = xtrain.Mesh(data=8)
        return mesh, xtrain.plans.fsdp(model, mesh, min_size=64)
    mesh = xtrain.Mesh(data=4, tensor=2)
    return mesh, xtrain.plans.megatron(model, mesh)


@functools.cache
def trained(name: str):
    """(the peft model the step trained, the step, its parity result) under layout `name`."""
    model = lora_llama()
    mesh, plan = layout(name, model)
    step = xtrain.compile(model, mesh, optimizer=adamw(model.parameters()), plan=plan, loss_fn=lm_loss)
    losses = [step(*batch)["loss"] for batch in lm_batches()]
    result = ParityResult(losses, reference()[0], step.state_dict(), reference()[1], 5e-5)
    return model, step, result


def per_device_bytes(step, names) -> int:
    """fp32 bytes per device of parameters `names` under the step's specs."""
    sizes = dict(step.mesh.shape)
    total = 0
    for name in names:
        spec = step.param_specs[name]
        split = math.prod(sizes[a] for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry))
        total += 4 * math.prod(step.state.params[name].shape) // split
    return total


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["data8", "fsdp", "megatron"])
def test_lora_matches_torch_and_keeps_state_for_the_adapters_only(name):
    model, step, result = trained(name)
    assert_parity(result)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    assert step.state.params and all(".lora_" in n for n in step.state.params)  # trainable: the adapters
    assert not any(".lora_" in n for n in step.state.frozen)
    state = step.report().state_memory
    grads = per_device_bytes(step, step.state.params)
    assert state["gradients"] == grads and grads < state["parameters"] / 4
    assert grads * 2 <= state["optimizer"] <= grads * 2 + 8  # Adam's two moments (+ the step count)
    if name != "data8":  # the frozen base is split as without peft
        assert xtrain.plans.assert_sharded(step) <= 0.05


@pytest.mark.e2e
def test_megatron_sees_through_peft_wrappers_and_splits_adapters_with_their_base():
    model = lora_llama()
    plan = xtrain.plans.megatron(model, xtrain.Mesh(data=4, tensor=2), example=lm_batches()[0], loss_fn=lm_loss)
    specs = plan.param_specs({n: tuple(p.shape) for n, p in model.named_parameters()}, {"data": 4, "tensor": 2})
    layer = "base_model.model.model.layers.0"
    column = [f"{layer}.self_attn.q_proj", f"{layer}.self_attn.v_proj", f"{layer}.mlp.up_proj"]
    row = [f"{layer}.self_attn.o_proj", f"{layer}.mlp.down_proj"]
    for proj in column:  # base split on its outputs, B too, A whole
        assert specs[f"{proj}.base_layer.weight"] == ("tensor", None)
        assert specs[f"{proj}.lora_B.default.weight"] == ("tensor", None)
        assert not any(specs[f"{proj}.lora_A.default.weight"])
    for proj in row:  # base split on its inputs, A too, B whole
        assert specs[f"{proj}.base_layer.weight"] == (None, "tensor")
        assert specs[f"{proj}.lora_A.default.weight"] == (None, "tensor")
        assert not any(specs[f"{proj}.lora_B.default.weight"])
    assert specs[f"{layer}.self_attn.k_proj.weight"] == ("tensor", None)  # unwrapped layers as before
    # found in the graph: B's output is added to the column-parallel base's (a low-rank detour)
    assert any("q_proj.lora_B.default adds its output to" in n and "q_proj.lora_A.default kept whole" in n
               for n in plan.notes), plan.notes

    # the adapters' own tensor-axis collectives are r wide (the backward sums the gradient of
    # the rank-r activation over the tensor axis); every d-wide one serves the base model; the
    # data axis syncs the adapters' gradients only
    _, step, _ = trained("megatron")
    collectives = step.report().collectives
    local_tokens = 8 // 4 * 16
    adapters = [c for c in collectives if ".lora_" in c.source and "tensor" in c.axes]
    assert adapters and all(c.payload_bytes == local_tokens * RANK * 4 for c in adapters), adapters
    synced = sum(c.payload_bytes for c in collectives if c.source.startswith("xtrain.grad_sync"))
    assert synced == step.report().state_memory["gradients"]


@pytest.mark.e2e
def test_trained_adapter_saves_with_peft_and_loads_with_the_same_logits(tmp_path):
    model, step, _ = trained("data8")
    model.load_state_dict(step.state_dict())
    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").is_file() and (tmp_path / "adapter_config.json").is_file()
    loaded = PeftModel.from_pretrained(base_llama(), tmp_path).eval()
    ids = lm_batches(n=1, seed=9)[0][0]
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    reference_model = copy.deepcopy(lora_llama())
    reference_model.load_state_dict(reference()[1])
    with torch.no_grad():
        torch.testing.assert_close(got, reference_model.eval()(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.multiprocess
def test_finetune_lora_example_trains_saves_and_reloads_its_adapter(tmp_path):
    script = EXAMPLE.parent / "finetune_lora.py"
    args = ["--steps", "12", "--layers", "1", "--d-model", "32", "--seq", "32", "--lr", "1e-2",
            "--layout", "megatron", "--out", str(tmp_path / "adapter")]
    proc = subprocess.run([sys.executable, str(script), *args], env=child_env(), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, f"example failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    done = final_line(proc.stdout)
    assert done["steps"] == 12 and done["last_loss"] < done["first_loss"] - 0.1, done
    assert done["reloaded_eval_loss"] == pytest.approx(done["eval_loss"], abs=2e-4)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

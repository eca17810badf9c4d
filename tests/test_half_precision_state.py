"""bf16 and fp16 parameters leave xtrain bit for bit: state_dict(), export (safetensors and
torch.save), HF from_pretrained of the export, and checkpoints."""
import pytest
import torch
from transformers import GPT2LMHeadModel

import xtrain

from test_hf_models import gpt2, lm_batches, lm_loss

pytestmark = pytest.mark.e2e


def same(a: dict, b: dict) -> list[str]:
    """Keys whose tensors differ in dtype or in any bit."""
    return [k for k in b if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_parameters_round_trip_exactly(dtype, tmp_path):
    torch.manual_seed(0)
    model = gpt2().to(dtype)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                          loss_fn=lm_loss)
    assert same(step.state_dict(), initial) == []
    step(*lm_batches(n=1)[0])
    trained = step.state_dict()
    assert {v.dtype for k, v in trained.items() if v.is_floating_point()} == {dtype}
    assert not torch.equal(trained["transformer.h.0.mlp.c_fc.weight"], initial["transformer.h.0.mlp.c_fc.weight"])

    step.export(tmp_path / "hf" / "model.safetensors")
    model.config.save_pretrained(tmp_path / "hf")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", dtype=dtype)
    assert same(loaded.state_dict(), trained) == []
    assert same(torch.load(step.export(tmp_path / "model.pt"), weights_only=True), trained) == []

    step.save(tmp_path / "ckpt")
    other = gpt2().to(dtype)
    restored = xtrain.compile(other, xtrain.Mesh(data=4, tensor=2), loss_fn=lm_loss,
                              optimizer=torch.optim.SGD(other.parameters(), lr=0.05),
                              plan=xtrain.plans.megatron(other, {"data": 4, "tensor": 2}, example=lm_batches(n=1)[0],
                                                         loss_fn=lm_loss))
    restored.load(tmp_path / "ckpt")
    assert same(restored.state_dict(), trained) == []

"""Auxiliary-loss-free load balancing (Plan(router_bias_rate=...), xtrain.lowering.router_bias):
HF DeepSeek-V3's selection bias (`e_score_correction_bias`) moves each step by the rate towards
balance. The oracle: torch training the same model with the same update written out (from the
routers' chosen experts of the step), under the parity standard, the buffers included; on data
parallel, expert parallel and expert x tensor parallel."""
import copy
import dataclasses

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

import xtrain
from xtrain import plans
from xtrain.errors import PlanError
from xtrain.testing import ParityResult, assert_parity
from test_moe import qwen3_moe

VOCAB, EXPERTS, RATE = 101, 8, 0.02
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def deepseek():
    """The dense first layer, then shared + 8 routed experts, top-2 of 2 of 4 groups, sigmoid scores."""
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS,
        n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=0, use_cache=False))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def batches(n=5):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (8, 32), generator=g),) for _ in range(n)]


def torch_with_bias_updates(model, data, rate):
    """torch on one device, the DeepSeek-V3 update written out: after each step every router's
    bias += rate x sign(mean load - load), the load counted from the experts it chose."""
    model = copy.deepcopy(model).train()
    optimizer = adamw(model.parameters())
    routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
    chosen = {}
    for r in routers:
        r.register_forward_hook(lambda mod, args, out: chosen.__setitem__(mod, out[2]))
    losses = []
    for batch in data:
        optimizer.zero_grad()
        loss = lm_loss(model, *batch)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for r in routers:
                load = torch.bincount(chosen[r].flatten(), minlength=EXPERTS).float()
                r.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model, data = deepseek(), batches()
    return model, data, torch_with_bias_updates(model, data, RATE)


@pytest.mark.e2e
@pytest.mark.parametrize("mesh", [dict(data=8), dict(data=4, expert=2), dict(data=2, expert=2, tensor=2)],
                         ids=["data", "expert", "expert x tensor"])
def test_selection_bias_moves_towards_balance_as_deepseek_v3_writes_it(reference, mesh):
    model, data, want = reference
    assert want[1][BIAS].abs().sum() > 0  # the update moved the bias (and with it the routing)
    model = copy.deepcopy(model)
    tensor, mesh = "tensor" in mesh, xtrain.Mesh(**mesh)
    plan = dataclasses.replace(plans.megatron(model, mesh) if tensor else xtrain.Plan(), router_bias_rate=RATE)
    step = xtrain.compile(model, mesh, optimizer=adamw(model.parameters()), loss_fn=lm_loss, plan=plan)
    losses = [step(*b)["loss"] for b in data]
    assert_parity(ParityResult(losses, want[0], step.state_dict(), want[1], 5e-5))


@pytest.mark.e2e
def test_the_bias_is_refused_where_no_router_has_one():
    model = qwen3_moe()  # its router has no selection bias
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()), loss_fn=lm_loss,
                          plan=xtrain.Plan(router_bias_rate=1e-3))
    with pytest.raises(PlanError, match="e_score_correction_bias"):
        step(*batches(1)[0])


@pytest.mark.e2e
def test_the_bias_needs_the_explicit_lowering(reference):
    from xtrain.errors import UnsupportedError
    model = copy.deepcopy(reference[0])
    with pytest.raises(UnsupportedError, match=r"router_bias_rate=0.001\) balances MoE layers .* lowering='explicit'"):
        xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()), loss_fn=lm_loss,
                       plan=xtrain.Plan(router_bias_rate=1e-3), lowering="xla")


@pytest.mark.unit
def test_the_rate_must_be_positive():
    with pytest.raises(PlanError, match="positive rate"):
        xtrain.Plan(router_bias_rate=0)

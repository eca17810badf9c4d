"""A batch's indices are held to torch's rules inside the compiled step: an embedding id or a
cross-entropy target out of range skips the update and names the argument, module, op and
value (JAX alone would read NaN or clip); negative indices follow each torch op; an empty batch
and float labels are refused with the argument's position."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xtrain
from xtrain.errors import BatchIndexError, BatchTypeError, InputError
from xtrain.testing import assert_parity, run_parity

from models import GPT, MLP, mlp_batches, token_batches

pytestmark = pytest.mark.e2e

SKIPPED = r"The update was skipped: parameters and optimizer state are those before this step"


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def compile_(model, mesh=None, **kwargs):
    return xtrain.compile(model, xtrain.Mesh(**(mesh or {"data": 8})), optimizer=sgd(model.parameters()), **kwargs)


def equal(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_target_out_of_range_skips_the_update_and_is_named():
    torch.manual_seed(0)
    step = compile_(MLP(classes=4))
    x, y = mlp_batches(n=1)[0]
    y = y.clamp(max=3)
    y[5] = 99
    before = step.state_dict()
    with pytest.raises(BatchIndexError, match=r"step 1: batch argument 1 holds 99 where module '<top level>' .* "
                                              r"dimension of size 4: valid values are 0\.\.3, or the ignore index -100\. "
                                              + SKIPPED):
        step(x, y)
    assert equal(before, step.state_dict())
    y[5] = -100  # the ignore index is no error
    assert step(x, y)["skipped"] is False and not equal(before, step.state_dict())


@pytest.mark.parametrize("mesh,plan", [({"data": 8}, None), ({"data": 4, "tensor": 2}, xtrain.plans.megatron)],
                         ids=["dp8", "tp2"])
def test_an_embedding_index_out_of_range_is_named_on_any_layout(mesh, plan):
    torch.manual_seed(0)
    model = GPT(vocab=10)
    step = compile_(model, mesh, plan=plan(model, mesh) if plan else None)
    x, y = token_batches(n=1, vocab=10)[0]
    x = x.clone()
    x[13, 3] = 1000
    with pytest.raises(BatchIndexError, match=r"batch argument 0 holds 1000 where module 'tok' uses it as an index "
                                              r"\(embedding\) into a dimension of size 10: valid values are 0\.\.9\. "
                                              + SKIPPED):
        step(x, y)
    x[13, 3] = -1  # embedding refuses negative indices, as torch does
    with pytest.raises(BatchIndexError, match=r"argument 0 holds -1 where module 'tok' .* valid values are 0\.\.9"):
        step(x, y)


class Picks(nn.Module):
    """Advanced indexing with a batch of positions (torch wraps negative ones)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 6)

    def forward(self, x, where):
        h = self.fc(x)                     # (B, 6)
        return h[torch.arange(h.shape[0]), where].square().mean()


def test_advanced_indexing_wraps_negative_indices_like_torch_and_refuses_beyond():
    torch.manual_seed(0)
    batches = [(x, torch.tensor([-1, 2, -6, 5] * 4)) for x, _ in mlp_batches(n=4)]
    assert_parity(run_parity(Picks(), sgd, batches, xtrain.Mesh(data=8)))
    step = compile_(Picks())
    with pytest.raises(BatchIndexError, match=r"batch argument 1 holds -7 .* \(indexing \(x\[idx\]\)\) into a "
                                              r"dimension of size 6: valid values are -6\.\.5"):
        step(batches[0][0], torch.tensor([-7] + [0] * 15))


class ShiftedLM(nn.Module):
    """Reads one token tensor twice: columns :-1 as embedding ids (vocab 10), 1: as targets of
    a 20-class head, as HF language models shift their labels."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 20)

    def forward(self, tokens):
        logits = self.head(self.tok(tokens[:, :-1]))
        return F.cross_entropy(logits.reshape(-1, 20), tokens[:, 1:].reshape(-1))


def test_each_use_checks_only_the_part_of_the_argument_it_reads():
    torch.manual_seed(0)
    step = compile_(ShiftedLM())
    tokens = torch.randint(0, 10, (16, 5))
    tokens[:, -1] = 15  # a valid target, never an embedding id
    assert step(tokens)["skipped"] is False
    tokens[2, 0] = 15   # an embedding id past the vocabulary
    with pytest.raises(BatchIndexError, match=r"batch argument 0 holds 15 where module 'tok' uses it as an index "
                                              r"\(embedding\) into a dimension of size 10"):
        step(tokens)
    notes = [n for n in step.report(tokens).notes if n.startswith("input checks")]
    assert notes == ["input checks: 2 index use(s) of the batch checked against their range: argument 0 in embedding "
                     "of 'tok', argument 0 in cross_entropy/nll_loss target of '<top level>'"]


def test_the_xla_lowering_and_eval_check_too():
    torch.manual_seed(0)
    step = compile_(MLP(classes=4), lowering="xla")
    x, y = mlp_batches(n=1)[0]
    y = y.clamp(max=3)
    y[0] = 4
    with pytest.raises(BatchIndexError, match=r"step 1: batch argument 1 holds 4 .*" + SKIPPED):
        step(x, y)
    with pytest.raises(BatchIndexError, match=r"step 1 \(eval\): batch argument 1 holds 4 .* Nothing was evaluated"):
        step.eval(x, y)


class Offsets(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, 4)

    def forward(self, ids):
        return self.tok(ids.cumsum(1) % 10).sum()


def test_an_index_the_checks_cannot_follow_is_a_report_note():
    step = compile_(Offsets())
    ids = torch.randint(0, 3, (8, 4))
    assert step(ids)["skipped"] is False
    assert "input checks: embedding in module 'tok' indexes with batch argument 0 through cumsum: not checked" in \
        step.report(ids).notes


def test_an_empty_batch_and_float_labels_are_refused_naming_the_argument():
    step = compile_(MLP())
    x, y = mlp_batches(n=1)[0]
    with pytest.raises(InputError, match=r"batch argument 0 has shape \(0, 12\): an empty batch \(no samples\)"):
        step(x[:0], y[:0])
    with pytest.raises(BatchTypeError, match=r"batch argument 1 is floating-point but .* uses it as the indices of "
                                             r"cross_entropy/nll_loss target: pass integer labels/indices"):
        step(x, y.float())


def test_checks_can_be_turned_off():
    torch.manual_seed(0)
    step = compile_(MLP(classes=4), check_inputs=False)
    x, y = mlp_batches(n=1)[0]
    y[0] = 99
    assert step(x, y)["skipped"] is False  # JAX's clipped gather: what the checks exist to prevent
    assert not [n for n in step.report(x, y).notes if n.startswith("input checks")]


def test_an_hf_language_models_labels_are_checked_where_its_loss_reads_them():
    from test_hf_models import gpt2, lm_batches, lm_loss

    torch.manual_seed(0)
    model = gpt2()
    step = compile_(model, loss_fn=lm_loss)
    ids, labels = lm_batches(n=1)[0]
    labels = labels.clone()
    labels[:, 0] = 500  # HF shifts the labels: position 0 is never a target (padded with -100 at the end)
    assert step(ids, labels)["skipped"] is False
    labels[3, 7] = 500
    with pytest.raises(BatchIndexError, match=r"batch argument 1 holds 500 .* \(cross_entropy/nll_loss target\) "
                                              r"into a dimension of size 101"):
        step(ids, labels)

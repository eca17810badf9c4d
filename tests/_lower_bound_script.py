"""Run by test_jax_lower_bound.py in a subprocess whose PYTHONPATH puts the lowest JAX that
pyproject.toml admits first: the parity standard on data, tensor and ZeRO-3 layouts."""
import os
import sys

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from xtrain.runtime.backends import with_cpu_xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = with_cpu_xla_flags(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
import torch  # noqa: E402

import xtrain  # noqa: E402
from xtrain.testing import assert_parity, run_parity, torch_reference  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from models import GPT, token_batches  # noqa: E402


def main(expected: str) -> None:
    assert jax.__version__ == expected, f"running jax {jax.__version__} from {jax.__file__}, expected {expected}"
    torch.manual_seed(0)
    model, batches = GPT(), token_batches()
    adamw = lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01)  # noqa: E731
    reference = torch_reference(model, adamw, batches)
    dp8, tp2 = xtrain.Mesh(data=8), xtrain.Mesh(data=4, tensor=2)
    layouts = {
        "ddp": (dp8, None),
        "megatron": (tp2, xtrain.plans.megatron(model, tp2)),
        "fsdp": (dp8, xtrain.plans.fsdp(model, dp8)),
    }
    for name, (mesh, plan) in layouts.items():
        for lowering in ("explicit", "xla"):
            assert_parity(run_parity(model, adamw, batches, mesh, plan=plan, reference=reference,
                                     lowering=lowering))
            print(f"jax {jax.__version__}: {name} ({lowering}) meets the parity standard", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

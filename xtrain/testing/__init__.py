"""Test utilities shipped with xtrain (the single-device parity oracle)."""
from xtrain.testing.parity import ParityResult, assert_parity, run_parity, torch_reference

__all__ = ["ParityResult", "assert_parity", "run_parity", "torch_reference"]

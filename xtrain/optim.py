"""Optimizers: the torch.optim classes xtrain translates to optax (SGD, Adam, AdamW, with param
groups and LR schedulers). The translation lives in the front end (xtrain.frontend.optim)."""
from xtrain.frontend.optim import LearningRates, from_torch

__all__ = ["LearningRates", "from_torch"]

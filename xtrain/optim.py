"""Optimizers: the torch.optim classes xtrain translates to optax (SGD, Adam, AdamW, with param
groups and LR schedulers), and the large-batch optimizers torch lacks, LARS and LAMB, as torch
optimizers (eager torch runs them as they are). The translation and the classes live in the
front end (xtrain.frontend.optim, xtrain.frontend.large_batch)."""
from xtrain.frontend.large_batch import LAMB, LARS, exclude_from_adaptation
from xtrain.frontend.optim import LearningRates, from_torch

__all__ = ["LAMB", "LARS", "LearningRates", "exclude_from_adaptation", "from_torch"]

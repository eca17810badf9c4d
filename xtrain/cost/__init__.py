"""Costs of a training step: hardware peaks (hardware.py)."""

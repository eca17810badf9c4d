"""Lowering: a Model + Plan + mesh -> compiled per-step programs, and what they communicate."""

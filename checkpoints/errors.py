"""Errors raised for malformed or mismatched checkpoints."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file is malformed, or its tensors do not match the model."""

"""Functional, typed entry points; each op is a folder (reference.py, triton.py, op.py)."""

from __future__ import annotations

from tandem.ops.adagrad import adagrad
from tandem.ops.gru import gru
from tandem.ops.lstm import lstm
from tandem.ops.syncbn import sync_batch_norm

__all__ = ["adagrad", "gru", "lstm", "sync_batch_norm"]

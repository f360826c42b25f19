"""Functional, typed entry points; each op is a folder (reference.py, triton.py, op.py)."""

from __future__ import annotations

from tandem.ops.adagrad import adagrad
from tandem.ops.gru import gru

__all__ = ["adagrad", "gru"]

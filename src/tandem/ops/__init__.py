"""Functional, typed entry points; each op is a folder (reference.py, triton.py, op.py)."""

from __future__ import annotations

from tandem.ops.gru import gru
from tandem.ops.lstm import lstm

__all__ = ["gru", "lstm"]

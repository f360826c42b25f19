"""Functional, typed entry points; each op is a folder (reference.py, triton.py, op.py)."""

from __future__ import annotations

from tandem.ops.adagrad import adagrad

__all__: list[str] = ["adagrad"]

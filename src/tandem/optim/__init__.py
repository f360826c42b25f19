"""Optimizers: drop-ins for ``torch.optim`` whose math lives in ``tandem.ops``."""

from __future__ import annotations

from tandem.optim.adagrad import Adagrad

__all__ = ["Adagrad"]

"""Drop-in modules: thin wrappers that validate arguments, own parameters and call ``tandem.ops``."""

from __future__ import annotations

from tandem.nn.gru import GRU
from tandem.nn.lstm import LSTM
from tandem.nn.syncbn import SyncBatchNorm

__all__ = ["GRU", "LSTM", "SyncBatchNorm"]

"""Models composed from tandem's parts, as ``tandem train`` uses them."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import tandem

__all__ = ["SpeechClassifier"]


class SpeechClassifier(nn.Module):
    """DeepSpeech-style utterance classifier: sequence-wise batch norm, a bidirectional RNN stack, pooling.

    - ``tandem.nn.SyncBatchNorm`` normalises every input frame over the whole (global) batch. It runs on
      ``PackedSequence.data``, which holds only real frames, so padding never enters the statistics.
    - ``tandem.nn.GRU`` (or ``LSTM``), bidirectional, on the packed sequences: no compute on padding.
    - mean and max over each utterance's frames, then a linear layer to class logits.

    Example::

        >>> model = SpeechClassifier(num_features=12, num_classes=9, hidden=64, layers=2)
        >>> logits = model(torch.randn(4, 29, 12), torch.tensor([29, 7, 12, 20]))
        >>> logits.shape
        torch.Size([4, 9])
    """

    def __init__(
        self, num_features: int, num_classes: int, hidden: int = 64, layers: int = 2, cell: str = "gru"
    ):
        super().__init__()
        cells = {"gru": tandem.nn.GRU, "lstm": getattr(tandem.nn, "LSTM", None)}
        if cell not in cells:
            raise ValueError(f"SpeechClassifier: expected cell in {sorted(cells)}, got {cell!r}")
        if cells[cell] is None:
            raise ValueError(f"SpeechClassifier: cell {cell!r} is not available in this build of tandem")
        self.norm = tandem.nn.SyncBatchNorm(num_features)
        self.rnn = cells[cell](num_features, hidden, num_layers=layers, bidirectional=True)
        self.head = nn.Linear(4 * hidden, num_classes)

    def forward(self, features: Tensor, lengths: Tensor) -> Tensor:
        """``features`` [B, T, F] padded, ``lengths`` [B] -> logits [B, C]."""
        packed = pack_padded_sequence(features, lengths.cpu(), batch_first=True, enforce_sorted=False)
        frames = self.norm(packed.data)  # [P, F]: the real frames only
        out, _ = self.rnn(
            PackedSequence(frames, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
        )
        padded, out_lengths = pad_packed_sequence(out, batch_first=True)  # [B, T, 2H]
        valid = torch.arange(padded.shape[1], device=padded.device) < out_lengths.to(padded.device)[:, None]
        valid = valid.unsqueeze(-1)
        mean = (padded * valid).sum(1) / out_lengths.to(padded)[:, None]
        peak = padded.masked_fill(~valid, float("-inf")).amax(1)
        return self.head(torch.cat([mean, peak], 1))

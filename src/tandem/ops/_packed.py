"""Index arithmetic of the packed step layout shared by the recurrent ops (GRU, LSTM).

A layer's input is ``[P, I]``: the rows of ``PackedSequence.data`` (time-major, step ``t`` holds the
first ``batch_sizes[t]`` sequences, sequences sorted by decreasing length). A padded ``[T, B, I]`` batch
is the special case ``batch_sizes = [B] * T``. The reverse direction walks each sequence from its own
last frame: its step ``s`` reads frame ``len_b - 1 - s`` of sequence ``b``, so both directions have the
same active rows at every step and one batched matmul serves both.

Saved activations live in "step-packed" buffers: row ``offsets[s] + b`` of a direction holds step ``s``
of sequence ``b`` (for the forward direction that is the time-packed row itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem._device import to_device

__all__ = ["PackedSteps"]


@dataclass
class PackedSteps:
    """Index arithmetic of a packed batch, computed once per call from ``batch_sizes``."""

    sizes: list[int]  # active sequences per step, non-increasing
    offsets: list[int]  # first packed row of each step
    uniform: bool  # every sequence has the full length T (a padded batch)
    rev_rows: Tensor | None  # [P] step-packed row of the reverse direction -> time-packed row (involution)
    prev_rows: Tensor | None  # [P] row of cat(h0, states) holding each step's previous state (packed only)
    last_rows: Tensor | None  # [B] row of ``states`` holding each sequence's final state (packed only)

    @staticmethod
    def build(
        batch_sizes: Tensor | list[int],
        rows: int,
        batch: int,
        directions: int,
        device: torch.device,
        op: str = "rnn",
    ) -> PackedSteps:
        """Check ``batch_sizes`` against the rows and batch of the call; ``op`` prefixes the errors. A list
        is the sizes themselves: a padded batch's, known from its shape (torch.compile traces the
        autograd-tracked layers, under torch.func transforms, without reading a tensor's values)."""
        if isinstance(batch_sizes, list):
            sizes = [int(n) for n in batch_sizes]
        else:
            sizes = [int(n) for n in batch_sizes.tolist()]
        if not sizes or sizes[-1] < 1 or any(a < b for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"{op}: expected batch_sizes non-increasing and positive, got {sizes}")
        if sum(sizes) != rows:
            raise ValueError(f"{op}: expected sum(batch_sizes) == x.shape[0] = {rows}, got {sum(sizes)}")
        if sizes[0] != batch:
            raise ValueError(f"{op}: expected batch_sizes[0] == h0.shape[1] = {batch}, got {sizes[0]}")
        steps = len(sizes)
        offsets = [0] * steps
        for s in range(1, steps):
            offsets[s] = offsets[s - 1] + sizes[s - 1]
        uniform = sizes[-1] == batch
        total = offsets[-1] + sizes[-1]
        rev_rows = prev_rows = last_rows = None
        if uniform:
            if directions == 2:
                # step s of every sequence reads frame T - 1 - s
                rev_rows = torch.arange(total, device=device).view(steps, batch).flip(0).reshape(-1)
        else:
            bs = torch.tensor(sizes)
            off = torch.tensor(offsets)
            step_of_row = torch.repeat_interleave(torch.arange(steps), bs)  # [P]
            seq_of_row = torch.arange(total) - off[step_of_row]  # [P]
            lengths = (bs.unsqueeze(0) > torch.arange(batch).unsqueeze(1)).sum(1)  # [B]
            if directions == 2:
                frame = lengths[seq_of_row] - 1 - step_of_row
                rev_rows = to_device(off[frame] + seq_of_row, device)
            # rows of cat(h0, states): [0, B) hold h0, step s occupies B + offsets[s] + [0, sizes[s])
            prev_start = torch.cat([torch.zeros(1, dtype=torch.long), batch + off[:-1]])
            prev_rows = to_device(prev_start[step_of_row] + seq_of_row, device)
            last_rows = to_device(off[lengths - 1] + torch.arange(batch), device)
        return PackedSteps(sizes, offsets, uniform, rev_rows, prev_rows, last_rows)

    def split(self, t: Tensor, dim: int = 1) -> tuple[Tensor, ...]:
        """Per-step views of a step-packed ``[D, P, ...]`` buffer: the loops never slice."""
        return t.split(self.sizes, dim)

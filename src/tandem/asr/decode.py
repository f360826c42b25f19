"""Greedy CTC decoding: the most likely class per frame, repeats collapsed, blanks dropped."""

from __future__ import annotations

import torch
from torch import Tensor

from tandem.asr.text import Alphabet

__all__ = ["greedy_decode"]


def greedy_decode(log_probs: Tensor, frames: Tensor, alphabet: Alphabet) -> list[str]:
    """Transcripts of a batch of CTC outputs.

    Args:
        log_probs: ``[T, B, K]`` scores per frame (any monotone scale: logits, log-probabilities).
        frames: ``[B]`` real frames of each utterance; later frames are ignored.
        alphabet: class ``k`` is ``alphabet``'s id ``k`` (0 the blank).

    Example::

        >>> from tandem.asr.text import ENGLISH
        >>> ids = torch.tensor([0, 17, 17, 0, 16, 0, 0, 7])   # _ o o _ n _ _ e -> "one"
        >>> greedy_decode(torch.nn.functional.one_hot(ids, 29).float()[:, None], torch.tensor([8]), ENGLISH)
        ['one']
    """
    if log_probs.dim() != 3 or log_probs.shape[2] != len(alphabet):
        raise ValueError(
            f"greedy_decode: expected log_probs [T, B, {len(alphabet)}], got shape {list(log_probs.shape)}"
        )
    best = log_probs.argmax(-1).T.cpu()  # [B, T]
    texts = []
    for b, n in enumerate(frames.tolist()):
        ids = best[b, :n]
        keep = torch.ones_like(ids, dtype=torch.bool)
        keep[1:] = ids[1:] != ids[:-1]  # collapse repeats; a blank between two equal ids keeps both
        texts.append(alphabet.decode(ids[keep & (ids != 0)]))
    return texts

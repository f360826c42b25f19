"""The bundled recordings: the Free Spoken Digit Dataset, packed losslessly in ``spoken_digits.npz``.

3,000 real recordings of isolated English digits (6 speakers, 50 per digit per speaker, 8 kHz), by
Z. Jackson, C. Souza, J. Flaks, Y. Pan, H. Nicolas and A. Thite (Zenodo, DOI 10.5281/zenodo.1342401),
CC BY-SA 4.0. Built from the original WAV files by ``scripts/make_spoken_digits.py`` (its docstring
describes the file's layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["DIGIT_WORDS", "SPOKEN_DIGITS", "Recordings", "load_spoken_digits"]

SPOKEN_DIGITS = Path(__file__).resolve().parents[1] / "data" / "spoken_digits.npz"
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@dataclass(frozen=True)
class Recordings:
    """Isolated-word recordings: ``samples[offsets[i]:offsets[i + 1]]`` (float32 in [-1, 1]) is the word
    ``words[i]`` spoken by ``speakers[speaker[i]]``, take ``index[i]`` of that word and speaker."""

    samples: Tensor  # [S] float32
    offsets: Tensor  # [N + 1] int64
    words: tuple[str, ...]  # [N]
    speaker: Tensor  # [N] int64
    index: Tensor  # [N] int64
    speakers: tuple[str, ...]
    sample_rate: int

    def __len__(self) -> int:
        return len(self.words)

    def audio(self, i: int) -> Tensor:
        """Recording ``i``'s samples, ``[n]`` float32 (a view)."""
        return self.samples[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def select(self, keep: Tensor) -> list[int]:
        """The recording numbers where the bool tensor ``keep`` [N] is True."""
        return torch.nonzero(keep).flatten().tolist()


def load_spoken_digits(path: str | Path = SPOKEN_DIGITS) -> Recordings:
    """The bundled Free Spoken Digit recordings (0.2 s to read: 22 minutes of 8 kHz audio).

    Example::

        >>> rec = load_spoken_digits()
        >>> len(rec), rec.sample_rate, rec.speakers[rec.speaker[0]], rec.words[0]
        (3000, 8000, 'george', 'zero')
    """
    with np.load(path, allow_pickle=False) as npz:
        delta = (npz["delta_hi"].astype(np.uint16) << 8) | npz["delta_lo"]
        samples = np.cumsum(delta.view(np.int16), dtype=np.int16)  # undoes the wrapping difference
        digit = npz["digit"].astype(np.int64)
        return Recordings(
            samples=torch.from_numpy(samples.astype(np.float32) / 32768.0),
            offsets=torch.from_numpy(npz["offsets"]),
            words=tuple(DIGIT_WORDS[d] for d in digit),
            speaker=torch.from_numpy(npz["speaker"].astype(np.int64)),
            index=torch.from_numpy(npz["index"].astype(np.int64)),
            speakers=tuple(str(s) for s in npz["speakers"]),
            sample_rate=int(npz["sample_rate"]),
        )

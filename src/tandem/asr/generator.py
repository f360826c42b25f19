"""Connected-digit utterances made from isolated recordings: "four seven two" from three recordings.

An utterance joins 1 to 7 recordings of one speaker with gaps of low-level noise (tens to a few hundred
ms), at a random gain. Everything random about an utterance is drawn when it is planned, from a
generator seeded by the caller, so a plan is a pure function of (recordings, seed): the test set is the
same in every run, and a training epoch is the same on every rank and after a resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tandem.asr.corpus import Recordings

__all__ = ["Utterance", "ConnectedDigits", "split_recordings"]


@dataclass(frozen=True)
class Utterance:
    """A planned utterance: the recordings in order, the silence before, between and after them (in
    samples, ``len(recordings) + 1`` values), the gain, the noise level, and a seed for the rest
    (noise samples, augmentation)."""

    recordings: tuple[int, ...]
    gaps: tuple[int, ...]
    gain: float
    noise: float
    seed: int
    transcript: str
    length: int  # samples


def split_recordings(recordings: Recordings, test_speaker: str | None = None) -> tuple[list[int], list[int]]:
    """(train, test) recording numbers: the dataset's customary split (takes 0-4 of every word and
    speaker are the test set, 5-49 training), or with ``test_speaker`` all of that speaker's recordings
    as the test set and the other speakers' as training."""
    if test_speaker is None:
        is_test = recordings.index < 5
    else:
        if test_speaker not in recordings.speakers:
            raise ValueError(
                f"--test-speaker: expected one of {list(recordings.speakers)}, got {test_speaker!r}"
            )
        is_test = recordings.speaker == recordings.speakers.index(test_speaker)
    return recordings.select(~is_test), recordings.select(is_test)


class ConnectedDigits:
    """Plans and renders connected-digit utterances from a set of recordings.

    Args:
        recordings: the isolated words.
        ids: which of them this set uses (for example the training split).
        max_words: words per utterance are uniform in ``[1, max_words]``.
        gap_ms: range of the silences between words; ``edge_ms`` before the first and after the last.
        gain_db: range of the utterance's gain.
        noise_dbfs: range of the level (RMS, dB of full scale) of the Gaussian noise under everything.

    Example::

        >>> from tandem.asr.corpus import load_spoken_digits
        >>> rec = load_spoken_digits()
        >>> train, test = split_recordings(rec)
        >>> digits = ConnectedDigits(rec, test)
        >>> plan = digits.plan(seed=0)
        >>> sum(len(u.recordings) for u in plan) == len(test)   # every recording once
        True
        >>> audio = digits.render(plan[0])  # [samples] float32
    """

    def __init__(
        self,
        recordings: Recordings,
        ids: Sequence[int],
        *,
        max_words: int = 7,
        gap_ms: tuple[float, float] = (30.0, 300.0),
        edge_ms: tuple[float, float] = (20.0, 200.0),
        gain_db: tuple[float, float] = (-10.0, 6.0),
        noise_dbfs: tuple[float, float] = (-80.0, -50.0),
    ) -> None:
        if not ids:
            raise ValueError("ConnectedDigits: expected at least one recording, got none")
        self.recordings = recordings
        self.ids = list(ids)
        self.max_words = max_words
        rate = recordings.sample_rate / 1000
        self._gap = (round(gap_ms[0] * rate), round(gap_ms[1] * rate))
        self._edge = (round(edge_ms[0] * rate), round(edge_ms[1] * rate))
        self._gain_db, self._noise_dbfs = gain_db, noise_dbfs
        self._sizes = recordings.offsets[1:] - recordings.offsets[:-1]

    def plan(self, seed: int | Sequence[int], passes: int = 1) -> list[Utterance]:
        """Utterances that use each recording ``passes`` times: per pass and speaker, the recordings in
        random order cut into runs of 1 to ``max_words``; all utterances shuffled."""
        rng = np.random.default_rng(seed)
        speaker = self.recordings.speaker[self.ids].numpy()
        ids = np.asarray(self.ids)
        utterances = []
        for _ in range(passes):
            for s in np.unique(speaker):
                mine = rng.permutation(ids[speaker == s])
                start = 0
                while start < len(mine):
                    count = int(rng.integers(1, self.max_words + 1))
                    utterances.append(
                        self._utterance(tuple(int(i) for i in mine[start : start + count]), rng)
                    )
                    start += count
        return [utterances[i] for i in rng.permutation(len(utterances))]

    def _utterance(self, recs: tuple[int, ...], rng: np.random.Generator) -> Utterance:
        gaps = (
            int(rng.integers(self._edge[0], self._edge[1] + 1)),
            *(int(g) for g in rng.integers(self._gap[0], self._gap[1] + 1, size=len(recs) - 1)),
            int(rng.integers(self._edge[0], self._edge[1] + 1)),
        )
        return Utterance(
            recordings=recs,
            gaps=gaps,
            gain=float(10 ** (rng.uniform(*self._gain_db) / 20)),
            noise=float(10 ** (rng.uniform(*self._noise_dbfs) / 20)),
            seed=int(rng.integers(2**62)),
            transcript=" ".join(self.recordings.words[i] for i in recs),
            length=sum(gaps) + int(self._sizes[list(recs)].sum()),
        )

    def render(self, utterance: Utterance) -> Tensor:
        """The utterance's samples ``[length]`` float32, clipped to [-1, 1]."""
        audio = torch.zeros(utterance.length)
        at = utterance.gaps[0]
        for rec, gap in zip(utterance.recordings, utterance.gaps[1:]):
            word = self.recordings.audio(rec)
            audio[at : at + len(word)] = word
            at += len(word) + gap
        noise = torch.randn(utterance.length, generator=torch.Generator().manual_seed(utterance.seed))
        return (audio * utterance.gain + noise * utterance.noise).clamp_(-1.0, 1.0)

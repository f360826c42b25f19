"""From waveforms and transcripts to the tensors a CTC step takes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.asr.augment import Augmentation
from tandem.asr.features import LogMel
from tandem.asr.text import Alphabet

__all__ = ["Batch", "collate"]


@dataclass(frozen=True)
class Batch:
    """Features ``[B, T, F]`` (padded), frames ``[B]``, CTC targets ``[sum(target_lengths)]`` (label ids
    end to end), target lengths ``[B]``, and the transcripts."""

    features: Tensor
    frames: Tensor
    targets: Tensor
    target_lengths: Tensor
    transcripts: list[str]

    def __len__(self) -> int:
        return len(self.transcripts)


def collate(
    audio: Sequence[Tensor],
    transcripts: Sequence[str],
    logmel: LogMel,
    alphabet: Alphabet,
    augmentation: Augmentation | None = None,
    seeds: Sequence[int] | None = None,
) -> Batch:
    """Features of ``audio`` (1-D float tensors at the feature rate) and encoded ``transcripts``;
    ``augmentation`` (training) draws from a generator seeded by each utterance's ``seeds`` entry."""
    generators = None
    if augmentation is not None:
        if seeds is None or len(seeds) != len(audio):
            raise ValueError(f"collate: expected {len(audio)} seeds with an augmentation, got {seeds!r}")
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        audio = [augmentation.waveform(a, g) for a, g in zip(audio, generators)]
    lengths = torch.tensor([len(a) for a in audio])
    waveforms = torch.nn.utils.rnn.pad_sequence(list(audio), batch_first=True)
    features, frames = logmel(waveforms, lengths)
    if generators is not None:
        rate = 1000.0 / logmel.config.hop_ms
        for i, g in enumerate(generators):
            augmentation.features(features[i], int(frames[i]), g, rate)
    encoded = [alphabet.encode(t) for t in transcripts]
    return Batch(
        features=features,
        frames=frames,
        targets=torch.cat(encoded) if encoded else torch.zeros(0, dtype=torch.int64),
        target_lengths=torch.tensor([len(e) for e in encoded], dtype=torch.int64),
        transcripts=[alphabet.normalize(t) for t in transcripts],
    )

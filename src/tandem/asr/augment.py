"""Training-time augmentation: speed perturbation and noise on the waveform, SpecAugment masks on the
features. Every draw comes from a generator the caller seeds (per utterance), so an augmented epoch is
reproducible: the same on every rank and after a resume."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from tandem.asr.features import resample

__all__ = ["FASTEST", "Augmentation"]

# Speed factors as rational resampling ratios (orig : 20): 0.9x ... 1.1x, as Kaldi's speed perturbation.
_SPEED_ORIG = (18, 19, 20, 21, 22)
# The fastest perturbation's length ratio (new : orig): a recording's shortest form in training
FASTEST = (20, max(_SPEED_ORIG))


@dataclass(frozen=True)
class Augmentation:
    """What is randomised in training (all off with ``Augmentation.none()``).

    Args:
        speed: perturb the speed (tempo and pitch together) by 0.9x to 1.1x.
        noise_snr_db: with probability ``noise_p``, add white noise at a signal-to-noise ratio drawn
            uniformly from this range.
        freq_masks, freq_width: SpecAugment frequency masks, each up to ``freq_width`` bands.
        time_masks, time_width: time masks per second of audio, each up to ``time_width`` frames.
    """

    speed: bool = True
    noise_p: float = 0.5
    noise_snr_db: tuple[float, float] = (10.0, 40.0)
    freq_masks: int = 2
    freq_width: int = 6
    time_masks: float = 1.0
    time_width: int = 8

    @classmethod
    def none(cls) -> Augmentation:
        return cls(speed=False, noise_p=0.0, freq_masks=0, time_masks=0.0)

    def to_dict(self) -> dict:
        return asdict(self)

    def waveform(self, audio: Tensor, generator: torch.Generator) -> Tensor:
        """``audio`` ``[S]`` faster or slower and noisier (a new tensor, maybe of another length)."""
        draws = torch.rand(3, generator=generator).tolist()
        if self.speed:
            orig = _SPEED_ORIG[min(int(draws[0] * len(_SPEED_ORIG)), len(_SPEED_ORIG) - 1)]
            audio = resample(audio, orig, 20)
        if draws[1] < self.noise_p:
            snr = self.noise_snr_db[0] + draws[2] * (self.noise_snr_db[1] - self.noise_snr_db[0])
            level = audio.square().mean().sqrt() * 10 ** (-snr / 20)
            audio = audio + torch.randn(audio.shape, generator=generator) * level
        return audio

    def features(
        self, features: Tensor, frames: int, generator: torch.Generator, frame_rate: float
    ) -> Tensor:
        """``features`` ``[T, F]`` (normalised: 0 is the mean) with SpecAugment masks set to 0, in place."""
        bands = features.shape[1]
        for _ in range(self.freq_masks):
            width, start = torch.rand(2, generator=generator).tolist()
            width = int(width * (self.freq_width + 1))
            start = int(start * (bands - width + 1))
            features[:, start : start + width] = 0
        count = int(self.time_masks * frames / frame_rate + torch.rand((), generator=generator).item())
        for _ in range(count):
            width, start = torch.rand(2, generator=generator).tolist()
            width = min(int(width * (self.time_width + 1)), frames // 10)
            start = int(start * (frames - width + 1))
            features[start : start + width] = 0
        return features

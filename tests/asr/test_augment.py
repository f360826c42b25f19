"""Training-time augmentation (speed, noise, SpecAugment masks): each does what it says, measured on the
signal (a tone's pitch, a noise's level, the masked bands and frames), draws from the caller's generator
alone, and reaches the training batches but not the test set's."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.asr.augment import _SPEED_ORIG, Augmentation
from tandem.asr.corpus import load_spoken_digits
from tandem.asr.distributed import Group
from tandem.asr.generator import ConnectedDigits, split_recordings
from tandem.asr.model import ModelConfig
from tandem.asr.training import DataSets, Run, TrainConfig

RATE = 8000


def _tone(hz: float, seconds: float = 1.0) -> torch.Tensor:
    t = torch.arange(int(RATE * seconds), dtype=torch.float64) / RATE
    return (0.3 * torch.sin(2 * math.pi * hz * t)).float()


def _peak_hz(audio: torch.Tensor) -> float:
    spectrum = torch.fft.rfft(audio.double() * torch.hann_window(len(audio), dtype=torch.float64)).abs()
    return float(spectrum.argmax()) * RATE / len(audio)


def test_speed_perturbation_scales_length_and_pitch_by_one_of_five_factors():
    """0.9x-1.1x as Kaldi's: a recording resampled by orig/20 is 20/orig as long and its pitch orig/20 as
    high (tempo and pitch together); every factor is drawn."""
    audio = _tone(400.0)
    speed_only = Augmentation(speed=True, noise_p=0.0)
    seen = set()
    for seed in range(40):
        out = speed_only.waveform(audio, torch.Generator().manual_seed(seed))
        orig = round(20 * len(audio) / len(out))
        assert orig in _SPEED_ORIG and len(out) == math.ceil(len(audio) * 20 / orig)
        assert _peak_hz(out) == pytest.approx(400.0 * orig / 20, abs=2.0)
        seen.add(orig)
    assert seen == set(_SPEED_ORIG)


def test_noise_is_added_at_the_drawn_signal_to_noise_ratio_with_its_probability():
    audio = _tone(300.0, seconds=2.0)
    noisy = Augmentation(speed=False, noise_p=1.0, noise_snr_db=(20.0, 20.0))
    out = noisy.waveform(audio, torch.Generator().manual_seed(0))
    noise = out - audio
    snr = 10 * math.log10(audio.square().mean().item() / noise.square().mean().item())
    assert snr == pytest.approx(20.0, abs=0.3)
    assert abs(noise.mean().item()) < 0.1 * noise.std().item()  # centred
    # noise_p: the share of utterances that get noise
    half = Augmentation(speed=False, noise_p=0.5)
    changed = [
        not torch.equal(half.waveform(audio, torch.Generator().manual_seed(s)), audio) for s in range(200)
    ]
    assert 70 <= sum(changed) <= 130
    quiet = Augmentation(speed=False, noise_p=0.0)
    assert torch.equal(quiet.waveform(audio, torch.Generator().manual_seed(0)), audio)


def test_spec_augment_masks_whole_bands_and_frames_within_their_widths():
    frames, bands = 300, 40  # 3 s at 100 frames a second
    masks = Augmentation(freq_masks=2, freq_width=6, time_masks=1.0, time_width=8)
    zero_bands, zero_frames = [], []
    for seed in range(50):
        features = torch.rand(frames, bands) + 1.0  # no zeros but the masks'
        out = masks.features(features, frames, torch.Generator().manual_seed(seed), frame_rate=100.0)
        assert out is features  # in place
        zero = out == 0
        bands_masked = zero.all(dim=0)
        frames_masked = zero.all(dim=1)
        # every zero is in a masked band or a masked frame
        assert torch.equal(zero, bands_masked.unsqueeze(0) | frames_masked.unsqueeze(1))
        zero_bands.append(int(bands_masked.sum()))
        zero_frames.append(int(frames_masked.sum()))
        assert zero_bands[-1] <= 2 * 6
        assert zero_frames[-1] <= 4 * 8  # up to 3 + 1 masks at one a second, each up to 8 frames
    assert max(zero_bands) > 6 and min(zero_bands) < 6  # widths drawn, two masks
    assert max(zero_frames) > 0


def test_the_draws_come_from_the_callers_generator_alone():
    audio = _tone(500.0)
    augment = Augmentation()
    a = augment.waveform(audio, torch.Generator().manual_seed(7))
    torch.manual_seed(123)  # the global generator plays no part
    b = augment.waveform(audio, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    others = [augment.waveform(audio, torch.Generator().manual_seed(s)) for s in range(8, 12)]
    assert any(len(o) != len(a) or not torch.equal(o, a) for o in others)


def test_none_changes_nothing():
    audio, features = _tone(500.0), torch.rand(120, 40) + 1.0
    none = Augmentation.none()
    assert torch.equal(none.waveform(audio, torch.Generator().manual_seed(0)), audio)
    before = features.clone()
    assert torch.equal(none.features(features, 120, torch.Generator().manual_seed(0), 100.0), before)


def _run(augment: bool, monkeypatch) -> Run:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rec = load_spoken_digits()
    train_ids, test_ids = split_recordings(rec)
    data = DataSets(ConnectedDigits(rec, train_ids[:64]), ConnectedDigits(rec, test_ids[:24]))
    config = TrainConfig(model=ModelConfig(hidden=16, layers=1, conv_channels=4), augment=augment)
    return Run(config, Group(torch.device("cpu"), 10), data)


def test_training_batches_are_augmented_reproducibly_and_the_test_set_is_not(monkeypatch):
    plain, augmented, again = (_run(a, monkeypatch) for a in (False, True, True))
    first = [next(r.batches())[0] for r in (plain, augmented, again)]
    assert first[0].transcripts == first[1].transcripts  # the same utterances ...
    assert not torch.equal(first[0].frames, first[1].frames) or not torch.equal(
        first[0].features, first[1].features
    )  # ... augmented
    assert torch.equal(first[1].features, first[2].features)  # the same draws in a second run
    tests = [list(r._test_batches(8, [])) for r in (plain, augmented)]
    assert len(tests[0]) == len(tests[1]) > 0
    for a, b in zip(*tests):
        assert torch.equal(a.features, b.features) and torch.equal(a.frames, b.frames)

"""Training-time augmentation (speed, noise, SpecAugment masks): each does what it says, measured on the
signal (a tone's pitch, a noise's level, the masked bands and frames), draws from the caller's generator
alone, and reaches the training batches but not the test set's."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.asr.augment import _SPEED_ORIG, Augmentation
from tandem.asr.batch import collate
from tandem.asr.corpus import load_spoken_digits
from tandem.asr.distributed import Group
from tandem.asr.features import FeatureConfig, LogMel
from tandem.asr.generator import ConnectedDigits, split_recordings
from tandem.asr.model import ModelConfig
from tandem.asr.text import ENGLISH
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


@pytest.mark.parametrize("frames", [30, 50])
def test_short_utterances_get_time_masks_sometimes_none_wider_than_a_tenth_of_them(frames):
    """An utterance under a second (here 0.3 s or 0.5 s at 100 frames a second) has a time mask with the
    chance of its fraction of a second (the count is rounded at random, not down to none), and no
    mask wider than a tenth of its frames, however wide ``time_width`` allows."""
    masks = Augmentation(freq_masks=0, time_masks=1.0, time_width=8)
    counts = []
    for seed in range(200):
        features = torch.rand(frames, 40) + 1.0
        masked = _masked_frames(masks.features(features, frames, torch.Generator().manual_seed(seed), 100.0))
        assert int(masked.sum()) <= frames // 10, seed  # at most one mask, at most frames // 10 wide
        counts.append(bool(masked.any()))
    # a mask drawn 0 frames wide masks nothing: about frames / 100 x (1 - 1 / 9) of them show one
    expected = 200 * frames / 100 * 8 / 9
    assert 0.6 * expected <= sum(counts) <= 1.4 * expected


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


def _noise(seconds: float, seed: int) -> torch.Tensor:
    """White noise: its log-mel frames are all different, so a frame of zeros is a time mask's."""
    return 0.1 * torch.randn(int(RATE * seconds), generator=torch.Generator().manual_seed(seed))


def _masked_frames(features: torch.Tensor) -> torch.Tensor:
    """``[T]``: the frames of ``features`` ``[T, F]`` set to 0 in every band."""
    return (features == 0).all(dim=1)


def test_an_utterances_augmentation_does_not_depend_on_its_batch():
    """collate draws an utterance's speed, noise and masks from its own seed alone, and places its time
    masks by its own frames, not the batch's padded length: a short utterance after a long one is
    augmented as it is alone (so its masks stay in its frames, at its own count and widths)."""
    logmel = LogMel(FeatureConfig())
    augment = Augmentation(time_masks=5.0)  # many masks a second: a wrong length changes their count
    short, long = _noise(0.6, 1), _noise(3.0, 2)
    masked = 0
    for seed in range(12):
        alone = collate([short], ["one"], logmel, ENGLISH, augment, [seed])
        batch = collate([long, short], ["two", "one"], logmel, ENGLISH, augment, [seed + 100, seed])
        n = int(alone.frames[0])
        assert int(batch.frames[1]) == n < batch.features.shape[1]  # padded
        assert torch.equal(_masked_frames(batch.features[1, :n]), _masked_frames(alone.features[0]))
        torch.testing.assert_close(batch.features[1, :n], alone.features[0])
        assert torch.equal(batch.features[1, n:], torch.zeros_like(batch.features[1, n:]))
        masked += int(_masked_frames(alone.features[0]).sum())
    assert masked > 0  # the masks are compared, not only their absence


def test_each_utterance_draws_from_its_own_seed():
    """Two utterances of a batch with the same seed are augmented alike, with different seeds differently
    (speed, noise and masks are drawn per utterance, not once for the batch)."""
    logmel, augment, audio = LogMel(FeatureConfig()), Augmentation(), _noise(1.0, 3)
    different = 0
    for seed in range(6):
        same = collate([audio, audio], ["one"] * 2, logmel, ENGLISH, augment, [seed, seed])
        assert torch.equal(same.frames[0], same.frames[1])
        assert torch.equal(same.features[0], same.features[1])
        other = collate([audio, audio], ["one"] * 2, logmel, ENGLISH, augment, [seed, seed + 50])
        different += not torch.equal(other.frames[0], other.frames[1]) or not torch.equal(
            other.features[0], other.features[1]
        )
    assert different == 6


@pytest.mark.parametrize("window_ms, hop_ms", [(25.0, 10.0), (20.0, 5.0)])
def test_collate_places_time_masks_per_second_of_audio_at_the_feature_hop(window_ms, hop_ms):
    """``time_masks`` is masks per second of audio: collate converts frames to seconds at the features'
    hop (frames a second = 1000 / hop_ms), whatever the window's length."""
    logmel = LogMel(FeatureConfig(window_ms=window_ms, hop_ms=hop_ms))
    masks = Augmentation(speed=False, noise_p=0.0, freq_masks=0, time_masks=1.0, time_width=8)
    seconds, per_utterance = 3.0, []
    for seed in range(40):
        batch = collate([_noise(seconds, seed)], ["one"], logmel, ENGLISH, masks, [seed])
        assert int(batch.frames[0]) == batch.features.shape[1]
        per_utterance.append(int(_masked_frames(batch.features[0]).sum()))
        assert per_utterance[-1] <= (int(seconds) + 1) * 8  # up to 3 + 1 masks, each up to 8 frames
    # one mask a second, 4 frames wide on average (0 to 8, a little less where two overlap)
    assert 2.5 <= sum(per_utterance) / len(per_utterance) / seconds <= 5.5


def test_the_batch_transcripts_are_the_normalised_text_its_targets_encode():
    """A batch's transcripts (the references evaluation scores against) are normalised as its CTC targets
    are: lower case, one space between words, none at the ends, whatever the caller's data set gave."""
    logmel = LogMel(FeatureConfig())
    audio = [_noise(0.5, 4), _noise(0.7, 5)]
    for augmentation, seeds in ((None, None), (Augmentation(), [0, 1])):
        batch = collate(audio, ["  Four\tTWO ", "nine"], logmel, ENGLISH, augmentation, seeds)
        assert batch.transcripts == ["four two", "nine"]
        ends = batch.target_lengths.cumsum(0).tolist()
        decoded = [ENGLISH.decode(batch.targets[e - n : e]) for e, n in zip(ends, batch.target_lengths)]
        assert decoded == batch.transcripts


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

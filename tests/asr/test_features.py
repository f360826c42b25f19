"""Log-mel features and resampling against independent implementations: librosa's HTK mel filterbank and
spectrogram, scipy's polyphase resampler, and exact band-limited signals."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from tandem.asr.corpus import load_spoken_digits
from tandem.asr.features import FeatureConfig, LogMel, mel_filterbank, resample

librosa = pytest.importorskip("librosa")
scipy_signal = pytest.importorskip("scipy.signal")


@pytest.mark.parametrize(
    "rate, n_fft, n_mels, f_min, f_max",
    [(8000, 256, 40, 0.0, None), (16000, 512, 80, 20.0, 7600.0), (8000, 256, 64, 100.0, 3800.0)],
    ids=["8k-40", "16k-80-band", "8k-64-band"],
)
def test_filterbank_equals_librosa_htk(rate, n_fft, n_mels, f_min, f_max):
    ours = mel_filterbank(rate, n_fft, n_mels, f_min, f_max).numpy()
    ref = librosa.filters.mel(
        sr=rate, n_fft=n_fft, n_mels=n_mels, fmin=f_min, fmax=f_max, htk=True, norm=None
    )
    np.testing.assert_allclose(ours, ref.T, rtol=1e-5, atol=1e-6)


def _librosa_logmel(audio: np.ndarray, cfg: FeatureConfig) -> np.ndarray:
    """librosa's power mel spectrogram of the same frames, logged and normalised as LogMel documents.
    librosa centres a ``win_length`` window in each ``n_fft`` frame, so the audio is shifted by half the
    difference to put the same samples under each window (and padded after, where the window is 0)."""
    shift = (cfg.n_fft - cfg.win_length) // 2
    y = np.concatenate(
        [np.zeros(shift), audio.astype(np.float64), np.zeros(cfg.n_fft - cfg.win_length - shift)]
    )
    mel = librosa.feature.melspectrogram(
        y=y, sr=cfg.sample_rate, n_fft=cfg.n_fft, hop_length=cfg.hop_length, win_length=cfg.win_length,
        window="hann", center=False, power=2.0, n_mels=cfg.n_mels, htk=True, norm=None,
    ).T  # fmt: skip
    log = np.log(mel + 1e-6)
    centred = log - log.mean(0)
    return centred / ((log.std(0) if cfg.normalize == "band" else centred.std()) + 1e-5)


@pytest.mark.parametrize(
    "cfg, dtype, atol",
    [
        (FeatureConfig(), torch.float64, 1e-6),  # librosa keeps its filterbank in float32
        (FeatureConfig(16000, 80, 25.0, 10.0), torch.float64, 1e-6),
        (FeatureConfig(), torch.float32, 2e-3),
        (FeatureConfig(normalize="band"), torch.float64, 1e-6),
        (FeatureConfig(16000, 80, 25.0, 10.0, "band"), torch.float64, 1e-6),
    ],
    ids=["8k-40-float64", "16k-80-float64", "8k-40-float32", "8k-40-band-float64", "16k-80-band-float64"],
)
def test_logmel_equals_librosa_on_real_speech(cfg, dtype, atol):
    rec = load_spoken_digits()
    audio = [rec.audio(i).to(dtype) for i in (0, 1234, 2999)]
    if cfg.sample_rate != rec.sample_rate:
        audio = [resample(a, rec.sample_rate, cfg.sample_rate) for a in audio]
    lengths = torch.tensor([len(a) for a in audio])
    batch = torch.nn.utils.rnn.pad_sequence(audio, batch_first=True)
    features, frames = LogMel(cfg)(batch, lengths)
    assert features.shape == (3, int(frames.max()), cfg.n_mels)
    for i, a in enumerate(audio):
        ref = _librosa_logmel(a.numpy(), cfg)
        assert frames[i] == len(ref)
        np.testing.assert_allclose(features[i, : len(ref)].numpy(), ref, rtol=0, atol=atol)
        assert torch.all(features[i, len(ref) :] == 0)


def test_logmel_of_an_utterance_does_not_depend_on_its_batch():
    rec = load_spoken_digits()
    a, b = rec.audio(7), rec.audio(2500)
    lm = LogMel()
    alone, n = lm(a[None], torch.tensor([len(a)]))
    batch = torch.nn.utils.rnn.pad_sequence([b, a], batch_first=True)
    together, frames = lm(batch, torch.tensor([len(b), len(a)]))
    assert frames[1] == n[0]
    torch.testing.assert_close(together[1, : int(n[0])], alone[0], rtol=0, atol=1e-5)


def test_recording_shorter_than_a_window_has_one_frame():
    features, frames = LogMel()(torch.randn(1, 50) * 0.1, torch.tensor([50]))
    assert frames.tolist() == [1] and features.shape == (1, 1, 40) and torch.isfinite(features).all()


def _tones(rate: int, seconds: float, freqs=(440.0, 1000.0, 2500.0)) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return sum(np.sin(2 * np.pi * f * t + k) for k, f in enumerate(freqs))


@pytest.mark.parametrize(
    "orig, new",
    [
        (16000, 8000),
        (44100, 8000),
        (22050, 8000),
        (48000, 16000),
        (8000, 16000),
        (11025, 8000),
        (44056, 8000),  # ratios that do not reduce: interpolated output by output, one filter per phase
        (8001, 8000),
    ],
)
def test_resample_keeps_the_band_and_matches_scipy(orig, new):
    x = _tones(orig, 0.5)
    ours = resample(torch.from_numpy(x), orig, new).numpy()
    assert len(ours) == math.ceil(len(x) * new / orig)
    exact = _tones(new, len(ours) / new)[: len(ours)]
    inner = slice(len(ours) // 8, -len(ours) // 8)  # away from the edges, where both pad with zeros
    assert np.abs(ours[inner] - exact[inner]).max() < 1e-3
    theirs = scipy_signal.resample_poly(x, new // math.gcd(orig, new), orig // math.gcd(orig, new))
    assert np.abs(ours[inner] - theirs[inner]).max() < 5e-3


@pytest.mark.parametrize("tone", [3000.0, 4500.0, 6000.0])
def test_resample_removes_what_the_new_rate_cannot_hold(tone):
    """A tone above the new Nyquist frequency (4 kHz) must vanish, not fold back as an alias."""
    x = _tones(16000, 1.0, (tone,))
    y = resample(torch.from_numpy(x), 16000, 8000).numpy()[800:-800]
    rms = np.sqrt((y**2).mean())
    if tone < 3800:  # inside the pass band (0.945 x 4 kHz)
        assert abs(rms - np.sqrt(0.5)) < 0.01
    else:
        assert rms < 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_resample_by_phase_equals_output_by_output(dtype, monkeypatch):
    """44056 Hz to 8 kHz: the interpolation's filters taken from a table of its 1000 phases (4-5x faster)
    are bit for bit those computed for each output, which rates beyond the table's size still take."""
    from tandem.asr import features

    x = torch.randn(2, 9000, dtype=dtype)
    by_phase = resample(x, 44056, 8000)
    monkeypatch.setattr(features, "_PHASE_ENTRIES", 0)
    assert torch.equal(resample(x, 44056, 8000), by_phase)


def test_resample_shapes_and_errors():
    x = torch.randn(2, 3, 16000)
    assert resample(x, 16000, 8000).shape == (2, 3, 8000)
    assert resample(x, 8000, 8000) is x
    with pytest.raises(ValueError, match="orig_freq"):
        resample(x, 0, 8000)
    with pytest.raises(ValueError, match="new_freq"):
        resample(x, 8000, 7999.5)


def test_feature_config_takes_numbers_of_any_kind_and_refuses_what_computes_nothing():
    """Checked when made (a checkpoint's settings too), not at the first recording: numpy's numbers and a
    whole float are taken, as Python's int and float; what gives no sample, or no number, is refused."""
    from fractions import Fraction

    config = FeatureConfig(
        sample_rate=np.int64(16000), n_mels=np.int32(80), window_ms=np.float32(25), hop_ms=Fraction(10)
    )
    assert config == FeatureConfig(16000, 80, 25.0, 10.0)
    assert type(config.sample_rate) is int and type(config.hop_ms) is float
    assert FeatureConfig(sample_rate=8000.0).to_dict() == FeatureConfig().to_dict()
    refused = [
        ({"sample_rate": 0}, "sample_rate a positive integer up to 10^7, got 0"),
        ({"sample_rate": 10**400}, "sample_rate a positive integer up to 10^7"),  # (an OverflowError)
        ({"sample_rate": 8000.5}, "sample_rate a positive integer"),
        ({"n_mels": True}, "n_mels a positive integer up to 10^7, got True"),
        ({"hop_ms": 0.0}, "hop_ms in milliseconds, above 0 up to 10000, got 0.0"),
        ({"window_ms": 1e308}, "window_ms in milliseconds"),
        ({"window_ms": float("nan")}, "window_ms in milliseconds"),
        ({"hop_ms": "10"}, "hop_ms in milliseconds"),
        ({"sample_rate": 100, "hop_ms": 1.0}, "hop_ms of at least one sample at 100 Hz, got 1.0"),
        ({"normalize": "global"}, "normalize one of 'utterance', 'band', got 'global'"),
        ({"normalize": None}, "normalize one of 'utterance', 'band', got None"),
    ]
    for settings, message in refused:
        with pytest.raises(ValueError, match=re.escape(f"FeatureConfig: expected {message}")):
            FeatureConfig(**settings)

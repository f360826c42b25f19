"""The bundled recordings (against the script that builds them and the original WAV files) and the
connected-digit generator: deterministic per seed, splits disjoint, transcripts true to the audio."""

from __future__ import annotations

import math
import subprocess
import sys
import wave
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tandem.asr.corpus import DIGIT_WORDS, SPOKEN_DIGITS, load_spoken_digits
from tandem.asr.generator import ConnectedDigits, split_recordings
from tandem.asr.training import AUGMENTED_GAIN_DB, TEST_SEED, _batches, digit_sets

ROOT = Path(__file__).resolve().parents[2]
FSDD = ROOT.parent / "shared" / "data" / "fsdd"
needs_fsdd = pytest.mark.skipif(
    not FSDD.exists(), reason="the original WAV files are not beside this checkout"
)


@pytest.fixture(scope="module")
def rec():
    return load_spoken_digits()


def test_bundled_recordings(rec):
    assert len(rec) == 3000 and rec.sample_rate == 8000
    assert rec.speakers == ("george", "jackson", "lucas", "nicolas", "theo", "yweweler")
    assert torch.equal(torch.bincount(rec.speaker), torch.full((6,), 500))
    assert sorted(set(rec.words)) == sorted(DIGIT_WORDS) and rec.words.count("seven") == 300
    assert rec.index.min() == 0 and rec.index.max() == 49
    assert rec.samples.abs().max() <= 1.0 and rec.offsets[-1] == len(rec.samples)


@needs_fsdd
def test_bundled_file_is_what_the_script_makes(tmp_path):
    out = tmp_path / "digits.npz"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_spoken_digits.py"), str(FSDD), str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    with np.load(out) as fresh, np.load(SPOKEN_DIGITS) as shipped:
        assert sorted(fresh.files) == sorted(shipped.files)
        for key in fresh.files:
            np.testing.assert_array_equal(fresh[key], shipped[key], err_msg=key)


@needs_fsdd
@pytest.mark.parametrize("name", ["0_george_0.wav", "7_jackson_32.wav", "9_yweweler_49.wav", "4_theo_3.wav"])
def test_recordings_equal_the_original_wav_files(rec, name):
    digit, speaker, index = name[:-4].split("_")
    (i,) = [
        i
        for i in range(len(rec))
        if rec.words[i] == DIGIT_WORDS[int(digit)]
        and rec.speakers[rec.speaker[i]] == speaker
        and rec.index[i] == int(index)
    ]
    with wave.open(str(FSDD / "recordings" / name)) as w:
        original = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    np.testing.assert_array_equal(rec.audio(i).numpy() * 32768, original.astype(np.float32))


def test_customary_split_is_takes_0_to_4(rec):
    train, test = split_recordings(rec)
    assert len(train) == 2700 and len(test) == 300 and not set(train) & set(test)
    assert all(rec.index[i] < 5 for i in test) and all(rec.index[i] >= 5 for i in train)


def test_held_out_speaker(rec):
    train, test = split_recordings(rec, "theo")
    assert len(test) == 500 and len(train) == 2500
    assert {rec.speakers[rec.speaker[i]] for i in test} == {"theo"}
    assert "theo" not in {rec.speakers[rec.speaker[i]] for i in train}
    with pytest.raises(ValueError, match="--test-speaker: expected one of"):
        split_recordings(rec, "nobody")


def test_plan_is_a_function_of_the_seed(rec):
    _, test = split_recordings(rec)
    digits = ConnectedDigits(rec, test)
    assert digits.plan(3) == digits.plan(3) and digits.plan(3) != digits.plan(4)
    assert digits.plan((0, 5)) == ConnectedDigits(rec, test).plan((0, 5))


@pytest.mark.parametrize("passes", [1, 2])
def test_plan_uses_every_recording_passes_times_one_speaker_each(rec, passes):
    train, _ = split_recordings(rec)
    plan = ConnectedDigits(rec, train).plan(0, passes=passes)
    used = [r for u in plan for r in u.recordings]
    assert sorted(used) == sorted(train * passes)
    sizes = [len(u.recordings) for u in plan]
    assert min(sizes) == 1 and max(sizes) == 7
    for u in plan:
        assert len({int(rec.speaker[r]) for r in u.recordings}) == 1
        assert u.transcript == " ".join(rec.words[r] for r in u.recordings)
        assert len(u.gaps) == len(u.recordings) + 1
        assert all(240 <= g <= 2400 for g in u.gaps[1:-1])  # 30-300 ms at 8 kHz


def test_render_places_each_recording_after_its_gap(rec):
    _, test = split_recordings(rec)
    digits = ConnectedDigits(rec, test, noise_dbfs=(-200.0, -200.0), gain_db=(0.0, 0.0))
    u = next(u for u in digits.plan(1) if len(u.recordings) >= 3)
    audio = digits.render(u)
    assert audio.shape == (u.length,) and audio.dtype == torch.float32
    at = u.gaps[0]
    assert audio[:at].abs().max() < 1e-6
    for r, gap in zip(u.recordings, u.gaps[1:]):
        word = rec.audio(r)
        torch.testing.assert_close(audio[at : at + len(word)], word, rtol=0, atol=1e-6)
        at += len(word)
        assert audio[at : at + gap].abs().max() < 1e-6
        at += gap
    assert at == u.length


def test_render_is_deterministic_and_noisy_between_words(rec):
    _, test = split_recordings(rec)
    digits = ConnectedDigits(rec, test)
    u = digits.plan(0)[0]
    a, b = digits.render(u), digits.render(u)
    assert torch.equal(a, b)
    gap = a[: u.gaps[0]]
    assert 0 < gap.std() < 0.01  # low-level noise, not silence and not speech


def test_the_background_noise_is_at_its_configured_level_in_dbfs(rec):
    """Each utterance's noise level is drawn in dB of full scale (default -80 to -50 dBFS), converted as
    an amplitude (/ 20): the noise rendered between words has that RMS. (At / 10 it fell to -160 to
    -100 dBFS, well below a 16-bit step, and the test of a noisy gap still passed.)"""
    _, test = split_recordings(rec)
    digits = ConnectedDigits(rec, test)
    plan = digits.plan(0)
    levels = 20 * np.log10([u.noise for u in plan])
    assert levels.min() >= -80.0 and levels.max() <= -50.0
    assert levels.min() < -75.0 and levels.max() > -55.0  # the whole range is drawn
    for u in plan[:40]:
        audio = digits.render(u)
        at, gaps = 0, []
        for r, gap in zip((None, *u.recordings), u.gaps):
            at += 0 if r is None else len(rec.audio(r))
            gaps.append(audio[at : at + gap])
            at += gap
        between = torch.cat(gaps)
        rms_db = 20 * math.log10(float(between.square().mean().sqrt()))
        assert abs(rms_db - 20 * math.log10(u.noise)) < 1.0, (rms_db, u.noise)
        assert -81.0 <= rms_db <= -49.0


@pytest.mark.parametrize("speaker", [None, "theo"])
def test_augmented_training_gains_span_the_wider_range_and_the_test_set_stays(rec, speaker):
    plain, augmented = digit_sets(rec, speaker), digit_sets(rec, speaker, augment=True)
    assert augmented.test.plan(TEST_SEED) == plain.test.plan(TEST_SEED)
    gains = [20 * math.log10(u.gain) for u in augmented.train.plan(0)]
    low, high = AUGMENTED_GAIN_DB
    assert low <= min(gains) < low + 2 and high - 2 < max(gains) <= high
    assert min(20 * math.log10(u.gain) for u in plain.train.plan(0)) >= -10.0


def test_training_utterances_may_start_and_end_on_a_word_the_test_set_keeps_its_edges(rec):
    """People's recordings are often cut close to the speech: some training utterances are too (edges
    from 0 ms); the test utterances keep the generator's 20-200 ms, so that runs still compare."""
    sets = digit_sets(rec)
    rate = rec.sample_rate / 1000
    train_edges = [e for u in sets.train.plan(0) for e in (u.gaps[0], u.gaps[-1])]
    test_edges = [e for u in sets.test.plan(TEST_SEED) for e in (u.gaps[0], u.gaps[-1])]
    assert min(train_edges) < 10 * rate and max(train_edges) <= 200 * rate
    assert min(test_edges) >= 20 * rate


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("count", [1, 31, 32, 33, 65, 70, 97])
def test_every_planned_utterance_is_in_one_global_batch_that_every_rank_has_a_share_of(count, world):
    """Batches of 32 by length: a last batch too small for every rank to get an utterance was dropped,
    and with it the same longest recordings of a manifest every epoch (65 of them on 2 ranks: the
    longest never trained). It now joins the batch before it; only a plan of fewer utterances than
    ranks has no batch."""
    plan = [SimpleNamespace(length=int(n)) for n in np.random.default_rng(count).integers(100, 9000, count)]
    batches = _batches(plan, 32, world, np.random.default_rng(0))
    assert all(len(b) >= world for b in batches) and all(len(b) < 32 + world for b in batches)
    trained = sorted(id(u) for b in batches for u in b)
    assert trained == (sorted(id(u) for u in plan) if count >= world else [])

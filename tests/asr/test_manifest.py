"""Training on your own recordings: NeMo-style manifests of WAV files (here bundled recordings written at
16 kHz, so the resampler runs), every kind of malformed manifest refused before anything is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from _cli import tandem

from tandem.asr.audio import read_audio
from tandem.asr.augment import FASTEST
from tandem.asr.corpus import load_spoken_digits
from tandem.asr.features import FeatureConfig, resample
from tandem.asr.generator import ConnectedDigits, split_recordings
from tandem.asr.manifest import ManifestError, ctc_frames_needed, read_manifest
from tandem.asr.model import ModelConfig
from tandem.asr.text import ENGLISH, Alphabet

soundfile = pytest.importorskip("soundfile")


def _write_wav(path: Path, audio: torch.Tensor, rate: int = 16000) -> None:
    soundfile.write(str(path), resample(audio, 8000, rate).numpy(), rate, subtype="PCM_16")


@pytest.fixture(scope="module")
def manifests(tmp_path_factory) -> tuple[Path, Path]:
    """Two-word utterances of george and jackson: 40 from takes 5-49 to train on, 8 from takes 0-4 to test
    on; WAV files at 16 kHz in a folder beside the manifests (relative paths) and one absolute path."""
    folder = tmp_path_factory.mktemp("manifests")
    (folder / "audio").mkdir()
    rec = load_spoken_digits()
    train_ids, test_ids = split_recordings(rec)
    speakers = {rec.speakers.index("george"), rec.speakers.index("jackson")}
    paths = []
    for name, ids, count in (("train", train_ids, 40), ("test", test_ids, 8)):
        ids = [i for i in ids if int(rec.speaker[i]) in speakers]
        digits = ConnectedDigits(rec, ids, max_words=2)
        lines = []
        for k, u in enumerate(digits.plan(1)[:count]):
            wav = folder / "audio" / f"{name}{k}.wav"
            audio = digits.render(u)
            _write_wav(wav, audio)
            where = str(wav) if k == 0 else f"audio/{wav.name}"
            line = {"audio_filepath": where, "text": u.transcript.upper(), "duration": len(audio) / 8000}
            lines.append(json.dumps(line))
        paths.append(folder / f"{name}.jsonl")
        paths[-1].write_text("\n".join(lines) + "\n")
    return paths[0], paths[1]


def test_a_short_run_learns_the_manifests_recordings(manifests, tmp_path):
    train, test = manifests
    out = tmp_path / "run"
    done = tandem(
        "--train-manifest", str(train), "--test-manifest", str(test), "--nproc", "2", "--threads", "1",
        "--hidden", "64", "--layers", "2", "--batch-size", "8", "--epochs", "25", "--warmup-steps", "10",
        "--lr", "0.03", "--workers", "1", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    history = metrics["history"]
    assert history[-1]["train_loss"] < 0.3 * history[0]["train_loss"], history
    words = sum(len(json.loads(line)["text"].split()) for line in test.read_text().splitlines())
    assert history[-1]["test_cer"] < 0.6 and history[-1]["test_words"] == words, history
    assert metrics["config"]["train_manifest"] == str(train.resolve())
    assert "8 test utterances" in done.stdout


def _manifest(tmp_path: Path, lines: list[object]) -> Path:
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def _bad_manifests(tmp_path: Path, good_wav: Path) -> dict[str, tuple[list[object], str]]:
    not_audio = tmp_path / "notes.wav"
    not_audio.write_text("these are words, not sound")
    short = tmp_path / "short.wav"
    soundfile.write(str(short), (torch.randn(1600) * 0.1).numpy(), 16000)  # 0.1 s
    slow = tmp_path / "slow.wav"  # a 1 Hz header: hours of audio at the model's rate
    soundfile.write(str(slow), (torch.randn(4000) * 0.1).numpy(), 1)
    truncated = tmp_path / "cut.wav"  # a copy cut short: libsndfile would read its first half quietly
    truncated.write_bytes(good_wav.read_bytes()[: len(good_wav.read_bytes()) // 2])
    ok = {"audio_filepath": str(good_wav), "text": "two"}
    seconds = soundfile.info(str(good_wav)).duration
    pipe = tmp_path / "pipe.wav"  # it was "no such file"
    if not pipe.exists():
        os.mkfifo(pipe)
    return {
        "truncated": (
            [ok, {"audio_filepath": str(truncated), "text": "two"}],
            f":2: audio file {truncated}: a truncated WAV file: its header announces",
        ),
        "invalid-json": ([ok, '{"audio_filepath": "a.wav", "text": '], ":2: invalid JSON"),
        "missing-key": ([ok, {"audio_filepath": str(good_wav)}], ":2: missing key(s) 'text'"),
        "empty-text": ([ok, {"audio_filepath": str(good_wav), "text": "  "}], ":2: empty text"),
        "alphabet": (
            [ok, {"audio_filepath": str(good_wav), "text": "café 2"}],
            ":2: characters 'é2' are not in",
        ),
        "missing-file": ([ok, {"audio_filepath": "gone.wav", "text": "two"}], "gone.wav: no such file"),
        "not-audio": ([ok, {"audio_filepath": str(not_audio), "text": "two"}], "not a readable recording"),
        "too-short": (
            [ok, {"audio_filepath": str(short), "text": "seven eight nine"}],
            ":2: audio file " + str(short) + " is too short for its transcript",
        ),
        "not-an-object": ([ok, "[1, 2]"], ":2: expected a JSON object, got list"),
        "directory": ([ok, {"audio_filepath": str(tmp_path), "text": "two"}], f"{tmp_path}: a directory"),
        "negative-duration": (
            [ok, {"audio_filepath": str(good_wav), "text": "two", "duration": -5}],
            ":2: expected 'duration' to be a number of seconds, above 0, got -5",
        ),
        "text-duration": (
            [ok, {"audio_filepath": str(good_wav), "text": "two", "duration": "n/a"}],
            ":2: expected 'duration' to be a number of seconds, above 0, got 'n/a'",
        ),
        "nan-offset": (
            [ok, f'{{"audio_filepath": "{good_wav}", "text": "two", "offset": NaN}}'],
            ":2: expected 'offset' to be a number of seconds, 0 or more, got nan",
        ),
        "offset-past-the-end": (
            [ok, {"audio_filepath": str(good_wav), "text": "two", "offset": seconds}],
            f":2: 'offset' {seconds} s is at or past the end of audio file {good_wav}",
        ),
        "duration-past-the-end": (
            [ok, {"audio_filepath": str(good_wav), "text": "two", "offset": 0.5, "duration": seconds}],
            f":2: 'offset' + 'duration' = {0.5 + seconds:.3f} s reaches past the end of audio file "
            f"{good_wav}",
        ),
        "huge-integer-offset": (  # an integer beyond float's range: OverflowError, a traceback
            [ok, f'{{"audio_filepath": "{good_wav}", "text": "two", "offset": 1{"0" * 400}}}'],
            ":2: expected 'offset' to be a number of seconds, 0 or more, got 100000000000... (an integer of "
            "401 digits)",
        ),
        "longer-integer": (  # more digits than Python converts: json's ValueError, a traceback
            [ok, f'{{"audio_filepath": "{good_wav}", "text": "two", "offset": 1{"0" * 5000}}}'],
            ":2: invalid JSON (Exceeds the limit (4300 digits) for integer string conversion",
        ),
        "blank": (  # --alphabet, the hint, refuses the blank
            [ok, {"audio_filepath": str(good_wav), "text": "two_three"}],
            ":2: characters '_' are not in the alphabet \" 'abcdefghijklmnopqrstuvwxyz\" ('_' is CTC's blank "
            "and cannot be a character)",
        ),
        "pipe": (
            [ok, {"audio_filepath": str(pipe), "text": "two"}],
            f":2: audio file {pipe}: not a regular file",
        ),
        "rate": (
            [ok, {"audio_filepath": str(slow), "text": "two"}],
            f":2: audio file {slow}: sample rate 1 Hz is outside the rates taken, 1000-768000 Hz",
        ),
    }


def test_every_kind_of_problem_is_named_with_its_line(manifests, tmp_path):
    good = next((manifests[0].parent / "audio").glob("*.wav"))
    for name, (lines, message) in _bad_manifests(tmp_path, good).items():
        with pytest.raises(ManifestError) as error:
            read_manifest(_manifest(tmp_path, lines), ENGLISH, FeatureConfig(), ModelConfig())
        assert message in str(error.value) and "1 problem(s)" in str(error.value), name


def _speech(path: Path, channels: int = 1, rate: int = 8000) -> Path:
    """Half a second of noise at speech level: a recording the check takes for a one-letter transcript."""
    noise = np.random.default_rng(0).uniform(-0.3, 0.3, (rate // 2, 1))
    soundfile.write(str(path), np.repeat(noise, channels, 1), rate, subtype="PCM_16")
    return path


def _problem(path: Path) -> str:
    """The one problem :func:`read_manifest` finds in the manifest ``path``."""
    with pytest.raises(ManifestError) as error:
        read_manifest(path, ENGLISH, FeatureConfig(), ModelConfig())
    message = str(error.value)
    assert "1 problem(s)" in message, message
    return message


@pytest.mark.parametrize(
    "error",
    [
        PermissionError(13, "Permission denied"),
        IsADirectoryError(21, "Is a directory"),
        OSError(5, "Input/output error"),
    ],
    ids=["permission", "directory", "io"],
)
def test_a_file_that_cannot_be_opened_is_a_problem_naming_it_and_why(tmp_path, monkeypatch, error):
    """A file the user may not read (chmod 000, another user's) or that fails to open ended the check with
    a traceback: it is a problem of its line, as a missing file is. (Opening is made to fail: root, as in
    a container, reads any file.)"""
    from tandem.asr import manifest

    good, locked = _speech(tmp_path / "good.wav"), _speech(tmp_path / "locked.wav")
    real = open

    def opening(file, *args, **kwargs):
        if Path(file) == locked:
            raise type(error)(error.errno, error.strerror, str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(manifest, "open", opening, raising=False)
    lines = [{"audio_filepath": str(good), "text": "a"}, {"audio_filepath": "locked.wav", "text": "a"}]
    message = _problem(_manifest(tmp_path, lines))
    assert f"m.jsonl:2: audio file {locked}: cannot read it ({error.strerror})" in message, message


def test_a_recording_of_no_samples_is_refused(tmp_path):
    """An empty file, or a ``duration`` shorter than one sample, passed the check and stopped training when
    it was met ('empty recording', hours into a run): each is its line's problem."""
    good, empty = _speech(tmp_path / "good.wav"), tmp_path / "empty.wav"
    soundfile.write(str(empty), np.zeros((0, 1)), 8000, subtype="PCM_16")
    ok = {"audio_filepath": str(good), "text": "a"}
    message = _problem(_manifest(tmp_path, [ok, {"audio_filepath": str(empty), "text": "a"}]))
    assert f"m.jsonl:2: audio file {empty}: an empty recording (0 samples)" in message, message
    for duration in (0.00001, 0.4 / 8000):
        message = _problem(_manifest(tmp_path, [ok, {**ok, "duration": duration, "offset": 0.25}]))
        expected = f"m.jsonl:2: 'duration' {duration} s holds no sample of audio file {good} (one sample is"
        assert expected in message and "0.000125 s at its 8000 Hz)" in message, message
    # one sample is a recording
    (entry,) = read_manifest(
        _manifest(tmp_path, [{**ok, "duration": 0.6 / 8000}]), ENGLISH, FeatureConfig(), ModelConfig()
    )
    assert (entry.start, entry.frames, entry.samples) == (0, 1, 1)


def test_a_huge_offset_or_duration_is_refused_not_an_overflow(tmp_path):
    """A finite but huge ``offset`` (1e308 s) raised OverflowError from the sample it starts at: it is past
    the end of the file, as a duration that long is, each written in a few digits."""
    good = _speech(tmp_path / "good.wav")
    ok = {"audio_filepath": str(good), "text": "a"}
    for extra, expected in (
        (
            {"offset": 1e308},
            f"m.jsonl:2: 'offset' 1e+308 s is at or past the end of audio file {good} (0.500 s",
        ),
        (
            {"duration": 1e308},
            f"m.jsonl:2: 'offset' + 'duration' = 1e+308 s reaches past the end of audio file {good} (0.500 s",
        ),
        ({"offset": 1e308, "duration": 1e308}, "m.jsonl:2: 'offset' 1e+308 s is at or past the end"),
        ({"offset": 0.1, "duration": 1.7e308}, "m.jsonl:2: 'offset' + 'duration' = 1.7e+308 s reaches past"),
    ):
        message = _problem(_manifest(tmp_path, [ok, {**ok, **extra}]))
        assert expected in message, message


def test_a_file_with_more_channels_than_an_array_may_have_is_trained_on(tmp_path):
    """A file's samples are [channels, samples] whatever their number: a 100-channel take (a microphone
    array) passed the check and then stopped training, told to 'pass its transpose'."""
    from tandem.asr.audio import MAX_CHANNELS, read_audio, to_model_input
    from tandem.asr.manifest import ManifestSet

    wide = _speech(tmp_path / "wide.wav", channels=MAX_CHANNELS + 36)
    entries = read_manifest(
        _manifest(tmp_path, [{"audio_filepath": str(wide), "text": "a"}]),
        ENGLISH,
        FeatureConfig(),
        ModelConfig(),
    )
    data = ManifestSet(entries, 8000)
    waveform, rate = read_audio(wide)
    assert waveform.shape[0] == 100
    expected = to_model_input(waveform[:1], rate, 8000)  # every channel the same: the mix is one of them
    assert torch.allclose(data.render(data.plan(0)[0]), expected, atol=1e-6)


def test_offset_and_duration_cut_segments_out_of_a_recording_as_nemo_reads_them(manifests, tmp_path):
    """NeMo reads ``duration`` seconds from ``offset`` (0 if absent), or to the end without a duration:
    each line trains on its own segment (the whole file was read for every line, without a word)."""
    from tandem.asr.audio import to_model_input
    from tandem.asr.manifest import ManifestSet

    rate = 16000
    long = tmp_path / "long.wav"
    samples = torch.randn(3 * rate, generator=torch.Generator().manual_seed(0)) * 0.1
    soundfile.write(str(long), samples.numpy(), rate, subtype="FLOAT")
    lines = [
        {"audio_filepath": "long.wav", "text": "two", "offset": 0.5, "duration": 1.25},
        {"audio_filepath": "long.wav", "text": "two", "offset": 2},
        {"audio_filepath": "long.wav", "text": "two", "duration": 1},
        {"audio_filepath": "long.wav", "text": "two", "duration": 3.05},  # within the slack: all of it
        {"audio_filepath": "long.wav", "text": "two", "offset": 0, "duration": 3, "speaker": "x"},
        {"audio_filepath": "long.wav", "text": "two"},
    ]
    entries = read_manifest(_manifest(tmp_path, lines), ENGLISH, FeatureConfig(), ModelConfig())
    parts = [(8000, 28000), (32000, 48000), (0, 16000), (0, 48000), (0, 48000), (0, 48000)]
    assert [(e.start, e.frames) for e in entries] == [(8000, 20000), (32000, -1), (0, 16000)] + [(0, -1)] * 3
    data = ManifestSet(entries, 8000)
    plan = {u.index: u for u in data.plan(0)}
    for i, (a, b) in enumerate(parts):
        expected = to_model_input(samples[a:b], rate, 8000)
        audio = data.render(plan[i])
        assert torch.equal(audio, expected) and entries[i].samples == len(audio) == plan[i].length, i
    # a manifest without offsets or durations keeps the fingerprint it had before they were read
    whole = ManifestSet(entries[3:], 8000)
    import hashlib

    listed = [[str(e.path), e.text, e.samples] for e in entries[3:]]
    assert whole.fingerprint() == hashlib.sha256(json.dumps(listed).encode()).hexdigest()
    assert len({ManifestSet([e], 8000).fingerprint() for e in entries[:3]}) == 3


@pytest.mark.parametrize("rate, kept", [(44100, 22051), (22050, 11026), (44100, 22050)])
def test_an_entrys_samples_are_what_rendering_it_gives_at_a_rate_that_is_no_multiple(tmp_path, rate, kept):
    """A recording at 44.1 kHz or 22.05 kHz is resampled to the model's 8 kHz by a ratio that is not whole:
    the length the check gives its entry (the plan's, the batches' and the check of its frames) is the
    rendered one, the partial last sample rounded up as resampling rounds it."""
    from tandem.asr.manifest import ManifestSet

    audio = np.random.default_rng(0).uniform(-0.3, 0.3, kept)
    soundfile.write(str(tmp_path / "odd.wav"), audio, rate, subtype="PCM_16")
    entries = read_manifest(
        _manifest(tmp_path, [{"audio_filepath": "odd.wav", "text": "two"}]),
        ENGLISH,
        FeatureConfig(),
        ModelConfig(),
    )
    data = ManifestSet(entries, 8000)
    (u,) = data.plan(0)
    assert entries[0].samples == u.length == len(data.render(u)) == -(-kept * 8000 // rate)


def test_lines_end_at_newlines_only_and_a_byte_order_mark_is_skipped(manifests, tmp_path):
    """JSON text may hold U+2028, U+0085 and other characters str.splitlines() cuts at (json.dumps with
    ensure_ascii=False writes them as they are); Windows tools write a BOM and CRLF."""
    good = next((manifests[0].parent / "audio").glob("*.wav"))
    note = "a\u2028b\x85c\x0cd"
    lines = [
        json.dumps({"audio_filepath": str(good), "text": "two", "note": note}, ensure_ascii=False),
        json.dumps({"audio_filepath": str(good), "text": "one"}),
        json.dumps({"audio_filepath": "gone.wav", "text": "one"}),
    ]
    path = tmp_path / "m.jsonl"
    path.write_bytes("\ufeff".encode() + "\r\n".join(lines).encode() + b"\r\n")
    with pytest.raises(ManifestError) as error:
        read_manifest(path, ENGLISH, FeatureConfig(), ModelConfig())
    message = str(error.value)
    assert "1 problem(s)" in message and f"{path}:3: audio file" in message, message
    path.write_bytes("\ufeff".encode() + "\r\n".join(lines[:2]).encode())
    entries = read_manifest(path, ENGLISH, FeatureConfig(), ModelConfig())
    assert [(e.text, e.line) for e in entries] == [("two", 1), ("one", 2)]


def test_all_problems_are_listed_at_once_up_to_a_limit(tmp_path):
    path = _manifest(tmp_path, ["{"] * 25 + [{"text": "x"}])
    with pytest.raises(ManifestError) as error:
        read_manifest(path, ENGLISH, FeatureConfig(), ModelConfig())
    text = str(error.value)
    assert "26 problem(s)" in text and f"{path}:1: invalid JSON" in text and "... and 6 more" in text


def test_alphabet_widens_and_empty_manifest(manifests, tmp_path):
    good = next((manifests[0].parent / "audio").glob("*.wav"))
    path = _manifest(tmp_path, [{"audio_filepath": str(good), "text": "Café 2"}])
    wide = Alphabet.widened(ENGLISH, ["é2"])
    (entry,) = read_manifest(path, wide, FeatureConfig(), ModelConfig(n_classes=len(wide)))
    assert entry.text == "café 2" and entry.line == 1
    with pytest.raises(ManifestError, match="no recordings"):
        read_manifest(_manifest(tmp_path, [""]), ENGLISH, FeatureConfig(), ModelConfig())


def test_a_recording_too_short_for_its_transcript_once_sped_up_is_refused_for_training(tmp_path):
    """With augmentation the fastest speed (1.1x) shortens a recording: one whose frames just hold its
    transcript then held one frame too few, CTC's loss of it was inf, zeroed (zero_infinity), and the
    step learned nothing of it, without a word. It is refused for training with augmentation."""
    features, model = FeatureConfig(), ModelConfig()
    text = "abcdefghij"
    samples = next(n for n in range(1000, 8000, 8) if model.output_frames(features.frames(n)) == len(text))
    assert model.output_frames(features.frames(-(-samples * FASTEST[0] // FASTEST[1]))) < len(text)
    clip = tmp_path / "clip.wav"
    soundfile.write(str(clip), np.random.default_rng(0).uniform(-0.3, 0.3, samples), 8000, subtype="PCM_16")
    path = _manifest(tmp_path, [{"audio_filepath": str(clip), "text": text}])
    read_manifest(path, ENGLISH, features, model)  # at its own speed it fits
    expected = (
        r":1: audio file .*clip.wav is too short for its transcript when training speeds it up 1.1x "
        r"\(augmentation\): .* gives 9 output frames, the 10 characters need 10 \(--augment off"
    )
    with pytest.raises(ManifestError, match=expected):
        read_manifest(path, ENGLISH, features, model, shortest=FASTEST)


def test_a_manifest_not_in_utf8_names_the_line(tmp_path, manifests):
    good = next((manifests[0].parent / "audio").glob("*.wav"))
    path = tmp_path / "latin1.jsonl"
    lines = [{"audio_filepath": str(good), "text": "two"}, {"audio_filepath": str(good), "text": "café"}]
    for end in ("\n", "\r\n", "\r"):  # the line endings the manifest's lines end at
        path.write_bytes(end.join(json.dumps(x, ensure_ascii=False) for x in lines).encode("latin-1"))
        with pytest.raises(ManifestError, match=r"latin1.jsonl:2: not UTF-8 \(byte 0xe9: .*\); expected a"):
            read_manifest(path, ENGLISH, FeatureConfig(), ModelConfig())


def test_transcripts_and_the_alphabet_are_compared_in_composed_form(tmp_path, manifests):
    """ "é" saved as e and a combining accent (as some tools write it) was refused naming the accent alone,
    with "é" in --alphabet; and --alphabet typed so added the accent alone."""
    good = next((manifests[0].parent / "audio").glob("*.wav"))
    path = _manifest(tmp_path, [{"audio_filepath": str(good), "text": "cafe\u0301"}])
    for typed in ("\u00e9", "e\u0301"):
        alphabet = Alphabet.widened(ENGLISH, [typed])
        assert alphabet.characters == ENGLISH.characters + "\u00e9"
        (entry,) = read_manifest(path, alphabet, FeatureConfig(), ModelConfig())
        assert entry.text == "caf\u00e9"


def test_the_problems_of_both_manifests_come_in_one_error(tmp_path, manifests):
    """The test manifest's problems were said only once the training manifest's were fixed (a second scan
    of every line)."""
    good = next((manifests[0].parent / "audio").glob("*.wav"))
    bad = _bad_manifests(tmp_path, good)
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    train, test = (
        _manifest(tmp_path / "train", bad["alphabet"][0]),
        _manifest(tmp_path / "test", bad["missing-file"][0]),
    )
    done = tandem(
        "--train-manifest", str(train), "--test-manifest", str(test), "--out", str(tmp_path / "out")
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"--train-manifest {train}: 1 problem(s)" in done.stderr and bad["alphabet"][1] in done.stderr
    assert f"--test-manifest {test}: 1 problem(s)" in done.stderr and bad["missing-file"][1] in done.stderr


def test_test_recordings_that_are_training_recordings_are_warned_of(tmp_path, capsys, monkeypatch):
    from tandem.asr.manifest import Entry
    from tandem.cli.train import _warn_of_shared_recordings

    clip = tmp_path / "a.wav"
    train = [Entry(clip, "a", 100, 1), Entry(clip, "b", 100, 2, start=50, frames=100)]
    test = [Entry(tmp_path / "." / "a.wav", "a", 100, 7), Entry(clip, "a", 100, 8, start=10, frames=100)]
    _warn_of_shared_recordings(train, test, Path("train.jsonl"), Path("test.jsonl"))
    warning = capsys.readouterr().err
    expected = "1 of the 2 test recordings are training recordings too (the first: test.jsonl line 7, train"
    assert f"tandem train: warning: {expected}.jsonl line 1)" in warning, warning
    _warn_of_shared_recordings(train, test[1:], Path("train.jsonl"), Path("test.jsonl"))
    assert capsys.readouterr().err == ""
    # once: under a torchrun started by hand every rank checks the manifests, at every restart
    for name, value in (("RANK", "1"), ("TORCHELASTIC_RESTART_COUNT", "1")):
        with monkeypatch.context() as patch:
            patch.setenv("WORLD_SIZE", "2")  # (a process torchrun started)
            patch.setenv(name, value)
            _warn_of_shared_recordings(train, test, Path("train.jsonl"), Path("test.jsonl"))
        assert capsys.readouterr().err == "", name


def test_the_check_says_of_a_file_what_reading_it_says(tmp_path):
    """The check reads headers (read_header), not samples: an Ogg/Vorbis file cut short was 'an empty
    recording (0 samples)' there and a 16-bit float WAV 'not a readable recording (... Unspecified
    internal error)', where reading either (read_audio) says what it is."""
    import io
    import struct

    ogg = io.BytesIO()
    soundfile.write(ogg, np.random.default_rng(0).uniform(-0.3, 0.3, 16000), 8000, format="OGG")
    cut = tmp_path / "cut.ogg"
    cut.write_bytes(ogg.getvalue()[: len(ogg.getvalue()) // 2])
    half = tmp_path / "half.wav"  # format tag 3 (float), 16 bits
    fmt = b"fmt " + struct.pack("<IHHIIHH", 16, 3, 1, 8000, 16000, 2, 16)
    samples = np.linspace(-0.5, 0.5, 800).astype("<f2").tobytes()
    chunks = fmt + b"data" + struct.pack("<I", len(samples)) + samples
    half.write_bytes(b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks)
    for path in (cut, half):
        with pytest.raises(Exception) as reading:
            read_audio(path)
        message = _problem(_manifest(tmp_path, [{"audio_filepath": str(path), "text": "a"}]))
        assert f":1: audio file {reading.value}" in message, (message, str(reading.value))


def test_ctc_frames_needed():
    assert ctc_frames_needed(ENGLISH.encode("three")) == 6 and ctc_frames_needed(ENGLISH.encode("a")) == 1


@pytest.mark.parametrize("kind", ["not-audio", "too-short", "alphabet"])
def test_the_command_refuses_a_bad_manifest_and_writes_nothing(manifests, tmp_path, kind):
    good = next((manifests[0].parent / "audio").glob("*.wav"))
    lines, message = _bad_manifests(tmp_path, good)[kind]
    bad = _manifest(tmp_path, lines)
    out = tmp_path / "out"
    done = tandem(
        "--train-manifest", str(bad), "--test-manifest", str(manifests[1]), "--out", str(out), timeout=120
    )
    assert done.returncode == 2 and message in done.stderr and "--train-manifest" in done.stderr
    assert not out.exists()


@pytest.mark.parametrize("which", ["--train-manifest", "--test-manifest"])
def test_a_manifest_with_fewer_recordings_than_processes_is_refused(manifests, tmp_path, which):
    """Every process takes a share of each batch and of the test set: with fewer recordings than
    processes one would wait for the others' collectives (the test set) or divide by zero (training)."""
    one = tmp_path / "one.jsonl"
    first = json.loads(manifests[0 if which == "--train-manifest" else 1].read_text().splitlines()[0])
    one.write_text(json.dumps(first) + "\n")
    paths = {"--train-manifest": str(manifests[0]), "--test-manifest": str(manifests[1]), which: str(one)}
    out = tmp_path / "out"
    done = tandem(*[x for kv in paths.items() for x in kv], "--nproc", "2", "--out", str(out), timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{which} {one}: 1 recording(s) for 2 processes; expected at least one per process" in done.stderr
    assert not out.exists()


_RANK_0 = """
import json, os, sys, argparse
import tandem.asr.training as training
from tandem.cli import train as cli_train

def check_again(*args, **kwargs):
    raise AssertionError("checked again")

parser = argparse.ArgumentParser()
cli_train.add_arguments(parser)
config = cli_train.asr_config(cli_train._with_defaults(parser.parse_args(sys.argv[1:])))
real, training.read_manifest = training.read_manifest, check_again
train, test = training.manifest_entries(config)  # the launcher's
os.utime(config.test_manifest)  # the manifest changed: checked again
try:
    training.manifest_entries(config)
    again = False
except AssertionError:
    again = True
training.read_manifest = real
fresh = training.manifest_entries(config)
with open(os.environ["RESULT"], "w") as f:
    json.dump([len(train), len(test), again, [train, test] == list(fresh)], f)
"""


def test_the_ranks_take_the_entries_the_launcher_checked(manifests, tmp_path, monkeypatch):
    """Rank 0 read every recording's header again after the launcher had (~50 s each for LibriSpeech's
    281k lines, at every launch and restart); it takes the launcher's entries while the manifests stay
    as they were, through the launcher's options as the ranks get them."""
    import argparse
    import sys

    from tandem.cli import train as cli_train

    train, test = manifests
    result = tmp_path / "result.json"
    monkeypatch.setenv("RESULT", str(result))
    monkeypatch.setattr(
        cli_train,
        "_torchrun_command",
        lambda args: [sys.executable, "-c", _RANK_0, *cli_train._worker_argv(args)],
    )
    parser = argparse.ArgumentParser()
    cli_train.add_arguments(parser)
    argv = ["--train-manifest", str(train), "--test-manifest", str(test), "--nproc", "2", "--hidden", "64"]
    args = cli_train._with_defaults(parser.parse_args([*argv, "--out", str(tmp_path / "run")]))
    assert cli_train._check_manifests(args) is None
    import tandem.asr.training as training

    with monkeypatch.context() as patch:  # one process (--nproc 1) trains in the launcher's: checked there
        patch.setattr(training, "read_manifest", lambda *a, **k: pytest.fail("checked again"))
        assert training.manifest_entries(cli_train.asr_config(args)) == args.checked_manifests[1]
    assert cli_train._launch(args) == 0
    assert json.loads(result.read_text()) == [40, 8, True, True]


@pytest.mark.parametrize("edit", ["during the check", "mtime restored", "none"])
def test_the_launchers_entries_are_taken_only_for_the_manifests_they_came_from(
    manifests, tmp_path, monkeypatch, edit
):
    """The key of the launcher's entries is the manifests' before its check: one edited during the check
    (a replaced file) is checked again by rank 0 (it trained on the lines of a file gone), as is one
    edited with its size and modification time put back (``touch -r``, ``cp -p``)."""
    import os
    import shutil

    import tandem.asr.training as training

    train, test = (shutil.copy(m, tmp_path / m.name) for m in manifests)
    (tmp_path / "audio").symlink_to(manifests[0].parent / "audio")  # for the lines' relative paths
    config = training.TrainConfig(train_manifest=str(train), test_manifest=str(test))
    real = training.read_manifest
    lines = Path(train).read_text().splitlines(keepends=True)

    def edit_train() -> None:
        stat = os.stat(train)
        Path(train).write_text("".join(lines[1:] + lines[:1]))  # the same bytes, in another order
        if edit == "mtime restored":
            os.utime(train, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    def reading(*args, **kwargs):
        if edit == "during the check" and kwargs.get("what") == "--train-manifest":
            edit_train()
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "_CHECKED", {})
    monkeypatch.setattr(training, "read_manifest", reading)
    key, entries = training.checked_manifests(config)
    saved = tmp_path / "checked.pickle"
    assert training.save_checked_manifests(key, entries, saved)
    if edit == "mtime restored":
        edit_train()
    read_again = []
    monkeypatch.setattr(training, "_CHECKED", {})  # rank 0: a process of its own
    monkeypatch.setattr(training, "read_manifest", lambda *a, **k: read_again.append(1) or real(*a, **k))
    monkeypatch.setenv(training.CHECKED_MANIFESTS_ENV, str(saved))
    got = training.manifest_entries(config)
    assert bool(read_again) == (edit != "none")
    now = real(train, Alphabet(config.alphabet), config.features, config.model)
    assert [e.text for e in got[0]] == [e.text for e in now]
    # a launcher that cannot write the file (a full disk) launches without it
    assert not training.save_checked_manifests(key, entries, tmp_path / "gone" / "checked.pickle")


@pytest.mark.parametrize(
    "args, message",
    [
        (("--train-manifest", "x.jsonl"), "expected both or neither"),
        (("--alphabet", "é"), "--alphabet: only with --train-manifest"),
        (("--task", "classify", "--alphabet", "é"), "only for --task asr"),
    ],
)
def test_manifest_options_are_checked(tmp_path, args, message):
    done = tandem(*args, "--out", str(tmp_path / "out"), timeout=60)
    assert done.returncode == 2 and message in done.stderr and not (tmp_path / "out").exists()


def test_resume_refuses_a_manifest_that_changed(manifests, tmp_path):
    """--resume continues the run that began: with a training manifest that lost a line since, it is
    refused before anything is trained or written; put back, the run continues."""
    train, test = manifests
    mine = tmp_path / "train.jsonl"
    # absolute paths: the copy lives in another folder
    lines = [json.loads(line) for line in train.read_text().splitlines()]
    for line in lines:
        line["audio_filepath"] = str((train.parent / line["audio_filepath"]).resolve())
    mine.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "run"
    args = (
        "--train-manifest", str(mine), "--test-manifest", str(test), "--nproc", "1", "--threads", "1",
        "--hidden", "16", "--layers", "1", "--batch-size", "8", "--workers", "0", "--out", str(out),
    )  # fmt: skip
    assert tandem(*args, "--epochs", "1").returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    mine.write_text("".join(json.dumps(line) + "\n" for line in lines[:-1]))
    done = tandem(*args, "--epochs", "2", "--resume")
    assert done.returncode == 2, done.stderr[-2000:]
    assert (
        "--resume: the recordings of --train-manifest differ from the ones the checkpoint's run"
        in done.stderr
    )
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    mine.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = tandem(*args, "--epochs", "2", "--resume")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "metrics.json").read_text())["history"][-1]["epoch"] == 2


def test_a_silent_recording_is_trained_on_with_a_warning(manifests, tmp_path, capsys):
    """The check reads headers, not samples: a silent recording in a manifest is found when training
    reads it, and must not end the run: it is rendered as it is (zeros), with one warning naming it."""
    from tandem.asr import manifest

    good = next((manifests[0].parent / "audio").glob("*.wav"))
    silent = tmp_path / "silent.wav"
    soundfile.write(str(silent), torch.zeros(16000).numpy(), 16000, subtype="PCM_16")
    lines = [{"audio_filepath": str(good), "text": "two"}, {"audio_filepath": str(silent), "text": "one"}]
    path = _manifest(tmp_path, lines)
    entries = read_manifest(path, ENGLISH, FeatureConfig(), ModelConfig())
    data = manifest.ManifestSet(entries, 8000)
    plan = {u.index: u for u in data.plan(0)}
    manifest._WARNED_SILENT.discard(silent)
    for _ in range(2):
        audio = data.render(plan[1])
        assert audio.shape == (8000,) and not audio.any()
    warned = capsys.readouterr().err.splitlines()
    assert warned == [
        f"tandem train: warning: {silent} (manifest line 2): a silent recording (peak amplitude 0), "
        "used as it is; take it out of the manifest for your next run"  # a test recording is not trained on
    ]
    assert data.render(plan[0]).abs().max() > 0.01 and capsys.readouterr().err == ""
    # what is not silence stays an error: NaN samples (a float WAV) end the run naming the line
    broken = tmp_path / "nan.wav"
    soundfile.write(str(broken), np.full(16000, np.nan, dtype=np.float32), 16000, subtype="FLOAT")
    lines[1]["audio_filepath"] = str(broken)
    data = manifest.ManifestSet(
        read_manifest(_manifest(tmp_path, lines), ENGLISH, FeatureConfig(), ModelConfig()), 8000
    )
    with pytest.raises(
        manifest.AudioError, match=r"NaN or infinite samples, .* range of ±3.4e\+38 \(manifest line 2\)"
    ):
        data.render(plan[1])


@pytest.mark.parametrize("which", ["train", "test"])
def test_a_recording_unreadable_mid_run_ends_it_on_every_rank_with_one_verdict(manifests, tmp_path, which):
    """The check before the run reads headers: NaN samples in a float WAV are met when a rank reads the
    recording. That rank failed alone with a traceback, and torchrun restarted the ranks into the same
    recording until --max-restarts ran out. Now every rank ends after that step (or evaluation) together:
    exit 2, the file and its line named, no restart, nothing saved of the step."""
    broken = tmp_path / "nan.wav"
    samples = np.full(16000, 0.1, dtype=np.float32)
    samples[100] = np.nan
    soundfile.write(str(broken), samples, 16000, subtype="FLOAT")
    paths = {}
    for name, source in zip(("train", "test"), manifests):
        lines = [json.loads(line) for line in source.read_text().splitlines()]
        for line in lines:
            line["audio_filepath"] = str(source.parent / line["audio_filepath"])
        if name == which:
            lines[2]["audio_filepath"] = str(broken)
        (tmp_path / name).mkdir()
        paths[name] = _manifest(tmp_path / name, lines)
    out = tmp_path / "run"
    done = tandem(
        "--train-manifest", str(paths["train"]), "--test-manifest", str(paths["test"]), "--nproc", "2",
        "--threads", "1", "--hidden", "16", "--layers", "1", "--batch-size", "8", "--epochs", "2",
        "--workers", "1", "--max-restarts", "2", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    said = f"{broken}: the recording holds NaN or infinite samples, or 64-bit float samples beyond float32's"
    assert f"{said} range of ±3.4e+38 (--{which}-manifest line 3)" in done.stderr
    assert "a recording could not be read after step" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout and "resuming" not in done.stdout
    assert not (out / "metrics.json").exists()


def test_a_recording_of_one_output_frame_is_refused_for_training_naming_it(tmp_path):
    """A 0.05 s recording of "a" gives one output frame, enough for its transcript: with --batch-size 1 (or
    alone in an epoch's last batch) the batch norm between two recurrent layers saw one value per channel
    and the run ended mid-epoch in a traceback. Training needs two; a test set takes it."""
    clip = tmp_path / "clip.wav"
    soundfile.write(str(clip), np.random.default_rng(0).uniform(-0.3, 0.3, 400), 8000, subtype="PCM_16")
    path = _manifest(tmp_path, [{"audio_filepath": str(clip), "text": "a"}])
    (entry,) = read_manifest(path, ENGLISH, FeatureConfig(), ModelConfig())
    with pytest.raises(ManifestError, match=r":1: audio file .*clip.wav is too short to train on: .* 1 out"):
        read_manifest(path, ENGLISH, FeatureConfig(), ModelConfig(), least_frames=2)
    # 520 samples give two frames, and one once speed perturbation's fastest (1.1x) shortens them
    soundfile.write(str(clip), np.random.default_rng(0).uniform(-0.3, 0.3, 520), 8000, subtype="PCM_16")
    read_manifest(path, ENGLISH, FeatureConfig(), ModelConfig(), least_frames=2)
    with pytest.raises(ManifestError, match=r"gives 2 output frame\(s\) \(1 when sped up 1.1x\)"):
        read_manifest(path, ENGLISH, FeatureConfig(), ModelConfig(), least_frames=2, shortest=FASTEST)
    done = tandem(
        "--train-manifest", str(path), "--test-manifest", str(path), "--nproc", "1", "--layers", "2",
        "--batch-size", "1", "--epochs", "1", "--augment", "on", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert done.returncode == 2 and "too short to train on" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_a_linked_manifests_relative_paths_are_relative_to_the_links_folder(manifests, tmp_path):
    """The README's "relative to the manifest's folder", for a manifest reached through a link: the
    folder the user named, as NeMo reads it. The link's target's folder was taken, training on its
    audio/ where the link's folder has another."""
    import argparse

    import tandem.asr.training as training
    from tandem.cli import train as cli_train

    train, test = manifests
    (tmp_path / "audio").mkdir()
    for wav in (train.parent / "audio").iterdir():  # copies, under the same names
        (tmp_path / "audio" / wav.name).write_bytes(wav.read_bytes())
    (tmp_path / "train.jsonl").symlink_to(train)  # beside the copies
    parser = argparse.ArgumentParser()
    cli_train.add_arguments(parser)
    link = tmp_path / "train.jsonl"
    args = parser.parse_args(["--train-manifest", str(link), "--test-manifest", str(test)])
    entries, _ = training.manifest_entries(cli_train.asr_config(cli_train._with_defaults(args)))
    relative = [e.path for e in entries[1:]]  # the first line's path is absolute
    assert relative and all(p.parent == tmp_path / "audio" for p in relative), relative[:2]

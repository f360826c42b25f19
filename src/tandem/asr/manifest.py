"""Training on your own recordings: JSON-lines manifests in NVIDIA NeMo's convention, checked before a run.

One line per recording: ``{"audio_filepath": "a.wav", "text": "hello there", "duration": 1.7}``; a
relative path is relative to the manifest's folder. As NeMo reads them, the optional ``offset`` and
``duration`` (seconds) pick the part of the file the text belongs to: ``duration`` seconds from
``offset`` (default 0), or the rest of the file without ``duration``, so several lines can cut segments
out of one long recording. Text is lower-cased and its whitespace collapsed, as the alphabet normalises
it. Lines end at ``\\n`` only (JSON text may hold U+2028 and the like), and a UTF-8 byte-order mark is
skipped.

:func:`read_manifest` checks every line before training starts and raises one :class:`ManifestError`
that lists the problems (up to a limit), each with the manifest, the line and what is wrong: invalid
JSON, a missing key, empty text, characters outside the alphabet, a missing or unreadable file, a WAV
cut short, a sample rate outside 1 kHz-768 kHz, a recording of no samples, an ``offset`` or ``duration``
that is no number of seconds, reaches past the file's end or holds no sample, or audio too short for its
transcript under CTC (fewer output frames than the labels need). It reads each file's header, not its
samples: a silent recording is found when training reads it, and used as it is with a warning
(:meth:`ManifestSet.render`).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch import Tensor
from tqdm import tqdm

from tandem.asr.audio import (
    MAX_SAMPLE_RATE,
    MIN_SAMPLE_RATE,
    SILENCE_PEAK,
    AudioError,
    first_line,
    half_range,
    read_audio,
    read_header,
    to_model_input,
    truncation_message,
)
from tandem.asr.features import FeatureConfig
from tandem.asr.model import ModelConfig
from tandem.asr.text import BLANK, Alphabet

__all__ = [
    "Entry",
    "ManifestError",
    "ManifestSet",
    "ManifestUtterance",
    "check_entry",
    "ctc_frames_needed",
    "read_manifest",
]

MAX_PROBLEMS = 20
# How far past a recording's end ``offset + duration`` may reach (durations written to a few decimals,
# or of the file before it was converted); beyond it the line does not describe its file.
DURATION_SLACK_S = 0.1


class ManifestError(ValueError):
    """A manifest that cannot be trained on; the message lists every problem found (up to a limit)."""


@dataclass(frozen=True)
class Entry:
    """A checked manifest line: the recording, its transcript (normalised), its length in samples at
    the model's rate, and the part of the file it is: ``frames`` samples (at the file's rate) from
    sample ``start``, or (-1) to the file's end."""

    path: Path
    text: str
    samples: int
    line: int
    start: int = 0
    frames: int = -1


def ctc_frames_needed(labels: Tensor) -> int:
    """Frames CTC needs to emit ``labels``: one per label, and a blank between each pair of equal
    neighbours ("three" needs 6: t h r e _ e)."""
    repeats = int((labels[1:] == labels[:-1]).sum()) if len(labels) > 1 else 0
    return len(labels) + repeats


def read_manifest(
    path: str | Path,
    alphabet: Alphabet,
    features: FeatureConfig,
    model: ModelConfig,
    *,
    what: str = "--train-manifest",
    least_frames: int = 1,
    shortest: tuple[int, int] = (1, 1),
) -> list[Entry]:
    """Every line of the manifest ``path``, checked (see the module docstring); a recording gives at least
    ``least_frames`` output frames (2 to train a model with batch norms between its recurrent layers: a
    batch of one recording of one frame would hold one value per channel, torch's error mid-run), when
    shortened to ``shortest[0] / shortest[1]`` of its length (speed perturbation's fastest).

    Raises:
        ManifestError: naming ``what`` (the option), the manifest, and each line's problem.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{what} {path}: no such file") from None
    except OSError as e:
        raise ManifestError(f"{what} {path}: cannot read it ({e})") from None
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[: e.start]  # lines end at "\n", "\r\n" or "\r", as below
        line = before.count(b"\n") + before.count(b"\r") - before.count(b"\r\n") + 1
        raise ManifestError(
            f"{what} {path}:{line}: not UTF-8 (byte {data[e.start]:#04x}: {e.reason}); expected a manifest "
            "saved as UTF-8"
        ) from None
    # "\n" ends a line, and "\r\n" or "\r" as universal newlines read them; str.splitlines would also cut
    # at U+2028, U+0085 and others, which JSON strings may hold as they are
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    entries: list[Entry] = []
    problems: list[str] = []
    # a bar on the terminal for a long manifest: every file's header is read here
    bar = tqdm(lines, desc=f"checking {path.name}", unit="file", leave=False, disable=len(lines) < 500)
    for number, raw in enumerate(bar, 1):
        if not raw.strip():
            continue
        problem = None
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as e:
            problem = f"invalid JSON ({e.msg} at column {e.colno})"
        except ValueError as e:  # an integer of more than 4300 digits, Python's limit (not a JSONDecodeError)
            problem = f"invalid JSON ({str(e).split(';')[0]})"
        else:
            entry_or_problem = check_entry(
                item, path, number, alphabet, features, model, least_frames, shortest
            )
            if isinstance(entry_or_problem, Entry):
                entries.append(entry_or_problem)
            else:
                problem = entry_or_problem
        if problem:
            problems.append(f"{path}:{number}: {problem}")
    if not entries and not problems:
        problems.append(f"{path}: no recordings (the manifest is empty)")
    if problems:
        more = f"\n  ... and {len(problems) - MAX_PROBLEMS} more" if len(problems) > MAX_PROBLEMS else ""
        listed = "\n  ".join(problems[:MAX_PROBLEMS])
        raise ManifestError(f"{what} {path}: {len(problems)} problem(s):\n  {listed}{more}")
    return entries


def check_entry(
    item: object,
    manifest: Path,
    number: int,
    alphabet: Alphabet,
    features: FeatureConfig,
    model: ModelConfig,
    least_frames: int = 1,
    shortest: tuple[int, int] = (1, 1),
) -> Entry | str:
    """Line ``number`` of ``manifest``, parsed as ``item``: its :class:`Entry`, or what is wrong with it
    (the check :func:`read_manifest` makes of every line)."""
    if not isinstance(item, dict):
        return f"expected a JSON object, got {type(item).__name__}"
    missing = [k for k in ("audio_filepath", "text") if k not in item]
    if missing:
        return f"missing key(s) {', '.join(repr(k) for k in missing)}"
    if not isinstance(item["audio_filepath"], str) or not isinstance(item["text"], str):
        return "expected 'audio_filepath' and 'text' to be strings"
    text = alphabet.normalize(item["text"])
    if not text:
        return "empty text"
    unknown = alphabet.unknown(text)
    if unknown:
        chars = "".join(unknown)
        hint = "--alphabet adds them"
        if BLANK in chars:  # which --alphabet refuses
            others = "; --alphabet adds the others" if len(chars) > 1 else ""
            hint = f"{BLANK!r} is CTC's blank and cannot be a character{others}"
        return f"characters {chars!r} are not in the alphabet {alphabet.characters!r} ({hint})"
    audio = Path(item["audio_filepath"])
    audio = audio if audio.is_absolute() else manifest.parent / audio
    offset, duration = (_seconds(item, key) for key in ("offset", "duration"))
    try:
        if audio.is_dir():
            return f"audio file {audio}: a directory, not a file"
        if not audio.is_file():
            there = audio.exists()  # a pipe, a device, a socket: libsndfile would wait on it or fail
            return f"audio file {audio}: " + ("not a regular file" if there else "no such file")
        for key, value, least in (("offset", offset, "0 or more"), ("duration", duration, "above 0")):
            if isinstance(value, str):
                return f"expected {key!r} to be a number of seconds, {least}, got {value}"
        with open(audio, "rb") as f:
            cut = truncation_message(f)
    except OSError as e:  # no permission to read it (or to search its folder), an I/O error
        return f"audio file {audio}: cannot read it ({e.strerror or e})"
    if cut is not None:
        return f"audio file {audio}: {cut}"
    try:
        length, rate = read_header(audio)
    except AudioError as e:  # what read_audio says of it too (it begins with the file's name)
        return f"audio file {e}"
    except Exception as e:  # soundfile's errors are RuntimeErrors (LibsndfileError) and others
        reason = first_line(e) or type(e).__name__
        return f"audio file {audio}: not a readable recording ({reason})"
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:  # as to_model_input would refuse it
        return (
            f"audio file {audio}: sample rate {rate} Hz is outside the rates taken, "
            f"{MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz (a broken header?)"
        )
    if length == 0:  # (libsndfile reads such a file as no samples; training would stop at it)
        return f"audio file {audio}: an empty recording (0 samples)"
    # past the end is decided before rounding: a huge offset (1e308 s) is no number of samples
    if offset and (offset * rate >= length or round(offset * rate) >= length):
        return f"'offset' {offset} s is at or past the end of audio file {audio} ({length / rate:.3f} s long)"
    start, taken = round((offset or 0.0) * rate), -1
    if duration is not None:
        end = (offset or 0.0) + duration
        if end > length / rate + DURATION_SLACK_S:
            return (
                f"'offset' + 'duration' = {_format_seconds(end)} s reaches past the end of audio file "
                f"{audio} ({length / rate:.3f} s long)"
            )
        taken = min(round(duration * rate), length - start)
        if taken == 0:
            return (
                f"'duration' {duration} s holds no sample of audio file {audio} (one sample is "
                f"{1 / rate:.3g} s at its {rate} Hz)"
            )
        if start == 0 and taken == length:
            taken = -1  # the whole file
    kept = length - start if taken < 0 else taken
    samples = math.ceil(kept * features.sample_rate / rate)  # at the model's rate
    frames = int(model.output_frames(features.frames(samples)))
    needed = ctc_frames_needed(alphabet.encode(text))
    if frames < needed:
        return (
            f"audio file {audio} is too short for its transcript: {samples / features.sample_rate:.2f} s "
            f"gives {frames} output frames, the {len(text)} characters need {needed}"
        )
    fastest = -(-samples * shortest[0] // shortest[1])  # as speed perturbation's resampling rounds it
    fewest = frames if fastest == samples else int(model.output_frames(features.frames(fastest)))
    if fewest < needed:  # CTC's loss of it would be inf, zeroed (zero_infinity): a step that learns nothing
        return (
            f"audio file {audio} is too short for its transcript when training speeds it up "
            f"{shortest[1] / shortest[0]:g}x (augmentation): {fastest / features.sample_rate:.2f} s gives "
            f"{fewest} output frames, the {len(text)} characters need {needed} (--augment off keeps its "
            "speed)"
        )
    if fewest < least_frames:
        sped = f" ({fewest} when sped up {shortest[1] / shortest[0]:g}x)" if fastest != samples else ""
        return (
            f"audio file {audio} is too short to train on: {samples / features.sample_rate:.2f} s gives "
            f"{frames} output frame(s){sped}; training takes {least_frames} or more (batch norm between the "
            "recurrent layers over a batch of this one recording would have one value per channel)"
        )
    return Entry(audio, text, samples, number, start, taken)


def _format_seconds(seconds: float) -> str:
    """``seconds`` to the millisecond, or in scientific notation where that would be hundreds of digits
    (an ``offset`` or ``duration`` of 1e308)."""
    return f"{seconds:.3f}" if seconds < 1e9 else f"{seconds:.3g}"


def _seconds(item: dict, key: str) -> float | str | None:
    """``item[key]`` as seconds: None if absent (or null), else a finite number, 0 or more (``offset``)
    or above 0 (``duration``); what came, as a string, if not."""
    value = item.get(key)
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    # (an integer beyond float's range, 1 and 400 zeros, is no number of seconds: isfinite overflowed)
    number = number and (abs(value) < 2**1023 if isinstance(value, int) else math.isfinite(value))
    if not number or value < 0 or (key == "duration" and value == 0):
        shown = repr(value)
        return shown if len(shown) <= 24 else f"{shown[:12]}... (an integer of {len(shown)} digits)"
    return float(value)


@dataclass(frozen=True)
class ManifestUtterance:
    """A manifest recording in a training plan (the fields the training loop reads of any utterance)."""

    index: int
    transcript: str
    length: int
    seed: int


class ManifestSet:
    """A manifest's recordings as the training loop takes them: ``plan(seed)`` orders them,
    ``render(u)`` reads one (mono, at the model's rate), as :class:`~tandem.asr.generator.ConnectedDigits`
    does for the bundled digits. ``name`` goes before the line number in what it says of a recording (the
    option that gave the manifest, say)."""

    def __init__(self, entries: Sequence[Entry], sample_rate: int, name: str = "manifest") -> None:
        self.entries, self.sample_rate, self.name = list(entries), sample_rate, name
        self.ids = list(range(len(self.entries)))

    def fingerprint(self) -> str:
        """SHA-256 of the recordings in order (path, transcript, length): what the plans are drawn from,
        so a resumed run can tell that its manifest changed."""
        listed = [[str(e.path), e.text, e.samples, *self._segment(e)] for e in self.entries]
        return hashlib.sha256(json.dumps(listed).encode()).hexdigest()

    @staticmethod
    def _segment(entry: Entry) -> list[int]:
        """The part of its file an entry is, where it is not the whole file (so a manifest without
        ``offset`` or ``duration`` keeps the fingerprint it had before they were read)."""
        return [] if (entry.start, entry.frames) == (0, -1) else [entry.start, entry.frames]

    def plan(self, seed: int | Sequence[int], passes: int = 1) -> list[ManifestUtterance]:
        """Every recording ``passes`` times, in an order drawn from ``seed``."""
        rng = np.random.default_rng(seed)
        utterances = []
        for _ in range(passes):
            seeds = rng.integers(2**62, size=len(self.entries)).tolist()
            order = rng.permutation(len(self.entries)).tolist()
            utterances += [
                ManifestUtterance(i, self.entries[i].text, self.entries[i].samples, seeds[i]) for i in order
            ]
        return utterances

    def render(self, utterance: ManifestUtterance) -> Tensor:
        """The recording at the model's rate. A silent one (the check reads no samples) is used as it is
        (trained or tested on), with a warning the first time this process reads it: one file must not end
        a long run."""
        entry = self.entries[utterance.index]
        try:
            waveform, rate = read_audio(entry.path, silent_ok=True, start=entry.start, frames=entry.frames)
            # a file's samples are [channels, samples] by construction: more than MAX_CHANNELS (a
            # microphone array's take) is no transposed array
            audio = to_model_input(
                waveform, rate, self.sample_rate, name=str(entry.path), layout_checked=True, silent_ok=True
            )
        except AudioError as e:
            raise AudioError(f"{e} ({self.name} line {entry.line})") from None
        peak = float(audio.abs().max())
        if half_range(audio) <= SILENCE_PEAK and entry.path not in _WARNED_SILENT:  # read_audio's rule
            _WARNED_SILENT.add(entry.path)
            # through tqdm: on a line of its own, not after a progress bar of this process
            tqdm.write(
                f"tandem train: warning: {entry.path} ({self.name} line {entry.line}): a silent recording "
                f"(peak amplitude {peak:.3g}), used as it is; take it out of the manifest for your next run",
                file=sys.stderr,
            )
        return audio


# the silent recordings this process has warned of (each once)
_WARNED_SILENT: set[Path] = set()

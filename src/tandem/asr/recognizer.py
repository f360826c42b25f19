"""Inference: a trained recognizer rebuilt from its checkpoint alone, audio in, text out.

``Recognizer.from_checkpoint(path)`` reads the self-describing checkpoint that ``tandem train`` writes
(model configuration, feature settings, alphabet, weights; :mod:`tandem.asr.checkpoint`) and transcribes
waveforms or files: each recording mixed to mono and resampled to the rate the model was trained at,
log-mel features, the model in eval mode without autograd, greedy CTC decoding; a recording with long
silence before or after its words is then cut to its words (see :data:`EDGE_KEPT_MS`), one with none is
padded with low noise (:data:`PAD_MS`), and transcribed again. Recordings are batched longest first, so
each batch holds recordings of similar length; in eval mode a recording's transcript does not depend on
what it is batched with.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from tandem.asr.audio import AudioError, AudioSource, first_line, read_audio, source_name, to_model_input
from tandem.asr.checkpoint import CheckpointError, load_checkpoint
from tandem.asr.decode import greedy_decode
from tandem.asr.features import FeatureConfig, LogMel, saved_feature_settings
from tandem.asr.model import TANDEM_PARTS, TORCH_PARTS, DeepSpeech2, ModelConfig
from tandem.asr.text import Alphabet

__all__ = ["FileTranscript", "Recognizer"]

Waveform = Tensor | np.ndarray

# Silence at a recording's edges. `tandem train` makes utterances with 0-200 ms of silence before the first
# word and after the last, and the features are normalised over the whole utterance, so how much silence
# a recording holds changes how every word looks. Measured with the default model (seed 0) on the 3,000
# bundled recordings, share wrong: 1.8% with 250 ms of low noise (-60 dBFS) at both ends, 18.8% with 1 s,
# 79.6% with 3 s, and 10.3% as they are (cut close to the words). So a recording is transcribed, then
# - cut to EDGE_KEPT_MS[0] ms before its first non-blank output frame and EDGE_KEPT_MS[1] ms after its
#   last, and transcribed again; again while a cut removes at least MIN_CUT_MS, at most MAX_CUTS times.
#   More after the last frame, because a word's characters come out before it ends (on the test
#   utterances the first 14-39 ms after the word's start, the last 60-130 ms before its end, medians; up
#   to 350 ms at the 95th percentile). 1 s: 4.2%, 3 s: 21.9%. In the same cuts, a silence between two
#   words (between two letters' output frames) is cut to INNER_KEPT_MS after the first and before the
#   second where that removes at least MIN_CUT_MS, as training's gaps between words are 30-300 ms.
# - where its first non-blank frame is less than SPEECH_AT_START_MS from its start (no silence before the
#   first word), PAD_MS of Gaussian noise at PAD_LEVEL_DB below its peak is put before and after it, and it
#   is transcribed again: 2.7% as they are; the generated test sets and the recordings with 100 ms or
#   more of silence are unchanged (BENCHMARKS.md, train).
EDGE_KEPT_MS = (250.0, 500.0)
INNER_KEPT_MS = (200.0, 350.0)
MIN_CUT_MS = 100.0
MAX_CUTS = 3
SPEECH_AT_START_MS = 60.0
PAD_MS = 150.0
PAD_LEVEL_DB = -50.0


@dataclass(frozen=True)
class FileTranscript:
    """What :meth:`Recognizer.transcribe_files` made of one file.

    ``text`` is the transcript, or None with ``error`` (an :class:`~tandem.asr.audio.AudioError`'s
    message, naming the file) when the file could not be transcribed. ``audio_seconds`` is the
    recording's duration (0 on error); ``seconds`` the time spent on it: reading and resampling it, plus
    its share (by length) of its batch's features, model and decoding."""

    source: str
    text: str | None
    audio_seconds: float = 0.0
    seconds: float = 0.0
    error: str | None = None


def _resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:  # an index (an accelerator's) where none is, a bad string
        raise ValueError(
            f"Recognizer: expected device 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r} ({first_line(e)})"
        ) from None
    if dev.type not in ("cpu", "cuda"):  # the kernels run on these; 'meta' computes nothing
        raise ValueError(f"Recognizer: expected device 'auto', 'cpu', 'cuda' or 'cuda:N', got {str(dev)!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"Recognizer: device {str(dev)!r} was asked for, but CUDA is not available")
    return dev


def _tidy(texts: list[str]) -> list[str]:
    """Transcripts without the spaces that greedy decoding leaves at their edges and doubles between words
    (a space the model heard in noise: ' six', 'one  two'), which a comparison of strings would count."""
    return [" ".join(text.split()) for text in texts]


class Recognizer:
    """A trained speech recognizer: waveforms or files in, transcripts out.

    Args:
        model: the acoustic model (put in eval mode; it stays on its device).
        features: the feature settings it was trained with (their ``sample_rate`` is the model's rate).
        alphabet: its output classes.
        fit_edges: cut long silence before the first word, after the last and between two, pad a
            recording with none before its first word, and transcribe again (see :data:`EDGE_KEPT_MS`,
            :data:`INNER_KEPT_MS`, :data:`PAD_MS`); False: one pass over each recording as it is.

    Example::

        >>> rec = Recognizer.from_checkpoint("runs/asr/checkpoint.pt")      # doctest: +SKIP
        >>> waveform, rate = read_audio("four_two.wav")   # [channels, samples] float32, its rate in Hz
        >>> rec.transcribe(waveform, rate)
        'four two'
        >>> rec.transcribe_batch([clip_a, clip_b], sample_rate=16000)  # 1-D or [C, S], numpy or torch
        ['one', 'seven three']
        >>> for r in rec.transcribe_files(["a.wav", "b.wav"], batch_size=16):
        ...     print(r.source, r.text, r.error)
        a.wav one None
        b.wav None b.wav: silent recording (peak amplitude 0, ...); nothing to transcribe
    """

    def __init__(
        self, model: DeepSpeech2, features: FeatureConfig, alphabet: Alphabet, *, fit_edges: bool = True
    ) -> None:
        if not isinstance(model, DeepSpeech2):  # (a state_dict: Recognizer.from_checkpoint loads one)
            raise TypeError(
                f"Recognizer: expected model a DeepSpeech2, got {type(model).__name__} (a checkpoint: "
                "Recognizer.from_checkpoint)"
            )
        for name, value, kind in (("features", features, FeatureConfig), ("alphabet", alphabet, Alphabet)):
            if not isinstance(value, kind):
                got = type(value).__name__
                raise TypeError(f"Recognizer: expected {name} of type {kind.__name__}, got {got}")
        fit_edges = _check_fit_edges(fit_edges)  # every check before the model is put in eval mode
        if model.config.n_classes != len(alphabet):
            raise ValueError(
                f"Recognizer: expected a model with {len(alphabet)} classes (the alphabet's, blank "
                f"included), got n_classes={model.config.n_classes}"
            )
        if model.config.n_mels != features.n_mels:
            raise ValueError(
                f"Recognizer: expected features of {model.config.n_mels} mel bands (the model's n_mels), "
                f"got n_mels={features.n_mels}"
            )
        self.model = model.eval()
        self.features = features
        self.alphabet = alphabet
        self.fit_edges = fit_edges
        self.device = next(model.parameters()).device
        with torch.device("cpu"):  # its buffers, whatever the default device (torch.set_default_device)
            self.logmel = LogMel(features)
        self.logmel.to(self.device)

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike[str], device: str | torch.device = "cpu", *, fit_edges: bool = True
    ) -> Recognizer:
        """The recognizer saved in ``path`` by ``tandem train``, on ``device`` (``"cpu"``, ``"cuda"``,
        ``"cuda:1"``, or ``"auto"``: CUDA when there is one); ``fit_edges`` as the constructor's.

        Raises:
            CheckpointError: ``path`` is missing, truncated, of another kind (a ``--task classify``
                checkpoint) or version, or its settings and weights do not make a recognizer; the
                message names the file.
            ValueError: ``device`` is none of those, or is CUDA and there is none.
        """
        dev = _resolve_device(device)
        _check_fit_edges(fit_edges)
        if isinstance(path, bytes):  # a path as the OS gives it
            path = os.fsdecode(path)
        state = load_checkpoint(path, map_location="cpu")
        try:
            config = ModelConfig(**state["model_config"])
            features = FeatureConfig(**saved_feature_settings(state["feature_config"]))
            alphabet = Alphabet(state["alphabet"])
            # float32, the checkpoint's, whatever torch's default dtype (float64 made float64 layers), on the
            # CPU whatever the default device (torch.set_default_device), then moved to ``device``
            with torch.device("cpu"):
                model = DeepSpeech2(config, TANDEM_PARTS).float()
            mismatch = _weights_mismatch(model, state["model"], state["model_config"])
            if mismatch is not None:
                raise CheckpointError(f"{Path(path)}: does not make a recognizer: {mismatch}")
            model.load_state_dict(state["model"])
            recognizer = cls(model, features, alphabet, fit_edges=fit_edges)
        except CheckpointError:
            raise
        except (TypeError, ValueError, KeyError, RuntimeError, OverflowError) as e:
            first = first_line(e) or type(e).__name__
            raise CheckpointError(f"{Path(path)}: does not make a recognizer: {first}") from None
        return recognizer.to(dev)

    def to(self, device: str | torch.device) -> Recognizer:
        """Move the model and feature extractor to ``device`` (in place); returns self."""
        dev = _resolve_device(device)
        self.model.to(dev)
        self.logmel.to(dev)
        self.device = dev
        return self

    @property
    def sample_rate(self) -> int:
        """The rate the model was trained at; input at other rates is resampled to it."""
        return int(self.features.sample_rate)

    # ---- waveforms

    def transcribe(self, waveform: Waveform, sample_rate: int) -> str:
        """The transcript of one recording.

        Args:
            waveform: ``[samples]`` or ``[channels, samples]`` float, a tensor or numpy array (channels
                are averaged).
            sample_rate: its rate in Hz (explicit: never guessed).

        Raises:
            AudioError: an empty or silent recording (see :func:`tandem.asr.audio.to_model_input`).
            TypeError: ``waveform`` is no samples (a path: :meth:`transcribe_files` reads files).
        """
        return self._decode([to_model_input(waveform, sample_rate, self.sample_rate)])[0][0]

    def transcribe_batch(
        self, waveforms: Sequence[Waveform], sample_rate: int | Sequence[int], *, batch_size: int = 32
    ) -> list[str]:
        """Transcripts of several recordings, in their order, computed ``batch_size`` at a time.

        Args:
            waveforms: recordings as :meth:`transcribe` takes them, of any lengths.
            sample_rate: one rate (Hz) for all of them, or one per recording.
            batch_size: recordings per forward pass (longest first; the result is the same for any).

        Raises:
            AudioError: an empty or silent recording, named ``waveforms[i]``.
            TypeError: an entry that is no samples (a path, None), named ``waveforms[i]``.
        """
        batch_size = _check_batch_size(batch_size)
        if isinstance(waveforms, Mapping) or not hasattr(waveforms, "__len__"):  # a generator, a dict
            raise TypeError(
                "waveforms: expected a sequence of recordings (a list of tensors or numpy arrays), got "
                f"{type(waveforms).__name__}"
            )
        # one rate: a number of any kind (int, float, numpy or 0-d tensor); else one per waveform
        rates = [sample_rate] * len(waveforms) if np.ndim(sample_rate) == 0 else list(sample_rate)
        if len(rates) != len(waveforms):
            raise ValueError(
                f"transcribe_batch: expected one sample_rate or {len(waveforms)} (one per waveform), "
                f"got {len(rates)}"
            )
        mono = [
            to_model_input(w, r, self.sample_rate, name=f"waveforms[{i}]")
            for i, (w, r) in enumerate(zip(waveforms, rates))
        ]
        return self._decode(mono, batch_size)[0]

    # ---- files

    def iter_transcribe_files(
        self, files: Sequence[AudioSource], batch_size: int = 16
    ) -> Iterator[FileTranscript]:
        """:meth:`transcribe_files` one result at a time, in order, as each group of ``batch_size``
        files is done (only that group's audio is in memory). The arguments are checked at the call."""
        batch_size = _check_batch_size(batch_size)
        hint = None
        if isinstance(files, (str, bytes, bytearray, memoryview, os.PathLike)):
            hint = "one file goes in a list"
        elif isinstance(files, (Mapping, AbstractSet)):
            hint = "in an order: a list"
        elif _samples(files):
            hint = "samples: transcribe or transcribe_batch"
        elif not (hasattr(files, "__getitem__") and hasattr(files, "__len__")):
            hint = "a list of them"
        if hint is not None:
            raise TypeError(
                "files: expected a sequence of paths, binary file objects or files' bytes, got "
                f"{type(files).__name__} ({hint})"
            )
        return self._transcribe_groups(files, batch_size)

    def _transcribe_groups(self, files: Sequence[AudioSource], batch_size: int) -> Iterator[FileTranscript]:
        for start in range(0, len(files), batch_size):
            # by index, not by slice: a deque, an array of paths take indices alone, or slice otherwise
            indices = range(start, min(start + batch_size, len(files)))
            group = [(files[j], _entry_name(files[j], j)) for j in indices]
            done: dict[int, FileTranscript] = {}
            read: list[tuple[int, Tensor, float, float]] = []  # (index, mono, audio seconds, seconds)
            for i, (source, name) in enumerate(group):
                began = time.perf_counter()
                if not _a_file(source):  # samples (transcribe_batch takes them), None, a number
                    error = (
                        f"{name}: expected a path, a binary file object or a file's bytes, got "
                        f"{type(source).__name__}"
                        + (" (samples: transcribe_batch)" if _samples(source) else "")
                    )
                    done[i] = FileTranscript(name, None, error=error)
                    continue
                try:
                    waveform, rate = read_audio(source, name=name)
                    mono = to_model_input(waveform, rate, self.sample_rate, name=name, layout_checked=True)
                except AudioError as e:
                    done[i] = FileTranscript(name, None, error=str(e))
                    continue
                except (MemoryError, RuntimeError, ValueError, TypeError, AttributeError) as e:
                    # whatever else one file does (an entry that is no file object, a rate that exhausts
                    # memory): that file's error, not the end of the others
                    done[i] = FileTranscript(name, None, error=_cannot(name, e))
                    continue
                read.append((i, mono, waveform.shape[-1] / rate, time.perf_counter() - began))
            for (i, _, duration, reading), (text, seconds, error) in zip(
                read, self._decode_group(read, batch_size)
            ):
                name = group[i][1]
                if error is not None:
                    done[i] = FileTranscript(name, None, error=_cannot(name, error))
                else:
                    done[i] = FileTranscript(name, text, audio_seconds=duration, seconds=reading + seconds)
            yield from (done[i] for i in range(len(group)))

    def _decode_group(
        self, read: list[tuple[int, Tensor, float, float]], batch_size: int
    ) -> list[tuple[str | None, float, str | None]]:
        """(text, seconds, why it failed) of each read file: decoded together, the batch's time shared by
        length (as its features and recurrent steps are); where that fails (memory for one long
        recording), each file alone, so that what fails is that file's error and the others are
        transcribed (each with its share of the failed attempt's time too)."""
        mono = [m for _, m, _, _ in read]
        total = sum(len(m) for m in mono)
        began = time.perf_counter()
        failed = None
        try:
            texts, seconds = self._decode(mono, batch_size)
        except Exception as e:  # noqa: BLE001 - that file's error, or retried file by file
            failed = _reason(e)  # the text alone: the traceback would keep the batch's tensors alive
        if failed is None:
            return [(text, seconds * len(m) / total if total else 0.0, None) for m, text in zip(mono, texts)]
        if len(mono) == 1:
            return [(None, 0.0, failed)]
        spent = time.perf_counter() - began
        alone = [self._decode_group([entry], 1)[0] for entry in read]
        return [(text, s + spent * len(m) / total, why) for (text, s, why), m in zip(alone, mono)]

    def transcribe_files(self, files: Sequence[AudioSource], batch_size: int = 16) -> list[FileTranscript]:
        """Read and transcribe ``files`` (paths, binary file objects such as ``sys.stdin.buffer``, or
        files' bytes: see :func:`~tandem.asr.audio.read_audio`), ``batch_size`` at a time. A file that
        cannot be transcribed (missing, not audio, empty, silent) gets a result with its ``error`` instead
        of stopping the others.

        Returns:
            one :class:`FileTranscript` per file, in the order of ``files``.
        """
        return list(self.iter_transcribe_files(files, batch_size))

    # ---- the model

    def to_torch(self) -> DeepSpeech2:
        """The same network built from torch's modules (torch.nn.GRU/LSTM, BatchNorm1d) with these
        weights, in eval mode on the same device: to run it without tandem's recurrent kernels, or to
        compare with them. It is still tandem's ``DeepSpeech2`` (tandem must be importable to load a
        pickled one), run eagerly: its first convolution is a function of tandem's on the CPU, which
        TorchScript cannot compile or save, and its packing of the real frames depends on the data,
        which torch.export does not take.

        Example::

            >>> net = rec.to_torch()                            # doctest: +SKIP
            >>> log_probs, out_frames = net(features, frames)   # [T', B, K], [B]
        """
        net = DeepSpeech2(self.model.config, TORCH_PARTS).to(self.device)
        net.load_state_dict(self.model.state_dict())
        return net.eval()

    @torch.inference_mode()
    def _decode(self, mono: list[Tensor], batch_size: int = 32) -> tuple[list[str], float]:
        """Transcripts of mono waveforms at the model's rate (in their order) and the seconds it took."""
        began = time.perf_counter()
        texts: list[str] = [""] * len(mono)
        audio, todo = list(mono), list(range(len(mono)))
        spans = self._pass(audio, todo, batch_size, texts)
        if not self.fit_edges:
            return _tidy(texts), time.perf_counter() - began
        for _ in range(MAX_CUTS):
            cuts = {i: self._kept(len(audio[i]), spans[i]) for i in todo}
            todo = [i for i in todo if cuts[i] is not None]
            if not todo:
                break
            for i in todo:
                audio[i] = torch.cat([audio[i][start:end] for start, end in cuts[i]])
            spans.update(self._pass(audio, todo, batch_size, texts))
        near = SPEECH_AT_START_MS * self.features.sample_rate / 1000
        bare = [i for i, span in spans.items() if span is not None and span.first * self._step < near]
        if bare:
            for i in bare:
                audio[i] = _padded(audio[i], round(PAD_MS * self.features.sample_rate / 1000))
            self._pass(audio, bare, batch_size, texts)
        return _tidy(texts), time.perf_counter() - began

    @property
    def _step(self) -> int:
        """Samples per output frame."""
        return self.features.hop_length * math.prod(self.model.config.conv_time_strides)

    def _pass(
        self, audio: list[Tensor], todo: list[int], batch_size: int, texts: list[str]
    ) -> dict[int, _Spoken | None]:
        """Transcribe ``audio[i]`` for ``i`` in ``todo`` into ``texts[i]``; returns where each one's output
        characters are (None where all its output frames are blank)."""
        spans: dict[int, _Spoken | None] = {}
        space = self.alphabet.characters.find(" ") + 1  # 0 (the blank's id) where there is no space
        order = sorted(todo, key=lambda i: -len(audio[i]))
        dtype = next(self.model.parameters()).dtype
        for chosen in _batches(order, [len(a) for a in audio], batch_size):
            lengths = torch.tensor([len(audio[i]) for i in chosen], device="cpu")
            padded = torch.nn.utils.rnn.pad_sequence([audio[i] for i in chosen], batch_first=True)
            features, frames = self.logmel(padded.to(self.device), lengths)  # [B, T, n_mels], [B]
            features = features.to(dtype)  # the model's (one made under another default dtype, converted)
            log_probs, out_frames = self.model(features, frames)  # [T', B, K], [B]
            for i, text in zip(chosen, greedy_decode(log_probs, out_frames, self.alphabet)):
                texts[i] = text
            best = log_probs.argmax(-1).T.cpu()  # [B, T']
            for b, i in enumerate(chosen):
                ids = best[b, : int(out_frames[b])]
                at = (ids != 0).nonzero().flatten()
                letters = ((ids != 0) & (ids != space)).nonzero().flatten().tolist()
                spans[i] = _Spoken(int(at[0]), int(at[-1]), letters) if len(at) else None
        return spans

    def _kept(self, samples: int, spoken: _Spoken | None) -> list[tuple[int, int]] | None:
        """The pieces ``[start, end)`` to keep of a recording of ``samples`` samples whose output characters
        are ``spoken``: :data:`EDGE_KEPT_MS` before its first and after its last, and of a silence between
        two letters :data:`INNER_KEPT_MS` after the first and before the second, each cut only where it
        removes at least :data:`MIN_CUT_MS` (the two edges together); None where nothing is cut (or
        nothing was said)."""
        if spoken is None:
            return None
        cfg, step = self.features, self._step
        before, after = (round(ms * cfg.sample_rate / 1000) for ms in EDGE_KEPT_MS)
        inner_before, inner_after = (round(ms * cfg.sample_rate / 1000) for ms in INNER_KEPT_MS)
        least = MIN_CUT_MS * cfg.sample_rate / 1000
        # an output frame's input frames end a window after the start of their last hop
        tail = cfg.win_length - cfg.hop_length
        start = max(0, spoken.first * step - before)
        end = min(samples, (spoken.last + 1) * step + tail + after)
        if samples - (end - start) < least:  # the edges as they are
            start, end = 0, samples
        pieces = []
        for a, b in zip(spoken.letters, spoken.letters[1:]):
            hole = ((a + 1) * step + tail + inner_after, b * step - inner_before)
            if hole[1] - hole[0] >= least:  # a long silence between two words
                pieces.append((start, hole[0]))
                start = hole[1]
        pieces.append((start, end))
        return None if pieces == [(0, samples)] else pieces


@dataclass(frozen=True)
class _Spoken:
    """Where a recording's output characters are: its first and last non-blank output frames, and the
    frames of its letters (neither blank nor space), in order."""

    first: int
    last: int
    letters: list[int]


# A forward pass pads its recordings to the longest, so one long recording among short ones would make
# the whole batch long: a batch holds at most this many samples with the padding (4.2 M: 16 recordings
# of 33 s at 8 kHz), or one recording whatever its length.
PADDED_SAMPLES = 2**22


def _batches(order: list[int], lengths: list[int], batch_size: int) -> Iterator[list[int]]:
    """``order`` (longest first) cut into batches of at most ``batch_size`` recordings and, padding
    included, :data:`PADDED_SAMPLES` samples."""
    chosen: list[int] = []
    for i in order:
        if chosen and (len(chosen) == batch_size or (len(chosen) + 1) * lengths[chosen[0]] > PADDED_SAMPLES):
            yield chosen
            chosen = []
        chosen.append(i)
    if chosen:
        yield chosen


def _a_file(source: object) -> bool:
    """``source`` is of a kind :func:`~tandem.asr.audio.read_audio` reads: a path, a binary file object,
    a file's bytes."""
    return isinstance(source, (str, bytes, bytearray, memoryview, os.PathLike)) or hasattr(source, "read")


def _samples(source: object) -> bool:
    """``source`` holds samples: a tensor, or a numpy array of numbers (an array of paths holds files)."""
    return isinstance(source, Tensor) or (isinstance(source, np.ndarray) and source.dtype.kind not in "USO")


def _entry_name(source: object, index: int) -> str:
    """What messages call entry ``index`` of ``files``: :func:`source_name`'s name, or ``files[i]`` for an
    entry that is none of the kinds taken."""
    return source_name(source) if _a_file(source) else f"files[{index}]"


def _reason(error: BaseException) -> str:
    """An exception's type and the first line of its message (200 characters at most)."""
    return f"{type(error).__name__}: {first_line(error)[:200]}"


def _cannot(name: str, error: BaseException | str) -> str:
    """A file's error line for a failure other than its audio's (an exception, or its :func:`_reason`)."""
    return f"{name}: cannot transcribe ({error if isinstance(error, str) else _reason(error)})"


def _padded(waveform: Tensor, samples: int) -> Tensor:
    """``waveform`` with ``samples`` of Gaussian noise at :data:`PAD_LEVEL_DB` below its peak before and
    after it (the same noise for every recording: a transcript depends on the recording alone)."""
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(2, samples, generator=generator, dtype=waveform.dtype, device="cpu")
    noise = noise.to(waveform.device) * (waveform.abs().max() * 10 ** (PAD_LEVEL_DB / 20))
    return torch.cat([noise[0], waveform, noise[1]])


def _check_fit_edges(fit_edges: bool) -> bool:
    if not isinstance(fit_edges, (bool, np.bool_)):
        raise TypeError(f"Recognizer: expected fit_edges True or False, got {fit_edges!r}")
    return bool(fit_edges)


def _check_batch_size(batch_size: int) -> int:
    """``batch_size`` as an int: any integer type (a numpy integer too), positive, not a bool."""
    try:
        size = operator.index(batch_size)
    except TypeError:
        size = None
    if isinstance(batch_size, (bool, np.bool_)) or size is None or size < 1:
        raise ValueError(f"Recognizer: expected a positive integer batch_size, got {batch_size!r}")
    return size


# Weights a message names of each kind (missing, unexpected, of another shape) before "and N more"
_NAMED = 4


def _named(names: list[str]) -> str:
    """The first :data:`_NAMED` of ``names``, then how many more."""
    more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    return ", ".join(names[:_NAMED]) + more


def _weights_mismatch(model: DeepSpeech2, weights: object, config: Mapping[str, object]) -> str | None:
    """What keeps a checkpoint's ``weights`` from loading into ``model``, built from its ``config`` (its
    ``model_config``): the weights missing, unexpected and of another shape, a few of each by name, and the
    settings ``config`` lacks (taken as their defaults, so most likely the cause); None if they fit, or if
    ``weights`` is no mapping (``load_state_dict`` says so)."""
    if not isinstance(weights, Mapping):
        return None
    expected = model.state_dict()
    missing = [k for k in expected if k not in weights]
    unexpected = [str(k) for k in weights if k not in expected]
    reshaped = [
        f"{k} {list(weights[k].shape)} (the model's {list(v.shape)})"
        for k, v in expected.items()
        if isinstance(weights.get(k), Tensor) and weights[k].shape != v.shape
    ]
    kinds = (("missing", missing), ("unexpected", unexpected), ("of another shape", reshaped))
    found = [f"{kind} {_named(names)}" for kind, names in kinds if names]
    if not found:
        return None
    said = f"its weights do not fit the model its model_config describes: {'; '.join(found)}"
    lacked = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in config]
    if lacked:
        defaults = ", ".join(f"{name}={getattr(model.config, name)!r}" for name in lacked)
        said += (
            f" (its model_config lacks {', '.join(map(repr, lacked))}: the defaults {defaults} were taken)"
        )
    return said

"""Audio in at the boundary: recordings read from files (WAV and what else libsndfile reads) and turned
into what the model takes, one mono waveform at the feature rate.

Reading goes through ``soundfile`` (libsndfile): Python's ``wave`` reads integer PCM only, and float WAVs
are common output of audio tools. Sample rates are never guessed: a file carries its own, and arrays come
with theirs as an argument.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Union

import numpy as np
import torch
from torch import Tensor

from tandem.asr.features import resample

__all__ = [
    "AudioError",
    "AudioSource",
    "MAX_CHANNELS",
    "MAX_SAMPLE_RATE",
    "SILENCE_PEAK",
    "first_line",
    "half_range",
    "read_audio",
    "read_header",
    "source_name",
    "to_model_input",
    "truncation_message",
    "wav_truncation",
]

# A recording whose every sample is at most one step of 16-bit PCM (-90 dBFS) holds no sound: all
# zeros, or the last bit's dither. Per-utterance feature normalisation would blow such a recording up to
# full scale, and the model would transcribe noise, so it is refused instead.
SILENCE_PEAK = 2.0**-15
# More "channels" than this is a [samples, channels] array (soundfile.read's layout) passed untransposed.
# Files carry their layout, so they may have more.
MAX_CHANNELS = 64
# The highest sample rate taken (768 kHz, the top rate of audio converters): a higher one is a broken
# header or a wrong argument, and resampling from it would take gigabytes.
MAX_SAMPLE_RATE = 768_000
# The lowest (1 kHz, below any recording of speech): a lower one is a broken header or a rate given in kHz,
# and resampling from it would make minutes of audio of every second.
MIN_SAMPLE_RATE = 1_000
# Integer PCM samples as libsndfile scales them to float: 8-, 16- and 32-bit (unsigned 8-bit centred on 128)
_PCM_SCALE = {
    torch.int8: (0, 2.0**7),
    torch.uint8: (128, 2.0**7),
    torch.int16: (0, 2.0**15),
    torch.int32: (0, 2.0**31),
}
# A mix of channels whose peak is this far below the loudest channel's (40 dB) is channels that cancel
CANCELLED = 0.01
# The fewest samples (a channel's) in which sound can be told from silence, judged by the range they span:
# one sample spans none, and was called silent whatever its value
FEWEST_SAMPLES = 2
# Float samples above this are scaled down by their peak before the features (whose per-utterance
# normalisation removes the level anyway): squared in float32, they would overflow to inf and NaN.
LOUDEST = 1e15

AudioSource = Union[str, bytes, bytearray, memoryview, "os.PathLike[str]", BinaryIO]


class AudioError(ValueError):
    """A recording that cannot be transcribed: missing, not audio, empty or silent. The message starts
    with the file's (or argument's) name."""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message ("" for none): what a one-line message quotes of it."""
    return (str(error).strip().splitlines() or [""])[0]


def source_name(source: AudioSource) -> str:
    """What messages call ``source``: the path as given, the file object's ``name`` (``<stdin>``), or
    ``<N bytes>`` for a recording's bytes."""
    if _holds_audio(source):
        return f"<{memoryview(source).nbytes} bytes>"  # type: ignore[arg-type]
    if isinstance(source, (str, bytes, os.PathLike)):
        return os.fsdecode(source)
    return str(getattr(source, "name", "<stream>"))


def _holds_audio(source: object) -> bool:
    """``source`` is a recording's bytes, not a path: a bytearray or memoryview, or bytes with a NUL in
    them (no path holds one; every WAV header does)."""
    return isinstance(source, (bytearray, memoryview)) or (isinstance(source, bytes) and b"\0" in source)


def read_audio(
    source: AudioSource,
    *,
    name: str | None = None,
    silent_ok: bool = False,
    start: int = 0,
    frames: int = -1,
) -> tuple[Tensor, int]:
    """Read a recording: its samples and its sample rate.

    Any sample rate and channel count; WAV with 8-bit (unsigned), 16/24/32-bit integer or 32/64-bit
    float samples, and the other formats libsndfile reads (FLAC, OGG/Vorbis, AIFF...). Integer samples
    are scaled to [-1, 1) as libsndfile does (divided by 2^(bits-1)).

    Args:
        source: a path, a binary file object (read to its end, so a pipe such as standard input works), or
            a file's bytes (bytes that hold a NUL, as every WAV header does; a bytearray or memoryview).
        name: what error messages call the recording (default: the path, or the file object's ``name``).
        silent_ok: return a silent recording instead of raising.
        start, frames: read ``frames`` samples (each channel's) from sample ``start``, or (-1) to the
            end, as ``soundfile.read`` takes them (a segment of a long recording).

    Returns:
        waveform ``[channels, samples]`` float32, and the sample rate in Hz.

    Raises:
        AudioError: no such file, not a recording libsndfile reads, no samples (empty), non-finite
            samples, or one sample (too short to judge) or silent (every sample at most
            :data:`SILENCE_PEAK` in magnitude, or one step of an 8-bit file's; unless ``silent_ok``).

    Example::

        >>> waveform, rate = read_audio("speech.wav")   # doctest: +SKIP
        >>> waveform.shape, rate
        (torch.Size([2, 35280]), 44100)
    """
    label = name if name is not None else source_name(source)
    if _holds_audio(source):
        source = io.BytesIO(bytes(source))  # type: ignore[arg-type]
    try:
        if isinstance(source, (str, bytes, os.PathLike)):
            if not os.fspath(source):
                raise AudioError(f"{label!r}: an empty path, not a file name")
            path = Path(os.fsdecode(source))
            if not path.exists():
                raise AudioError(f"{label}: no such file")
            if path.is_dir():
                raise AudioError(f"{label}: not a file (a directory)")
            if path.is_char_device() or path.is_block_device():
                raise AudioError(f"{label}: a device, not a recording")
            if path.is_file() and path.stat().st_size == 0:
                raise AudioError(f"{label}: empty input (0 bytes)")
            # opened here, so that any name the system takes works (libsndfile wants UTF-8 paths); a
            # named pipe (<(cmd), /dev/stdin) is read to its end, as it cannot seek
            with open(path, "rb") as f:
                whole = f if path.is_file() else _whole(f, label)
                samples, rate, silence = _decode(_readable(whole, label), label, start, frames)
        else:
            samples, rate, silence = _decode(_readable(_whole(source, label), label), label, start, frames)
    except OSError as e:
        raise AudioError(f"{label}: cannot read ({e.strerror or e})") from None
    waveform = torch.from_numpy(np.ascontiguousarray(samples.T))  # [channels, samples]
    _check_samples(waveform, label, silent_ok=silent_ok, silence=silence)
    return waveform, int(rate)


# The most a stream (a pipe, standard input) is read into memory: hours of CD-quality audio; an endless
# one (cat /dev/zero) grew without bound and printed nothing
STREAM_LIMIT_BYTES = 2**30


def _whole(stream: BinaryIO, label: str) -> io.BytesIO:
    """A stream read to its end (libsndfile seeks; pipes cannot), at most :data:`STREAM_LIMIT_BYTES`."""
    try:
        data = stream.read(STREAM_LIMIT_BYTES + 1)
    except UnicodeDecodeError:
        data = ""
    except ValueError as e:  # a closed file
        raise AudioError(f"{label}: cannot read ({e})") from None
    if isinstance(data, str):
        raise AudioError(f"{label}: a file opened in text mode; open it in binary mode ('rb')")
    if not data:
        raise AudioError(f"{label}: empty input (0 bytes)")
    if len(data) > STREAM_LIMIT_BYTES:
        raise AudioError(
            f"{label}: more than {STREAM_LIMIT_BYTES >> 20} MiB from a stream (an endless one?); expected a "
            "recording: give its file, which is read in place"
        )
    return io.BytesIO(data)


# Sizes a WAV writer puts in the data chunk's header when it cannot know the length (a stream, a pipe
# it cannot seek back in): 0 or 0xFFFFFFFF, 0x7FFFF000 (sox), 0x7FFFFFFF (arecord and others). 0 is also
# an empty recording's true size: it is a placeholder only where no chunk follows (:func:`_chunk_follows`).
_WAV_UNKNOWN_SIZES = (0, 0xFFFFFFFF, 0x7FFFF000, 0x7FFFFFFF)
# What the containers that announce their samples' size look like: the first bytes, where the form type
# is and what it must be, the chunk ids' length, the size fields' length and byte order, the bytes a
# chunk's size counts besides its body (Wave64's counts its own header), the padding of chunks, the
# sample chunk's id and the bytes in it before the samples (AIFF's SSND: offset and block size)
_CONTAINERS = {
    b"RIFF": (12, (8, b"WAVE"), 4, 4, "little", 0, 2, b"data", 0),
    b"RIFX": (12, (8, b"WAVE"), 4, 4, "big", 0, 2, b"data", 0),  # big-endian WAV
    b"RF64": (12, (8, b"WAVE"), 4, 4, "little", 0, 2, b"data", 0),  # EBU's 64-bit WAV: sizes in ds64
    b"BW64": (12, (8, b"WAVE"), 4, 4, "little", 0, 2, b"data", 0),
    b"riff": (40, (24, b"wave"), 16, 8, "little", 24, 8, b"data", 0),  # Sony Wave64 (GUIDs)
    b"FORM": (12, (8, (b"AIFF", b"AIFC")), 4, 4, "big", 0, 2, b"SSND", 8),
}
_CONTAINER_NAMES = {
    b"RIFF": "WAV",
    b"RIFX": "RIFX WAV",
    b"RF64": "RF64 WAV",
    b"BW64": "BW64 WAV",
    b"riff": "Wave64",
    b"FORM": "AIFF",
    b".snd": "AU",
    b"dns.": "AU",  # little-endian (libsndfile writes it on request)
    b"NIST": "NIST SPHERE",
}
# What a NIST SPHERE header's sample_coding may be where its samples' bytes are sample_count x
# sample_n_bytes x channel_count: uncompressed (libsndfile reads no other; "pcm,embedded-shorten-v2.00"
# and the like are compressed, their sizes not the samples')
_NIST_CODINGS = ("pcm", "ulaw", "mu-law", "alaw")
# The most of a NIST SPHERE header read (its size is a multiple of 1024, 1024 in the files seen)
_NIST_HEADER_LIMIT = 1 << 16


def wav_truncation(f: BinaryIO) -> tuple[int, int] | None:
    """For a recording cut short (a copy or download that stopped): the bytes of samples its header
    announces and the bytes the file holds after that header; None for a complete file, a WAV written as
    a stream (a size of 0, 0xFFFFFFFF, 0x7FFFF000 or 0x7FFFFFFF; an AU's 0xFFFFFFFF) or anything else.
    Read are WAV (RIFF, big-endian RIFX, and RF64/BW64, whose 64-bit sizes are in their ds64 chunk), Sony
    Wave64, AIFF/AIFC, AU (.snd) and NIST SPHERE: libsndfile reads any of them cut short without a word,
    as the shorter recording it holds. ``f`` is read from its start and left there."""
    cut = _cut_short(_sample_chunk(f))
    return None if cut is None else cut[1:]


def truncation_message(f: BinaryIO) -> str | None:
    """What is wrong with a recording cut short (see :func:`wav_truncation`), or None."""
    return _truncation(_sample_chunk(f))


def _truncation(found: tuple[bytes, int | None, int, int] | None) -> str | None:
    """:func:`truncation_message` of what :func:`_sample_chunk` found."""
    cut = _cut_short(found)
    if cut is None:
        return None
    kind, announced, held = cut
    return (
        f"a truncated {_CONTAINER_NAMES[kind]} file: its header announces {announced} bytes of samples, "
        f"the file holds {held} ({100 * held / announced:.0f}%); it was probably cut short while copied or "
        "written"
    )


def _cut_short(found: tuple[bytes, int | None, int, int] | None) -> tuple[bytes, int, int] | None:
    """The container, the bytes of samples announced and those held, of a recording cut short (from what
    :func:`_sample_chunk` found)."""
    if found is None:
        return None
    kind, announced, held, _ = found
    return (kind, announced, held) if announced is not None and announced > held else None


def _sample_chunk(f: BinaryIO) -> tuple[bytes, int | None, int, int] | None:
    """``f``'s container (its key in :data:`_CONTAINER_NAMES`), the bytes of samples its header announces
    (None for a stream's placeholder), the bytes after the sample chunk's header, and where a RIFF or
    RIFX WAV's data size is (an RF64/BW64 stream's: its ds64's 64-bit data size; -1 in other containers
    and other RF64 files); None if ``f`` is none of them or its header ends before its samples. ``f`` is
    left at 0."""
    f.seek(0, io.SEEK_END)
    end = f.tell()
    f.seek(0)
    try:
        head = f.read(40)
        if head[:4] in (b".snd", b"dns."):
            return _au_samples(head, end)
        if head[:8] == b"NIST_1A\n":
            return _nist_samples(f, head, end)
        if _container(head) is None:
            return None
        _, _, _, size_len, _, counted, _, sample_id, skip = _CONTAINERS[head[:4]]
        ds64 = None  # RF64/BW64: the data size held for the data chunk whose own size is 0xFFFFFFFF
        ds64_at = -1  # and where it is
        for chunk, size in _chunks(f, head[:4]):
            if chunk == b"ds64" and head[:4] in (b"RF64", b"BW64"):
                body = f.read(16)
                ds64 = int.from_bytes(body[8:16], "little") if len(body) == 16 else None
                ds64_at = f.tell() - len(body) + 8
            if chunk == sample_id:
                held = end - f.tell() - skip
                if head[:4] in (b"RIFF", b"RIFX"):
                    known = size not in _WAV_UNKNOWN_SIZES or (size == 0 and _chunk_follows(f, head, end))
                    return head[:4], (size if known else None), held, f.tell() - size_len
                if ds64 is not None and size == 0xFFFFFFFF:
                    # ffmpeg writing RF64 into a pipe leaves its ds64 zeros (the sizes are not known
                    # yet): a placeholder, as RIFF's data size 0 is, unless a chunk follows (empty)
                    if ds64 == 0 and not _chunk_follows(f, head, end):
                        return head[:4], None, held, ds64_at
                    size = ds64
                size -= counted + skip
                return head[:4], (size if size > 0 else None), held, -1
        return None
    finally:
        f.seek(0)


def _container(head: bytes) -> bytes | None:
    """The key in :data:`_CONTAINERS` of a file whose first bytes are ``head``, or None."""
    if head[:4] not in _CONTAINERS:
        return None
    _, (at, form), *_ = _CONTAINERS[head[:4]]
    return head[:4] if head[at : at + 4] in (form if isinstance(form, tuple) else (form,)) else None


def _chunks(f: BinaryIO, kind: bytes) -> Iterator[tuple[bytes, int]]:
    """The chunks of ``f``, a ``kind`` of :data:`_CONTAINERS`, from its first: each one's id (its first 4
    bytes: a Wave64 GUID's are its name) and size, ``f`` at the chunk's body while it is taken (which
    may read on). The walk ends where a chunk's header would, at the end of the file, or at a chunk
    size below its header's."""
    first, _, id_len, size_len, order, counted, pad, _, _ = _CONTAINERS[kind]
    at = first
    while True:
        f.seek(at)
        header = f.read(id_len + size_len)
        if len(header) < id_len + size_len:
            return
        size = int.from_bytes(header[id_len:], order)
        yield header[:4], size
        body = size - counted
        if body < 0:  # a broken Wave64 size (it counts its own header): not a header to walk
            return
        at += id_len + size_len + body + (-body % pad)  # chunks are padded to a multiple of ``pad``


def _au_samples(head: bytes, end: int) -> tuple[bytes, int | None, int, int] | None:
    """:func:`_sample_chunk` of an AU file (``head``: its first bytes, ``end``: its size): the data size
    at 4 bytes in (0xFFFFFFFF where the writer did not know it: a stream), the samples from the data
    offset at 8 to the end; big-endian, little-endian in a "dns." file."""
    order = "big" if head[:4] == b".snd" else "little"
    if len(head) < 12:
        return None
    offset, size = int.from_bytes(head[4:8], order), int.from_bytes(head[8:12], order)
    if offset > end:
        return None
    return head[:4], (None if size == 0xFFFFFFFF else size), end - offset, -1


def _nist_samples(f: BinaryIO, head: bytes, end: int) -> tuple[bytes, int | None, int, int] | None:
    """:func:`_sample_chunk` of a NIST SPHERE file (``head``: its first bytes, ``end``: its size): its text
    header's size on its second line, the samples' bytes from its fields (sample_count, of each channel,
    x sample_n_bytes x channel_count; None where one is missing or the samples are compressed), the
    bytes after the header."""
    try:
        size = int(head[8:16])
    except ValueError:
        return None
    if not 16 <= size <= min(end, _NIST_HEADER_LIMIT):
        return None
    f.seek(0)
    fields = {}
    for line in f.read(size).split(b"\n")[2:]:
        words = line.decode("latin-1").split(None, 2)
        if words == ["end_head"]:
            break
        if len(words) == 3 and words[1].startswith("-"):
            fields[words[0]] = words[2].strip()
    if fields.get("sample_coding", "pcm") not in _NIST_CODINGS:
        return None
    try:
        announced = math.prod(int(fields[k]) for k in ("sample_count", "sample_n_bytes", "channel_count"))
    except (KeyError, ValueError):
        return None
    return b"NIST", (announced if announced > 0 else None), end - size, -1


# IEEE float samples' format tag in a WAV's fmt chunk (and the first field of WAVE_FORMAT_EXTENSIBLE's
# (0xFFFE) sub-format GUID), and the sizes libsndfile reads them in: others (16-bit half floats, 24-bit
# ones, which some tools write) fail with its "Unspecified internal error"
_FLOAT_TAG = 3
_FLOAT_BITS = (32, 64)


def _unsupported_format(f: BinaryIO) -> str | None:
    """What libsndfile cannot read in a WAV (RIFF, RIFX, RF64/BW64, Wave64) that it failed to open, said
    plainly where its own message is none: float samples of other than 32 or 64 bits; else None. ``f``
    is left at 0."""
    try:
        f.seek(0)
        kind = _container(f.read(40))
        if kind is None or kind == b"FORM":
            return None
        order = _CONTAINERS[kind][4]
        for chunk, size in _chunks(f, kind):
            if chunk == b"fmt ":
                fmt = f.read(min(size, 40))
                if len(fmt) < 16:
                    return None
                tag, bits = int.from_bytes(fmt[:2], order), int.from_bytes(fmt[14:16], order)
                if tag == 0xFFFE and len(fmt) >= 28:  # WAVE_FORMAT_EXTENSIBLE: the sub-format's tag
                    tag = int.from_bytes(fmt[24:28], order)
                if tag == _FLOAT_TAG and bits not in _FLOAT_BITS:
                    return (
                        f"an unsupported sample format: float with {bits} bits (float samples are read with "
                        f"{' or '.join(map(str, _FLOAT_BITS))} bits)"
                    )
                return None
        return None
    finally:
        f.seek(0)


def _chunk_follows(f: BinaryIO, head: bytes, end: int) -> bool:
    """Whether a RIFF (or RIFX) WAV's data chunk of size 0 (or an RF64's whose ds64 says 0), whose header
    ``f`` has just been read (``head``: the file's first bytes, ``end``: its size), is empty for real:
    another chunk follows it (a tag appended after an empty recording), as libsndfile reads it. It is a
    stream's placeholder, read to the end, where the RIFF size says the file ends at that header
    (written before the samples), or the bytes after it are no chunk header: an id of printable ASCII (a
    space not first) and a size within the file. ``f`` is left where it was."""
    at = f.tell()
    order = "big" if head[:4] == b"RIFX" else "little"
    riff = int.from_bytes(head[4:8], order)
    if riff not in _WAV_UNKNOWN_SIZES and riff + 8 <= at:
        return False
    header = f.read(8)
    f.seek(at)
    if len(header) < 8:
        return False
    name, size = header[:4], int.from_bytes(header[4:], order)
    return all(0x20 <= c <= 0x7E for c in name) and name[0] != 0x20 and at + 8 + size <= end


def _readable(f: BinaryIO, label: str) -> BinaryIO:
    """``f`` as libsndfile is to read it, its header walked once: a recording cut short is refused, a WAV
    whose data size is a stream's 0 read to its end (:func:`_unknown_size_read_whole`)."""
    found = _sample_chunk(f)
    problem = _truncation(found)
    if problem is not None:
        raise AudioError(f"{label}: {problem}")
    return _unknown_size_read_whole(f, found)


def read_header(path: str | os.PathLike[str]) -> tuple[int, int]:
    """A recording's length in samples (a channel's) and its sample rate, from its header: nothing is
    decoded. A WAV written as a stream with a data size of 0 counts the samples it holds, as
    :func:`read_audio` reads them.

    Raises :class:`AudioError` (naming ``path``) where :func:`read_audio` says more than libsndfile would:
    a sample format it does not read, a file of a decoded length that decodes to nothing; libsndfile's
    own errors otherwise."""
    import soundfile

    with open(path, "rb") as f:
        source = _unknown_size_read_whole(f, _sample_chunk(f))
        try:
            info = soundfile.info(source)
        except (RuntimeError, TypeError, ValueError):
            unsupported = _unsupported_format(source)
            if unsupported is not None:
                raise AudioError(f"{path}: {unsupported}") from None
            raise
        size = source.seek(0, io.SEEK_END)
        problem = _length_problem(str(path), info.frames, info.format, info.subtype, size)
        if problem is not None:
            raise AudioError(problem)
    return info.frames, info.samplerate


def _unknown_size_read_whole(f: BinaryIO, found: tuple[bytes, int | None, int, int] | None) -> BinaryIO:
    """``f``, or a copy of it whose WAV data size 0 (a stream's placeholder, which libsndfile reads as no
    samples at all) says 0xFFFFFFFF (another one, which it reads to the end), or whose RF64/BW64 ds64
    data size 0 (ffmpeg's into a pipe, also read as no samples; libsndfile has no placeholder there) says
    the bytes the file holds after the data chunk's header (libsndfile reads the whole frames in them);
    ``found``: what :func:`_sample_chunk` found in ``f``."""
    if found is None or found[1] is not None or found[3] < 0 or found[2] <= 0:
        return f
    data = bytearray(f.read())
    f.seek(0)
    at = found[3]
    if found[0] in (b"RF64", b"BW64"):
        data[at : at + 8] = found[2].to_bytes(8, "little")
    elif data[at : at + 4] == bytes(4):
        data[at : at + 4] = b"\xff" * 4
    return io.BytesIO(bytes(data))


# Formats whose length libsndfile finds by decoding (Ogg's last page, MP3's frames, FLAC's STREAMINFO,
# where 0 is "not known"), not from a size in the header: a file of them cut short or damaged reads as 0
# samples (an Ogg/Vorbis file cut before its last page does), which is no sign of an empty recording
_DECODED_LENGTH = ("OGG", "MP3", "FLAC")
# libsndfile's frame count of a file whose header does not say it (a FLAC written into a pipe: STREAMINFO's
# total 0) is 2^63 - 1, and it cannot read such a file to its end (read as one array: "array is too big";
# in blocks, the seek past the last one fails)
_UNKNOWN_FRAMES = 2**62


def _length_problem(label: str, frames: int, format: str, subtype: str, size: int) -> str | None:
    """What is wrong with a file of ``size`` bytes whose length libsndfile gives as ``frames`` (its
    ``format`` and ``subtype``), or None: a length no header says (:data:`_UNKNOWN_FRAMES`), or no samples
    in a format whose length it decodes (:data:`_DECODED_LENGTH`). Said alike by :func:`read_audio` and
    by :func:`read_header`."""
    if frames >= _UNKNOWN_FRAMES:
        return (
            f"{label}: a {format} file whose header does not say its length (written into a pipe?), which "
            "libsndfile cannot read to its end; save it again as a file (for example: ffmpeg -i IN OUT.wav)"
        )
    if frames == 0 and format in _DECODED_LENGTH:
        return (
            f"{label}: no samples could be decoded from its {size} bytes ({format} {subtype}); it may be cut "
            "short or damaged (or hold an empty recording)"
        )
    return None


def _decoded_short(label: str, sound: Any, start: int, frames: int, got: int) -> str | None:
    """What is wrong where a format whose length libsndfile takes from its header but decodes the samples
    of (an MP3's Xing frame count) gave more than 1% fewer than it announced: a file cut short, which
    would be transcribed in part without a word. (An Ogg file cut short announces what it still holds.)"""
    if sound.format not in _DECODED_LENGTH:
        return None
    expected = max(sound.frames - start, 0) if frames < 0 else min(frames, max(sound.frames - start, 0))
    if got >= 0.99 * expected:
        return None
    return (
        f"{label}: a truncated {sound.format} file: its header announces {sound.frames} samples, only "
        f"{start + got} could be decoded; it may be cut short or damaged"
    )


def _decode(f: BinaryIO, label: str, start: int = 0, frames: int = -1) -> tuple[np.ndarray, int, float]:
    """``[samples, channels]`` float32 (``frames`` of them from ``start``, or to the end), the rate, and the
    peak at or under which the file is silent (:func:`_silence_peak`), by libsndfile; :class:`AudioError`
    if it cannot, or if it finds no samples in a format whose length it decodes (:data:`_DECODED_LENGTH`)."""
    import soundfile  # a runtime dependency, imported here so training never loads libsndfile

    size = f.seek(0, io.SEEK_END)
    f.seek(0)
    try:
        with soundfile.SoundFile(f) as sound:
            silence = _silence_peak(sound.subtype)
            if sound.seekable():
                if start:
                    sound.seek(start)
            else:
                # codecs libsndfile cannot seek in (GSM 6.10, G.721/G.723, NMS ADPCM) take neither a seek
                # nor "to the end" (-1): the frames are counted, and those before start read and dropped
                if frames < 0:
                    frames = max(sound.frames - start, 0)
                if start:
                    sound.read(start, dtype="float32", always_2d=True)
            problem = _length_problem(label, sound.frames, sound.format, sound.subtype, size)
            if problem is None:
                samples = sound.read(frames, dtype="float32", always_2d=True)
                problem = _decoded_short(label, sound, start, frames, len(samples))
            rate = sound.samplerate
    except (RuntimeError, TypeError, ValueError) as e:  # soundfile.LibsndfileError is a RuntimeError
        unsupported = _unsupported_format(f)
        if unsupported is not None:
            raise AudioError(f"{label}: {unsupported}") from None
        reason = (getattr(e, "error_string", None) or first_line(e) or type(e).__name__).rstrip(".")
        raise AudioError(f"{label}: not a readable audio file ({reason})") from None
    if problem is not None:
        raise AudioError(problem)
    return samples, rate, silence


def _silence_peak(subtype: str) -> float:
    """One step of an 8-bit file's samples (2^-7: its last bit's dither is silence as 16-bit's is); of
    G.711's near zero (A-law and mu-law: 2^-12, 13-bit steps there, and A-law has no zero: its silence
    decodes to +-2^-12); else :data:`SILENCE_PEAK`."""
    if subtype in ("PCM_U8", "PCM_S8", "DPCM_8", "DWVW_8"):
        return 2.0**-7
    if subtype in ("ALAW", "ULAW"):
        return 2.0**-12
    return SILENCE_PEAK


def _check_samples(
    waveform: Tensor,
    label: str,
    channels: Tensor | None = None,
    silent_ok: bool = False,
    silence: float = SILENCE_PEAK,
) -> float:
    """``waveform``'s peak magnitude, or :class:`AudioError` if it is empty, not finite or (unless
    ``silent_ok``) too short to judge (:data:`FEWEST_SAMPLES`) or silent (its peak at most ``silence``);
    ``channels`` (``[C, samples]``), where ``waveform`` is their mix, names loud channels that cancel (the
    mix 40 dB or more below the loudest channel, :data:`CANCELLED`)."""
    if waveform.shape[-1] == 0:
        raise AudioError(f"{label}: empty recording (0 samples)")
    peak = float(waveform.abs().max())
    if not math.isfinite(peak):
        # (a 64-bit float file's finite samples beyond float32's range are read as infinite)
        raise AudioError(
            f"{label}: the recording holds NaN or infinite samples, or 64-bit float samples beyond float32's "
            f"range of ±{torch.finfo(torch.float32).max:.3g}"
        )
    if silent_ok:
        return peak
    # judged by half the range the samples span: a constant offset (a DC bias) with nothing but a step of
    # dither on it is silence too, as is A-law's silence, which decodes to +-2^-12 (no code for 0)
    swing = half_range(waveform)
    loudest = 0.0
    if channels is not None and channels.shape[0] > 1:
        loudest = float(max(half_range(c) for c in channels))
    # channels that (nearly) cancel: the mix is what is left of one voice in opposite phase (a mis-wired
    # microphone), not the recording (a silent channel leaves half the other, -6 dB)
    if swing <= silence or swing < loudest * CANCELLED:
        if waveform.shape[-1] < FEWEST_SAMPLES:
            raise AudioError(
                f"{label}: too short: {waveform.shape[-1]} sample, too few to tell sound from silence (at "
                f"least {FEWEST_SAMPLES} are needed); nothing to transcribe"
            )
        if loudest > silence:  # (a NaN does not compare: the mix would have held it)
            # how to give one channel, in Python and from `tandem transcribe` (which has no option for it)
            raise AudioError(
                f"{label}: its {channels.shape[0]} channels cancel out when mixed to mono (the loudest "
                f"channel's peak is {loudest:.3g}, the mix's {swing:.3g}); transcribe one of them: in Python "
                "pass waveform[0] (read_audio gives [channels, samples]), on the command line take it out "
                "first (sox in.wav -t wav - remix 1 | tandem transcribe -)"
            )
        bits = round(1 - math.log2(silence))
        amplitude = f"peak amplitude {peak:.3g}"
        if swing < peak:
            amplitude = f"samples within {swing:.3g} of {float(waveform.max()) - swing:.3g}"
        raise AudioError(
            f"{label}: silent recording ({amplitude}, not above {silence:.3g}, one step of {bits}-bit "
            "audio); nothing to transcribe"
        )
    return peak


def half_range(samples: Tensor) -> float:
    """Half the range ``samples`` span (their amplitude about the middle of that range): at most
    :data:`SILENCE_PEAK` (one step of 16-bit audio), a recording is silent."""
    return (float(samples.max()) - float(samples.min())) / 2


def to_model_input(
    waveform: Tensor | np.ndarray,
    sample_rate: int,
    target_rate: int,
    *,
    name: str = "waveform",
    layout_checked: bool = False,
    silent_ok: bool = False,
) -> Tensor:
    """A recording as the model's input: channels averaged to mono, resampled to ``target_rate``.

    Resampling is :func:`tandem.asr.features.resample` (windowed sinc with its cut-off below the lower
    Nyquist frequency, so higher frequencies are filtered out rather than aliased).

    Args:
        waveform: ``[samples]`` or ``[channels, samples]``, a tensor or numpy array of float samples, or
            of 8-, 16- or 32-bit integer PCM (``scipy.io.wavfile``'s int16), scaled to [-1, 1) as
            libsndfile scales them (unsigned 8-bit centred on 128); other integer types are refused.
        sample_rate: the waveform's rate in Hz.
        target_rate: the model's rate in Hz (a checkpoint's ``FeatureConfig.sample_rate``).
        name: what error messages call the waveform.
        layout_checked: the waveform is ``[channels, samples]`` for sure (read from a file), so more than
            :data:`MAX_CHANNELS` channels is no sign of a transposed array.
        silent_ok: return a silent recording as it is instead of raising (training: one recording must
            not end a run).

    Returns:
        ``[samples']`` float32, ``samples' = ceil(samples * target_rate / sample_rate)``.

    Raises:
        AudioError: empty, non-finite, one sample or silent (see :data:`SILENCE_PEAK`) after mixing to
            mono, or a rate above :data:`MAX_SAMPLE_RATE` or below :data:`MIN_SAMPLE_RATE`.
        ValueError: a bad shape or rate, naming the argument.
        TypeError: no samples (a path, a file's bytes, None), naming the argument.

    Example::

        >>> to_model_input(torch.randn(2, 44100), 44100, 8000).shape
        torch.Size([8000])
    """
    if not _positive_integer(sample_rate):
        raise ValueError(f"{name}: expected a positive integer sample_rate in Hz, got {sample_rate!r}")
    if float(sample_rate) > MAX_SAMPLE_RATE:
        raise AudioError(
            f"{name}: sample rate {int(sample_rate)} Hz is above the highest taken, {MAX_SAMPLE_RATE} Hz"
        )
    if float(sample_rate) < MIN_SAMPLE_RATE:
        raise AudioError(
            f"{name}: sample rate {int(sample_rate)} Hz is below the lowest taken, {MIN_SAMPLE_RATE} Hz (the "
            "rate is in Hz, not kHz)"
        )
    if isinstance(waveform, np.ndarray):
        if not waveform.dtype.isnative:  # big-endian samples (from a file's bytes): the same values
            waveform = waveform.astype(waveform.dtype.newbyteorder("="))
        waveform = np.ascontiguousarray(waveform)  # a reversed view (negative strides) too
        if not waveform.flags.writeable:  # read-only (np.frombuffer, a memmap): torch would warn
            waveform = waveform.copy()
    if isinstance(waveform, (str, bytes, bytearray, memoryview, os.PathLike)) or waveform is None:
        hint = " (a file: read_audio or transcribe_files reads it)" if waveform is not None else ""
        raise TypeError(
            f"{name}: expected samples, a tensor or numpy array, got {type(waveform).__name__}{hint}"
        )
    try:
        # on the CPU (a tensor where it is), not on the default device (torch.set_default_device)
        x = torch.as_tensor(waveform, device=waveform.device if isinstance(waveform, Tensor) else "cpu")
    except (TypeError, ValueError, RuntimeError) as e:  # a list of strings, ragged lists, objects
        raise TypeError(
            f"{name}: expected samples, a tensor or numpy array, got {type(waveform).__name__} "
            f"({first_line(e)})"
        ) from None
    if x.dim() not in (1, 2):
        raise ValueError(f"{name}: expected [samples] or [channels, samples], got shape {list(x.shape)}")
    if x.dim() == 2 and x.shape[0] == 0:
        raise ValueError(f"{name}: expected at least one channel, got shape {list(x.shape)}")
    if x.dim() == 2 and x.shape[0] > MAX_CHANNELS and not layout_checked:
        raise ValueError(
            f"{name}: expected [channels, samples] with at most {MAX_CHANNELS} channels, got shape "
            f"{list(x.shape)} (soundfile.read gives [samples, channels]: pass its transpose)"
        )
    if x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name}: expected real samples, got dtype {x.dtype}")
    # 8-bit PCM's silence is its files' (one step of it: :func:`_silence_peak`), the rest 16-bit's
    silence = 2.0**-7 if x.dtype in (torch.int8, torch.uint8) else SILENCE_PEAK
    if not x.is_floating_point():
        if x.dtype not in _PCM_SCALE:
            raise ValueError(
                f"{name}: expected float samples or 8-, 16- or 32-bit integer PCM, got dtype {x.dtype} "
                "(scale the samples to [-1, 1] first)"
            )
        offset, scale = _PCM_SCALE[x.dtype]
        x = (x.to(torch.float64) - offset) / scale
    x = x.detach()
    if x.dtype == torch.float64 and x.numel():
        peak = float(x.abs().max())
        if math.isfinite(peak) and peak > torch.finfo(torch.float32).max:
            x = x / peak  # beyond float32's range: scaled here, as float32 samples above LOUDEST are below
    x = x.to(torch.float32)
    mono = x.mean(0) if x.dim() == 2 else x  # [samples]
    peak = _check_samples(mono, name, x if x.dim() == 2 else None, silent_ok, silence)
    if peak > LOUDEST:
        mono = mono / peak  # float32's power spectrum would overflow; the features do not see the level
    return resample(mono, int(sample_rate), int(target_rate)).contiguous()


def _positive_integer(value: object) -> bool:
    """A whole number above 0 of any numeric kind (int, float, numpy, a 0-d tensor); no bool or text."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        return False
    if isinstance(value, (Tensor, np.ndarray)) and value.dtype in (torch.bool, np.bool_):
        return False
    try:
        as_float = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return math.isfinite(as_float) and as_float > 0 and as_float == int(as_float)

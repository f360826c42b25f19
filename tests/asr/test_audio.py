"""Reading recordings and turning them into the model's input, against references we did not write:
files written by soundfile in every WAV sample format, their integer samples decoded by Python's own
``wave`` module, and resampling by scipy's polyphase resampler."""

from __future__ import annotations

import io
import math
import re
import struct
import wave

import numpy as np
import pytest
import torch

from tandem.asr.audio import SILENCE_PEAK, AudioError, read_audio, to_model_input

sf = pytest.importorskip("soundfile")
scipy_signal = pytest.importorskip("scipy.signal")

# soundfile subtype -> bytes per sample of the integer formats (None: float)
SUBTYPES = {"PCM_U8": 1, "PCM_16": 2, "PCM_24": 3, "PCM_32": 4, "FLOAT": None, "DOUBLE": None}


def _noise(samples: int, channels: int, seed: int = 0) -> np.ndarray:
    """[samples, channels] float64 in [-0.9, 0.9], soundfile's layout."""
    return np.random.default_rng(seed).uniform(-0.9, 0.9, (samples, channels))


def _wave_samples(path) -> np.ndarray:
    """[channels, samples] float64 of an integer PCM WAV, decoded from the raw frames that the standard
    library's ``wave`` reads: unsigned 8-bit around 128, signed little-endian otherwise, over 2^(bits-1)."""
    with wave.open(str(path)) as w:
        width, channels, raw = w.getsampwidth(), w.getnchannels(), w.readframes(w.getnframes())
    data = np.frombuffer(raw, dtype=np.uint8).reshape(-1, width).astype(np.int64)
    if width == 1:
        values = data[:, 0] - 128
    else:
        values = sum(data[:, k] << (8 * k) for k in range(width))
        values = np.where(values >= 1 << (8 * width - 1), values - (1 << (8 * width)), values)
    return (values / float(1 << (8 * width - 1))).reshape(-1, channels).T


@pytest.mark.parametrize("channels", [1, 2, 5], ids=lambda c: f"ch{c}")
@pytest.mark.parametrize("subtype", list(SUBTYPES))
def test_reads_every_wav_sample_format(tmp_path, subtype, channels):
    rate = {1: 8000, 2: 44100, 5: 11025}[channels]
    data = _noise(1234, channels)
    path = tmp_path / f"{subtype}.wav"
    sf.write(path, data, rate, subtype=subtype)
    waveform, got_rate = read_audio(path)
    assert got_rate == rate and waveform.dtype == torch.float32 and waveform.shape == (channels, 1234)
    width = SUBTYPES[subtype]
    if width is None:  # float samples: what was written, as float32
        np.testing.assert_array_equal(waveform.numpy(), data.T.astype(np.float32))
    else:
        np.testing.assert_allclose(waveform.numpy(), _wave_samples(path), rtol=0, atol=1e-7)
        # the written data within one quantization step, or float32's resolution for 32-bit samples
        step = max(2.0 ** (1 - 8 * width), 2.0**-24)
        np.testing.assert_allclose(waveform.numpy(), data.T, rtol=0, atol=step)


def test_reads_streams_including_ones_that_cannot_seek(tmp_path):
    data = _noise(500, 2)
    buffer = io.BytesIO()
    sf.write(buffer, data, 16000, format="WAV", subtype="PCM_16")

    class Pipe(io.RawIOBase):  # what standard input is: read only, no seek
        def __init__(self, payload: bytes) -> None:
            self._inner = io.BytesIO(payload)
            self.name = "<stdin>"

        def readable(self) -> bool:
            return True

        def readinto(self, b) -> int:
            return self._inner.readinto(b)

    waveform, rate = read_audio(io.BufferedReader(Pipe(buffer.getvalue())))
    path = tmp_path / "same.wav"
    path.write_bytes(buffer.getvalue())
    assert rate == 16000 and torch.equal(waveform, read_audio(path)[0])


def _silence(n: int, level: float) -> np.ndarray:
    x = np.zeros((n, 1))
    x[::7] = level
    return x


@pytest.mark.parametrize(
    "kind, make, expected",
    [
        pytest.param("missing", None, "no such file", id="missing"),
        pytest.param("directory", None, "not a file", id="directory"),
        pytest.param("text", b"hello, I am not a recording\n", "not a readable audio file", id="text"),
        pytest.param("header", b"RIFF\x24\x00\x00\x00WAVEfmt ", "not a readable audio file", id="header"),
        pytest.param("empty", np.zeros((0, 2)), "empty recording (0 samples)", id="0-samples"),
        pytest.param("zeros", np.zeros((8000, 1)), "silent recording", id="all-zero"),
        pytest.param("lsb", _silence(8000, 2.0**-15), "silent recording", id="16-bit-lsb"),
        pytest.param("nan", np.full((100, 1), np.nan), "NaN or infinite", id="nan"),
        pytest.param(
            "huge", np.full((100, 1), 1e300), "64-bit float samples beyond float32's range", id="huge"
        ),
    ],
)
def test_bad_files_raise_audio_errors_naming_the_file(tmp_path, kind, make, expected):
    path = tmp_path / f"{kind}.wav"
    if kind == "directory":
        path.mkdir()
    elif isinstance(make, bytes):
        path.write_bytes(make)
    elif make is not None:
        sf.write(path, make, 8000, subtype={"nan": "FLOAT", "huge": "DOUBLE"}.get(kind, "PCM_16"))
    with pytest.raises(AudioError) as info:
        read_audio(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and expected in message and "\n" not in message
    assert isinstance(info.value, ValueError)


# containers whose header announces the samples' size, with a sample format each that is not PCM_16 (an
# odd byte count, a block format); libsndfile reads any of them cut short as the shorter recording
CONTAINERS = [
    ("WAV", "PCM_U8", "WAV"),
    ("WAV", "IMA_ADPCM", "WAV"),
    ("WAVEX", "PCM_24", "WAV"),
    ("RF64", "PCM_16", "RF64 WAV"),
    ("RF64", "FLOAT", "RF64 WAV"),
    ("W64", "PCM_24", "Wave64"),
    ("W64", "MS_ADPCM", "Wave64"),
    ("AIFF", "PCM_16", "AIFF"),
    ("AIFF", "ALAW", "AIFF"),
    ("RIFX", "PCM_16", "RIFX WAV"),
    ("RIFX", "FLOAT", "RIFX WAV"),
    ("AU", "PCM_24", "AU"),
    ("AU-LE", "ULAW", "AU"),
    ("NIST", "PCM_16", "NIST SPHERE"),
    ("NIST", "ALAW", "NIST SPHERE"),
]
# the containers above that are another's format in another byte order (soundfile's format, endian)
ENDIAN = {"RIFX": ("WAV", "BIG"), "AU-LE": ("AU", "LITTLE")}


@pytest.mark.parametrize("container, subtype, name", CONTAINERS)
def test_a_recording_cut_short_is_refused_in_every_container_that_says_its_size(
    tmp_path, container, subtype, name
):
    """RF64 (what ffmpeg and broadcast recorders write past 4 GB), Wave64, AIFF, RIFX (big-endian WAV), AU
    and NIST SPHERE cut short were read in part without a word (only RIFF WAV was checked); whole, every
    one reads as soundfile reads it."""
    from tandem.asr.audio import wav_truncation

    data = io.BytesIO()
    fmt, endian = ENDIAN.get(container, (container, "FILE"))
    sf.write(data, _noise(8001, 2), 8000, format=fmt, subtype=subtype, endian=endian)
    whole = data.getvalue()
    path = tmp_path / "whole.audio"
    path.write_bytes(whole)
    expected, _ = sf.read(path, dtype="float32", always_2d=True)
    waveform, rate = read_audio(path)
    assert rate == 8000 and torch.equal(waveform, torch.from_numpy(expected.T.copy()))
    assert wav_truncation(io.BytesIO(whole)) is None
    if container == "W64":  # a chunk size below its own header's 24 bytes: no walk back to it (a hang)
        broken = bytearray(whole)
        broken[56:64] = bytes(8)
        assert wav_truncation(io.BytesIO(bytes(broken))) is None
    for cut in (len(whole) // 2, len(whole) - 1):
        path.write_bytes(whole[:cut])
        for source in (path, io.BytesIO(whole[:cut])):
            with pytest.raises(AudioError, match=f"a truncated {name} file: its header announces"):
                read_audio(source, name=str(path))


def test_an_ogg_vorbis_file_cut_short_that_decodes_to_no_samples_is_not_called_empty(tmp_path):
    """An Ogg/Vorbis file cut before its last page reads as 0 samples (libsndfile finds an Ogg's length at
    its end) and was refused as an 'empty recording (0 samples)'; it is named as a file from which no
    samples could be decoded, its size said. An empty WAV is still an empty recording."""
    data = io.BytesIO()
    sf.write(data, _noise(16000, 1), 8000, format="OGG", subtype="VORBIS")
    cut = data.getvalue()[: len(data.getvalue()) // 2]
    assert sf.info(io.BytesIO(cut)).frames == 0  # what libsndfile makes of it
    path = tmp_path / "cut.ogg"
    path.write_bytes(cut)
    for source in (path, io.BytesIO(cut)):
        with pytest.raises(AudioError) as info:
            read_audio(source, name="cut.ogg")
        message = str(info.value)
        assert message.startswith(
            f"cut.ogg: no samples could be decoded from its {len(cut)} bytes (OGG VORBIS)"
        )
        assert "cut short or damaged" in message and "empty recording (0" not in message
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros((0, 1)), 8000, subtype="PCM_16")
    with pytest.raises(AudioError, match=r"^empty: empty recording \(0 samples\)$"):
        read_audio(empty, name="empty")


@pytest.mark.skipif("MP3" not in sf.available_formats(), reason="this libsndfile writes no MP3")
def test_an_mp3_file_cut_short_is_refused_not_transcribed_in_part(tmp_path):
    """An MP3's length comes from its Xing header, its samples from decoding: one cut in half decoded
    half its samples, which were transcribed without a word (exit status 0). The whole file reads."""
    data = io.BytesIO()
    sf.write(data, 0.3 * np.sin(np.arange(16000) * 0.3)[:, None], 8000, format="MP3")
    whole = data.getvalue()
    assert read_audio(io.BytesIO(whole), name="whole.mp3")[0].shape[-1] == sf.info(io.BytesIO(whole)).frames
    cut = whole[: len(whole) // 2]
    announced = sf.info(io.BytesIO(cut)).frames
    path = tmp_path / "cut.mp3"
    path.write_bytes(cut)
    for source in (path, io.BytesIO(cut)):
        with pytest.raises(
            AudioError, match=f"^cut.mp3: a truncated MP3 file: its header announces {announced}"
        ):
            read_audio(source, name="cut.mp3")


def test_rifx_au_and_nist_sphere_sizes_are_their_headers_and_streams_are_read_whole(tmp_path):
    """Headers written by hand: a RIFX WAV's big-endian data size, an AU's data size and offset (big- or
    little-endian), a NIST SPHERE's sample_count x sample_n_bytes x channel_count after its text header
    are the bytes announced; cut short, each is refused with them and the bytes held. A stream's
    placeholders (RIFX's as RIFF's, AU's 0xFFFFFFFF) are read to the end, and a compressed SPHERE's
    sizes are not taken for its samples'."""
    from tandem.asr.audio import wav_truncation

    pcm = (np.arange(200).reshape(100, 2) * 300 - 30000).astype(np.int16)  # 100 frames, 2 channels
    expected = torch.from_numpy((pcm.T / 2.0**15).astype(np.float32))
    fmt = b"fmt " + struct.pack(">IHHIIHH", 16, 1, 2, 8000, 32000, 4, 16)
    samples = b"data" + struct.pack(">I", 400) + pcm.astype(">i2").tobytes()
    rifx = b"RIFX" + struct.pack(">I", 4 + len(fmt) + len(samples)) + b"WAVE" + fmt + samples
    au = b".snd" + struct.pack(">IIIII", 28, 400, 3, 8000, 2) + b"note" + pcm.astype(">i2").tobytes()
    au_le = b"dns." + struct.pack("<IIIII", 24, 400, 3, 8000, 2) + pcm.astype("<i2").tobytes()

    def sphere(coding: str) -> bytes:
        fields = ["sample_count -i 100", "sample_n_bytes -i 2", "channel_count -i 2", "sample_rate -i 8000"]
        fields += [f"sample_coding -s{len(coding)} {coding}", "sample_byte_format -s2 01", "end_head"]
        return "\n".join(["NIST_1A", "   1024", *fields, ""]).encode().ljust(1024, b" ")

    nist = sphere("pcm") + pcm.astype("<i2").tobytes()
    for name, data, header_bytes in (
        ("RIFX WAV", rifx, 44),
        ("AU", au, 28),
        ("AU", au_le, 24),
        ("NIST SPHERE", nist, 1024),
    ):
        path = tmp_path / "whole.audio"
        path.write_bytes(data)
        waveform, rate = read_audio(path)
        assert rate == 8000 and torch.equal(waveform, expected), name
        assert wav_truncation(io.BytesIO(data)) is None
        cut = data[: header_bytes + 250]
        assert wav_truncation(io.BytesIO(cut)) == (400, 250), name
        message = (
            f"^cut: a truncated {name} file: its header announces 400 bytes of samples, the file holds 250 "
        )
        with pytest.raises(AudioError, match=message):
            read_audio(cut, name="cut")
    at = rifx.index(b"data") + 4
    for size in (0, 0xFFFFFFFF, 0x7FFFF000, 0x7FFFFFFF):
        streamed = rifx[:at] + struct.pack(">I", size) + rifx[at + 4 :]
        assert wav_truncation(io.BytesIO(streamed)) is None
        assert torch.equal(read_audio(streamed)[0], expected), hex(size)
    streamed = au[:8] + b"\xff" * 4 + au[12:]
    assert wav_truncation(io.BytesIO(streamed)) is None and torch.equal(read_audio(streamed)[0], expected)
    assert wav_truncation(io.BytesIO(sphere("pcm,embedded-shorten-v2.00") + bytes(76))) is None


def test_a_wav_written_as_a_stream_with_a_data_size_of_0_is_read_to_its_end(tmp_path):
    """A data size of 0 (a stream's placeholder) made libsndfile read no samples: 'empty recording'. It is
    read to its end, as the other placeholders are, from a file or a stream, and a manifest's check of
    the header counts the samples it holds."""
    from tandem.asr.audio import read_header

    data = io.BytesIO()
    sf.write(data, _noise(1600, 1), 16000, format="WAV", subtype="PCM_16")
    stream = bytearray(data.getvalue())
    at = stream.index(b"data") + 4
    stream[at : at + 4] = bytes(4)
    path = tmp_path / "streamed.wav"
    path.write_bytes(bytes(stream))
    expected, _ = read_audio(io.BytesIO(data.getvalue()))
    for source in (path, io.BytesIO(bytes(stream))):
        waveform, rate = read_audio(source, name="streamed")
        assert rate == 16000 and torch.equal(waveform, expected)
    assert read_header(path) == (1600, 16000) and path.read_bytes() == bytes(stream)


def _rf64_stream(fmt: bytes, after_data: bytes) -> bytes:
    """An RF64 WAV as ffmpeg writes one into a pipe (``-f wav -rf64 always``): its RIFF size 0xFFFFFFFF, a
    ds64 chunk of zeros (no size known yet), ``fmt``, and a data chunk whose size is 0xFFFFFFFF
    followed by ``after_data``."""
    ds64 = b"ds64" + struct.pack("<I", 28) + bytes(28)
    chunks = ds64 + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", 0xFFFFFFFF)
    return b"RF64" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + chunks + after_data


def test_an_rf64_wav_written_as_a_stream_is_read_to_its_end(tmp_path):
    """ffmpeg's RF64 into a pipe (a ds64 of zeros, the data size 0xFFFFFFFF) was refused as 'empty
    recording (0 samples)': libsndfile takes the ds64's data size, 0. Its samples are read to the end
    (the whole frames: a partial one at the end is dropped), from a file or a stream, and counted by
    read_header; an empty one followed by a chunk stays empty."""
    from tandem.asr.audio import read_header

    fmt = struct.pack("<HHIIHH", 1, 2, 8000, 32000, 4, 16)  # PCM, stereo, 8 kHz, 16-bit
    pcm = (np.arange(2 * 1500).reshape(1500, 2) * 17 - 20000).astype("<i2")
    path = tmp_path / "ff.wav"
    path.write_bytes(_rf64_stream(fmt, pcm.tobytes() + b"\x01\x02\x03"))
    expected = torch.from_numpy((pcm.T / 2.0**15).astype(np.float32))
    for source in (path, io.BytesIO(path.read_bytes())):
        waveform, rate = read_audio(source, name="ff")
        assert rate == 8000 and torch.equal(waveform, expected)
    assert read_header(path) == (1500, 8000)
    tag = b"LIST" + struct.pack("<I", 12) + b"INFOINAM" + struct.pack("<I", 0)
    path.write_bytes(_rf64_stream(fmt, tag))
    with pytest.raises(AudioError, match=r"^ff: empty recording \(0 samples\)$"):
        read_audio(path, name="ff")


def _riff(*chunks: tuple[bytes, bytes], riff_size: int | None = None) -> bytes:
    """A RIFF WAVE file of ``(id, body)`` chunks (padded to even sizes); ``riff_size`` for the RIFF
    header's own (default: the true one)."""
    body = b"WAVE" + b"".join(c + len(b).to_bytes(4, "little") + b + b"\0" * (len(b) % 2) for c, b in chunks)
    return b"RIFF" + (len(body) if riff_size is None else riff_size).to_bytes(4, "little") + body


def test_an_empty_data_chunk_followed_by_another_chunk_is_an_empty_recording(tmp_path):
    """A data size of 0 followed by a chunk (a LIST/INFO tag a tagger appended to an empty recording) is
    no stream's placeholder: libsndfile reads 0 samples; the tag's bytes were read as samples. A
    placeholder is still read to its end where the RIFF size ends the file at the data chunk's header
    (written before the samples) or the bytes after it are no chunk header within the file."""
    from tandem.asr.audio import read_header

    fmt = (b"fmt ", struct.pack("<HHIIHH", 1, 1, 8000, 16000, 2, 16))  # PCM, mono, 8 kHz, 16-bit
    name = b"Voice memo 12, recorded on my phone\0" * 20
    tag = (b"LIST", b"INFO" + b"INAM" + struct.pack("<I", len(name)) + name)
    tagged = tmp_path / "tagged.wav"
    tagged.write_bytes(_riff(fmt, (b"data", b""), tag))
    assert sf.info(str(tagged)).frames == 0
    assert read_header(tagged) == (0, 8000)
    for source in (tagged, tagged.read_bytes()):
        with pytest.raises(AudioError, match=r"^tagged: empty recording \(0 samples\)$"):
            read_audio(source, name="tagged")
    # 16-bit samples whose first bytes look like a chunk header ("LIST", a size within the file)
    samples = b"LIST" + (8).to_bytes(4, "little") + (np.arange(400) * 50 - 10000).astype("<i2").tobytes()
    for case, data in (
        ("header-only RIFF size", _riff(fmt, (b"data", samples), riff_size=36)),
        ("size past the end", _riff(fmt, (b"data", b"LIST\xff\xff\0\0" + samples[8:]), riff_size=0)),
    ):
        data = bytearray(data)
        at = data.index(b"data") + 4
        data[at : at + 4] = bytes(4)
        path = tmp_path / "streamed.wav"
        path.write_bytes(bytes(data))
        waveform, rate = read_audio(path)
        assert (waveform.shape, rate) == ((1, 404), 8000) and read_header(path) == (404, 8000), case


def test_a_chunk_of_odd_size_before_the_data_is_stepped_over_with_its_pad_byte(tmp_path):
    """RIFF pads a chunk of odd size with one byte its size does not count: a LIST tag of odd size before
    the data chunk (as taggers write them) is stepped over with it, so the data chunk is found; whole,
    the file is read as soundfile reads it, and cut short it is refused as a truncated WAV (the data
    chunk missed, it was read in part without a word)."""
    from tandem.asr.audio import wav_truncation

    fmt = (b"fmt ", struct.pack("<HHIIHH", 1, 1, 8000, 16000, 2, 16))  # PCM, mono, 8 kHz, 16-bit
    name = b"Odd memo\0"  # 9 bytes: the tag's body is 4 + 4 + 4 + 9 = 21, padded to 22
    tag = (b"LIST", b"INFO" + b"INAM" + struct.pack("<I", len(name)) + name)
    assert len(tag[1]) % 2 == 1
    pcm = (np.arange(1000) * 53 - 26000).astype("<i2")
    whole = _riff(fmt, tag, (b"data", pcm.tobytes()))
    path = tmp_path / "tagged.wav"
    path.write_bytes(whole)
    expected, _ = sf.read(path, dtype="float32", always_2d=True)
    waveform, rate = read_audio(path)
    assert rate == 8000 and waveform.shape == (1, 1000)
    assert torch.equal(waveform, torch.from_numpy(expected.T.copy()))
    assert wav_truncation(io.BytesIO(whole)) is None
    cut = whole[: len(whole) - 500]
    assert wav_truncation(io.BytesIO(cut)) == (2000, 1500)
    for source in (cut, io.BytesIO(cut)):
        with pytest.raises(AudioError, match="^cut: a truncated WAV file: its header announces 2000 bytes"):
            read_audio(source, name="cut")


def test_a_flac_whose_header_does_not_say_its_length_is_named_so(tmp_path):
    """A FLAC written into a pipe leaves STREAMINFO's total samples 0, which libsndfile counts as 2^63 - 1
    frames and cannot read to the end: 'not a readable audio file (array is too big ...)'. It is named
    for what it is, from reading it and from the check of its header."""
    from tandem.asr.audio import read_header

    data = io.BytesIO()
    sf.write(data, _noise(4000, 1), 8000, format="FLAC")
    flac = bytearray(data.getvalue())
    flac[8 + 13] &= 0xF0  # STREAMINFO (after "fLaC" and its block header): total samples, 36 bits, to 0
    flac[8 + 14 : 8 + 18] = bytes(4)
    assert sf.info(io.BytesIO(bytes(flac))).frames == 2**63 - 1  # what libsndfile makes of it
    path = tmp_path / "piped.flac"
    path.write_bytes(bytes(flac))
    expected = f"{path}: a FLAC file whose header does not say its length (written into a pipe?)"
    for read in (read_audio, read_header):
        with pytest.raises(AudioError, match=f"^{re.escape(expected)}"):
            read(path)


def test_float_wavs_of_16_or_24_bits_name_their_sample_format(tmp_path):
    """A WAV of 16-bit (half) or 24-bit float samples (format tag 3, or WAVE_FORMAT_EXTENSIBLE with the
    float sub-format) was 'not a readable audio file (Unspecified internal error)', libsndfile's word for
    it; the message names the format. The same layout with 32-bit floats is read."""
    x = np.linspace(-0.5, 0.5, 64)

    def fmt(bits: int, extensible: bool, order: str = "<") -> bytes:
        size = bits // 8
        body = struct.pack(order + "HHIIHH", 0xFFFE if extensible else 3, 1, 8000, 8000 * size, size, bits)
        if extensible:
            guid = struct.pack(order + "IHH", 3, 0, 0x10) + bytes.fromhex("800000aa00389b71")  # float's
            body += struct.pack(order + "HHI", 22, bits, 4) + guid
        return body

    def wav(riff: bytes, fmt_body: bytes, samples: bytes, order: str = "<") -> bytes:
        chunks = b"fmt " + struct.pack(order + "I", len(fmt_body)) + fmt_body
        chunks += b"data" + struct.pack(order + "I", len(samples)) + samples
        return riff + struct.pack(order + "I", 4 + len(chunks)) + b"WAVE" + chunks

    cases = {
        "half": wav(b"RIFF", fmt(16, False), x.astype("<f2").tobytes()),
        "half-extensible": wav(b"RIFF", fmt(16, True), x.astype("<f2").tobytes()),
        "float24": wav(b"RIFF", fmt(24, False), bytes(3 * 64)),
        "rifx-half": wav(b"RIFX", fmt(16, False, ">"), x.astype(">f2").tobytes(), ">"),
    }
    for name, data in cases.items():
        bits = 24 if name == "float24" else 16
        with pytest.raises(RuntimeError, match="Unspecified internal error"):
            sf.info(io.BytesIO(data))  # libsndfile's word for it
        path = tmp_path / f"{name}.wav"
        path.write_bytes(data)
        message = (
            f"an unsupported sample format: float with {bits} bits (float samples are read with 32 or 64"
        )
        message += " bits)"
        for source, label in ((path, str(path)), (data, "<bytes>")):
            with pytest.raises(AudioError, match=f"^{re.escape(f'{label}: {message}')}$"):
                read_audio(source, name=label)
    for extensible in (False, True):
        waveform, _ = read_audio(wav(b"RIFF", fmt(32, extensible), x.astype("<f4").tobytes()))
        assert torch.equal(waveform[0], torch.from_numpy(x.astype(np.float32)))


def test_a_files_bytes_are_read_as_the_file_is_and_bytes_without_a_nul_are_a_path(tmp_path):
    """A recording's bytes were taken for a file name ('no such file', the escaped bytes as its name); a
    bytearray or memoryview raised AttributeError. A path as bytes (no NUL in it) stays a path."""
    import os

    from tandem.asr.audio import source_name

    path = tmp_path / "a.wav"
    sf.write(path, _noise(800, 2), 8000, subtype="PCM_16")
    expected, rate = read_audio(path)
    data = path.read_bytes()
    for source in (data, bytearray(data), memoryview(data)):
        waveform, got = read_audio(source)
        assert torch.equal(waveform, expected) and got == rate
        assert source_name(source) == f"<{len(data)} bytes>"
    assert torch.equal(read_audio(os.fsencode(path))[0], expected)
    with pytest.raises(AudioError, match=r"^<8 bytes>: not a readable audio file"):
        read_audio(b"RIFF\0\0\0\0")


def test_a_text_mode_or_closed_file_and_an_empty_path_are_named_errors(tmp_path):
    """They raised UnicodeDecodeError, TypeError or ValueError from inside, or (an empty path, which is the
    current folder) called the recording a directory."""
    path = tmp_path / "a.wav"
    sf.write(path, _noise(800, 1), 8000, subtype="PCM_16")
    expected = f"^{path}: a file opened in text mode; open it in binary"
    for encoding in ("utf-8", "latin-1"):
        with open(path, encoding=encoding) as text, pytest.raises(AudioError, match=expected):
            read_audio(text)
    with open(path, "rb") as closed:
        pass
    with pytest.raises(AudioError, match=f"^{path}: cannot read \\(.*closed file\\)"):
        read_audio(closed)
    with pytest.raises(AudioError, match="^'': an empty path, not a file name"):
        read_audio("")


def test_reads_named_pipes_and_names_that_are_not_utf8(tmp_path):
    """A FIFO (what <(cmd) and /dev/stdin are) is read to its end; a file whose name is not UTF-8 (libsndfile
    takes UTF-8 paths only) is opened by tandem and read."""
    import os
    import threading

    data = _noise(800, 1)
    wav = io.BytesIO()
    sf.write(wav, data, 8000, format="WAV", subtype="PCM_16")
    odd = os.fsencode(tmp_path) + b"/bad\xff.wav"
    with open(odd, "wb") as f:
        f.write(wav.getvalue())
    waveform, rate = read_audio(os.fsdecode(odd))
    assert rate == 8000 and waveform.shape == (1, 800)
    fifo = tmp_path / "pipe.wav"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(wav.getvalue()))
    writer.start()
    try:
        piped, _ = read_audio(fifo)
    finally:
        writer.join(timeout=10)
    assert torch.equal(piped, waveform)


def test_the_silence_rule_is_one_16_bit_step(tmp_path):
    """Samples within 2^-15 of the middle of their range are silence; two steps is a (very quiet)
    recording."""
    assert SILENCE_PEAK == 2.0**-15
    quiet = tmp_path / "quiet.wav"
    samples = _silence(8000, 2 * 2.0**-15)
    samples[3::7] = -2 * 2.0**-15
    sf.write(quiet, samples, 8000, subtype="PCM_16")
    waveform, _ = read_audio(quiet)
    assert float(waveform.abs().max()) == 2 * 2.0**-15
    with pytest.raises(AudioError, match="^<stdin>: empty input"):
        read_audio(io.BytesIO(b""), name="<stdin>")


def test_a_one_sample_recording_is_too_short_not_silent(tmp_path):
    """One sample spans no range, and a WAV of one sample of 0.247 was called 'silent recording (samples
    within 0 of 0.247 ...)'; it is too short to tell sound from silence, as file or array; two samples
    are judged, and silent_ok takes one."""
    path = tmp_path / "one.wav"
    with wave.open(str(path), "wb") as w:  # the standard library's writer: 16-bit mono, 8 kHz
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(struct.pack("<h", 8094))  # 0.247 of full scale
    too_short = r"too short: 1 sample, too few to tell sound from silence \(at least 2 are needed\)"
    with pytest.raises(AudioError, match=f"^one.wav: {too_short}; nothing to transcribe$"):
        read_audio(path, name="one.wav")
    with pytest.raises(AudioError, match=f"^clip: {too_short}"):
        to_model_input(np.array([[0.247], [0.1]]), 8000, 8000, name="clip")
    waveform, _ = read_audio(path, silent_ok=True)
    assert waveform.tolist() == [[8094 / 2**15]]
    assert to_model_input(np.array([0.247, -0.1]), 8000, 8000).shape == (2,)


@pytest.mark.parametrize("offset", [0.05, -0.3])
def test_a_constant_offset_with_one_step_of_dither_is_silence(tmp_path, offset):
    """A DC bias with nothing on it but a step of dither: its peak is the offset, far above one step,
    and it was transcribed as words ("seven six"); a recording on the same offset is read."""
    rng = np.random.default_rng(1)
    dc = tmp_path / "dc.wav"
    sf.write(dc, offset + rng.integers(-1, 1, 8000) * 2.0**-15, 8000, subtype="PCM_16")
    with pytest.raises(
        AudioError, match=rf"silent recording \(samples within 1.53e-05 of {offset - 2**-16:.3g}"
    ):
        read_audio(dc)
    speech = tmp_path / "speech.wav"
    sf.write(speech, offset + 0.1 * np.sin(np.arange(8000) * 0.3), 8000, subtype="PCM_16")
    assert read_audio(speech)[0].shape == (1, 8000)


@pytest.mark.parametrize("subtype", ["ALAW", "ULAW"])
def test_g711_silence_is_one_of_its_steps_near_zero(tmp_path, subtype):
    """G.711's smallest steps are 2^-12 (A-law has no code for 0: its silence decodes to +-2^-12): zeros
    or a 16-bit step of dither written as A-law or mu-law were transcribed as words; a quiet recording
    of a few steps is read."""
    rng = np.random.default_rng(2)
    for name, samples in (("zeros", np.zeros(8000)), ("dither", rng.integers(-1, 2, 8000) * 2.0**-15)):
        path = tmp_path / f"{name}.wav"
        sf.write(path, samples, 8000, subtype=subtype)
        with pytest.raises(AudioError, match="silent recording .* one step of 13-bit audio"):
            read_audio(path)
    quiet = tmp_path / "quiet.wav"
    sf.write(quiet, 0.002 * np.sin(np.arange(8000) * 0.3), 8000, subtype=subtype)
    assert read_audio(quiet)[0].shape == (1, 8000)


def test_an_8_bit_files_silence_is_one_step_of_its_own(tmp_path):
    """8-bit samples within one step (2^-7) of zero are its last bit's dither, silence as 16-bit's one step
    is (they were transcribed as noise blown up to full scale); two steps are a recording."""
    rng = np.random.default_rng(0)
    dither, quiet = tmp_path / "dither.wav", tmp_path / "quiet.wav"
    sf.write(dither, rng.integers(-1, 2, 8000) / 128, 8000, subtype="PCM_U8")
    sf.write(quiet, rng.integers(-2, 3, 8000) / 128, 8000, subtype="PCM_U8")
    with pytest.raises(
        AudioError, match=r"silent recording \(peak amplitude 0.0078.*one step of 8-bit audio"
    ):
        read_audio(dither)
    waveform, _ = read_audio(dither, silent_ok=True)
    assert float(waveform.abs().max()) == 2.0**-7
    assert float(read_audio(quiet)[0].abs().max()) == 2 * 2.0**-7


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_an_8_bit_arrays_silence_is_its_files(dtype):
    """8-bit PCM given as an array followed 16-bit's rule (one step of dither was transcribed), where the
    same samples in an 8-bit file are silence."""
    rng = np.random.default_rng(0)
    offset = 128 if dtype == np.uint8 else 0
    dither = (offset + rng.integers(-1, 2, 8000)).astype(dtype)
    with pytest.raises(AudioError, match="silent recording .*one step of 8-bit audio"):
        to_model_input(dither, 8000, 8000)
    quiet = (offset + rng.integers(-2, 3, 8000)).astype(dtype)
    assert float(to_model_input(quiet, 8000, 8000).abs().max()) > 0


def _tones(rate: int, samples: int, freqs: tuple[float, ...]) -> np.ndarray:
    t = np.arange(samples) / rate
    return sum(np.sin(2 * np.pi * f * t + k) for k, f in enumerate(freqs)) / len(freqs)


@pytest.mark.parametrize("rate", [16000, 44100, 8000])
def test_to_model_input_mixes_to_mono_and_resamples_like_scipy(rate):
    """Two channels of different tones (one above the 4 kHz that 8 kHz holds) become their average,
    resampled: scipy's resample_poly of the average, inside the pass band and away from the edges."""
    n = rate // 2
    high = 3500.0 if rate == 8000 else 6000.0
    stereo = np.stack([_tones(rate, n, (300.0, 2500.0)), _tones(rate, n, (1000.0, high))])
    out = to_model_input(torch.from_numpy(stereo), rate, 8000)
    assert out.dtype == torch.float32 and out.shape == (math.ceil(n * 8000 / rate),)
    g = math.gcd(rate, 8000)
    theirs = scipy_signal.resample_poly(stereo.mean(0), 8000 // g, rate // g)
    inner = slice(len(out) // 8, -len(out) // 8)
    np.testing.assert_allclose(out.numpy()[inner], theirs[inner], rtol=0, atol=5e-3)
    # numpy arrays, float64 or float32, and 1-D input give the same
    assert torch.equal(to_model_input(stereo.astype(np.float32), rate, 8000), out)
    mono = to_model_input(stereo.mean(0), rate, 8000)
    torch.testing.assert_close(mono, out, rtol=0, atol=1e-6)


def test_to_model_input_errors_name_the_argument():
    x = torch.randn(2, 1000)
    shape = r"^clip: expected \[samples\] or \[channels, samples\], got shape \[1, 2, 1000\]"
    with pytest.raises(ValueError, match=shape):
        to_model_input(x[None], 8000, 8000, name="clip")
    with pytest.raises(ValueError, match=r"at most 64 channels, got shape \[1000, 2\].*transpose"):
        to_model_input(x.T, 8000, 8000)
    for rate in (0, 8000.5, True, -8000):
        with pytest.raises(ValueError, match="expected a positive integer sample_rate"):
            to_model_input(x, rate, 8000)
    with pytest.raises(AudioError, match=r"^waveform: empty recording"):
        to_model_input(torch.zeros(2, 0), 8000, 8000)
    with pytest.raises(AudioError, match=r"^waveform: its 2 channels cancel out when mixed to mono") as info:
        to_model_input(torch.stack([x[0], -x[0]]), 8000, 8000)  # loud channels, silence in mono
    # how to give one channel, in Python and to `tandem transcribe` (no option for it): one line
    message = str(info.value)
    assert (
        "pass waveform[0]" in message and "remix 1 | tandem transcribe -)" in message and "\n" not in message
    )
    # nearly: one voice in opposite phase (a mis-wired microphone) leaves a mix 60 dB down, which was
    # transcribed as noise; 20 dB down, or a silent channel (6 dB), is a recording
    with pytest.raises(AudioError, match=r"^waveform: its 2 channels cancel out.*the mix's 0.00"):
        to_model_input(torch.stack([x[0], -0.999 * x[0]]), 8000, 8000)
    for other in (-0.8 * x[0], torch.zeros(1000)):
        to_model_input(torch.stack([x[0], other]), 8000, 8000)
    assert to_model_input(torch.stack([x[0], -0.999 * x[0]]), 8000, 8000, silent_ok=True).shape == (1000,)
    with pytest.raises(ValueError, match=r"^waveform: expected at least one channel, got shape \[0, 100\]"):
        to_model_input(np.zeros((0, 100), np.float32), 8000, 8000)
    for rate in (float("nan"), float("inf"), "8000", None):
        with pytest.raises(ValueError, match="expected a positive integer sample_rate"):
            to_model_input(x, rate, 8000)
    with pytest.raises(AudioError, match=r"^waveform: sample rate 1000003 Hz is above the highest taken"):
        to_model_input(x, 1_000_003, 8000)


def test_to_model_input_takes_reversed_views_and_any_level():
    """A numpy view with negative strides is copied, not refused; float samples far above full scale
    (1e20: float32's power spectrum would overflow) come out as finite as the same clip at unit level."""
    clip = np.random.default_rng(0).uniform(-0.5, 0.5, 4000)
    backwards = clip[::-1]
    got = to_model_input(backwards, 8000, 8000).numpy()
    np.testing.assert_array_equal(got, backwards.astype(np.float32))
    unit = to_model_input(clip / np.abs(clip).max(), 16000, 8000)
    for level in (1e20, 1e300):  # beyond float32's range (3.4e38) in float64: it was called infinite
        torch.testing.assert_close(to_model_input(clip * level, 16000, 8000), unit)


@pytest.mark.parametrize(("orig", "new"), [(441, 80), (80, 441), (3, 2), (7, 160), (160, 80)])
def test_resampling_output_by_output_is_the_polyphase_table(monkeypatch, orig, new):
    """Rates whose reduced ratio would make a table of gigabytes (8001 Hz to 8000 Hz) take the filter
    output by output instead: the same numbers as the table where both apply."""
    from tandem.asr import features

    x = torch.randn(2, 3000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    table = features.resample(x, orig, new)
    monkeypatch.setattr(features, "_TABLE_ENTRIES", 0)
    torch.testing.assert_close(features.resample(x, orig, new), table, rtol=0, atol=1e-12)


def test_coprime_rates_resample_in_bounded_memory():
    """8001 Hz and 44101 Hz to 8000 Hz (coprime: a table of 8000 phases of 8035 taps, 0.5 GB, and more):
    against scipy's polyphase resampler, inside the pass band and away from the edges."""
    from tandem.asr import features

    cached = features._sinc_kernel.cache_info().currsize
    for rate in (8001, 44101):
        x = _tones(rate, rate // 2, (300.0, 1200.0, 2500.0))
        out = features.resample(torch.from_numpy(x), rate, 8000).numpy()
        theirs = scipy_signal.resample_poly(x, 8000, rate)
        inner = slice(len(out) // 8, -len(out) // 8)
        np.testing.assert_allclose(out[inner], theirs[inner], rtol=0, atol=5e-3)
    assert features._sinc_kernel.cache_info().currsize == cached  # no table was built, none kept


def test_integer_pcm_is_scaled_as_libsndfile_scales_it(tmp_path):
    """8/16/32-bit PCM arrays (scipy.io.wavfile's int16) are the samples soundfile reads from the same WAV
    as float: the silence rule and the features see the same recording; other integer types are refused,
    and big-endian arrays are their values."""
    rng = np.random.default_rng(0)
    for subtype, dtype in (("PCM_U8", np.uint8), ("PCM_16", np.int16), ("PCM_32", np.int32)):
        path = tmp_path / f"{subtype}.wav"
        sf.write(path, rng.uniform(-0.5, 0.5, 4000), 8000, subtype=subtype)
        as_float, _ = sf.read(path, dtype="float32")
        if dtype is np.uint8:  # soundfile reads unsigned 8-bit only as float: the bytes by hand
            raw = np.frombuffer(path.read_bytes()[-4000:], dtype=np.uint8)
        else:
            raw, _ = sf.read(path, dtype=dtype.__name__)
        torch.testing.assert_close(
            to_model_input(raw, 8000, 8000), torch.from_numpy(as_float), rtol=0, atol=0
        )
        big = raw.astype(np.dtype(dtype).newbyteorder(">"))
        assert torch.equal(to_model_input(big, 8000, 8000), to_model_input(raw, 8000, 8000))
    # digital silence with a last bit of dither is silent as int16 as it is as float
    with pytest.raises(AudioError, match="silent recording"):
        to_model_input(rng.integers(-1, 2, 16000).astype(np.int16), 8000, 8000)
    for dtype in (np.int64, np.uint16):
        with pytest.raises(
            ValueError, match=rf"^clip: expected float samples or 8-, 16- or 32-bit .*{dtype.__name__}"
        ):
            to_model_input(np.ones(100, dtype), 8000, 8000, name="clip")


def test_rates_below_1_khz_and_boolean_rates_are_refused():
    x = torch.randn(1000)
    with pytest.raises(AudioError, match=r"^w: sample rate 16 Hz is below the lowest taken, 1000 Hz \(.*kHz"):
        to_model_input(x, 16, 8000, name="w")
    assert to_model_input(x, 1000, 8000).shape == (8000,)
    for rate in (np.True_, torch.tensor(True), np.array(True)):
        with pytest.raises(ValueError, match="expected a positive integer sample_rate"):
            to_model_input(x, rate, 8000)


@pytest.mark.parametrize("subtype", ["GSM610", "NMS_ADPCM_16"])
def test_codecs_libsndfile_cannot_seek_in_are_read(tmp_path, subtype):
    """GSM 6.10 and NMS ADPCM (WAV): libsndfile reads them but cannot seek in them, and soundfile then
    refuses "to the end" (frames=-1); they were refused as "not a readable audio file". A segment from a
    start reads the samples a whole read has there."""
    path = tmp_path / "codec.wav"
    sf.write(path, 0.3 * np.sin(np.arange(8000) * 0.05), 8000, subtype=subtype, format="WAV")
    whole, rate = read_audio(path)
    assert rate == 8000 and whole.shape[1] >= 7900
    part, _ = read_audio(path, start=1000, frames=500)
    torch.testing.assert_close(part, whole[:, 1000:1500])


def test_a_device_an_empty_file_and_an_endless_stream_are_refused(tmp_path, monkeypatch):
    """/dev/zero was read into memory without end (0.5 GB/s, nothing printed); an empty regular file said
    "Format not recognised" where an empty stream says "empty input"; a stream is read up to
    STREAM_LIMIT_BYTES."""
    import tandem.asr.audio as audio

    with pytest.raises(AudioError, match="^/dev/zero: a device, not a recording$"):
        read_audio("/dev/zero")
    empty = tmp_path / "empty.wav"
    empty.touch()
    with pytest.raises(AudioError, match=r"empty.wav: empty input \(0 bytes\)$"):
        read_audio(empty)
    monkeypatch.setattr(audio, "STREAM_LIMIT_BYTES", 1000)
    with pytest.raises(AudioError, match="^<stdin>: more than 0 MiB from a stream"):
        read_audio(io.BytesIO(b"\0" * 1001), name="<stdin>")


def test_a_decoder_error_without_a_message_is_named_by_its_type(tmp_path, monkeypatch):
    """An exception from the decoder with an empty message (a ValueError()) gave an IndexError from
    taking its first line; the one-line AudioError names the exception's type instead."""
    path = tmp_path / "a.wav"
    sf.write(path, _noise(800, 1), 8000, subtype="PCM_16")

    def refuse(*args, **kwargs):
        raise ValueError()

    monkeypatch.setattr(sf, "SoundFile", refuse)
    expected = f"{path}: not a readable audio file (ValueError)"
    with pytest.raises(AudioError, match=f"^{re.escape(expected)}$"):
        read_audio(path)

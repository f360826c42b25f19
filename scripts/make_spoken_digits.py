"""Build ``src/tandem/data/spoken_digits.npz`` from the Free Spoken Digit Dataset's WAV files.

Usage::

    python scripts/make_spoken_digits.py ../shared/data/fsdd src/tandem/data/spoken_digits.npz

The source holds ``recordings/{digit}_{speaker}_{index}.wav`` (8 kHz, 16-bit, mono). The result keeps
every sample exactly (lossless) in the layout that ``tandem.asr.corpus.load_spoken_digits`` reads:

- ``offsets`` int64 ``[N + 1]``: recording ``i`` is ``samples[offsets[i]:offsets[i + 1]]``;
- ``delta_hi``, ``delta_lo`` uint8 ``[S]``: the high and low bytes of the int16 samples' first
  difference (wrapping, over the concatenation). Speech changes slowly from sample to sample, so the
  differences are small and their high bytes mostly 0 or 255: this compresses to 12.7 MB where the
  plain samples take 15.4 MB;
- ``digit``, ``speaker``, ``index`` int8 ``[N]``; ``speakers`` the speaker names (``speaker`` indexes
  it); ``sample_rate`` the common rate.

Recordings are ordered by (speaker, digit, index). The derived file keeps the dataset's license,
CC BY-SA 4.0, and its credit (README.md).
"""

from __future__ import annotations

import argparse
import re
import wave
from pathlib import Path

import numpy as np

NAME = re.compile(r"(\d)_([a-z]+)_(\d+)\.wav")


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    """The int16 samples and the sample rate of a 16-bit mono PCM WAV file."""
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise ValueError(f"{path}: expected 16-bit mono PCM, got {8 * w.getsampwidth()}-bit, "
                             f"{w.getnchannels()} channels")  # fmt: skip
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int16), w.getframerate()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path, help="the FSDD folder (with recordings/)")
    parser.add_argument("out", type=Path, help="the .npz to write")
    args = parser.parse_args()

    entries = []
    for path in (args.source / "recordings").glob("*.wav"):
        match = NAME.fullmatch(path.name)
        if match is None:
            raise ValueError(f"{path}: expected a name {{digit}}_{{speaker}}_{{index}}.wav")
        entries.append((match[2], int(match[1]), int(match[3]), path))
    if not entries:
        raise ValueError(f"{args.source / 'recordings'}: no WAV files")
    entries.sort()
    speakers = sorted({e[0] for e in entries})

    chunks, rates = [], set()
    for *_, path in entries:
        samples, rate = read_wav(path)
        chunks.append(samples)
        rates.add(rate)
    if len(rates) != 1:
        raise ValueError(f"expected one sample rate over all recordings, got {sorted(rates)}")
    samples = np.concatenate(chunks)
    delta = np.diff(samples, prepend=np.int16(0)).view(np.uint16)  # int16 arithmetic wraps: exact
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in chunks])]).astype(np.int64)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.out,
        offsets=offsets,
        delta_hi=(delta >> 8).astype(np.uint8),
        delta_lo=(delta & 0xFF).astype(np.uint8),
        digit=np.array([e[1] for e in entries], dtype=np.int8),
        speaker=np.array([speakers.index(e[0]) for e in entries], dtype=np.int8),
        index=np.array([e[2] for e in entries], dtype=np.int8),
        speakers=np.array(speakers),
        sample_rate=np.int64(rates.pop()),
    )
    seconds = len(samples) / int(np.load(args.out)["sample_rate"])
    print(f"{args.out}: {len(entries)} recordings of {len(speakers)} speakers, {seconds / 60:.1f} min, "
          f"{args.out.stat().st_size / 1e6:.1f} MB")  # fmt: skip


if __name__ == "__main__":
    main()

"""Build ``src/tandem/data/japanese_vowels.npz`` from the UCI Japanese Vowels ``.ts`` files.

Usage::

    python scripts/make_japanese_vowels.py ../shared/data/japanese_vowels src/tandem/data/japanese_vowels.npz

The ``.ts`` format (sktime): header lines start with ``#`` or ``@``; after ``@data`` each line is one
utterance, 12 ``:``-separated channels (comma-separated series of equal length) and the class label.
The result holds the utterances padded to the longest one, in tandem's documented data format
(``tandem.data.load_npz``): ``features`` [N, T, F] float32, ``lengths`` [N], ``labels`` [N] (0-based)
and ``split`` [N] (0 = train, 1 = test).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def read_ts(path: Path) -> tuple[list[np.ndarray], list[int]]:
    """The utterances (``[T_i, F]`` float32 arrays) and labels of one ``.ts`` file."""
    series, labels = [], []
    in_data = False
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not in_data:
            in_data = line.lower() == "@data"
            continue
        *channels, label = line.split(":")
        values = [np.array([float(v) for v in c.split(",")], dtype=np.float32) for c in channels]
        if len({len(v) for v in values}) != 1:
            raise ValueError(f"{path}:{line_no}: channels of different lengths {[len(v) for v in values]}")
        series.append(np.stack(values, axis=1))  # [T_i, F]
        labels.append(int(label))
    if not series:
        raise ValueError(f"{path}: no @data section with utterances")
    return series, labels


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path, help="folder with JapaneseVowels_TRAIN.ts and _TEST.ts")
    parser.add_argument("out", type=Path, help="the .npz to write")
    args = parser.parse_args()

    parts = [read_ts(args.source / f"JapaneseVowels_{name}.ts") for name in ("TRAIN", "TEST")]
    series = parts[0][0] + parts[1][0]
    labels = np.array(parts[0][1] + parts[1][1], dtype=np.int64) - 1  # classes 1..9 -> 0..8
    split = np.array([0] * len(parts[0][0]) + [1] * len(parts[1][0]), dtype=np.int8)
    lengths = np.array([len(s) for s in series], dtype=np.int64)
    features = np.zeros((len(series), lengths.max(), series[0].shape[1]), dtype=np.float32)
    for i, s in enumerate(series):
        features[i, : len(s)] = s
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, features=features, lengths=lengths, labels=labels, split=split)
    n_train, n_test = int((split == 0).sum()), int((split == 1).sum())
    print(
        f"{args.out}: {len(series)} utterances ({n_train} train, {n_test} test), "
        f"lengths {lengths.min()}-{lengths.max()}, {features.shape[2]} features, {labels.max() + 1} classes"
    )


if __name__ == "__main__":
    main()

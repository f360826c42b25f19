"""Sequence-classification data for ``tandem train``: the bundled Japanese Vowels set and user files.

The file format (``.npz``, as written by ``numpy.savez``):

- ``features``: float ``[N, T, F]``, utterance ``i`` in ``features[i, :lengths[i]]`` (the rest is padding);
- ``lengths``: int ``[N]``, each in ``[1, T]``;
- ``labels``: int ``[N]``, classes ``0 .. C-1``;
- ``split`` (optional): int ``[N]``, 0 = train, 1 = test. Without it the last 20% (by index) is the test set.

The bundled ``japanese_vowels.npz`` (UCI Japanese Vowels, Kudo, Toyama and Shimbo 1999, CC BY 4.0) is
built from the original files by ``scripts/make_japanese_vowels.py``.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["SequenceData", "load_npz", "japanese_vowels", "JAPANESE_VOWELS"]

JAPANESE_VOWELS = Path(__file__).with_name("japanese_vowels.npz")


@dataclass(frozen=True)
class SequenceData:
    """Padded variable-length sequences with class labels, split into train and test."""

    features: Tensor  # [N, T, F] float32
    lengths: Tensor  # [N] int64
    labels: Tensor  # [N] int64
    is_test: Tensor  # [N] bool

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1

    @property
    def num_features(self) -> int:
        return self.features.shape[2]

    def subset(self, test: bool) -> SequenceData:
        keep = self.is_test == test
        return SequenceData(self.features[keep], self.lengths[keep], self.labels[keep], self.is_test[keep])

    def __len__(self) -> int:
        return self.features.shape[0]


# The largest class label taken: a label far above the others is a broken file, and the classifier's output
# layer would take memory for every class below it
MAX_LABEL = 2**20 - 1


def load_npz(path: str | Path) -> SequenceData:
    """Read and validate a data file; errors name the file, the key, what was expected and what came."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except FileNotFoundError:
        raise ValueError(f"--data {path}: no such file") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(
            f"--data {path}: expected a .npz file (numpy.savez), could not read it: {e}"
        ) from None

    def need(key: str, ndim: int, kind: str) -> np.ndarray:
        if key not in arrays:
            raise ValueError(f"--data {path}: expected key {key!r}, found keys {sorted(arrays)}")
        a = arrays[key]
        if a.ndim != ndim or a.dtype.kind not in kind:
            raise ValueError(
                f"--data {path}: expected {key!r} as a {ndim}-D {'float' if kind == 'f' else 'integer'} "
                f"array, got {a.ndim}-D {a.dtype}"
            )
        return a

    features = need("features", 3, "f")
    lengths, labels = need("lengths", 1, "iu"), need("labels", 1, "iu")
    n, steps, _ = features.shape
    for key, a in (("lengths", lengths), ("labels", labels)):
        if a.shape[0] != n:
            raise ValueError(f"--data {path}: expected {key!r} of length {n} (features' N), got {a.shape[0]}")
    if n == 0 or features.shape[2] == 0:
        raise ValueError(
            f"--data {path}: expected at least one sequence and one feature, got {features.shape}"
        )
    if lengths.min() < 1 or lengths.max() > steps:
        raise ValueError(
            f"--data {path}: expected lengths in [1, {steps}], got [{lengths.min()}, {lengths.max()}]"
        )
    if labels.min() < 0 or labels.max() > MAX_LABEL:
        raise ValueError(
            f"--data {path}: expected labels from 0 to {MAX_LABEL} (the classifier has an output per class), "
            f"got [{labels.min()}, {labels.max()}]"
        )
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf here, refused below
        features = features.astype(np.float32)
    if not np.isfinite(features).all():
        raise ValueError(f"--data {path}: expected finite float32 features, found NaN, inf or |x| > 3.4e38")
    if "split" in arrays:
        split = need("split", 1, "iub")
        if split.shape[0] != n or not np.isin(split, (0, 1)).all():
            raise ValueError(f"--data {path}: expected 'split' of {n} values in {{0, 1}}")
        is_test = split.astype(bool)
    else:
        is_test = np.arange(n) >= n - max(1, n // 5)
    if is_test.all() or not is_test.any():
        raise ValueError(f"--data {path}: expected both train and test sequences in 'split'")
    return SequenceData(
        torch.from_numpy(features),
        torch.from_numpy(lengths.astype(np.int64)),
        torch.from_numpy(labels.astype(np.int64)),
        torch.from_numpy(is_test),
    )


def japanese_vowels() -> SequenceData:
    """The bundled speaker-identification set: 270 train / 370 test utterances, 12 features, 9 speakers."""
    return load_npz(JAPANESE_VOWELS)

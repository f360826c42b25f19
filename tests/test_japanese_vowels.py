"""The bundled data set and the validation of user data files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.data import JAPANESE_VOWELS, japanese_vowels, load_npz

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "japanese_vowels"


def test_bundled_japanese_vowels():
    data = japanese_vowels()
    assert len(data) == 640 and data.num_features == 12 and data.num_classes == 9
    assert len(data.subset(test=False)) == 270 and len(data.subset(test=True)) == 370
    assert data.lengths.min() == 7 and data.lengths.max() == 29
    # padding is zero, frames are not
    for i in range(0, 640, 37):
        n = int(data.lengths[i])
        assert torch.all(data.features[i, n:] == 0) and torch.any(data.features[i, n - 1] != 0)
    assert torch.equal(torch.bincount(data.subset(test=False).labels), torch.full((9,), 30))


@pytest.mark.skipif(not SHARED.exists(), reason="the original .ts files are not beside this checkout")
def test_bundled_file_is_what_the_script_makes(tmp_path):
    out = tmp_path / "jv.npz"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_japanese_vowels.py"), str(SHARED), str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    with np.load(out) as fresh, np.load(JAPANESE_VOWELS) as shipped:
        assert sorted(fresh.files) == sorted(shipped.files)
        for key in fresh.files:
            np.testing.assert_array_equal(fresh[key], shipped[key], err_msg=key)


def _write(tmp_path, **arrays):
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    return path


GOOD = dict(
    features=np.ones((4, 3, 2), np.float32),
    lengths=np.array([3, 1, 2, 3]),
    labels=np.array([0, 1, 0, 1]),
    split=np.array([0, 0, 0, 1]),
)

BAD = {
    "missing-labels": ({k: v for k, v in GOOD.items() if k != "labels"}, "expected key 'labels'"),
    "features-2d": ({**GOOD, "features": np.ones((4, 3))}, "'features' as a 3-D float"),
    "lengths-too-long": ({**GOOD, "lengths": np.array([4, 1, 2, 3])}, r"lengths in \[1, 3\]"),
    "lengths-zero": ({**GOOD, "lengths": np.array([0, 1, 2, 3])}, r"lengths in \[1, 3\]"),
    "labels-count": ({**GOOD, "labels": np.array([0, 1])}, "'labels' of length 4"),
    "negative-label": ({**GOOD, "labels": np.array([0, -1, 0, 1])}, "labels from 0 to 1048575"),
    "nan": ({**GOOD, "features": np.full((4, 3, 2), np.nan, np.float32)}, "finite"),
    "split-values": ({**GOOD, "split": np.array([0, 2, 0, 1])}, "'split'"),
    "no-test": ({**GOOD, "split": np.array([0, 0, 0, 0])}, "both train and test"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_malformed_data_is_a_clear_error(tmp_path, name):
    arrays, message = BAD[name]
    with pytest.raises(ValueError, match=message):
        load_npz(_write(tmp_path, **arrays))


def test_not_an_npz_and_missing_file(tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_text("not a zip")
    with pytest.raises(ValueError, match="expected a .npz file"):
        load_npz(junk)
    with pytest.raises(ValueError, match="no such file"):
        load_npz(tmp_path / "absent.npz")


def test_default_split_is_the_last_fifth(tmp_path):
    data = load_npz(_write(tmp_path, **{k: v for k, v in GOOD.items() if k != "split"}))
    assert data.is_test.tolist() == [False, False, False, True]

"""The training-job benchmark: both stacks really train in one two-rank group, and the summary reads."""

from __future__ import annotations

import subprocess
import sys

import torch

from tandem.bench import train
from tandem.bench.runner import BenchRow


def test_both_stacks_train_an_epoch_in_one_group_and_the_summary_reads(monkeypatch, tmp_path):
    """The group runs under a process of its own, whose exit shows what the ranks left behind: they end
    with os._exit, and a multiprocessing lock of theirs (tqdm's) was never unlinked, so the resource
    tracker of the process that spawned them warned of leaked semaphores when it shut down."""
    p = dict(id="tiny", cell="gru", hidden=16, layers=1, world=2, epochs=1, threads=1, device="cpu")
    code = (
        "import sys, torch\n"
        "from tandem.bench import train\n"
        f"torch.save(train.run_group({p!r}), sys.argv[1])\n"
    )
    path = tmp_path / "result.pt"
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr
    result = torch.load(path, weights_only=False)
    assert set(result["seconds"]) == {"tandem", "torch"}
    assert all(len(v) == 1 and v[0] > 0 for v in result["seconds"].values())
    words = {stack: rates[1] for stack, rates in result["rates"].items()}
    assert words["tandem"] == words["torch"] == 600  # the same test set, scored for both
    monkeypatch.setitem(train.RESULTS, "tiny", result)
    rows = [
        BenchRow("train", s, "train", "tiny", 1.0, 1.0, 1.0, "cpu", "x", "x") for s in ("torch", "tandem")
    ]
    text = train.summary(rows)
    assert text.startswith("tiny: seconds per epoch (median of 1) tandem") and "test WER tandem" in text


def test_the_summary_gives_true_medians(monkeypatch):
    """Of an even count of epochs the mean of the middle two (it took the upper one: of two epochs the
    larger, the speedup's maximum)."""
    result = {"seconds": {"tandem": [1.0, 3.0], "torch": [2.0, 2.0]}, "rates": {}}
    result["rates"] = {stack: (0, 600, 0, 3000, 0, 200) for stack in ("tandem", "torch")}
    monkeypatch.setitem(train.RESULTS, "even", result)
    rows = [
        BenchRow("train", s, "train", "even", 1.0, 1.0, 1.0, "cpu", "x", "x") for s in ("torch", "tandem")
    ]
    text = train.summary(rows)
    # ratios 2.0 and 0.667: median 1.33x; seconds medians 2.0 each
    assert "tandem 2.0, torch 2.0; per-epoch speedup median 1.33x (min 0.67x, max 2.00x)" in text, text

"""The training-job benchmark: both stacks really train in one two-rank group, and the summary reads."""

from __future__ import annotations

import subprocess
import sys

from tandem.bench import train
from tandem.bench.runner import BenchRow


def test_both_stacks_train_an_epoch_in_one_group_and_the_summary_reads(monkeypatch):
    p = dict(id="tiny", cell="gru", hidden=16, layers=1, world=2, epochs=1, threads=1)
    result = train.run_group(p)
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


def test_the_ranks_leave_no_semaphore_behind():
    """The ranks end with os._exit: a multiprocessing lock of theirs (tqdm's) was never unlinked, and the
    resource tracker of the process that spawned them warned of leaked semaphores when it shut down."""
    code = (
        "from tandem.bench import train\n"
        "train.run_group(dict(id='tiny', cell='gru', hidden=8, layers=1, world=2, epochs=1, threads=1))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr

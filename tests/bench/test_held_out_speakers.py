"""benchmarks/held_out_speakers.py: the per-speaker summary over seeds (the runs themselves are tandem
train's, tested in tests/asr)."""

from __future__ import annotations

import pytest
from benchmarks.held_out_speakers import summarise, table


def _run(speaker: str, seed: int, wer: float) -> dict:
    return dict(speaker=speaker, seed=seed, wer=wer, cer=wer / 2, best_wer=wer - 0.01, train_s=100.0 + seed)


def test_summary_means_each_speaker_over_its_seeds_then_the_speakers():
    runs = [_run("theo", 0, 0.10), _run("theo", 1, 0.08), _run("george", 0, 0.30), _run("george", 1, 0.26)]
    rows = summarise(runs)
    assert [r["speaker"] for r in rows] == ["theo", "george", "all"]
    theo, george, every = rows
    assert theo["wer"] == pytest.approx(0.09) and theo["wers"] == [0.10, 0.08]
    assert theo["cer"] == pytest.approx(0.045) and theo["best_wer"] == pytest.approx(0.08)
    assert george["wer"] == pytest.approx(0.28) and george["train_s"] == pytest.approx(100.5)
    assert every["wer"] == pytest.approx(0.185) and every["wers"] == []
    text = table(rows, [0, 1]).splitlines()
    assert text[0].startswith("| held out | test WER, mean | seed 0 / 1 |")
    assert text[2] == "| theo | 9.0% | 10.0 / 8.0 | 4.5% | 8.0% | 100 |"
    assert text[4].startswith("| all | 18.5% |  |")


def test_one_speaker_has_no_mean_over_speakers():
    assert [r["speaker"] for r in summarise([_run("theo", 0, 0.1)])] == ["theo"]

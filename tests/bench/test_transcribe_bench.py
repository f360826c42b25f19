"""The transcription benchmark: both providers decode the same test utterances to the same transcripts,
and the summary gives each one's real-time factor."""

from __future__ import annotations

import torch

from tandem.bench import runner
from tandem.bench.registry import REGISTRY
from tandem.bench.runner import BenchRow


def test_providers_agree_and_the_summary_gives_real_time_factors(monkeypatch):
    runner.discover(["transcribe"])
    bench = REGISTRY["transcribe"]
    from tandem.bench import transcribe

    monkeypatch.setattr(transcribe, "RESULTS", {})
    params = dict(id="tiny", cell="gru", batch=2, count=3)
    thunks = {name: factory(params, torch.device("cpu"), "fwd") for name, factory in bench.providers.items()}
    texts = {name: thunk() for name, thunk in thunks.items()}
    assert set(texts) == {"torch", "tandem"} and len(texts["tandem"]) == 3
    assert texts["tandem"] == texts["torch"] == transcribe.RESULTS["tiny"]["texts"]["torch"]
    result = transcribe.RESULTS["tiny"]
    assert result["utterances"] == 3 and result["audio_seconds"] > 1 and result["feature_seconds"] > 0
    rows = [
        BenchRow("transcribe", name, "fwd", "tiny", p50, p50, p50, "cpu", "x", "x")
        for name, p50 in (("torch", 20.0), ("tandem", 10.0))
    ]
    text = transcribe.summary(rows)
    audio = result["audio_seconds"]
    assert text.startswith(f"tiny: 3 utterances, {audio:.1f} s of audio; RTF (model + greedy decoding, p50) ")
    assert f"torch {0.02 / audio:.4f}, tandem {0.01 / audio:.4f}" in text and text.endswith(
        "same transcripts"
    )
    assert bench.baseline == "torch" and bench.modes == ("fwd",) and "transcribe" in runner.KNOWN_OPS

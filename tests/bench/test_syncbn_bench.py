"""The syncbn benchmark's self-timed, multi-process providers on a tiny shape (one spawn of 2 ranks)."""

from __future__ import annotations

import pytest

from tandem.bench import runner
from tandem.bench.registry import REGISTRY


@pytest.mark.timeout(200)
def test_syncbn_providers_time_themselves(monkeypatch):
    runner.discover(["syncbn"])
    bench = REGISTRY["syncbn"]
    from tandem.bench import syncbn

    calls = []
    real = syncbn._run_ranks
    monkeypatch.setattr(syncbn, "_run_ranks", lambda kinds, p: calls.append(kinds) or real(kinds, p))
    params = dict(N=3, C=4, L=5, world=2, warmup=1, repeats=3)
    thunks = {
        name: factory(params, runner.torch.device("cpu"), "train")
        for name, factory in bench.providers.items()
    }
    times = {name: thunk() for name, thunk in thunks.items()}
    assert len(calls) == 1, "one spawn serves every provider of a shape (interleaved)"
    assert set(times) == {
        "torch",
        "allreduce-sum",
        "tandem",
        "tandem-nocomm",
        "torch+comm",
        "comm-latency",
    }
    assert all(len(t) == 3 and all(s > 0 for s in t) for t in times.values()), times
    assert bench.timing == "self" and bench.baseline == "torch"

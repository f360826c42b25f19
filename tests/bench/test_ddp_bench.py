"""The ddp benchmark's pieces that need no process group: the sleeping layer and the summary."""

from __future__ import annotations

import statistics

import torch

from tandem.bench import ddp
from tandem.bench.runner import BenchRow


def test_sleep_linear_has_the_gradients_of_a_matmul():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, w: ddp._SleepLinear.apply(x, w, 0.0), (x, w))
    out = ddp._SleepLinear.apply(x, w, 0.001)
    torch.testing.assert_close(out, x @ w.t(), rtol=0, atol=0)


def test_summary_from_rows():
    def row(shape, provider, ms):
        return BenchRow("ddp", provider, "train", shape, ms, ms, ms, "cpu", "x", "x")

    p50 = {"torch": 150.0, "torch-1MB": 130.0, "tandem": 120.0, "local": 100.0, "allreduce": 40.0}
    rows = [row("sleep-test", n, v) for n, v in p50.items()]
    rows += [row("gru-test-w1", n, v) for n, v in {"torch": 103.0, "tandem": 101.0, "local": 100.0}.items()]
    text = ddp.summary(rows)
    # (100 + 40 - 120) / 40 = 0.5 for tandem; torch-1MB is torch's best bucket size
    assert "tandem 0.50" in text and "torch-1MB 0.25" in text and "(torch-1MB) 130.0 ms" in text
    assert "tandem +1.0%" in text and "torch +3.0%" in text


def test_summary_with_per_step_times(monkeypatch):
    def row(provider, ms):
        return BenchRow("ddp", provider, "train", "sleep-steps", ms, ms, ms, "cpu", "x", "x")

    s = 1e-3
    times = {
        "torch": [150 * s, 150 * s],
        "tandem": [120 * s, 112 * s],
        "local": [100 * s, 100 * s],
        "allreduce-flat": [40 * s, 40 * s],
        "allreduce-buckets": [30 * s, 50 * s],
        "allreduce-last": [4 * s, 4 * s],
    }
    times["allreduce"] = times["allreduce-flat"]  # the faster way by median, as run_group picks it
    monkeypatch.setitem(ddp.RESULTS, "sleep-steps", {"times": times, "stats": []})
    rows = [row(n, 1e3 * statistics.median(times[n])) for n in ("torch", "tandem", "local", "allreduce")]
    text = ddp.summary(rows)
    # efficiencies per step (100 + 40 - 120) / 40 = 0.5 and (100 + 40 - 112) / 40 = 0.7: median 0.6
    assert "tandem 0.60" in text
    # 1 - 4 / 40 = 0.9; the faster way per step: (100 + 30 - 120) / 30 = 0.33 and 0.7: median 0.52
    assert "efficiency <= 0.90" in text and "instead: 0.52" in text

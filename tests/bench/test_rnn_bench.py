"""The GRU/LSTM benchmarks' variants: TIME_LOOP set around each call and restored, even on errors; the
CUDA-only and CPU-only providers stay out of the other device's rows."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tandem.bench._rnn import with_kernel_settings
from tandem.bench.gru import GRU_BENCH
from tandem.bench.lstm import LSTM_BENCH


def test_kernel_settings_are_set_and_restored(monkeypatch):
    kernels = types.ModuleType("fake_kernels")
    kernels.TIME_LOOP = "auto"
    monkeypatch.setitem(sys.modules, "fake_kernels", kernels)
    seen = []
    kernels.CUDA_GRAPHS = False
    run = with_kernel_settings(
        lambda: seen.append((kernels.TIME_LOOP, kernels.CUDA_GRAPHS)),
        "fake_kernels",
        TIME_LOOP="per-step",
        CUDA_GRAPHS=True,
    )
    run()
    assert seen == [("per-step", True)] and (kernels.TIME_LOOP, kernels.CUDA_GRAPHS) == ("auto", False)

    def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with_kernel_settings(fails, "fake_kernels", TIME_LOOP="persistent")()
    assert kernels.TIME_LOOP == "auto"


@pytest.mark.parametrize("bench", [GRU_BENCH, LSTM_BENCH], ids=["gru", "lstm"])
def test_device_only_providers_do_not_apply_elsewhere(bench):
    params = dict(bench.shapes[0].params)
    cpu = torch.device("cpu")
    for name in ("tandem-per-step", "tandem-graphs"):
        if name in bench.providers:
            assert bench.providers[name](params, cpu, "train") is None
    if "tandem-no-mkldnn" in bench.providers:
        assert bench.providers["tandem-no-mkldnn"](params, torch.device("meta"), "train") is None
        assert callable(bench.providers["tandem-no-mkldnn"](params, cpu, "fwd"))

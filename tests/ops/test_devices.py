"""Triton launches its kernels on the current CUDA device (and its current stream); torch's ops follow
their tensors. Every Triton entry point of tandem's ops sets the current device to its tensors' first."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

pytest.importorskip("triton")

TRITON_MODULES = ["adagrad", "gru", "lstm", "syncbn"]


@pytest.mark.parametrize("op", TRITON_MODULES)
def test_every_triton_entry_point_runs_on_its_tensors_device(op):
    module = importlib.import_module(f"tandem.ops.{op}.triton")
    entries = [
        (name, fn)
        for name, fn in vars(module).items()
        if name.endswith("_triton") and inspect.isfunction(fn) and fn.__module__ == module.__name__
    ]
    assert entries, f"no *_triton function in {module.__name__}"
    from tandem._device import on_tensors_device

    wrapper_code = on_tensors_device(lambda: None).__code__  # every wrapped function runs this code
    unguarded = [name for name, fn in entries if fn.__code__ is not wrapper_code]
    assert not unguarded, f"not wrapped in tandem._device.on_tensors_device: {unguarded}"


def test_the_wrapper_passes_arguments_and_results_through():
    from tandem._device import on_tensors_device

    @on_tensors_device
    def f(xs, y=None, *, scale=1):
        return [x * scale for x in xs], y

    x = torch.ones(2)
    out, y = f([x], "y", scale=3)
    assert torch.equal(out[0], 3 * x) and y == "y" and f.__name__ == "f"
    assert f([], None) == ([], None)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_layers_and_the_optimizer_on_the_second_gpu_while_the_first_is_current():
    """A GRU, an LSTM, a masked SyncBatchNorm and an Adagrad step on cuda:1 with cuda:0 current: the same
    numbers as on cuda:0 (they ran on GPU 0 with GPU 1's memory)."""
    import tandem

    def run(device: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        gru, lstm = tandem.nn.GRU(8, 16).to(device), tandem.nn.LSTM(8, 16).to(device)
        bn = tandem.nn.SyncBatchNorm(16).to(device)
        opt = tandem.optim.Adagrad([*gru.parameters(), *lstm.parameters(), *bn.parameters()], lr=0.1)
        x = torch.randn(5, 3, 8, device=device)
        mask = torch.ones(3, 5, dtype=torch.bool, device=device)
        y = bn(gru(x)[0].permute(1, 2, 0), mask=mask).sum() + lstm(x)[0].sum()
        y.backward()
        opt.step()
        torch.cuda.synchronize(device)
        return [p.detach().cpu() for p in opt.param_groups[0]["params"]]

    torch.cuda.set_device(0)
    want = run("cuda:0")
    got = run("cuda:1")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)

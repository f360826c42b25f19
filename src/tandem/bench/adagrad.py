"""Benchmark of ``tandem.optim.Adagrad``: one ``optimizer.step()`` against torch.optim.Adagrad's three paths.

Providers: ``torch`` (the baseline: torch's fastest path, its fused kernel, ``fused=True``, on the CPU and on
GPUs where torch.optim.Adagrad has one (2.13), else ``foreach=True``, its default (2.11)), ``torch-foreach``,
``torch-forloop`` (``foreach=False``, torch's default on CPU), ``tandem`` and ``tandem-tol`` (tandem with
``tol`` set, i.e. with the largest-change reduction). Each factory builds float32 parameters, constant
gradients and the optimizer outside the timed region; the thunk is one ``step()``.

What one step moves: read p, g, sum and write p, sum: 20 bytes per float32 parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.bench.registry import OpBench, Shape, register
from tandem.optim.adagrad import torch_fused_takes

__all__ = ["ADAGRAD_BENCH", "make_params"]


def make_params(params: dict[str, Any], device: torch.device) -> list[torch.nn.Parameter]:
    """``params["n_tensors"]`` float32 parameters of ``params["numel"]`` elements, each with a gradient."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(params["n_tensors"]):
        p = torch.nn.Parameter(torch.randn(params["numel"], generator=gen).to(device))
        p.grad = torch.randn(params["numel"], generator=gen).to(device)
        out.append(p)
    return out


def _provider(build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]):
    def factory(params: dict[str, Any], device: torch.device, mode: str) -> Callable[[], Any]:
        if mode != "step":
            raise ValueError(f"adagrad bench: expected mode 'step', got {mode!r}")
        opt = build(make_params(params, device))
        return opt.step

    return factory


def _torch_fastest(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # torch 2.11's Adagrad(fused=True) refuses CUDA tensors ("`fused=True` requires ... supported devices:
    # ['mps', 'xpu', 'hpu', 'cpu', ...]", on an H200); 2.13's takes them
    fused = torch_fused_takes(ps[0].device)
    return torch.optim.Adagrad(ps, **({"fused": True} if fused else {"foreach": True}))


def _tandem(**kwargs: Any) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    def build(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        from tandem.optim import Adagrad

        return Adagrad(ps, **kwargs)

    return build


ADAGRAD_BENCH = register(
    OpBench(
        op="adagrad",
        providers={
            "torch": _provider(_torch_fastest),
            "torch-foreach": _provider(lambda ps: torch.optim.Adagrad(ps, foreach=True)),
            "torch-forloop": _provider(lambda ps: torch.optim.Adagrad(ps, foreach=False)),
            "tandem": _provider(_tandem()),
            "tandem-tol": _provider(_tandem(tol=1e-8)),
        },
        shapes=(
            Shape(id="100x65536", params={"n_tensors": 100, "numel": 65536}, quick=True),
            Shape(id="10M-in-100", params={"n_tensors": 100, "numel": 100_000}),
        ),
        modes=("step",),
        baseline="torch",
        description="one Adagrad step (read p, g, sum; write p, sum) over 100 float32 tensors",
    )
)

"""What the GRU and LSTM benchmarks share: the shape grid's naming, the providers, kernel settings."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from tandem.bench.registry import Shape

__all__ = ["GPU_SIZES", "rnn_shape", "rnn_provider", "with_kernel_settings"]

# The GPU grid (shapes of the Triton kernels' issue), T, B, I, H; the last size is one where the
# persistent kernels run (tandem train --task classify's GRU is H64).
GPU_SIZES = ((1024, 16, 768, 768), (100, 32, 512, 512), (200, 64, 1024, 1024), (100, 32, 64, 64))


def rnn_shape(
    steps, batch, inp, hid, layers=1, bi=False, packed=False, quick=False, devices=("cpu",), dtype="float32"
) -> Shape:
    """A shape named like ``T50-B32-I128-H256-L2-bi-packed-bfloat16`` (float32, one layer, padded and
    unidirectional are the unnamed defaults)."""
    name = f"T{steps}-B{batch}-I{inp}-H{hid}" + (f"-L{layers}" if layers > 1 else "")
    name += "-bi" if bi else "-uni"
    name += "-packed" if packed else ""
    name += "" if dtype == "float32" else f"-{dtype}"
    params = dict(T=steps, B=batch, I=inp, H=hid, L=layers, bi=bi, packed=packed, dtype=dtype)
    return Shape(name, params, quick=quick, devices=devices)


def rnn_provider(cls: type[torch.nn.Module], kernels: str, mkldnn: bool = True, **settings: Any):
    """A provider running ``cls`` (a GRU or LSTM module class) on a shape's input: a training step
    (forward + backward of the sum of every output down to the input and every parameter) or a no-grad
    forward. A packed shape feeds a PackedSequence whose lengths are spread evenly over [T/2, T].

    ``mkldnn=False``: oneDNN off (CPU only). ``settings``: attributes of the Triton kernels module
    ``kernels`` (``TIME_LOOP``, ``CUDA_GRAPHS``) set while the provider runs (CUDA only). Elsewhere the
    factory returns None: the provider does not apply."""

    def factory(p: dict[str, Any], device: torch.device, mode: str):
        if (not mkldnn and device.type != "cpu") or (settings and device.type != "cuda"):
            return None
        dtype = getattr(torch, p["dtype"])
        model = cls(p["I"], p["H"], num_layers=p["L"], bidirectional=p["bi"], device=device, dtype=dtype)
        x = torch.randn(p["T"], p["B"], p["I"], device=device, dtype=dtype)
        if p["packed"]:
            lengths = torch.linspace(p["T"], p["T"] // 2, p["B"]).round().long()
            packed = pack_padded_sequence(x, lengths)
            data = packed.data.requires_grad_(mode == "train")
            inp: torch.Tensor | PackedSequence = PackedSequence(data, packed.batch_sizes, None, None)
        else:
            inp = x.requires_grad_(mode == "train")

        def train() -> None:
            out, hidden = model(inp)
            out = out.data if isinstance(out, PackedSequence) else out
            states = hidden if isinstance(hidden, tuple) else (hidden,)  # h_n, or (h_n, c_n)
            (out.sum() + sum(h.sum() for h in states)).backward()

        def forward() -> None:
            with torch.no_grad():
                model(inp)

        step = train if mode == "train" else forward
        if settings:
            return with_kernel_settings(step, kernels, **settings)
        if mkldnn:
            return step

        def without_mkldnn() -> None:
            with torch.backends.mkldnn.flags(enabled=False):
                step()

        return without_mkldnn

    return factory


def with_kernel_settings(thunk: Callable[[], None], kernels: str, **settings: Any) -> Callable[[], None]:
    """``thunk`` run with the Triton kernels module ``kernels`` (e.g. ``"tandem.ops.gru.triton"``) given
    ``settings`` (e.g. ``TIME_LOOP="per-step"``, ``CUDA_GRAPHS=True``), restored after each call."""

    def run() -> None:
        module = importlib.import_module(kernels)
        saved = {name: getattr(module, name) for name in settings}
        for name, value in settings.items():
            setattr(module, name, value)
        try:
            thunk()
        finally:
            for name, value in saved.items():
                setattr(module, name, value)

    return run

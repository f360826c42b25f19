"""``tandem bench --op gru``: tandem.nn.GRU against torch.nn.GRU, one training step or one forward.

A training step is forward + backward of ``out.sum() + h_n.sum()`` down to the input, every parameter
and nothing else (no optimizer). A packed shape feeds a PackedSequence whose lengths are spread
evenly over [T/2, T]; its padded twin (same T, B, sizes) shows what packing saves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import tandem
from tandem.bench._rnn import with_kernel_settings
from tandem.bench.registry import OpBench, Shape, register

__all__ = ["GRU_BENCH"]

# The GPU grid (shapes of the Triton kernels' issue): float32 and bfloat16, uni- and bidirectional; the
# last size is one where the persistent kernels run (tandem train's default model is H64).
_GPU_SIZES = ((1024, 16, 768, 768), (100, 32, 512, 512), (200, 64, 1024, 1024), (100, 32, 64, 64))  # T B I H


def _shape(
    steps, batch, inp, hid, layers=1, bi=False, packed=False, quick=False, devices=("cpu",), dtype="float32"
) -> Shape:
    name = f"T{steps}-B{batch}-I{inp}-H{hid}" + (f"-L{layers}" if layers > 1 else "")
    name += "-bi" if bi else "-uni"
    name += "-packed" if packed else ""
    name += "" if dtype == "float32" else f"-{dtype}"
    params = dict(T=steps, B=batch, I=inp, H=hid, L=layers, bi=bi, packed=packed, dtype=dtype)
    return Shape(name, params, quick=quick, devices=devices)


def _provider(cls: type[torch.nn.Module], **settings: Any):
    """``settings``: attributes of tandem's GRU Triton kernels module (``TIME_LOOP``, ``CUDA_GRAPHS``)
    set while the provider runs; CUDA only (None elsewhere)."""

    def factory(p: dict[str, Any], device: torch.device, mode: str):
        if settings and device.type != "cuda":
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
            out, h_n = model(inp)
            out = out.data if isinstance(out, PackedSequence) else out
            (out.sum() + h_n.sum()).backward()

        def forward() -> None:
            with torch.no_grad():
                model(inp)

        thunk = train if mode == "train" else forward
        return with_kernel_settings(thunk, "tandem.ops.gru.triton", **settings) if settings else thunk

    return factory


GRU_BENCH = register(
    OpBench(
        op="gru",
        providers={
            "torch": _provider(torch.nn.GRU),
            "tandem": _provider(tandem.nn.GRU),
            # on CUDA: the per-step kernels also where the persistent ones run by default, and the per-step
            # loops recorded as CUDA graphs
            "tandem-per-step": _provider(tandem.nn.GRU, TIME_LOOP="per-step"),
            "tandem-graphs": _provider(tandem.nn.GRU, CUDA_GRAPHS=True),
        },
        shapes=(
            _shape(50, 32, 128, 256, quick=True),
            _shape(50, 32, 128, 256, bi=True, quick=True),
            _shape(100, 16, 64, 128, layers=2, bi=True),
            _shape(200, 64, 256, 512),
            _shape(100, 32, 80, 256, bi=True),
            _shape(100, 32, 80, 256, bi=True, packed=True),
            *(
                _shape(t, b, i, h, bi=bi, dtype=dtype, devices=("cuda",), quick=b == 32 and not bi)
                for t, b, i, h in _GPU_SIZES
                for bi in (False, True)
                for dtype in ("float32", "bfloat16")
            ),
        ),
        modes=("train", "fwd"),
        description="tandem.nn.GRU vs torch.nn.GRU: training step (fwd + bwd incl. dx) and no-grad forward",
    )
)

"""``tandem bench --op lstm``: tandem.nn.LSTM against torch.nn.LSTM, one training step or one forward.

Two baselines: ``torch`` is torch.nn.LSTM as users run it, which on the CPU takes oneDNN's fused LSTM
for padded float32 input without projection; ``torch-no-mkldnn`` is the same module run under
``torch.backends.mkldnn.flags(enabled=False)``, PyTorch's native path made of the same kind of ops
tandem's own kernel uses. tandem.nn.LSTM runs oneDNN where torch does (``tandem``) and its own kernel
elsewhere; ``tandem-no-mkldnn`` shows its own kernel on every shape. A packed shape feeds a
PackedSequence whose lengths are spread evenly over [T/2, T] (torch runs its native loop on those); its
padded twin is the row before it. A training step is forward + backward of ``out.sum() + h_n.sum() +
c_n.sum()`` down to the input, every parameter and nothing else (no optimizer).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import tandem
from tandem.bench._rnn import with_kernel_settings
from tandem.bench.registry import OpBench, Shape, register

__all__ = ["LSTM_BENCH"]

# The GPU grid (shapes of the Triton kernels' issue): float32 and float16, uni- and bidirectional; the
# last size is one where the persistent kernels run.
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


def _provider(cls: type[torch.nn.Module], mkldnn: bool = True, **settings: Any):
    """``mkldnn=False``: oneDNN off (CPU only). ``settings``: attributes of tandem's LSTM Triton kernels
    module (``TIME_LOOP``, ``CUDA_GRAPHS``) set while the provider runs (CUDA only)."""

    def factory(p: dict[str, Any], device: torch.device, mode: str):
        if not mkldnn and device.type != "cpu":
            return None  # oneDNN is a CPU library: nothing to turn off elsewhere
        if settings and device.type != "cuda":
            return None
        dtype = getattr(torch, p["dtype"])
        model = cls(p["I"], p["H"], num_layers=p["L"], bidirectional=p["bi"], device=device, dtype=dtype)
        x = torch.randn(p["T"], p["B"], p["I"], device=device, dtype=dtype)
        if p["packed"]:
            lengths = torch.linspace(p["T"], p["T"] // 2, p["B"]).round().long()
            packed = pack_padded_sequence(x, lengths)
            data = packed.data.requires_grad_(mode == "train")
            x = PackedSequence(data, packed.batch_sizes, None, None)
        else:
            x.requires_grad_(mode == "train")

        def train() -> None:
            out, (h_n, c_n) = model(x)
            out = out.data if isinstance(out, PackedSequence) else out
            (out.sum() + h_n.sum() + c_n.sum()).backward()

        def forward() -> None:
            with torch.no_grad():
                model(x)

        step = train if mode == "train" else forward
        if settings:
            return with_kernel_settings(step, "tandem.ops.lstm.triton", **settings)
        if mkldnn:
            return step

        def without_mkldnn() -> None:
            with torch.backends.mkldnn.flags(enabled=False):
                step()

        return without_mkldnn

    return factory


LSTM_BENCH = register(
    OpBench(
        op="lstm",
        providers={
            "torch": _provider(torch.nn.LSTM),
            "torch-no-mkldnn": _provider(torch.nn.LSTM, mkldnn=False),
            "tandem": _provider(tandem.nn.LSTM),
            "tandem-no-mkldnn": _provider(tandem.nn.LSTM, mkldnn=False),
            # on CUDA: the per-step kernels also where the persistent ones run by default, and the per-step
            # loops recorded as CUDA graphs
            "tandem-per-step": _provider(tandem.nn.LSTM, TIME_LOOP="per-step"),
            "tandem-graphs": _provider(tandem.nn.LSTM, CUDA_GRAPHS=True),
        },
        shapes=(
            _shape(50, 32, 128, 256, quick=True),
            _shape(50, 32, 128, 256, bi=True, quick=True),
            _shape(100, 16, 64, 128, layers=2, bi=True),
            _shape(100, 32, 80, 256, bi=True),
            _shape(100, 32, 80, 256, bi=True, packed=True),
            *(
                _shape(t, b, i, h, bi=bi, dtype=dtype, devices=("cuda",), quick=b == 32 and not bi)
                for t, b, i, h in _GPU_SIZES
                for bi in (False, True)
                for dtype in ("float32", "float16")
            ),
        ),
        modes=("train", "fwd"),
        description=(
            "tandem.nn.LSTM vs torch.nn.LSTM (oneDNN, and native with mkldnn disabled): training step "
            "(fwd + bwd incl. dx) and no-grad forward"
        ),
    )
)

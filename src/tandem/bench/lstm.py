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

import functools

import torch

import tandem
from tandem.bench._rnn import GPU_SIZES, rnn_provider, rnn_shape
from tandem.bench.registry import OpBench, register

__all__ = ["LSTM_BENCH"]

# providers of this op: settings (TIME_LOOP, CUDA_GRAPHS) apply to its Triton kernels module
_provider = functools.partial(rnn_provider, kernels="tandem.ops.lstm.triton")


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
            rnn_shape(50, 32, 128, 256, quick=True),
            rnn_shape(50, 32, 128, 256, bi=True, quick=True),
            rnn_shape(100, 16, 64, 128, layers=2, bi=True),
            rnn_shape(100, 32, 80, 256, bi=True),
            rnn_shape(100, 32, 80, 256, bi=True, packed=True),
            *(
                rnn_shape(t, b, i, h, bi=bi, dtype=dtype, devices=("cuda",), quick=b == 32 and not bi)
                for t, b, i, h in GPU_SIZES
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

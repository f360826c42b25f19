"""``tandem bench --op gru``: tandem.nn.GRU against torch.nn.GRU, one training step or one forward.

A training step is forward + backward of ``out.sum() + h_n.sum()`` down to the input, every parameter
and nothing else (no optimizer). A packed shape feeds a PackedSequence whose lengths are spread
evenly over [T/2, T]; its padded twin (same T, B, sizes) shows what packing saves.
"""

from __future__ import annotations

import functools

import torch

import tandem
from tandem.bench._rnn import GPU_SIZES, rnn_provider, rnn_shape
from tandem.bench.registry import OpBench, register

__all__ = ["GRU_BENCH"]

# providers of this op: settings (TIME_LOOP, CUDA_GRAPHS) apply to its Triton kernels module
_provider = functools.partial(rnn_provider, kernels="tandem.ops.gru.triton")


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
            rnn_shape(50, 32, 128, 256, quick=True),
            rnn_shape(50, 32, 128, 256, bi=True, quick=True),
            rnn_shape(100, 16, 64, 128, layers=2, bi=True),
            rnn_shape(200, 64, 256, 512),
            rnn_shape(100, 32, 80, 256, bi=True),
            rnn_shape(100, 32, 80, 256, bi=True, packed=True),
            *(
                rnn_shape(t, b, i, h, bi=bi, dtype=dtype, devices=("cuda",), quick=b == 32 and not bi)
                for t, b, i, h in GPU_SIZES
                for bi in (False, True)
                for dtype in ("float32", "bfloat16")
            ),
        ),
        modes=("train", "fwd"),
        description="tandem.nn.GRU vs torch.nn.GRU: training step (fwd + bwd incl. dx) and no-grad forward",
    )
)

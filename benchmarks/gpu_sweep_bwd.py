"""Block sizes of the per-step backward kernel of tandem's GRU (`_gru_bwd_step`: BLOCK_J x BLOCK_K) or LSTM
(`_lstm_bwd_kernel`: BLOCK_H x BLOCK_R), swept on a GPU: a training step of tandem.nn.GRU / LSTM (CUDA
graphs on, so the host's launches drop out) with each block pair and num_warps, its gradients checked
against the default blocks' (the same kernel math, so equal up to summation order).

    PYTHONPATH=src python3 benchmarks/gpu_sweep_bwd.py [--cell gru lstm] [--shape T100-B32-I512-H512 ...]
        [--dtype float32 bfloat16] [--split [--no-product-sweep]]

``--split`` instead times the split backward step (``BWD_SPLIT``: the gate gradients, then the product,
two launches a step) against the fused one, with and without CUDA graphs, then sweeps the product's
blocks (BLOCK_K x BLOCK_N, num_warps) with graphs.

Prints one line per variant as it finishes (milliseconds per step, median of 20), the default first. The
GRU's blocks of f296a74 came from this sweep (then named gpu_sweep_gru_bwd.py). A dry run on the CPU (the
kernels under Triton's interpreter, in float64 so that the LSTM takes them (float32 runs oneDNN's there);
wall-clock times that mean nothing):

    TRITON_INTERPRET=1 TANDEM_FORCE_TRITON=1 PYTHONPATH=src python3 benchmarks/gpu_sweep_bwd.py \\
        --device cpu --shape T3-B4-I8-H16 --dtype float64 --blocks 16 --warps 4
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from gpu_profile import _parse_shape, step_times


def _step_time(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = model(x)
        out.float().square().sum().backward()

    times = step_times(step, x.device.type)
    return statistics.median(times), [x.grad.float()] + [p.grad.float() for p in model.parameters()]


def _variant(label: str, module, model, x, base: list[torch.Tensor], reference_ms: float) -> None:
    """Time one variant (the module's settings as patched), its gradients checked against ``base``."""
    module.STEP_GRAPHS = module.StepGraphs()  # no graph recorded with other settings is replayed
    try:
        ms, grads = _step_time(model, x)
    except Exception as e:  # a build that fails (resources) is a result too
        print(f"{label}: failed: {type(e).__name__}: {e}"[:200], flush=True)
        return
    err = max(((g - b).norm() / b.norm()).item() for g, b in zip(grads, base))
    print(f"{label}: {ms:.3f} ms ({reference_ms / ms:.2f}x), rel. diff {err:.1e}", flush=True)


def _sweep(cell: str, shape: dict[str, int], dtype: torch.dtype, device: str, blocks, warps) -> None:
    import tandem
    from tandem.ops.gru import triton as gru_triton
    from tandem.ops.lstm import triton as lstm_triton

    module = gru_triton if cell == "gru" else lstm_triton
    # the LSTM's blocks: BLOCK_H walks the gates' columns, BLOCK_R is a program's columns of dh_prev
    inner, outer = ("BLOCK_J", "BLOCK_K") if cell == "gru" else ("BLOCK_H", "BLOCK_R")
    module.CUDA_GRAPHS = device == "cuda"
    module.BWD_SPLIT = False  # the fused step, whose blocks these are (graphs alone would split it)
    module.TIME_LOOP = "per-step"
    default_meta = module._step_meta
    torch.manual_seed(0)
    layer = {"gru": tandem.nn.GRU, "lstm": tandem.nn.LSTM}[cell]
    model = layer(shape["I"], shape["H"], device=device, dtype=dtype)
    x = torch.randn(shape["T"], shape["B"], shape["I"], device=device, dtype=dtype, requires_grad=True)
    base_ms, base = _step_time(model, x)
    default = default_meta("bwd", dtype, shape["B"], shape["H"], *([shape["H"]] if cell == "lstm" else []))
    name = str(dtype).removeprefix("torch.")
    print(f"{cell} {name} default {default}: {base_ms:.3f} ms", flush=True)
    try:
        for block_in, block_out, num_warps in itertools.product(blocks, blocks + [128], warps):

            def meta(kind, *args, _i=block_in, _o=block_out, _w=num_warps):
                out = default_meta(kind, *args)
                if kind == "bwd":
                    out |= {inner: _i, outer: _o, "num_warps": _w}
                return out

            module._step_meta = meta
            label = f"{cell} {name} {inner[6:]}{block_in} {outer[6:]}{block_out} w{num_warps}"
            _variant(label, module, model, x, base, base_ms)
    finally:
        module._step_meta = default_meta


def _split(
    cell: str, shape: dict[str, int], dtype: torch.dtype, device: str, blocks, warps, products: bool = True
) -> None:
    import tandem
    from tandem.ops import _triton_rnn
    from tandem.ops.gru import triton as gru_triton
    from tandem.ops.lstm import triton as lstm_triton

    module = gru_triton if cell == "gru" else lstm_triton
    module.TIME_LOOP = "per-step"
    torch.manual_seed(0)
    layer = {"gru": tandem.nn.GRU, "lstm": tandem.nn.LSTM}[cell]
    model = layer(shape["I"], shape["H"], device=device, dtype=dtype)
    x = torch.randn(shape["T"], shape["B"], shape["I"], device=device, dtype=dtype, requires_grad=True)
    name = str(dtype).removeprefix("torch.")
    base = None
    for graphs in [False, True] if device == "cuda" else [False]:
        module.CUDA_GRAPHS = graphs
        times = {}
        for split in (False, True):
            module.BWD_SPLIT = split
            module.STEP_GRAPHS = module.StepGraphs()
            times[split], grads = _step_time(model, x)
            base = base if base is not None else grads
            err = max(((g - b).norm() / b.norm()).item() for g, b in zip(grads, base))
            label = f"{cell} {name} {'split' if split else 'fused'} graphs={graphs}"
            print(f"{label}: {times[split]:.3f} ms, rel. diff {err:.1e}", flush=True)
        print(f"{cell} {name} graphs={graphs}: split {times[False] / times[True]:.2f}x the fused", flush=True)
    if not products:
        module.BWD_SPLIT = None
        return
    module.BWD_SPLIT = True
    default = _triton_rnn.product_meta
    try:
        for block_k, block_n, num_warps in itertools.product(blocks + [128], blocks, warps):

            def meta(*args, _k=block_k, _n=block_n, _w=num_warps, **kwargs):
                return default(*args, **kwargs) | {"BLOCK_K": _k, "BLOCK_N": _n, "num_warps": _w}

            module.product_meta = meta
            label = f"{cell} {name} split product K{block_k} N{block_n} w{num_warps}"
            _variant(label, module, model, x, base, times[True])
    finally:
        module.product_meta = default
        module.BWD_SPLIT = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", nargs="+", default=["gru", "lstm"], choices=["gru", "lstm"])
    parser.add_argument("--shape", type=_parse_shape, nargs="+", default=[_parse_shape("T100-B32-I512-H512")])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--split", action="store_true", help="the split backward step against the fused")
    parser.add_argument(
        "--no-product-sweep", action="store_true", help="with --split: the two steps, no block sweep"
    )
    args = parser.parse_args()
    for shape in args.shape:
        if len(args.shape) > 1:
            print("shape " + "-".join(f"{k}{v}" for k, v in shape.items()), flush=True)
        for cell in args.cell:
            for name in args.dtype:
                blocks = (getattr(torch, name), args.device, args.blocks, args.warps)
                if args.split:
                    _split(cell, shape, *blocks, products=not args.no_product_sweep)
                else:
                    _sweep(cell, shape, *blocks)


if __name__ == "__main__":
    main()

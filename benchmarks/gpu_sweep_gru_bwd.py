"""Block sizes of the GRU's per-step backward kernel (`_gru_bwd_step`), swept on a GPU: a training step of
tandem.nn.GRU (CUDA graphs on, so the host's launches drop out) with each (BLOCK_J, BLOCK_K, num_warps),
its gradients checked against the default blocks' (same kernel math, so equal up to summation order).

    PYTHONPATH=src python3 benchmarks/gpu_sweep_gru_bwd.py [--shape T100-B32-I512-H512]
        [--dtype float32 bfloat16]

Prints one line per variant as it finishes (milliseconds per step, median of 20), the default first.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from gpu_profile import _parse_shape


def _step_time(gru: torch.nn.Module, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    def step() -> None:
        gru.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = gru(x)
        out.float().square().sum().backward()

    for _ in range(3):
        step()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), [x.grad.float()] + [p.grad.float() for p in gru.parameters()]


def main() -> None:
    import tandem
    from tandem.ops.gru import triton as gru_triton

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=_parse_shape, default=_parse_shape("T100-B32-I512-H512"))
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    shape = args.shape
    gru_triton.CUDA_GRAPHS = True
    gru_triton.TIME_LOOP = "per-step"
    default_meta = gru_triton._step_meta
    for name in args.dtype:
        dtype = getattr(torch, name)
        torch.manual_seed(0)
        gru = tandem.nn.GRU(shape["I"], shape["H"], device="cuda", dtype=dtype)
        x = torch.randn(shape["T"], shape["B"], shape["I"], device="cuda", dtype=dtype, requires_grad=True)
        gru_triton._step_meta = default_meta
        base_ms, base = _step_time(gru, x)
        print(
            f"{name} default {default_meta('bwd', dtype, shape['B'], shape['H'])}: {base_ms:.3f} ms",
            flush=True,
        )
        for block_j, block_k, warps in itertools.product((16, 32, 64), (16, 32, 64, 128), (4, 8)):

            def meta(kind, dt, batch, hid, _j=block_j, _k=block_k, _w=warps):
                out = default_meta(kind, dt, batch, hid)
                if kind == "bwd":
                    out |= dict(BLOCK_J=_j, BLOCK_K=_k, num_warps=_w)
                return out

            gru_triton._step_meta = meta
            try:
                ms, grads = _step_time(gru, x)
            except Exception as e:  # a build that fails (resources) is a result too
                print(
                    f"{name} J{block_j} K{block_k} w{warps}: failed: {type(e).__name__}: {e}"[:200],
                    flush=True,
                )
                continue
            err = max(((g - b).norm() / b.norm()).item() for g, b in zip(grads, base))
            label = f"{name} J{block_j} K{block_k} w{warps}"
            print(f"{label}: {ms:.3f} ms ({base_ms / ms:.2f}x), rel. diff {err:.1e}", flush=True)
        gru_triton._step_meta = default_meta


if __name__ == "__main__":
    main()

"""Where a GPU training step of tandem.nn.GRU / LSTM goes, kernel by kernel (torch.profiler), next to
torch.nn's (cuDNN): the question the bench tables cannot answer. For a session with a lent GPU:

    PYTHONPATH=src python3 benchmarks/gpu_profile.py [--cell gru lstm] [--shape T100-B32-I512-H512]
        [--dtype float32] [--loops default graphs] [--rows 12]

Prints, per cell, time loop and torch: milliseconds per step (events, median of 20 after warm-up), then
the kernels sorted by total device time over 5 profiled steps (calls, total and mean microseconds).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile


def _parse_shape(text: str) -> dict[str, int]:
    match = re.fullmatch(r"T(\d+)-B(\d+)-I(\d+)-H(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a shape like T100-B32-I512-H512, got {text!r}")
    return dict(zip("TBIH", map(int, match.groups())))


def _module(cell: str, stack: str, shape: dict[str, int], dtype: torch.dtype) -> torch.nn.Module:
    import tandem

    cls = {
        "tandem": {"gru": tandem.nn.GRU, "lstm": tandem.nn.LSTM},
        "torch": {"gru": torch.nn.GRU, "lstm": torch.nn.LSTM},
    }
    return cls[stack][cell](shape["I"], shape["H"], device="cuda", dtype=dtype)


def _set_loop(cell: str, loop: str) -> None:
    from tandem.ops.gru import triton as gru_triton
    from tandem.ops.lstm import triton as lstm_triton

    module = gru_triton if cell == "gru" else lstm_triton
    module.CUDA_GRAPHS = loop == "graphs"
    module.TIME_LOOP = "per-step" if loop == "per-step" else "auto"


def step_times(step, device: str, runs: int = 20) -> list[float]:
    """Milliseconds of ``runs`` calls of ``step`` after 3 warm-up calls: CUDA events on a GPU, the wall
    clock on the CPU (where only a dry run under Triton's interpreter happens)."""
    for _ in range(3):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - began))
    return times


def _profile(name: str, model: torch.nn.Module, x: torch.Tensor, rows: int) -> None:
    def step() -> None:
        out, _ = model(x)
        out.float().square().sum().backward()

    times = step_times(step, "cuda")
    print(f"\n== {name}: {statistics.median(times):.3f} ms per step (median of 20; min {min(times):.3f})")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time)
    total = sum(sum(v) for v in kernels.values())
    if not kernels:  # kernels not among the events in this torch: its own table instead
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows))
        return
    print(f"device time in kernels: {total / 5 / 1000:.3f} ms per step")
    for kernel, us in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        per_step, mean = sum(us) / 5, statistics.mean(us)
        print(f"  {len(us) / 5:7.1f} calls/step  {per_step:9.1f} us/step  {mean:8.2f} us  {kernel[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", nargs="+", default=["gru", "lstm"], choices=["gru", "lstm"])
    parser.add_argument("--shape", type=_parse_shape, default=_parse_shape("T100-B32-I512-H512"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--loops", nargs="+", default=["default", "graphs"], choices=["default", "graphs", "per-step"]
    )
    parser.add_argument("--rows", type=int, default=12)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(torch.__version__, torch.cuda.get_device_name(), args.shape, args.dtype)
    for cell in args.cell:
        gen = torch.Generator(device="cuda").manual_seed(0)
        shape = args.shape
        x = torch.randn(shape["T"], shape["B"], shape["I"], device="cuda", dtype=dtype, generator=gen)
        x.requires_grad_()
        for loop in args.loops:
            _set_loop(cell, loop)
            _profile(f"tandem {cell} {loop}", _module(cell, "tandem", shape, dtype), x, args.rows)
        _profile(f"torch {cell} (cuDNN)", _module(cell, "torch", shape, dtype), x, args.rows)


if __name__ == "__main__":
    main()

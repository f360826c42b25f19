"""Side-by-side CPU timing of the ``adagrad`` bench providers, until ``tandem bench`` runs them.

    PYTHONPATH=src python benchmarks/adagrad_quick.py --threads 2 --rounds 15

Every round times each provider once (``torch.utils.benchmark.Timer``, a block of ``--number`` steps),
in turn, so that load from other processes spreads over all providers; the table gives the median and
20th/80th percentiles of the per-step time over the rounds, and the baseline's median over each median.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.utils.benchmark import Timer

from tandem.bench.adagrad import ADAGRAD_BENCH


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=5, help="steps per timed block")
    parser.add_argument("--providers", nargs="*", default=None)
    parser.add_argument("--shapes", nargs="*", default=None)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    bench = ADAGRAD_BENCH
    device = torch.device("cpu")
    names = args.providers or list(bench.providers)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds x {args.number} steps")
    print(f"{'shape':12s} {'provider':14s} {'median ms':>10s} {'p20':>8s} {'p80':>8s} {'speedup':>8s}")
    for shape in bench.shapes:
        if args.shapes and shape.id not in args.shapes:
            continue
        thunks = {name: bench.providers[name](dict(shape.params), device, "step") for name in names}
        for thunk in thunks.values():  # warm-up: first steps allocate
            for _ in range(3):
                thunk()
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name, thunk in thunks.items():
                timer = Timer("thunk()", globals={"thunk": thunk}, num_threads=args.threads)
                times[name].append(timer.timeit(args.number).median * 1e3)
        base = statistics.median(times[bench.baseline]) if bench.baseline in times else float("nan")
        for name in names:
            v = sorted(times[name])
            med = statistics.median(v)
            print(
                f"{shape.id:12s} {name:14s} {med:10.2f} {_quantile(v, 0.2):8.2f} {_quantile(v, 0.8):8.2f} "
                f"{base / med:7.2f}x"
            )


if __name__ == "__main__":
    main()

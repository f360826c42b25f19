"""Optimizer step of ``tandem.parallel.ZeroAdagrad`` against ``tandem.optim.Adagrad`` on spawned Gloo ranks.

    PYTHONPATH=src python benchmarks/zero_adagrad.py --world 2 --reps 40

Each rank (one thread) holds the same parameters and gradients (set directly: no backward) for both
optimizers; every repetition steps each once, in alternating order, each step started together on all
ranks (a barrier, not timed), and a step takes as long as its slowest rank. ``full`` is every rank
updating every parameter (what DDP + Adagrad does), ``zero`` the sharded update plus the broadcasts of
the shards. Also printed: the bytes of ``sum`` state each rank holds.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tandem
from tandem.bench.ddp import GRUNet


def _models() -> dict[str, list[list[int]]]:
    return {
        "gru-H256-L3-bi (11.1 MiB, 26 tensors)": [list(p.shape) for p in GRUNet(80, 256, 3, 29).parameters()],
        "8 x [1024, 1024] (32 MiB)": [[1024, 1024]] * 8,
        "100 x [256, 256] (25 MiB)": [[256, 256]] * 100,
    }


def _rank_main(rank: int, world: int, store: str, out: str, reps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    res: dict[str, Any] = {}
    for name, shapes in _models().items():
        torch.manual_seed(0)
        pa = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
        pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
        for p, q in zip(pa, pb):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opts = {"zero": tandem.parallel.ZeroAdagrad(pa, lr=1e-3), "full": tandem.optim.Adagrad(pb, lr=1e-3)}
        times: dict[str, list[float]] = {"zero": [], "full": []}
        for i in range(reps + 3):  # 3 warm-up repetitions
            for n in ("zero", "full") if i % 2 else ("full", "zero"):
                dist.barrier()
                start = time.perf_counter()
                opts[n].step()
                if i >= 3:
                    times[n].append(time.perf_counter() - start)
        state_bytes = {
            n: sum(opts[n].state[p]["sum"].numel() * p.element_size() for p in ps)
            for n, ps in (("zero", pa), ("full", pb))
        }
        same = all(torch.allclose(p, q, rtol=1e-5, atol=1e-7) for p, q in zip(pa, pb))
        res[name] = {"times": times, "state_bytes": state_bytes, "same": same}
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    os._exit(0)


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-zero-bench-") as tmp:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_rank_main, args=(r, args.world, str(Path(tmp) / "store"), tmp, args.reps))
            for r in range(args.world)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + 600
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        results = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(args.world)]
    mib = 2**20
    print(f"world {args.world}, {args.reps} repetitions; p50 (p20-p80) of the slowest rank's step")
    for name in results[0]:
        cells = []
        for n in ("full", "zero"):
            xs = [max(v) for v in zip(*(res[name]["times"][n] for res in results))]
            p20, p50, p80 = (1e3 * q for q in (_pct(xs, 0.2), statistics.median(xs), _pct(xs, 0.8)))
            cells.append(f"{n} {p50:.2f} ms ({p20:.2f}-{p80:.2f})")
        held = "/".join(f"{res[name]['state_bytes']['zero'] / mib:.2f}" for res in results)
        print(
            f"{name}: {', '.join(cells)}; sum state per rank: full "
            f"{results[0][name]['state_bytes']['full'] / mib:.2f} MiB, zero {held} MiB; "
            f"parameters agree: {all(res[name]['same'] for res in results)}"
        )


if __name__ == "__main__":
    main()

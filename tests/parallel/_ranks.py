"""Spawning the Gloo ranks of a multi-process test: every wait bounded, every process killed at the end,
whatever happened. Each rank saves its result to ``<tmp>/rank<r>.pt``."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def spawn_ranks(
    target: Callable[..., None],
    args: Callable[[int], tuple[Any, ...]],
    world: int,
    tmp: Path,
    timeout_s: float,
    unwaited: int | None = None,
) -> list[Any]:
    """Run ``target(*args(r))`` in a spawned process per rank ``r``; each rank's saved result, None where
    a rank left none. Rank ``unwaited`` (one meant to stall) is not waited for, only killed."""
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args(r), daemon=True) for r in range(world)]
    # the ranks are CPU processes, as in CI, also on a machine with a GPU: there torch's PowerSGD hook
    # synchronises CUDA with the CPU tensors' device and raises (in torch's DDP as in ours)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        try:
            for p in procs:
                p.start()
        finally:
            if visible is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
        deadline = time.monotonic() + timeout_s
        for r, p in enumerate(procs):
            if r != unwaited:
                p.join(max(0.0, deadline - time.monotonic()))
    finally:
        late = set()
        for r, p in enumerate(procs):
            if p.pid is None:  # never started
                continue
            if p.is_alive():
                late.add(r)
                p.kill()
            p.join(5)
    paths = [tmp / f"rank{r}.pt" for r in range(world)]
    for r, (p, path) in enumerate(zip(procs, paths)):
        if not path.exists() and r != unwaited:  # why, for the failing test's captured output
            why = "still running at the deadline" if r in late else f"exit code {p.exitcode}"
            print(f"spawn_ranks: rank {r} left no result ({why}; {timeout_s:.0f} s allowed)", file=sys.stderr)
    return [torch.load(path, weights_only=False) if path.exists() else None for path in paths]


def join_group(rank: int, world: int, store: str) -> None:
    """A spawned rank's set-up: one thread, deterministic algorithms (fresh ``torch.empty`` memory is NaN,
    as in conftest.py: a slot left unwritten would show), and the Gloo group through the file ``store``
    with a 60 s timeout."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )

"""The process group of a training run started by torchrun (or a single process), and how it ends."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.asr.interrupt import Background
from tandem.ops.syncbn import sum_over_ranks

__all__ = ["Group", "WorkerCores", "pick_device", "pin_to_cores", "rank_threads"]


def torchrun_int(name: str, default: int) -> int:
    """torchrun's ``name`` variable (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) in a process it started
    (``WORLD_SIZE`` set), else ``default``: one left in the environment of a single process is not its."""
    return int(os.environ.get(name, default)) if "WORLD_SIZE" in os.environ else default


def pick_device(choice: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` (this rank's GPU, by ``LOCAL_RANK``) or ``"auto"`` (CUDA when there is one)."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("tandem train: error: --device cuda: CUDA is not available")
        return torch.device("cuda", torchrun_int("LOCAL_RANK", 0))
    return torch.device("cpu")


def rank_threads(threads: int | None) -> int:
    """``threads``, or by default this process's share of the machine's cores: the cores over the processes
    torchrun started on this node (``LOCAL_WORLD_SIZE``), at least one."""
    return threads or max(1, (os.cpu_count() or 1) // torchrun_int("LOCAL_WORLD_SIZE", 1))


def pin_to_cores(threads: int) -> list[int] | None:
    """Keep this process (and the threads it starts from now on: Gloo's, torch's) on cores of its own: the
    ``threads`` cores from ``LOCAL_RANK * threads`` of those it may use, when every rank of the node fits
    (``LOCAL_WORLD_SIZE * threads`` of them). Returns the cores, or None when nothing was pinned (a single
    process, ranks that do not fit, or no ``sched_setaffinity``).

    Call it before the process group exists. Unpinned, a rank's communication threads are woken on
    whichever core the scheduler picks, often the one where the other rank computes: the speech
    recognizer's 2-rank step under torchrun took 135-148 ms unpinned against 124-128 ms pinned (2 cores,
    one thread a rank). DataLoader workers started afterwards would inherit the rank's cores: give them
    :class:`WorkerCores` of the cores from before."""
    if not (hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")):
        return None
    local_rank = torchrun_int("LOCAL_RANK", 0)
    local_world = torchrun_int("LOCAL_WORLD_SIZE", 1)
    cores = sorted(os.sched_getaffinity(0))
    if local_world < 2 or local_world * threads > len(cores):
        return None
    mine = cores[local_rank * threads : (local_rank + 1) * threads]
    os.sched_setaffinity(0, mine)
    return mine


class WorkerCores:
    """A DataLoader ``worker_init_fn`` that lets a pinned rank's worker run on ``cores`` (those the rank
    had before :func:`pin_to_cores`), wherever there is room, while the rank keeps to its own."""

    def __init__(self, cores: list[int]) -> None:
        self.cores = list(cores)

    def __call__(self, worker_id: int) -> None:
        os.sched_setaffinity(0, self.cores)


def _attempt_store(rank: int, world: int, timeout: float) -> dict:
    """``init_process_group`` arguments that give each torchrun restart its own keys in the agent's store.

    torchrun's agent keeps one TCPStore for the whole launch and hands it to every attempt's workers; the
    process groups of an attempt find each other's addresses there under the same keys as the attempt
    before, so a restarted rank could read a dead rank's address and retry connecting to it until the
    timeout (seen with Gloo: 'failed to connect ... Connection refused' after a worker was killed).
    A prefix per attempt keeps them apart. Outside torchrun's agent store: torch's own env:// set-up."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"tandem/attempt_{attempt}", store), "rank": rank, "world_size": world}


class Group:
    """Rank, world size and the few collectives a training loop needs (no-ops when alone).

    Joins the default process group from torchrun's environment (Gloo on CPUs, NCCL on GPUs) when the
    world has more than one process.
    """

    def __init__(self, device: torch.device, timeout: float) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_world = torchrun_int("LOCAL_WORLD_SIZE", 1)
        self.device = device
        # how often the ranks meet while rank 0 works alone (see from_lead): well inside the timeout
        self.heartbeat = min(1.0, timeout / 10)
        if device.type == "cuda":  # this rank's GPU current: where NCCL's and Triton's work is launched
            torch.cuda.set_device(device)
        if self.world > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, timeout=timedelta(seconds=timeout), **_attempt_store(self.rank, self.world, timeout)
            )

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ranks (float64), bitwise the same on every rank. Every training step
        sums its loss and flags: through tandem's sum of small tensors (on the CPU an all_gather whose
        wait is polled), which took 0.34-0.50 ms against 0.62-0.93 ms for a polled Gloo all_reduce of the
        same tensor (2 ranks on the 2-core machine, computing between the calls)."""
        if self.world == 1:
            return values
        return sum_over_ranks(torch.tensor(values, dtype=torch.float64, device=self.device)).tolist()

    def max(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def broadcast(self, obj: object) -> object:
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def from_lead(self, compute: Callable[[], object]) -> object:
        """``compute()`` run on rank 0 alone, its result on every rank. While it runs, every rank takes part
        in a small collective each :attr:`heartbeat` seconds, so no rank waits in one for longer than the
        collective timeout however long it takes (the check of a manifest of a few hundred thousand
        recordings takes minutes: the others waited for it in one broadcast and failed after --timeout,
        and so did every torchrun restart). An exception of ``compute`` is raised on rank 0, and a
        RuntimeError saying so on the others."""
        if self.world == 1:
            return compute()
        work = Background(compute, "tandem-from-lead") if self.lead else None
        while not self.sum([float(work is not None and work.done)])[0]:
            time.sleep(self.heartbeat)
        if work is not None:
            try:
                value = work.result()
            except BaseException:
                self.broadcast(False)
                raise
            self.broadcast(True)
            return self.broadcast(value)
        if not self.broadcast(None):
            raise RuntimeError("rank 0 failed while the other ranks waited for it (its error says why)")
        return self.broadcast(None)

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def leave(self, code: int) -> None:
        """End a rank of a finished multi-process run at once, without interpreter shutdown.

        Gloo's worker threads release a collective's tensors after the caller has moved on, and in this
        torch that takes the GIL even while Python still holds the tensor. A worker doing so while the
        interpreter shuts down is killed inside C++ and aborts the process ("terminate called without an
        active exception": 3 of 183 runs of tandem train, where the metrics all_reduce is the last
        collective). In a two-rank script that exits right after an all_reduce: 9 aborts in 120 runs;
        keeping the tensor alive, 5 in 90; a barrier before leaving did no better in tandem train (1 in 66);
        leaving this way, none in 120. destroy_process_group does not stop the threads:
        torch.distributed.nn, imported with torch._dynamo on torch.optim's first use, keeps the default
        group in its functions' defaults. Everything this rank wrote is closed by now; only the standard
        streams need flushing.
        """
        if self.world > 1:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

"""``tandem bench --op train``: the whole training job, tandem's parts against torch's, side by side.

One process group (``world`` ranks on 127.0.0.1, Gloo, started as torchrun would start them) trains the
speech recognizer of ``tandem train`` twice over, once from tandem's parts and once from PyTorch's
(:class:`tandem.asr.training.Run`: torch.nn.GRU/LSTM, BatchNorm1d, torch.optim.Adagrad with
``fused=True``, torch's DistributedDataParallel), on the same utterances in the same order from the same
seed. Their epochs alternate (the order swapping every epoch), so the load of the machine falls on both
alike; each epoch's training time is one sample, and after the last epoch both models are scored on the
same test set. The summary under the table gives the seconds per epoch and the WER each reached.

On a GPU the ranks are one per GPU (NCCL): the CUDA shapes take one process, which any one GPU runs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from tandem.bench.registry import OpBench, Shape, register

__all__ = ["TRAIN_BENCH", "RESULTS", "run_group", "summary"]

GROUP_TIMEOUT_S = 3600.0
RESULTS: dict[str, dict[str, Any]] = {}  # shape id -> per-stack epoch seconds and final error rates


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out_dir: str, p: dict[str, Any]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    # tqdm's default lock is a multiprocessing one: a named semaphore that os._exit below never unlinks,
    # which the runner's resource tracker then reported as leaked. The rank's bars need a thread lock only.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    result: dict[str, Any]
    try:
        from tandem.asr.corpus import load_spoken_digits
        from tandem.asr.distributed import Group, pin_to_cores
        from tandem.asr.model import ModelConfig
        from tandem.asr.training import Run, TrainConfig, digit_sets

        pin_to_cores(p["threads"])  # as tandem train's ranks are, before torch's threads and Gloo's start
        torch.set_num_threads(p["threads"])
        device = torch.device("cuda", rank) if p["device"] == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = Group(device, timeout=300.0)
        # tandem train's defaults on the customary split (no augmentation there)
        config = TrainConfig(
            model=ModelConfig(cell=p["cell"], hidden=p["hidden"], layers=p["layers"]),
            epochs=p["epochs"],
            augment=False,
        )
        recordings = load_spoken_digits()
        data = digit_sets(recordings)
        runs = {stack: Run(config, group, data, stack) for stack in ("tandem", "torch")}
        seconds: dict[str, list[float]] = {stack: [] for stack in runs}
        for epoch in range(p["epochs"]):
            for stack in list(runs)[epoch % 2 :] + list(runs)[: epoch % 2]:
                group.barrier()
                start = time.perf_counter()
                runs[stack].train_epoch()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds[stack].append(group.max([time.perf_counter() - start])[0])
        rates = {stack: run.evaluate()[0].as_tuple() for stack, run in runs.items()}
        result = {"seconds": seconds, "rates": rates}
    except Exception:
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # no interpreter shutdown with Gloo threads about (see tandem.asr.distributed.Group.leave)


def run_group(p: dict[str, Any]) -> dict[str, Any]:
    """Spawn ``p["world"]`` ranks that train both stacks; rank 0's result (raises if a rank failed)."""
    world = p["world"]
    with tempfile.TemporaryDirectory(prefix="tandem-bench-train-") as tmp:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, port, tmp, p), daemon=True) for r in range(world)
        ]
        try:
            for proc in procs:
                proc.start()
            deadline = time.monotonic() + GROUP_TIMEOUT_S
            for proc in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.pid is not None and proc.is_alive():
                    proc.kill()
                    proc.join(5)
        results = []
        for r in range(world):
            path = Path(tmp) / f"rank{r}.pt"
            if not path.exists():
                raise RuntimeError(f"bench train: rank {r} of {world} left no result (crashed or timed out)")
            results.append(torch.load(path, weights_only=False))
    for r, res in enumerate(results):
        if "error" in res:
            raise RuntimeError(f"bench train: rank {r} failed:\n{res['error']}")
    return results[0]


_CACHE: dict[tuple, dict[str, Any]] = {}


def _provider(stack: str):
    def factory(params: dict[str, Any], device: torch.device, mode: str):
        if device.type != params["device"]:
            raise ValueError(f"bench train: shape {params['id']} runs on {params['device']}, got {device}")
        # the ranks share the runner's threads (two ranks on the default two threads: one each)
        p = {**params, "threads": max(1, torch.get_num_threads() // params["world"])}
        key = tuple(sorted(p.items()))

        def thunk() -> list[float]:
            if key not in _CACHE:  # the first provider of a shape trains both stacks
                _CACHE[key] = RESULTS[params["id"]] = run_group(p)
            return _CACHE[key]["seconds"][stack]

        return thunk

    return factory


def _shape(
    cell: str,
    epochs: int,
    quick: bool = False,
    world: int = 2,
    hidden: int = 128,
    layers: int = 3,
    device: str = "cpu",
) -> Shape:
    id_ = f"asr-{cell}-H{hidden}-L{layers}-w{world}-{epochs}ep" + ("-cuda" if device == "cuda" else "")
    params = dict(id=id_, cell=cell, hidden=hidden, layers=layers, world=world, epochs=epochs, device=device)
    return Shape(id_, params, quick=quick, devices=(device,))


def summary(rows: list[Any]) -> str:
    """Seconds per epoch, speedup and the test error rates each stack reached after the same epochs."""
    from tandem.asr.metrics import ErrorRates

    lines = []
    for shape in dict.fromkeys(r.shape for r in rows):
        res = RESULTS.get(shape)
        if res is None:
            continue
        sec = res["seconds"]
        ratios = sorted(a / b for a, b in zip(sec["torch"], sec["tandem"]))
        ours, theirs = (ErrorRates(*res["rates"][stack]) for stack in ("tandem", "torch"))
        median = statistics.median  # of an even count, the mean of the middle two
        lines.append(
            f"{shape}: seconds per epoch (median of {len(ratios)}) tandem {median(sec['tandem']):.1f}, "
            f"torch {median(sec['torch']):.1f}; per-epoch speedup median "
            f"{median(ratios):.2f}x (min {ratios[0]:.2f}x, max {ratios[-1]:.2f}x); after "
            f"{len(ratios)} epochs test WER tandem "
            f"{100 * ours.wer:.2f}%, torch {100 * theirs.wer:.2f}% (CER {100 * ours.cer:.2f}% / "
            f"{100 * theirs.cer:.2f}%, {ours.words} words)"
        )
    return "\n".join(lines)


TRAIN_BENCH = register(
    OpBench(
        op="train",
        providers={"torch": _provider("torch"), "tandem": _provider("tandem")},
        shapes=(
            _shape("gru", 2, quick=True),
            _shape("gru", 10),
            _shape("lstm", 10),
            _shape("gru", 6, quick=True, world=1, device="cuda"),
            _shape("lstm", 6, world=1, device="cuda"),
        ),
        modes=("train",),
        description="epochs of tandem train's speech recognizer, tandem's parts vs torch's, 2 Gloo ranks "
        "(one process on a GPU)",
        timing="self",
        extra={"summary": summary},
    )
)

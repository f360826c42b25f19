"""``tandem bench --op ddp``: tandem's DistributedDataParallel against torch's, on spawned Gloo ranks.

Each shape spawns one process group (2 ranks on 127.0.0.1, or 1 for the overhead shapes) that times
every provider, one step of each in turn: one step is ``zero_grad``, forward, loss and backward (the
gradients averaged over the ranks when it returns; no optimizer), each step started together on all
ranks (a barrier, not timed); a step takes as long as its slowest rank. The per-step times come back
to the runner (``timing="self"``).

Providers:
    torch          torch.nn.parallel.DistributedDataParallel, default settings (the baseline)
    torch-<n>MB    the same with bucket_cap_mb=n (its best bucket size is the one to beat)
    tandem         tandem.parallel.DistributedDataParallel, default settings
    local          the bare module, no communication: T_backward_alone
    allreduce      all-reduce of the model's gradients and nothing else: T_allreduce_alone. Each step
                   times one flat buffer and tandem's buckets back to back; the faster of the two by
                   median is used, with its time of every step. Tandem's last bucket alone is timed too:
                   what no overlap can hide, so the summary gives the efficiency it leaves at most.

Shapes:
    sleep-*  layers whose backward sleeps (the GIL released, no CPU used: the stand-in for a device
             computing) and then computes its real gradients (small matmuls), so on two shared CPU
             cores communication fights only with that; overlap efficiency =
             (T_backward_alone + T_allreduce_alone - T_step) / T_allreduce_alone.
    gru-*    the real model: a bidirectional tandem.nn.GRU stack with a linear head; here compute and
             Gloo do share the cores.
    *-w1     world size 1: the wrapper's overhead over the bare module.

The summary printed under the table gives the efficiencies and overheads.
"""

from __future__ import annotations

import datetime
import math
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tandem
from tandem.bench.registry import OpBench, Shape, register

__all__ = ["DDP_BENCH", "RESULTS", "summary", "run_group"]

TORCH_BUCKETS_MB = (1, 4, 10)
PROVIDERS = ("torch", *(f"torch-{mb}MB" for mb in TORCH_BUCKETS_MB), "tandem", "local", "allreduce")
GROUP_TIMEOUT_S = 600.0


# ----------------------------------------------------------------------------------------------
# models


class _SleepLinear(torch.autograd.Function):
    """``x @ w.T`` whose backward first sleeps ``seconds``: a layer whose backward takes that long
    without using the CPU, then produces its real gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.seconds = seconds
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        time.sleep(ctx.seconds)
        return grad @ weight, grad.t() @ x, None


class SleepNet(torch.nn.Module):
    """``layers`` square layers of ``width`` (``width**2`` weights each), each backward ``sleep_ms``."""

    def __init__(self, layers: int, width: int, sleep_ms: float) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(width, width) / math.sqrt(width)) for _ in range(layers)
        )
        self.seconds = sleep_ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = _SleepLinear.apply(x, w, self.seconds)
        return x


class GRUNet(torch.nn.Module):
    """A DeepSpeech-like stack: bidirectional tandem.nn.GRU layers and a linear output layer."""

    def __init__(self, inputs: int, hidden: int, layers: int, classes: int) -> None:
        super().__init__()
        self.rnn = tandem.nn.GRU(inputs, hidden, num_layers=layers, bidirectional=True)
        self.head = torch.nn.Linear(2 * hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out)


def _model_and_input(p: dict[str, Any]) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if p["model"] == "sleep":
        return SleepNet(p["layers"], p["width"], p["sleep_ms"]), torch.randn(p["batch"], p["width"])
    model = GRUNet(p["inputs"], p["hidden"], p["layers"], p["classes"])
    return model, torch.randn(p["T"], p["batch"], p["inputs"])


# ----------------------------------------------------------------------------------------------
# one rank


def _step_fn(wrapped: torch.nn.Module, module: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        module.zero_grad(set_to_none=True)
        wrapped(x).pow(2).mean().backward()

    return step


def _allreduce_fns(grads: list[torch.Tensor], buckets: list[list[int]]) -> dict[str, Callable[[], None]]:
    """The ways of all-reducing the gradients alone that the ``allreduce`` provider times each step."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    bufs = [torch.cat([grads[i].reshape(-1) for i in b]) for b in buckets]

    def one_flat() -> None:
        dist.all_reduce(flat)

    def bucketed() -> None:
        for work in [dist.all_reduce(b, async_op=True) for b in bufs]:
            work.wait()

    def last_bucket() -> None:
        dist.all_reduce(bufs[-1])

    return {"flat": one_flat, "buckets": bucketed, "last": last_bucket}


def _rank_main(rank: int, world: int, store: str, out_dir: str, p: dict[str, Any]) -> None:
    try:
        torch.set_num_threads(p["threads"])
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        steps: dict[str, Callable[[], None]] = {}
        x = None
        names = list(p.get("providers", PROVIDERS))
        for name in names:
            if name == "allreduce":
                continue
            model, x = _model_and_input(p)
            if name == "torch":
                wrapped = torch.nn.parallel.DistributedDataParallel(model)
            elif name.startswith("torch-"):
                mb = int(name.removeprefix("torch-").removesuffix("MB"))
                wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=mb)
            elif name == "tandem":
                wrapped = tandem.parallel.DistributedDataParallel(model)
                tandem_ddp = wrapped
            elif name.startswith("tandem-"):  # for experiments: tandem-<n>MB
                mb = float(name.removeprefix("tandem-").removesuffix("MB"))
                wrapped = tandem.parallel.DistributedDataParallel(model, bucket_cap_mb=mb)
            else:
                wrapped = model
            steps[name] = _step_fn(wrapped, model, x)
        for step in steps.values():  # warm-up: lazy init, torch's and tandem's bucket rebuilds
            for _ in range(p["warmup"]):
                dist.barrier()
                step()
        grads = [q.grad for q in tandem_ddp.module.parameters()]
        ar_fns = _allreduce_fns(grads, [b.members for b in tandem_ddp._buckets])
        times: dict[str, list[float]] = {name: [] for name in names if name != "allreduce"}
        tandem_stats = []
        for i in range(p["steps"]):
            # One step of each provider in turn, the order rotating: the neighbours' load, which comes
            # and goes, falls on all of them alike, and step i of each can be compared in pairs.
            for name in names[i % len(names) :] + names[: i % len(names)]:
                if name == "allreduce":
                    for method, fn in ar_fns.items():
                        dist.barrier()
                        start = time.perf_counter()
                        fn()
                        times.setdefault(f"allreduce-{method}", []).append(time.perf_counter() - start)
                    continue
                dist.barrier()
                start = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - start)
                if name == "tandem":
                    tandem_stats.append(tandem_ddp.stats())
        result: dict[str, Any] = {"times": times, "stats": tandem_stats}
    except Exception:
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # no process-group teardown to wait for


def run_group(p: dict[str, Any]) -> dict[str, Any]:
    """Spawn ``p["world"]`` ranks timing every provider (raises if any rank failed).

    A step's time is the slowest rank's (all started together): the time until every rank is done,
    which is what a data-parallel step costs; the bare module's time is taken the same way.
    """
    world = p["world"]
    with tempfile.TemporaryDirectory(prefix="tandem-bench-ddp-") as tmp:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, str(Path(tmp) / "store"), tmp, p), daemon=True)
            for r in range(world)
        ]
        try:
            for proc in procs:
                proc.start()
            deadline = time.monotonic() + GROUP_TIMEOUT_S
            for proc in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.pid is None:  # never started
                    continue
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
        results = []
        for r in range(world):
            path = Path(tmp) / f"rank{r}.pt"
            if not path.exists():
                raise RuntimeError(f"bench ddp: rank {r} of {world} left no result (crashed or timed out)")
            results.append(torch.load(path, weights_only=False))
    for r, res in enumerate(results):
        if "error" in res:
            raise RuntimeError(f"bench ddp: rank {r} failed:\n{res['error']}")
    times = {
        name: [max(per_rank) for per_rank in zip(*(res["times"][name] for res in results))]
        for name in results[0]["times"]
    }
    if "allreduce-flat" in times:
        # T_allreduce_alone: the faster way by median, and that way's time in every step. (Not the faster
        # of the two in each step: the smaller of two noisy draws runs below either way's typical time.)
        best = min(("flat", "buckets"), key=lambda m: statistics.median(times[f"allreduce-{m}"]))
        times["allreduce"] = times[f"allreduce-{best}"]
    return {**results[0], "times": times}


# ----------------------------------------------------------------------------------------------
# registry entry

_CACHE: dict[tuple, dict[str, Any]] = {}
RESULTS: dict[str, dict[str, Any]] = {}  # shape id -> per-step times and tandem's stats, for the summary


def _provider(name: str):
    def factory(params: dict[str, Any], device: torch.device, mode: str):
        if device.type != "cpu":
            raise ValueError(f"bench ddp: the Gloo benchmark runs on the CPU, got device {device}")
        # Ranks share the runner's threads (two ranks on the default two threads: one each).
        p = {**params, "threads": max(1, torch.get_num_threads() // params["world"])}
        key = tuple(sorted(p.items()))

        def thunk() -> list[float]:
            if key not in _CACHE:  # the first provider of a shape runs the group for all of them
                _CACHE[key] = RESULTS[params["id"]] = run_group(p)
            return _CACHE[key]["times"][name]

        return thunk

    return factory


def _sleep(layers: int, width: int, sleep_ms: float, world: int = 2, quick: bool = False) -> Shape:
    id_ = f"sleep-L{layers}-D{width}-{sleep_ms:g}ms" + ("-w1" if world == 1 else "")
    params = dict(model="sleep", layers=layers, width=width, sleep_ms=sleep_ms, batch=4, world=world)
    params.update(id=id_, steps=24, warmup=3)
    return Shape(id_, params, quick=quick, devices=("cpu",))


def _gru(hidden: int, layers: int, world: int = 2, quick: bool = False) -> Shape:
    id_ = f"gru-T50-B8-I80-H{hidden}-L{layers}-bi" + ("-w1" if world == 1 else "")
    params = dict(
        model="gru", inputs=80, hidden=hidden, layers=layers, classes=29, T=50, batch=8, world=world
    )
    params.update(id=id_, steps=16, warmup=3)
    return Shape(id_, params, quick=quick, devices=("cpu",))


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def summary(rows: Sequence[Any]) -> str:
    """Overlap efficiency per sleep shape, cost over the bare module for the others, tandem's stats().

    Each figure is the median over steps of the figure computed from that step's providers, which ran
    back to back (less noisy than a ratio of medians on a shared machine); rows of an earlier run
    (no per-step times here) fall back to their medians.
    """
    p50: dict[str, dict[str, float]] = {}
    for r in rows:
        p50.setdefault(r.shape, {})[r.provider] = r.p50_ms / 1e3
    lines = []
    for shape, med in p50.items():
        res = RESULTS.get(shape)
        t = res["times"] if res else {name: [v] for name, v in med.items()}
        steps = range(min(len(v) for v in t.values()))
        torch_best = min((n for n in med if n.startswith("torch")), key=lambda n: med[n])
        versus = (
            f"step p50 tandem {med['tandem'] * 1e3:.1f} ms vs torch's best bucket size ({torch_best}) "
            f"{med[torch_best] * 1e3:.1f} ms"
        )
        if not shape.startswith("sleep") or shape.endswith("-w1"):
            # Real compute (or one rank): what the wrapper costs over the bare module.
            over = {n: _median([t[n][i] / t["local"][i] - 1 for i in steps]) for n in ("tandem", torch_best)}
            lines.append(
                f"{shape}: step over the bare module: tandem {over['tandem']:+.1%}, {torch_best} "
                f"{over[torch_best]:+.1%}; {versus}"
            )
            continue
        eff = {
            n: _median([(t["local"][i] + t["allreduce"][i] - t[n][i]) / t["allreduce"][i] for i in steps])
            for n in t
            if n.startswith(("torch", "tandem"))
        }
        lines.append(
            f"{shape}: T_backward_alone {med['local'] * 1e3:.1f} ms, T_allreduce_alone "
            f"{med['allreduce'] * 1e3:.1f} ms; efficiency "
            + ", ".join(f"{n} {e:.2f}" for n, e in eff.items())
            + f"; {versus}"
        )
        if "allreduce-last" in t:
            ways = {m: _median(t[f"allreduce-{m}"]) * 1e3 for m in ("flat", "buckets", "last")}
            # The last bucket goes out when backward ends: T_step >= T_backward_alone + its all-reduce.
            bound = _median([1 - t["allreduce-last"][i] / t["allreduce"][i] for i in steps])
            per_step_min = _median(
                [
                    (t["local"][i] + m - t["tandem"][i]) / m
                    for i in steps
                    for m in [min(t["allreduce-flat"][i], t["allreduce-buckets"][i])]
                ]
            )
            lines.append(
                f"{shape}: all-reduce alone, p50: one flat buffer {ways['flat']:.1f} ms, tandem's buckets "
                f"{ways['buckets']:.1f} ms, its last bucket {ways['last']:.1f} ms: hiding all but the last "
                f"bucket gives efficiency <= {bound:.2f}; (tandem's efficiency with the faster way in each "
                f"step instead: {per_step_min:.2f})"
            )
    for shape in p50:
        res = RESULTS.get(shape)
        if res and res["stats"] and res["stats"][-1].buckets:
            st = res["stats"]
            lines.append(
                f"{shape}: tandem stats(), medians: backward "
                f"{_median([x.backward_s for x in st]) * 1e3:.1f} ms, "
                f"comm {_median([x.comm_s for x in st]) * 1e3:.1f} ms, wait after backward "
                f"{_median([x.wait_s for x in st]) * 1e3:.1f} ms, {st[-1].bytes_sent / 2**20:.1f} MiB "
                f"in {st[-1].buckets} buckets"
            )
    return "\n".join(lines)


DDP_BENCH = register(
    OpBench(
        op="ddp",
        providers={name: _provider(name) for name in PROVIDERS},
        shapes=(
            _sleep(8, 1024, 10.0, quick=True),
            _sleep(16, 768, 5.0),
            _gru(256, 3, quick=True),
            _gru(256, 3, world=1),
            _sleep(8, 1024, 10.0, world=1),
        ),
        modes=("train",),
        description="data-parallel step on 2 Gloo ranks: tandem vs torch DDP (bucket sizes), overlap",
        timing="self",
        extra={"summary": summary},
    )
)

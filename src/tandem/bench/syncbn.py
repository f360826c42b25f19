"""``tandem bench --op syncbn``: one training step (forward + backward) of batch norm on 2 Gloo ranks.

Each provider's thunk spawns the ranks once (FileStore rendezvous, 127.0.0.1 only), lets every rank
warm up and then time ``repeats`` steps, each started together after a barrier (not timed), and returns
rank 0's per-step seconds (``timing="self"``). The ranks share the runner's thread budget
(``threads // world`` each), so every provider pays the same CPU contention.

Providers:
    torch: ``torch.nn.BatchNorm1d`` on the local batch, no communication (the floor).
    allreduce-sum: the founding method: one all_reduce of per-rank sums and sums of squares forward,
        one of ``sum(dy)``, ``sum(dy * x)`` backward, torch's fused kernel for the normalisation;
        fast but wrong at large means (the merge cancels).
    tandem: ``tandem.nn.SyncBatchNorm``.
    allreduce-latency: the two small all_reduces alone (``2C + 1`` float64 and ``2C`` float32 values),
        no compute: the communication floor the issue's target refers to.
"""

from __future__ import annotations

import datetime
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.bench.registry import OpBench, Shape, register

__all__ = ["SYNCBN_BENCH"]

_TIMEOUT_S = 120


class _SumSquaresBN(torch.autograd.Function):
    """Sync batch norm by global sum and sum of squares (``var = E[x^2] - E[x]^2``): the baseline."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
        dims = [0, *range(2, x.dim())]
        n = x.numel() // x.shape[1]
        packed = torch.cat([x.sum(dims), (x * x).sum(dims), x.new_full((1,), n)])
        dist.all_reduce(packed)
        c = x.shape[1]
        total = packed[-1]
        mean = packed[:c] / total
        var = (packed[c : 2 * c] / total - mean * mean).clamp(min=0)
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            running_var.mul_(1 - momentum).add_(var * total / (total - 1), alpha=momentum)
        invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, weight, mean, invstd, total)
        return torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd, total = ctx.saved_tensors
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        sum_dy = dy.sum(dims)
        sum_dy_x = (dy * x).sum(dims)
        sum_dy_xhat = (sum_dy_x - mean * sum_dy) * invstd
        dw, db = sum_dy_xhat.clone(), sum_dy.clone()
        combined = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(combined)
        mean_dy, mean_dy_xhat = (combined / total).chunk(2)
        scale = (invstd * weight).view(shape)
        x_hat = (x - mean.view(shape)) * invstd.view(shape)
        dx = (dy - mean_dy.view(shape) - x_hat * mean_dy_xhat.view(shape)) * scale
        return dx, dw, db, None, None, None, None


class _SumSquaresModule(torch.nn.BatchNorm1d):
    def forward(self, x):
        args = (self.weight, self.bias, self.running_mean, self.running_var, 0.1, self.eps)
        return _SumSquaresBN.apply(x, *args)


def _step_fn(kind: str, p: dict[str, Any]):
    c = p["C"]
    if kind == "allreduce-latency":
        fwd = torch.zeros(2 * c + 1, dtype=torch.float64)
        bwd = torch.zeros(2 * c)

        def comm_only() -> None:
            dist.all_reduce(fwd)
            dist.all_reduce(bwd)

        return comm_only
    if kind == "torch":
        bn: torch.nn.Module = torch.nn.BatchNorm1d(c)
    elif kind == "allreduce-sum":
        bn = _SumSquaresModule(c)
    else:
        import tandem

        bn = tandem.nn.SyncBatchNorm(c)
    x = torch.randn(p["N"], c, p["L"], requires_grad=True)
    grad = torch.randn(p["N"], c, p["L"])

    def step() -> None:
        bn(x).backward(grad)
        x.grad = None
        bn.zero_grad(set_to_none=True)

    return step


def _rank_main(rank: int, world: int, store: str, out: str, kind: str, p: dict[str, Any]) -> None:
    torch.set_num_threads(p["threads"])
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=_TIMEOUT_S // 2),
    )
    try:
        torch.manual_seed(rank)
        step = _step_fn(kind, p)
        for _ in range(p["warmup"]):
            step()
        seconds = []
        for _ in range(p["repeats"]):
            dist.barrier()  # start together: a rank's wait in the collective is then communication only
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        if rank == 0:
            Path(out).write_text(json.dumps(seconds))
    finally:
        dist.destroy_process_group()


def _run_ranks(kind: str, p: dict[str, Any]) -> list[float]:
    """Spawn ``p["world"]`` ranks, wait at most ``_TIMEOUT_S`` (then kill them), return rank 0's times."""
    with tempfile.TemporaryDirectory(prefix="tandem-syncbn-bench-") as tmp:
        out = str(Path(tmp, "seconds.json"))
        ctx = mp.start_processes(
            _rank_main,
            args=(p["world"], str(Path(tmp, "store")), out, kind, p),
            nprocs=p["world"],
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + _TIMEOUT_S
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"syncbn bench: {kind} ranks did not finish in {_TIMEOUT_S} s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        return json.loads(Path(out).read_text())


def _provider(kind: str):
    def factory(p: dict[str, Any], device: torch.device, mode: str):
        if device.type != "cpu":
            raise ValueError(f"syncbn bench: only CPU tensors over Gloo here, got device {device}")
        params = dict(p, threads=max(1, torch.get_num_threads() // p["world"]))
        return lambda: _run_ranks(kind, params)

    return factory


def _shape(n: int, c: int, length: int, world: int = 2, quick: bool = False) -> Shape:
    params = dict(N=n, C=c, L=length, world=world, warmup=5, repeats=60)
    return Shape(f"N{n}-C{c}-L{length}-{world}ranks", params, quick=quick, devices=("cpu",))


SYNCBN_BENCH = register(
    OpBench(
        op="syncbn",
        providers={
            "torch": _provider("torch"),
            "allreduce-sum": _provider("allreduce-sum"),
            "tandem": _provider("tandem"),
            "allreduce-latency": _provider("allreduce-latency"),
        },
        shapes=(_shape(64, 256, 100, quick=True), _shape(16, 256, 100)),
        modes=("train",),
        timing="self",
        description="SyncBatchNorm fwd+bwd per rank on 2 Gloo ranks vs BatchNorm1d (no communication) "
        "and a sum/sum-of-squares all_reduce baseline",
    )
)

"""``tandem bench --op syncbn``: one training step (forward + backward) of batch norm on 2 Gloo ranks.

The ranks are spawned once per shape (FileStore rendezvous, 127.0.0.1 only) and time every provider
there, interleaved: repeat ``r`` runs each provider once, in an order rotated by ``r``, each step
started on all ranks together after a barrier (not timed). Interleaving matters on a shared machine:
timed one after the other, the same provider's p50 moved 2x between runs with the neighbours' load.
Each provider's thunk returns rank 0's per-step seconds (``timing="self"``); the first thunk of a shape
runs the ranks, the others take their share of that run. The ranks share the runner's thread budget
(``threads // world`` each).

Providers:
    torch: ``torch.nn.BatchNorm1d`` on the local batch, no communication (the floor).
    allreduce-sum: the founding method: one all_reduce of per-rank sums and sums of squares forward,
        one of ``sum(dy)``, ``sum(dy * x)`` backward, torch's fused kernel for the normalisation (written
        for speed: bmm dot products, no temporaries); fast but wrong at large means (the merge cancels).
    tandem: ``tandem.nn.SyncBatchNorm``.
    tandem-nocomm: tandem's kernels and autograd with the two collectives left out (each rank normalises
        by its own statistics): ``tandem - tandem-nocomm`` is what synchronizing costs.
    torch+comm: ``torch.nn.BatchNorm1d`` plus, after the forward and after the backward, the small
        collective that tandem's SyncBatchNorm issues there (results unused): a timing control for what
        any one-collective-per-direction design pays on these ranks, rank skew included.
    comm-latency: those two collectives alone (``2C + 1`` float64 and ``2C`` float32 values through
        :func:`tandem.ops.syncbn.sum_over_ranks`, an all_gather each on the CPU), no compute: the
        communication floor the issue's target refers to.
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
from tandem.ops.syncbn import sum_over_ranks

__all__ = ["SYNCBN_BENCH"]

_TIMEOUT_S = 300
_KINDS = ("torch", "allreduce-sum", "tandem", "tandem-nocomm", "torch+comm", "comm-latency")


class _SumSquaresBN(torch.autograd.Function):
    """Sync batch norm by global sums and sums of squares (``var = E[x^2] - E[x]^2``): the baseline,
    written to be fast on contiguous ``[N, C, L]`` CPU tensors (per-channel dot products as one bmm, no
    ``[N, C, L]`` temporary, torch's fused kernel for the normalisation)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
        n, c, length = x.shape
        frames = x.new_full((1,), n * length)
        sum_sq = torch.bmm(x.view(-1, 1, length), x.view(-1, length, 1)).view(n, c).sum(0)
        packed = torch.cat([x.sum((0, 2)), sum_sq, frames])
        dist.all_reduce(packed)
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
        n, c, length = x.shape
        dy = dy.contiguous()
        sum_dy = dy.sum((0, 2))
        sum_dy_x = torch.bmm(dy.view(-1, 1, length), x.view(-1, length, 1)).view(n, c).sum(0)
        sum_dy_xhat = (sum_dy_x - mean * sum_dy) * invstd
        dw, db = sum_dy_xhat.clone(), sum_dy.clone()
        combined = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(combined)
        mean_dy, mean_dy_xhat = (combined / total).chunk(2)
        # dx = a * dy + b * x + k per channel: three in-place passes
        a = invstd * weight
        b = -a * invstd * mean_dy_xhat
        k = -a * mean_dy - b * mean
        dx = dy * a.view(1, -1, 1)
        dx.add_(k.view(1, -1, 1)).addcmul_(x, b.view(1, -1, 1))
        return dx, dw, db, None, None, None, None


class _SumSquaresModule(torch.nn.BatchNorm1d):
    def forward(self, x):
        args = (self.weight, self.bias, self.running_mean, self.running_var, 0.1, self.eps)
        return _SumSquaresBN.apply(x, *args)


class _NoCommModule(torch.nn.BatchNorm1d):
    def forward(self, x):
        from tandem.ops.syncbn import _SyncBatchNorm

        args = (self.weight, self.bias, None, self.running_mean, self.running_var, True, 0.1, self.eps, None)
        return _SyncBatchNorm.apply(x, *args)


def _step_fn(kind: str, p: dict[str, Any]):
    c = p["C"]
    if kind == "comm-latency":
        fwd = torch.zeros(2 * c + 1, dtype=torch.float64)
        bwd = torch.zeros(2 * c)

        def comm_only() -> None:
            sum_over_ranks(fwd)
            sum_over_ranks(bwd)

        return comm_only
    if kind == "torch+comm":
        bn0 = torch.nn.BatchNorm1d(c)
        fwd = torch.zeros(2 * c + 1, dtype=torch.float64)
        bwd = torch.zeros(2 * c)
        x0 = torch.randn(p["N"], c, p["L"], requires_grad=True)
        grad0 = torch.randn(p["N"], c, p["L"])

        def torch_and_comm() -> None:
            y = bn0(x0)
            sum_over_ranks(fwd)
            y.backward(grad0)
            sum_over_ranks(bwd)
            x0.grad = None
            bn0.zero_grad(set_to_none=True)

        return torch_and_comm
    if kind == "torch":
        bn: torch.nn.Module = torch.nn.BatchNorm1d(c)
    elif kind == "allreduce-sum":
        bn = _SumSquaresModule(c)
    elif kind == "tandem-nocomm":
        bn = _NoCommModule(c)
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


def _rank_main(rank: int, world: int, store: str, out: str, kinds: list[str], p: dict[str, Any]) -> None:
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
        steps = {kind: _step_fn(kind, p) for kind in kinds}
        for step in steps.values():
            for _ in range(p["warmup"]):
                step()
        seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
        for r in range(p["repeats"]):
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                dist.barrier()  # start together: a wait in a collective is then communication only
                start = time.perf_counter()
                steps[kind]()
                seconds[kind].append(time.perf_counter() - start)
        if rank == 0:
            Path(out).write_text(json.dumps(seconds))
    finally:
        dist.destroy_process_group()


def _run_ranks(kinds: list[str], p: dict[str, Any]) -> dict[str, list[float]]:
    """Spawn ``p["world"]`` ranks, wait at most ``_TIMEOUT_S`` (then kill them), return rank 0's times."""
    with tempfile.TemporaryDirectory(prefix="tandem-syncbn-bench-") as tmp:
        out = str(Path(tmp, "seconds.json"))
        ctx = mp.start_processes(
            _rank_main,
            args=(p["world"], str(Path(tmp, "store")), out, kinds, p),
            nprocs=p["world"],
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + _TIMEOUT_S
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"syncbn bench: the ranks did not finish in {_TIMEOUT_S} s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        return json.loads(Path(out).read_text())


class _Case:
    """One shape's interleaved run, shared by its providers' thunks: the first ``take`` runs the ranks
    for every provider, each ``take`` hands out one provider's times once."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params
        self.results: dict[str, list[float]] = {}

    def take(self, kind: str) -> list[float]:
        if kind not in self.results:  # first call, or this provider already took its share: (re)run
            self.results = _run_ranks(list(_KINDS), self.params)
        return self.results.pop(kind)


_CASES: dict[tuple, _Case] = {}


def _provider(kind: str):
    def factory(p: dict[str, Any], device: torch.device, mode: str):
        if device.type != "cpu":
            raise ValueError(f"syncbn bench: only CPU tensors over Gloo here, got device {device}")
        params = dict(p, threads=max(1, torch.get_num_threads() // p["world"]))
        case = _CASES.setdefault(tuple(sorted(params.items())), _Case(params))
        return lambda: case.take(kind)

    return factory


def _shape(n: int, c: int, length: int, world: int = 2, quick: bool = False) -> Shape:
    params = dict(N=n, C=c, L=length, world=world, warmup=10, repeats=100)
    return Shape(f"N{n}-C{c}-L{length}-{world}ranks", params, quick=quick, devices=("cpu",))


SYNCBN_BENCH = register(
    OpBench(
        op="syncbn",
        providers={kind: _provider(kind) for kind in _KINDS},
        shapes=(_shape(64, 256, 100, quick=True), _shape(16, 256, 100)),
        modes=("train",),
        timing="self",
        description="SyncBatchNorm fwd+bwd per rank on 2 Gloo ranks vs BatchNorm1d (no communication) "
        "and a sum/sum-of-squares all_reduce baseline",
    )
)

"""tandem.nn.SyncBatchNorm across 2 and 3 Gloo processes against torch.nn.BatchNorm on the concatenated batch.

Each world size is spawned once (a module-scoped fixture): every rank runs all the checks below in order
and writes one verdict per check; each pytest test then reads its verdict from every rank. Checks do
their collectives first and compare afterwards, so a failed comparison never leaves a peer waiting;
the process group has a 30 s timeout and the parent kills the ranks after 150 s, whatever happens.

Collectives are counted twice: by wrapping every collective function of ``torch.distributed`` (what
Python code can call) and by counting ``c10d::`` ops in the profiler (what reached the backend).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import tandem
from tandem.ops.syncbn import POLL_S, _poll

C = 5
STEPS = 3
GROUP_TIMEOUT_S = 30
JOIN_TIMEOUT_S = 150
WORLDS = {2: [3, 5], 3: [0, 1, 7]}

# --------------------------------------------------------------------------------------------------
# what runs in every rank

_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "gather",
    "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast_object_list",
)  # fmt: skip


class Counter:
    """Counts collective calls through torch.distributed's Python API and c10d ops in the profiler."""

    def __init__(self) -> None:
        self.python: dict[str, int] = {}
        self.c10d: dict[str, int] = {}

    @property
    def total(self) -> tuple[int, int]:
        return sum(self.python.values()), sum(self.c10d.values())


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    counter = Counter()
    saved = []
    modules = (dist, dist.distributed_c10d)
    for module in modules:
        for name in _COLLECTIVES:
            fn = getattr(module, name, None)
            if fn is None:
                continue

            def wrapped(*args, __fn=fn, __name=name, **kwargs):
                counter.python[__name] = counter.python.get(__name, 0) + 1
                return __fn(*args, **kwargs)

            saved.append((module, name, fn))
            setattr(module, name, wrapped)
    try:
        # the legacy (non-kineto) profiler: it sees the c10d ops too and starts in ms, not seconds
        with torch.autograd.profiler.profile(use_kineto=False) as prof:
            yield counter
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
    for event in prof.function_events:
        if event.name.startswith("c10d::"):
            counter.c10d[event.name] = counter.c10d.get(event.name, 0) + 1


class Report:
    """Collects comparison failures instead of raising between collectives."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def close(self, label: str, got: torch.Tensor | None, want: torch.Tensor | None, atol=1e-5, rtol=1e-5):
        if got is None or want is None:
            if (got is None) != (want is None):
                self.errors.append(f"{label}: got {got is not None}, want {want is not None}")
            return
        if got.shape != want.shape:
            self.errors.append(f"{label}: shape {list(got.shape)} != {list(want.shape)}")
            return
        if got.numel() == 0:
            return
        g, w = got.detach().double(), want.detach().double()
        if not torch.allclose(g, w, atol=atol, rtol=rtol):
            err = (g - w).abs().max().item()
            self.errors.append(f"{label}: max abs error {err:.3g} (atol {atol}, rtol {rtol})")

    def true(self, label: str, ok: bool, detail: str = "") -> None:
        if not ok:
            self.errors.append(f"{label}: {detail}")

    def finish(self) -> None:
        if self.errors:
            raise AssertionError("\n".join(self.errors))


def _gen(*key) -> torch.Generator:
    """The same generator on every rank (``hash()`` of a str differs between processes)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _slice(batches: list[int], rank: int) -> slice:
    start = sum(batches[:rank])
    return slice(start, start + batches[rank])


def _all_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(p, parts[0]) for p in parts)


CASES = {
    # name: (torch class, frame shape, module kwargs, memory format, dtype)
    "2d": (torch.nn.BatchNorm1d, (), {}, None, torch.float32),
    "3d": (torch.nn.BatchNorm1d, (7,), {}, None, torch.float32),
    "4d": (torch.nn.BatchNorm2d, (3, 4), {}, None, torch.float32),
    "4d-channels_last": (torch.nn.BatchNorm2d, (3, 4), {}, torch.channels_last, torch.float32),
    "5d-channels_last_3d": (torch.nn.BatchNorm3d, (2, 3, 2), {}, torch.channels_last_3d, torch.float32),
    "3d-momentum_none": (torch.nn.BatchNorm1d, (7,), {"momentum": None}, None, torch.float32),
    "3d-affine_false": (torch.nn.BatchNorm1d, (7,), {"affine": False}, None, torch.float32),
    "3d-no_running_stats": (torch.nn.BatchNorm1d, (7,), {"track_running_stats": False}, None, torch.float32),
    "3d-bfloat16": (torch.nn.BatchNorm1d, (7,), {}, None, torch.bfloat16),
    "4d-float16": (torch.nn.BatchNorm2d, (3, 4), {}, None, torch.float16),
}


def check_equal_to_batchnorm(rank: int, batches: list[int], case: str) -> None:
    """STEPS training steps and one eval step: outputs, input grads, summed weight/bias grads, running
    stats (and equal on every rank), against torch's BatchNormNd on the whole batch in one process."""
    cls, frames, kwargs, fmt, dtype = CASES[case]
    rep = Report()
    ours = tandem.nn.SyncBatchNorm(C, **kwargs)
    ref = cls(C, **kwargs)
    if ours.affine:
        with torch.no_grad():
            w, b = torch.rand(C, generator=_gen(case, "wb")) + 0.5, torch.randn(C, generator=_gen(case, "b"))
            for m in (ours, ref):
                m.weight.copy_(w)
                m.bias.copy_(b)
    low = dtype != torch.float32
    tol = dict(atol=2e-2, rtol=2e-2) if low else dict(atol=2e-5, rtol=2e-5)
    part = _slice(batches, rank)
    for step in range(STEPS):
        full = (torch.randn(sum(batches), C, *frames, generator=_gen(case, step)) * 3 + 2).to(dtype)
        grad = torch.randn(full.shape, generator=_gen(case, step, "g")).to(dtype)
        if fmt is not None:
            full = full.contiguous(memory_format=fmt)
        x = full[part].clone().requires_grad_()
        if fmt is not None:
            x = x.detach().contiguous(memory_format=fmt).requires_grad_()
        y = ours(x)
        (y * grad[part]).sum().backward()
        # torch's reference in float32 on the same (rounded) values: what exact low-precision BN rounds
        xr = full.float().requires_grad_()
        yr = ref(xr)
        (yr * grad.float()).sum().backward()
        rep.close(f"step {step} y", y.float(), yr[part], **tol)
        rep.true(f"step {step} y dtype", y.dtype == dtype, str(y.dtype))
        if fmt is not None and x.numel():
            rep.true(f"step {step} y memory format", y.is_contiguous(memory_format=fmt), str(y.stride()))
            rep.true(
                f"step {step} dx memory format", x.grad.is_contiguous(memory_format=fmt), str(x.grad.stride())
            )
        rep.close(f"step {step} dx", x.grad.float(), xr.grad[part], **tol)
        if ours.affine:
            rep.close(
                f"step {step} sum dw",
                _all_sum(ours.weight.grad),
                ref.weight.grad,
                atol=1e-4 if not low else 0.1,
            )
            rep.close(
                f"step {step} sum db", _all_sum(ours.bias.grad), ref.bias.grad, atol=1e-4 if not low else 0.1
            )
            for m in (ours, ref):
                m.weight.grad = m.bias.grad = None
        if ours.track_running_stats:
            rep.close(f"step {step} running_mean", ours.running_mean, ref.running_mean, atol=1e-6)
            rep.close(f"step {step} running_var", ours.running_var, ref.running_var, atol=1e-5)
            rep.true("running stats equal on all ranks", _same_on_all_ranks(ours.running_mean))
            rep.true("running stats equal on all ranks", _same_on_all_ranks(ours.running_var))
            rep.true("num_batches_tracked", int(ours.num_batches_tracked) == step + 1)
    ours.eval()
    ref.eval()
    full = torch.randn(sum(batches), C, *frames, generator=_gen(case, "eval")).to(dtype)
    if ours.track_running_stats:  # eval without running stats = local batch stats, as torch's SyncBatchNorm
        rep.close("eval y", ours(full[part]).float(), ref(full.float())[part], **tol)
    rep.true(
        "state_dict keys", list(ours.state_dict()) == list(ref.state_dict()), str(list(ours.state_dict()))
    )
    rep.finish()


def check_collectives(rank: int, batches: list[int]) -> None:
    """One collective per training forward, one per backward; none in eval or without an input grad. On
    CPU tensors (Gloo) it is an all_gather, faster than Gloo's all_reduce for a few hundred bytes."""
    rep = Report()
    frames = (4,)
    for kwargs in ({}, {"track_running_stats": False}, {"affine": False}):
        bn = tandem.nn.SyncBatchNorm(C, **kwargs)
        x = torch.randn(batches[rank], C, *frames, requires_grad=True)
        with counting() as fwd:
            y = bn(x)
        with counting() as bwd:
            y.sum().backward()
        rep.true(f"{kwargs} forward", fwd.total == (1, 1) and fwd.python == {"all_gather": 1}, str(vars(fwd)))
        rep.true(
            f"{kwargs} backward", bwd.total == (1, 1) and bwd.python == {"all_gather": 1}, str(vars(bwd))
        )
        if bn.track_running_stats:
            bn.eval()
            with counting() as ev:
                bn(x).sum().backward()
            rep.true(f"{kwargs} eval", ev.total == (0, 0), str(vars(ev)))
    bn = tandem.nn.SyncBatchNorm(C)
    x = torch.randn(batches[rank], C, *frames)  # only the parameters need gradients
    with counting() as fwd:
        y = bn(x, lengths=torch.full((batches[rank],), 2))
    with counting() as bwd:
        y.sum().backward()
    rep.true("masked forward", fwd.total == (1, 1), str(vars(fwd)))
    rep.true("backward without input grad", bwd.total == (0, 0), str(vars(bwd)))
    rep.finish()


def check_large_offset(rank: int, batches: list[int]) -> None:
    """mean/std = 1e4 in float32, first step: output and input grad within 1e-5 of a float64 reference
    (torch's own float32 BatchNorm is off by ~5e-4 there; the sum/sum-of-squares method by 100%)."""
    rep = Report()
    full = 1e4 + torch.randn(sum(batches), C, 9, generator=_gen("offset"))  # float32
    grad = torch.randn(full.shape, generator=_gen("offset", "g"))
    part = _slice(batches, rank)
    ours = tandem.nn.SyncBatchNorm(C)
    x = full[part].clone().requires_grad_()
    y = ours(x)
    (y * grad[part]).sum().backward()
    exact = torch.nn.BatchNorm1d(C, dtype=torch.float64)
    x64 = full.double().requires_grad_()
    y64 = exact(x64)
    (y64 * grad.double()).sum().backward()
    torch_err = (torch.nn.BatchNorm1d(C)(full) - y64).abs().max().item()
    err = (y.double() - y64[part]).abs().max().item() if y.numel() else 0.0
    rep.true(
        "y vs float64", err <= min(1e-5, 2 * torch_err), f"ours {err:.3g}, torch float32 {torch_err:.3g}"
    )
    rep.close("dx vs float64", x.grad, x64.grad[part], atol=1e-5, rtol=0)
    rep.close("running_mean", ours.running_mean, exact.running_mean, atol=1e-3, rtol=0)
    rep.close(
        "running_var (relative)", ours.running_var / exact.running_var, torch.ones(C), atol=1e-5, rtol=0
    )
    rep.finish()


def check_large_offset_float64(rank: int, batches: list[int]) -> None:
    """float64 at a timestamp-like mean (1.7e9, std 1): torch's BatchNorm on the concatenated batch to
    the data's own precision (the ranks' statistics merge from centred differences; a merge of sums left
    nothing of the variance there)."""
    rep = Report()
    full = 1.7e9 + torch.randn(sum(batches), C, 9, generator=_gen("offset64"), dtype=torch.float64)
    part = _slice(batches, rank)
    ours = tandem.nn.SyncBatchNorm(C, dtype=torch.float64)
    y = ours(full[part])
    ref = torch.nn.BatchNorm1d(C, dtype=torch.float64)
    rep.close("y", y, ref(full)[part], atol=1e-6, rtol=0)
    rep.close("running_mean", ours.running_mean, ref.running_mean, atol=0, rtol=1e-15)
    rep.close("running_var", ours.running_var, ref.running_var, atol=0, rtol=1e-6)
    rep.finish()


def check_dtypes_differ_over_ranks(rank: int, batches: list[int]) -> None:
    """Rank 0 normalises float64, the others float32 (each its own module's dtype): the collectives carry
    float64 either way, so both directions complete and every rank gets the concatenated batch's numbers."""
    rep = Report()
    dtype = torch.float64 if rank == 0 else torch.float32
    full = torch.randn(sum(batches), C, 4, generator=_gen("dtypes"), dtype=torch.float64)
    grad = torch.randn(full.shape, generator=_gen("dtypes", "g"), dtype=torch.float64)
    part = _slice(batches, rank)
    ours = tandem.nn.SyncBatchNorm(C, dtype=dtype)
    x = full[part].to(dtype).requires_grad_()
    (ours(x) * grad[part].to(dtype)).sum().backward()
    ref = torch.nn.BatchNorm1d(C, dtype=torch.float64)
    x64 = full.clone().requires_grad_()
    y64 = ref(x64)
    (y64 * grad).sum().backward()
    rep.close("dx", x.grad, x64.grad[part], atol=1e-5, rtol=1e-5)
    rep.close("running_var", ours.running_var, ref.running_var, atol=1e-6, rtol=1e-6)
    rep.finish()


def check_masked(rank: int, batches: list[int]) -> None:
    """Padded frames (NaN here) are out of the statistics and get output 0 and gradient 0; the real
    frames match BatchNorm1d on the real frames of all ranks, via mask=, lengths=, a PackedSequence,
    and a time-major [T*B, C] flattening with a [T*B] mask."""
    rep = Report()
    steps = 6
    n_all = sum(batches)
    lengths_all = torch.randint(0, steps + 1, (n_all,), generator=_gen("len"))
    lengths_all[0] = steps
    full = torch.randn(n_all, C, steps, generator=_gen("masked")) * 2 + 1
    grad = torch.randn(full.shape, generator=_gen("masked", "g"))
    valid_all = torch.arange(steps) < lengths_all[:, None]  # [N, L]
    full = full.masked_fill(~valid_all[:, None, :], float("nan"))
    part = _slice(batches, rank)
    # torch on the real frames only: rows [M, C]
    rows = full.permute(0, 2, 1)[valid_all].clone().requires_grad_()
    ref = torch.nn.BatchNorm1d(C)
    yr = ref(rows)
    (yr * grad.permute(0, 2, 1)[valid_all]).sum().backward()
    local_rows = valid_all[part].sum().item()
    first = valid_all[: part.start].sum().item()
    mine = slice(first, first + local_rows)

    for how in ("mask", "lengths"):
        ours = tandem.nn.SyncBatchNorm(C)
        x = full[part].clone().requires_grad_()
        kw = {"mask": valid_all[part]} if how == "mask" else {"lengths": lengths_all[part]}
        y = ours(x, **kw)
        (y * grad[part]).sum().backward()
        valid = valid_all[part]
        rep.close(f"{how} y", y.permute(0, 2, 1)[valid], yr[mine])
        rep.close(f"{how} dx", x.grad.permute(0, 2, 1)[valid], rows.grad[mine])
        rep.true(f"{how} padded y == 0", bool((y.permute(0, 2, 1)[~valid] == 0).all()))
        rep.true(f"{how} padded dx == 0", bool((x.grad.permute(0, 2, 1)[~valid] == 0).all()))
        rep.close(f"{how} running_mean", ours.running_mean, ref.running_mean, atol=1e-6)
        rep.close(f"{how} running_var", ours.running_var, ref.running_var, atol=1e-5)

    # PackedSequence: data [P, C] has no padding; a rank without sequences feeds an empty [0, C]
    ours = tandem.nn.SyncBatchNorm(C)
    seqs = full[part].permute(2, 0, 1)  # [L, n, C]
    # the expected time-major [T, B, C] output: BN of the real frames, 0 elsewhere
    want = torch.zeros(steps, batches[rank], C)
    want.permute(1, 0, 2)[valid_all[part]] = yr[mine].detach()
    if batches[rank] and lengths_all[part].min() > 0:
        packed = pack_padded_sequence(seqs, lengths_all[part], enforce_sorted=False)
        out = ours(packed)
        rep.true("packed out type", type(out) is type(packed))
        rep.true("packed batch_sizes", torch.equal(out.batch_sizes, packed.batch_sizes))
        rep.close("packed y", pad_packed_sequence(out, total_length=steps)[0], want)
    else:  # zero-length sequences cannot be packed: this rank takes part with its real frames as rows
        ours(full[part].permute(0, 2, 1)[valid_all[part]])
    rep.close("packed running_mean", ours.running_mean, ref.running_mean, atol=1e-6)
    rep.close("packed running_var", ours.running_var, ref.running_var, atol=1e-5)

    # time-major [T, B, C] features flattened to frames, with a [T * B] mask
    ours = tandem.nn.SyncBatchNorm(C)
    h = full[part].permute(2, 0, 1).contiguous()  # [T, B, C]
    m = valid_all[part].t()  # [T, B]
    y = ours(h.reshape(-1, C), mask=m.reshape(-1)).view_as(h)
    rep.close("time-major y", y, want)
    rep.finish()


def check_bench_baseline(rank: int, batches: list[int]) -> None:
    """The benchmark's sum/sum-of-squares baseline is right at an ordinary scale (so the bench compares
    against working code), with one all_reduce each way."""
    from tandem.bench.syncbn import _SumSquaresModule

    rep = Report()
    full = torch.randn(sum(batches), C, 6, generator=_gen("bench")) * 2 + 1
    grad = torch.randn(full.shape, generator=_gen("bench", "g"))
    part = _slice(batches, rank)
    ours, ref = _SumSquaresModule(C), torch.nn.BatchNorm1d(C)
    x = full[part].clone().requires_grad_()
    with counting() as fwd:
        y = ours(x)
    with counting() as bwd:
        (y * grad[part]).sum().backward()
    xr = full.clone().requires_grad_()
    yr = ref(xr)
    (yr * grad).sum().backward()
    rep.close("y", y, yr[part], atol=1e-4)
    rep.close("dx", x.grad, xr.grad[part], atol=1e-4)
    rep.close("sum dw", _all_sum(ours.weight.grad), ref.weight.grad, atol=1e-3)
    rep.close("running_var", ours.running_var, ref.running_var, atol=1e-4)
    rep.true("one collective each way", fwd.total == bwd.total == (1, 1), f"{vars(fwd)} {vars(bwd)}")
    rep.finish()


def check_process_group(rank: int, batches: list[int]) -> None:
    """Statistics shared within ``process_group`` only: ranks 1 and 2 of 3 against BN on their batch."""
    group = dist.new_group([1, 2], timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    rep = Report()
    if rank in (1, 2):
        sub = [batches[1], batches[2]]
        full = torch.randn(sum(sub), C, 3, generator=_gen("group"))
        ours = tandem.nn.SyncBatchNorm(C, process_group=group)
        ref = torch.nn.BatchNorm1d(C)
        part = _slice(sub, rank - 1)
        with counting() as n:
            y = ours(full[part])
        rep.close("y", y, ref(full)[part])
        rep.close("running_var", ours.running_var, ref.running_var)
        rep.true("one collective", n.total == (1, 1), str(vars(n)))
    rep.finish()


def check_late_rank(rank: int, batches: list[int]) -> None:
    """The last rank reaches each collective long after the others stopped polling for it (``POLL_S``):
    they block in ``wait()`` and still get every rank's statistics, forward and backward."""
    rep = Report()
    late = rank == dist.get_world_size() - 1
    delay = 5 * POLL_S
    full = torch.randn(sum(batches), C, 3, generator=_gen("late"))
    grad = torch.randn(full.shape, generator=_gen("late", "g"))
    part = _slice(batches, rank)
    ours, ref = tandem.nn.SyncBatchNorm(C), torch.nn.BatchNorm1d(C)
    x, x_ref = full[part].clone().requires_grad_(), full.clone().requires_grad_()
    waited = []
    for direction in ("forward", "backward"):
        if late:
            time.sleep(delay)
        start = time.perf_counter()
        if direction == "forward":
            y = ours(x)
        else:
            y.backward(grad[part])
        waited.append(time.perf_counter() - start)
    y_ref = ref(x_ref)
    y_ref.backward(grad)
    rep.close("y", y, y_ref[part])
    rep.close("dx", x.grad, x_ref.grad[part])
    rep.close("running_var", ours.running_var, ref.running_var)
    if not late:  # the early ranks did wait past their polling, and then got the late rank's numbers
        rep.true("waited for the late rank", min(waited) > 0.8 * delay, f"{waited} against {delay} s")
    rep.finish()


def check_second_derivative_refused(rank: int, batches: list[int]) -> None:
    """create_graph=True across processes: every rank refuses it, with a message, before the backward's
    collective (none is left waiting)."""
    rep = Report()
    bn = tandem.nn.SyncBatchNorm(C)
    x = torch.randn(batches[rank], C, 3, generator=_gen("second", rank)).requires_grad_()
    y = bn(x)
    try:
        torch.autograd.grad(y.sin().sum(), x, create_graph=True)
        rep.true("refused", False, "create_graph=True ran")
    except RuntimeError as e:
        rep.true("refused", "second derivative" in str(e), str(e))
    y = bn(x)  # the group is still in step: a first derivative goes on as usual
    (dx,) = torch.autograd.grad(y.sin().sum(), x)
    rep.true("first derivative after", bool(torch.isfinite(dx).all()), "")
    rep.finish()


def _checks(world: int) -> dict[str, Callable[[int, list[int]], None]]:
    checks: dict[str, Callable[[int, list[int]], None]] = {
        f"equal-{case}": (lambda r, b, case=case: check_equal_to_batchnorm(r, b, case)) for case in CASES
    }
    checks.update(collectives=check_collectives, large_offset=check_large_offset, masked=check_masked)
    checks.update(
        large_offset_float64=check_large_offset_float64, dtypes_differ=check_dtypes_differ_over_ranks
    )
    checks["late"] = check_late_rank
    checks["second_derivative"] = check_second_derivative_refused
    if world == 2:
        checks["bench_baseline"] = check_bench_baseline
    if world == 3:
        checks["process_group"] = check_process_group
    return checks


def _rank_main(rank: int, world: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    verdicts = {}
    try:
        for name, check in _checks(world).items():
            torch.manual_seed(0)
            start = time.perf_counter()
            try:
                check(rank, WORLDS[world])
                verdicts[name] = "ok"
            except Exception:
                verdicts[name] = traceback.format_exc()
            verdicts[name + ":seconds"] = f"{time.perf_counter() - start:.2f}"
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(verdicts))
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# the parent


def _run_world(world: int, tmp: Path) -> list[dict[str, str]]:
    ctx = mp.start_processes(
        _rank_main, args=(world, str(tmp / "store"), str(tmp)), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} Gloo ranks did not finish in {JOIN_TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> Callable[[int], list[dict[str, str]]]:
    cache: dict[int, list[dict[str, str]]] = {}

    def get(world: int) -> list[dict[str, str]]:
        if world not in cache:
            cache[world] = _run_world(world, tmp_path_factory.mktemp(f"syncbn{world}"))
        return cache[world]

    return get


def _assert_ok(verdicts, world: int, name: str) -> None:
    per_rank = verdicts(world)
    failed = {r: v.get(name, "not run") for r, v in enumerate(per_rank) if v.get(name) != "ok"}
    assert not failed, "\n".join(f"rank {r} (batches {WORLDS[world]}):\n{msg}" for r, msg in failed.items())


WORLD_IDS = [pytest.param(w, id=f"{w}ranks-batches{'-'.join(map(str, b))}") for w, b in WORLDS.items()]


@pytest.mark.timeout(JOIN_TIMEOUT_S + 30)
@pytest.mark.parametrize("world", WORLD_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_equal_to_batchnorm_on_concatenated_batch(verdicts, world, case):
    _assert_ok(verdicts, world, f"equal-{case}")


@pytest.mark.timeout(JOIN_TIMEOUT_S + 30)
@pytest.mark.parametrize("world", WORLD_IDS)
def test_one_collective_per_direction(verdicts, world):
    _assert_ok(verdicts, world, "collectives")


@pytest.mark.timeout(JOIN_TIMEOUT_S + 30)
@pytest.mark.parametrize("world", WORLD_IDS)
def test_large_offset_float32(verdicts, world):
    _assert_ok(verdicts, world, "large_offset")


@pytest.mark.timeout(JOIN_TIMEOUT_S + 30)
@pytest.mark.parametrize("world", WORLD_IDS)
def test_large_offset_float64(verdicts, world):
    _assert_ok(verdicts, world, "large_offset_float64")


@pytest.mark.timeout(JOIN_TIMEOUT_S + 30)
@pytest.mark.parametrize("world", WORLD_IDS)
def test_ranks_of_different_dtypes(verdicts, world):
    _assert_ok(verdicts, world, "dtypes_differ")


@pytest.mark.timeout(JOIN_TIMEOUT_S + 30)
@pytest.mark.parametrize("world", WORLD_IDS)
def test_masked_statistics(verdicts, world):
    _assert_ok(verdicts, world, "masked")


@pytest.mark.timeout(JOIN_TIMEOUT_S + 30)
@pytest.mark.parametrize("world", WORLD_IDS)
def test_a_late_rank_outlasts_the_polling(verdicts, world):
    _assert_ok(verdicts, world, "late")


@pytest.mark.timeout(JOIN_TIMEOUT_S + 30)
@pytest.mark.parametrize("world", WORLD_IDS)
def test_a_second_derivative_across_processes_is_refused_on_every_rank(verdicts, world):
    _assert_ok(verdicts, world, "second_derivative")


def test_poll_ends_when_done_or_after_its_time():
    calls = []
    assert _poll(lambda: calls.append(1) or len(calls) == 3, 10.0) and len(calls) == 3
    start = time.perf_counter()
    assert not _poll(lambda: False, 0.01)
    assert time.perf_counter() - start >= 0.01


@pytest.mark.timeout(JOIN_TIMEOUT_S + 30)
def test_bench_baseline_is_batchnorm(verdicts):
    _assert_ok(verdicts, 2, "bench_baseline")


@pytest.mark.timeout(JOIN_TIMEOUT_S + 30)
def test_process_group(verdicts):
    _assert_ok(verdicts, 3, "process_group")


# --------------------------------------------------------------------------------------------------
# one process: no group to synchronize with


@pytest.mark.parametrize(
    ("cls", "shape", "fmt"),
    [
        pytest.param(torch.nn.BatchNorm1d, (6, 4), None, id="2d"),
        pytest.param(torch.nn.BatchNorm1d, (6, 4, 5), None, id="3d"),
        pytest.param(torch.nn.BatchNorm2d, (3, 4, 5, 2), torch.channels_last, id="4d-channels_last"),
        pytest.param(torch.nn.BatchNorm3d, (2, 4, 2, 3, 2), None, id="5d"),
    ],
)
@pytest.mark.parametrize(
    "kwargs", [{}, {"momentum": None}, {"affine": False, "track_running_stats": False}], ids=str
)
def test_without_distributed_is_torch_batchnorm(cls, shape, fmt, kwargs):
    """No process group: bit-for-bit torch's BatchNormNd (outputs, grads, buffers), eval included."""
    ours, ref = tandem.nn.SyncBatchNorm(shape[1], **kwargs), cls(shape[1], **kwargs)
    for _ in range(2):
        x = torch.randn(shape)
        x = x.contiguous(memory_format=fmt) if fmt else x
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        ys = [ours(xs[0]), ref(xs[1])]
        for y in ys:
            y.square().sum().backward()
        assert torch.equal(ys[0], ys[1]) and torch.equal(xs[0].grad, xs[1].grad)
        if fmt:
            assert ys[0].is_contiguous(memory_format=fmt)
    for a, b in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert a[0] == b[0] and torch.equal(a[1], b[1])
    ours.eval(), ref.eval()
    x = torch.randn(shape)
    assert torch.equal(ours(x), ref(x))


def test_masked_eval_uses_running_stats_and_zeroes_padding():
    bn, ref = tandem.nn.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        for m in (bn, ref):
            m.running_mean.copy_(torch.tensor([1.0, -2.0, 0.5]))
            m.running_var.copy_(torch.tensor([2.0, 0.5, 1.0]))
            m.weight.copy_(torch.tensor([1.5, 0.5, -1.0]))
    bn.eval(), ref.eval()
    x = torch.randn(4, 3, 6)
    lengths = torch.tensor([6, 0, 3, 1])
    y = bn(x, lengths=lengths)
    valid = torch.arange(6) < lengths[:, None]
    torch.testing.assert_close(y.permute(0, 2, 1)[valid], ref(x).permute(0, 2, 1)[valid])
    assert not y.permute(0, 2, 1)[~valid].any()


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_eval_with_tracking_turned_off_after_construction_uses_the_buffers_as_torchs(masked):
    """``track_running_stats = False`` set on a module made with it: its buffers stay, and in eval
    torch's batch norm normalises with them, as tandem's does."""
    bn, ref = tandem.nn.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        for m in (bn, ref):
            m.running_mean.copy_(torch.tensor([1.0, -2.0, 0.5]))
            m.running_var.copy_(torch.tensor([2.0, 0.5, 1.0]))
            m.track_running_stats = False
            m.eval()
    x = torch.randn(4, 3, 6)
    y = bn(x, lengths=torch.full((4,), 6)) if masked else bn(x)
    torch.testing.assert_close(y, ref(x))
    torch.testing.assert_close(bn.running_var, ref.running_var)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("affine", [True, False])
def test_masked_second_derivative_is_batchnorms_over_the_real_frames(training, affine):
    """A gradient penalty (create_graph=True) through a masked batch norm, one process: the derivatives
    of BatchNorm1d over the real frames alone, with NaN in the padding ignored."""
    bn = tandem.nn.SyncBatchNorm(3, affine=affine).double()
    ref = torch.nn.BatchNorm1d(3, affine=affine).double()
    with torch.no_grad():
        for m in (bn, ref):
            m.running_mean.copy_(torch.tensor([1.0, -2.0, 0.5]))
            m.running_var.copy_(torch.tensor([2.0, 0.5, 1.0]))
            if affine:
                m.weight.copy_(torch.tensor([1.5, 0.5, -1.0]))
                m.bias.copy_(torch.tensor([0.1, 0.2, 0.3]))
    bn.train(training), ref.train(training)
    x0 = torch.randn(4, 3, 6, dtype=torch.float64)
    lengths = torch.tensor([6, 4, 3, 1])
    valid = torch.arange(6) < lengths[:, None]  # [N, L]
    x0.permute(0, 2, 1)[~valid] = float("nan")
    grads = []
    for module in (ref, bn):
        x = x0.clone().requires_grad_()
        if module is ref:
            y = ref(x.permute(0, 2, 1)[valid])  # [frames, C]
        else:
            y = bn(x, lengths=lengths).permute(0, 2, 1)[valid]
        (gx,) = torch.autograd.grad(y.sin().sum(), x, create_graph=True)
        torch.where(valid.unsqueeze(1), gx, 0).square().sum().backward()
        grads.append([x.grad.permute(0, 2, 1)[valid]] + [p.grad for p in module.parameters()])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("as_list", [False, True], ids=["tensor", "list"])
def test_lengths_under_another_default_device_are_batchnorms_over_the_real_frames(as_list):
    """A CPU input with CPU lengths (or a list) where another device is the default
    (``torch.set_default_device``, the ``torch.device`` context; "meta" stands in for a GPU): BatchNorm1d
    over the real frames computes there; the lengths were moved to the default device and raised."""
    bn, ref = tandem.nn.SyncBatchNorm(3).double(), torch.nn.BatchNorm1d(3).double()
    x0 = torch.randn(4, 3, 6, dtype=torch.float64)
    lengths = torch.tensor([6, 4, 3, 1])
    valid = torch.arange(6) < lengths[:, None]  # [N, L]
    results = []
    for module in (ref, bn):
        x = x0.clone().requires_grad_()
        with torch.device("meta"):
            if module is ref:
                y = ref(x.permute(0, 2, 1)[valid])  # [frames, C]
            else:
                y = bn(x, lengths=lengths.tolist() if as_list else lengths).permute(0, 2, 1)[valid]
            y.sin().sum().backward()
        results.append([y, x.grad, ref.running_mean if module is ref else bn.running_mean])
    torch.testing.assert_close(results[1], results[0])


def test_training_on_no_frame_is_batchnorm_on_an_empty_batch():
    """Every frame masked out (on every rank): torch's BatchNorm on the empty batch of real frames gives
    an empty output and leaves the running statistics; here the padding's output and gradient are 0.
    One frame in all stays torch's error."""
    bn, ref = tandem.nn.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    x = torch.randn(2, 3, 4, requires_grad=True)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    assert ref(x.detach().permute(0, 2, 1)[mask]).shape == (0, 3)
    y = bn(x, mask=mask)
    y.sum().backward()
    assert not y.any() and not x.grad.any()
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(bn, name), getattr(ref, name)), name
    mask[0, 0] = True
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(x, mask=mask)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        ref(x.detach().permute(0, 2, 1)[mask])


def test_training_on_exactly_two_frames_updates_the_running_variance_as_torchs():
    """Two real frames (masked, one process) is the fewest that trains: the running variance moves
    towards their unbiased variance, as torch's BatchNorm1d on those two frames, rather than staying."""
    bn, ref = tandem.nn.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[0, 1] = mask[1, 2] = True
    bn(x, mask=mask)
    ref(x.permute(0, 2, 1)[mask])  # [2, C]
    assert not torch.equal(ref.running_var, torch.ones(3))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(bn, name), getattr(ref, name), msg=name)


def test_masked_forward_ad_updates_the_running_statistics_as_torchs():
    """Training with running statistics under forward-mode AD (a dual input), where the autograd-tracked
    path runs rather than the kernels: running_mean and the unbiased running_var as torch's BatchNorm1d
    over the real frames after the same forward. (torch.func's transforms refuse the in-place update of
    a captured buffer, torch's BatchNorm's as well.)"""
    from torch.autograd import forward_ad

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 6, dtype=torch.float64, generator=gen)
    tangent = torch.randn(x.shape, dtype=torch.float64, generator=gen)
    mask = torch.arange(6) < torch.tensor([3, 1, 2])[:, None]  # 6 real frames: the correction is 6 / 5
    ours = tandem.nn.SyncBatchNorm(2, dtype=torch.float64)
    ref = torch.nn.BatchNorm1d(2, dtype=torch.float64)
    with forward_ad.dual_level():
        y = ours(forward_ad.make_dual(x, tangent), mask=mask)
        assert forward_ad.unpack_dual(y).tangent is not None
    ref(x.permute(0, 2, 1)[mask])  # [F, C]
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours, name), getattr(ref, name), msg=name)


@pytest.mark.parametrize("rnn", [torch.nn.GRU, tandem.nn.GRU], ids=["torch-gru", "tandem-gru"])
def test_packed_sequence_through_torch_compile(rnn):
    """GRU -> SyncBatchNorm on the PackedSequence -> GRU under torch.compile: what eager computes. (A
    PackedSequence made by _replace could not be rebuilt by torch 2.13's dynamo across a graph break.)"""

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = rnn(4, 6, batch_first=True, bidirectional=True, dtype=torch.float64)
            self.bn = tandem.nn.SyncBatchNorm(12, dtype=torch.float64)
            self.b = rnn(12, 5, batch_first=True, dtype=torch.float64)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            p = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            p, _ = self.a(p)
            p, _ = self.b(self.bn(p))
            return p.data

    torch.manual_seed(0)
    model = Stack()
    x, lengths = torch.randn(3, 5, 4, dtype=torch.float64), torch.tensor([5, 3, 2])
    torch._dynamo.reset()
    got = torch.compile(model, backend="eager")(x, lengths)
    torch.testing.assert_close(got, model(x, lengths))


def test_packed_sequence_in_packed_sequence_out():
    bn, ref = tandem.nn.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    packed = pack_padded_sequence(torch.randn(5, 4, 3), torch.tensor([5, 4, 2, 1]))
    out = bn(packed)
    assert isinstance(out, type(packed)) and torch.equal(out.batch_sizes, packed.batch_sizes)
    torch.testing.assert_close(out.data, ref(packed.data))


def test_bad_input_raises_like_torch():
    bn, ref, sync_ref = tandem.nn.SyncBatchNorm(4), torch.nn.BatchNorm1d(4), torch.nn.SyncBatchNorm(4)
    # 1-D input: torch.nn.SyncBatchNorm's error and message
    with pytest.raises(ValueError) as theirs:
        sync_ref(torch.randn(4))
    with pytest.raises(ValueError, match="expected at least 2D input") as ours:
        bn(torch.randn(4))
    assert str(ours.value) == str(theirs.value)
    # wrong channel count: torch raises a RuntimeError (from its running_mean check); so do we, naming it
    with pytest.raises(RuntimeError):
        ref(torch.randn(3, 5))
    with pytest.raises(RuntimeError, match="expected input with 4 channels"):
        bn(torch.randn(3, 5))
    with pytest.raises(RuntimeError, match="expected input with 4 channels"):
        bn(torch.randn(3, 5, 2), mask=torch.ones(3, 2, dtype=torch.bool))
    # one value per channel in training
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        ref(torch.randn(1, 4))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        bn(torch.randn(1, 4))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        bn(torch.randn(3, 4, 2), lengths=torch.tensor([1, 0, 0]))
    assert int(bn.num_batches_tracked) == 0 and torch.equal(bn.running_var, torch.ones(4))
    with pytest.raises(ValueError, match="non-zero"):
        tandem.nn.SyncBatchNorm(0)(torch.randn(3, 0))


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_a_checkpoints_recomputation_counts_as_torchs(masked):
    """A non-reentrant checkpoint recomputes the forward in backward and stops right after the op: the
    running statistics move twice a step and so does num_batches_tracked, as torch's (momentum=None:
    the cumulative average reads the count)."""
    import torch.utils.checkpoint as cp

    mask = torch.ones(4, 5, dtype=torch.bool)
    ref, ours = torch.nn.BatchNorm1d(3, momentum=None), tandem.nn.SyncBatchNorm(3, momentum=None)
    for step in range(3):
        x = torch.randn(4, 3, 5, generator=_gen("ckpt", step))
        cp.checkpoint(ref, x.clone().requires_grad_(), use_reentrant=False).sum().backward()
        run = (lambda t: ours(t, mask=mask)) if masked else ours
        cp.checkpoint(run, x.clone().requires_grad_(), use_reentrant=False).sum().backward()
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 6
    torch.testing.assert_close(ours.running_mean, ref.running_mean)
    torch.testing.assert_close(ours.running_var, ref.running_var)


@pytest.mark.parametrize(
    "case", ["int64", "bool", "complex64", "float64-in-float32", "float32-in-float64", "bfloat16-module",
             "running-var-none"],
)  # fmt: skip
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_inputs_torch_refuses_are_refused_with_its_error(case, masked):
    """What torch's batch norm refuses (integer, bool and complex inputs, dtypes it does not mix, one
    running statistic without the other) is refused with its error on the masked path too, where tandem's
    own kernels run; nothing moves."""
    dtypes = {"int64": torch.int64, "bool": torch.bool, "complex64": torch.complex64}
    x = torch.ones(
        4, 3, 5, dtype=dtypes.get(case, torch.float64 if case == "float64-in-float32" else torch.float32)
    )
    module_dtype = {"float32-in-float64": torch.float64, "bfloat16-module": torch.bfloat16}.get(case)
    mods = [cls(3, dtype=module_dtype) for cls in (torch.nn.BatchNorm1d, tandem.nn.SyncBatchNorm)]
    if case == "running-var-none":
        for m in mods:
            m.running_var = None
    theirs = _outcome(mods[0], x)
    assert isinstance(theirs, tuple), "torch computes this"
    kwargs = {"mask": torch.ones(4, 5, dtype=torch.bool)} if masked else {}
    try:
        mods[1](x, **kwargs)
        ours = None
    except Exception as e:
        ours = type(e), str(e)
    assert ours == theirs
    assert int(mods[1].num_batches_tracked) == 0 and not mods[1].running_mean.any()


def test_an_infinite_value_makes_the_running_mean_infinite_as_torchs():
    x = torch.randn(4, 2, 5, dtype=torch.float64)
    x[1, 0, 2] = float("inf")
    ref, ours = torch.nn.BatchNorm1d(2, dtype=torch.float64), tandem.nn.SyncBatchNorm(2, dtype=torch.float64)
    ref(x), ours(x, mask=torch.ones(4, 5, dtype=torch.bool))
    assert ours.running_mean[0] == ref.running_mean[0] == float("inf")
    torch.testing.assert_close(ours.running_mean[1], ref.running_mean[1])


def test_a_transposed_input_gives_torchs_contiguous_output():
    """[N, L, C] seen as [N, C, L]: torch's batch norm returns a contiguous output (``view`` works on it)."""
    x = torch.randn(4, 7, 3).transpose(1, 2)
    y = tandem.nn.SyncBatchNorm(3)(x, mask=torch.ones(4, 7, dtype=torch.bool))
    ref = torch.nn.BatchNorm1d(3)(x)
    assert ref.is_contiguous() and y.is_contiguous()
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("create_graph", [False, True], ids=["backward", "create-graph"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(
    ("shape", "order"),
    [((4, 7, 3), (0, 2, 1)), ((5, 3, 2, 4), (3, 0, 1, 2)), ((3, 2, 4, 4), (0, 2, 3, 1))],
    ids=["transposed-3d", "batch-last-4d", "channels-last-4d"],
)
def test_the_input_gradient_has_torchs_layout(shape, order, training, create_graph):
    """The input's gradient as the op hands it on (a hook upstream sees it, and may ``view`` it): torch's
    batch norm returns it contiguous for an input of odd strides, channels_last for a channels_last one.
    tandem's kept the input's strides."""
    base = torch.randn(shape, dtype=torch.float64)
    mask = torch.ones(base.permute(order).shape[:1] + base.permute(order).shape[2:], dtype=torch.bool)
    grads = []
    for bn in (tandem.nn.SyncBatchNorm(shape[order[1]]), torch.nn.BatchNorm1d(shape[order[1]])):
        bn = bn.double().train(training)
        if isinstance(bn, torch.nn.BatchNorm1d) and len(shape) == 4:
            bn = torch.nn.BatchNorm2d(shape[order[1]]).double().train(training)
        h = base.clone().requires_grad_()
        x = h.permute(order)
        seen = []
        x.register_hook(seen.append)
        y = bn(x, mask=mask) if isinstance(bn, tandem.nn.SyncBatchNorm) else bn(x)
        torch.autograd.grad(y.square().sum(), h, create_graph=create_graph)
        grads.append(seen[0])
    ours, theirs = grads
    assert ours.stride() == theirs.stride(), (ours.stride(), theirs.stride())
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("training", [True, False], ids=["train-untracked", "eval"])
def test_masked_forward_ad_and_torch_func_are_batchnorms_over_the_real_frames(training):
    """Forward-mode AD (a jvp) and torch.func.grad through the masked path (its kernels' backward is
    hand-written): BatchNorm1d's over the real frames alone, as for the first derivatives."""
    from torch.func import grad as func_grad
    from torch.func import jvp

    x = torch.randn(3, 2, 6, dtype=torch.float64)
    lengths = torch.tensor([6, 2, 4])
    mask = torch.arange(6) < lengths[:, None]
    ours = tandem.nn.SyncBatchNorm(2, track_running_stats=not training, dtype=torch.float64)
    ref = torch.nn.BatchNorm1d(2, track_running_stats=not training, dtype=torch.float64)
    with torch.no_grad():
        for m in (ours, ref):
            m.weight.copy_(torch.tensor([1.5, -0.5]))
            if not training:
                m.running_mean.copy_(torch.tensor([0.3, -0.2]))
                m.running_var.copy_(torch.tensor([2.0, 0.7]))
    ours.train(training), ref.train(training)

    def real(t: torch.Tensor) -> torch.Tensor:  # [N, C, L] -> the real frames [F, C]
        return t.permute(0, 2, 1)[mask]

    def f_ours(t):
        return real(ours(t, mask=mask)).sin().sum()

    def f_ref(t):
        return ref(real(t).T.unsqueeze(0)).sin().sum()  # [1, C, F]: the real frames as one sequence

    tangent = torch.randn_like(x)
    torch.testing.assert_close(jvp(f_ours, (x,), (tangent,)), jvp(f_ref, (x,), (tangent,)))
    expected = func_grad(f_ref)(x)
    torch.testing.assert_close(func_grad(f_ours)(x), expected)

    # compiled, in one graph (no boolean indexing): the query for a running transform is traced (the
    # compiled gradient came out zero in eval)
    def f_masked(t):
        return (ours(t, mask=mask) * mask[:, None, :]).sin().sum()

    torch.compiler.reset()
    torch.testing.assert_close(torch.compile(func_grad(f_masked), backend="aot_eager")(x), expected)


def _outcome(module: torch.nn.Module, x: torch.Tensor) -> tuple[type, str] | torch.Tensor:
    try:
        return module(x)
    except Exception as e:
        return type(e), str(e)


@pytest.mark.parametrize("case", ["untracked-other-channels", "eval-without-mean", "eval-without-var"])
def test_edge_states_as_torch(case):
    """Where torch's batch norm takes any channel count (no per-channel tensor reaches it) and which error
    an eval-mode module without one of its running statistics raises."""
    mods = [cls(3, affine=False) for cls in (tandem.nn.SyncBatchNorm, torch.nn.SyncBatchNorm)]
    for m in mods:
        if case == "untracked-other-channels":
            m.track_running_stats = False  # the buffers stay, unused in training
        else:
            m.eval()
            setattr(m, "running_mean" if case == "eval-without-mean" else "running_var", None)
    x = torch.randn(4, 5 if case == "untracked-other-channels" else 3)
    ours, theirs = (_outcome(m, x) for m in mods)
    if isinstance(theirs, tuple):
        assert ours == theirs
    else:
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("shape", [(0, 5), (0, 5, 2), (2, 5, 0)], ids=["0x5", "0x5x2", "2x5x0"])
def test_an_empty_batch_of_another_width_as_torch(shape, training):
    """torch's batch norm returns an empty batch as it is, whatever its channel count (tandem raised its
    channel RuntimeError): the same output and buffers as torch's module, without a process group."""
    mods = [cls(3).train(training) for cls in (tandem.nn.SyncBatchNorm, torch.nn.SyncBatchNorm)]
    x = torch.randn(shape)
    ours, theirs = (_outcome(m, x) for m in mods)
    assert isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor), (ours, theirs)
    assert ours.shape == theirs.shape == x.shape
    torch.testing.assert_close(mods[0].state_dict(), mods[1].state_dict())


@pytest.mark.parametrize(
    "case",
    ["one-row-other-channels", "one-frame-other-channels", "eps-0-other-channels", "eval-eps-negative"],
)
def test_errors_torch_checks_before_the_channels_and_eps_in_eval(case):
    """torch's batch_norm checks the batch and eps before it meets a wrong channel count (tandem raised
    its channel RuntimeError where torch raises ValueError); a negative eps in eval is refused with a
    mask too (the masked path computed NaN). Reference: torch's module, on the real frames when masked."""
    eps = {"eps-0-other-channels": 0.0, "eval-eps-negative": -0.5}.get(case, 1e-5)
    mods = [cls(4, eps=eps) for cls in (tandem.nn.SyncBatchNorm, torch.nn.SyncBatchNorm)]
    x = {"one-row-other-channels": torch.randn(1, 5), "one-frame-other-channels": torch.randn(1, 5, 1)}.get(
        case, torch.randn(3, 5 if case == "eps-0-other-channels" else 4)
    )
    if case == "eval-eps-negative":
        for m in mods:
            m.eval()
    ours, theirs = (_outcome(m, x) for m in mods)
    assert isinstance(theirs, tuple) and ours == theirs
    if case == "eval-eps-negative":  # the masked path: the same error for the real frames alone
        mask = torch.ones(3, 2, dtype=torch.bool)
        with pytest.raises(ValueError) as masked:
            mods[0](x.unsqueeze(-1).expand(3, 4, 2), mask=mask)
        assert (ValueError, str(masked.value)) == theirs


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(
    ("setting", "value"),
    [("eps", "1e-5"), ("momentum", "1e-1"), ("momentum", 0.1 + 0j), ("eps", Fraction(1, 10))],
    ids=["eps-str", "momentum-str", "momentum-complex", "eps-fraction"],
)
@pytest.mark.parametrize("other_channels", [False, True], ids=["", "other-channels"])
def test_an_eps_or_momentum_torch_cannot_take_is_its_type_error(setting, value, training, other_channels):
    """An ``eps`` or ``momentum`` that is no float (YAML reads ``1e-5`` as a string) is torch's TypeError
    with its words, masked (tandem's kernels, as across processes) or not, before a wrong channel count:
    the masked path compared the string with other words, or normalised with it in eval, as it did with a
    complex momentum."""
    mods = [
        cls(4, **{setting: value}).train(training)
        for cls in (tandem.nn.SyncBatchNorm, torch.nn.SyncBatchNorm)
    ]
    x = torch.randn(3, 5 if other_channels else 4, 2)
    theirs = _outcome(mods[1], x)
    assert isinstance(theirs, tuple)
    assert _outcome(mods[0], x) == theirs
    with pytest.raises(TypeError) as masked:
        mods[0](x, mask=torch.ones(3, 2, dtype=torch.bool))
    assert (TypeError, str(masked.value)) == theirs
    assert int(mods[0].num_batches_tracked) == 0 and not mods[0].running_mean.any()


@pytest.mark.parametrize(
    "case",
    [
        "eval-untracked-one-row-other-channels",
        "eval-untracked-eps-0-other-channels",
        "eval-untracked-eps-negative-other-channels",
        "train-one-row-eps-0",
        "tracking-switched-on-other-channels",
        "lazy-converted-before-its-first-forward",
    ],
)
def test_errors_in_torchs_order_where_batch_statistics_run_in_eval(case):
    """Which error comes first, as torch's batch norm raises it: in eval without running statistics the
    batch's statistics run, so its batch size and positive-eps checks come before a wrong channel count
    (tandem checked them as for eval); a batch of one with eps 0 is refused for its size first; tracking
    switched on without buffers is torch's assertion, not the channel count; a lazy batch norm converted
    before its first forward is F.batch_norm's ValueError on the uninitialised weight."""
    eps = {"eps-0": 0.0, "eps-negative": -1e-3}
    eps = next((v for k, v in eps.items() if k in case), 1e-5)
    classes = (tandem.nn.SyncBatchNorm, torch.nn.SyncBatchNorm)  # (torch's: F.batch_norm, with no group)
    if case.startswith("lazy"):
        mods = [cls.convert_sync_batchnorm(torch.nn.LazyBatchNorm1d()) for cls in classes]
    else:
        untracked = case.startswith("eval-untracked") or case.startswith("tracking")
        mods = [cls(3, eps=eps, track_running_stats=not untracked) for cls in classes]
    for m in mods:
        m.train(not case.startswith("eval"))
        if case.startswith("tracking"):
            m.track_running_stats = True
    x = torch.randn(1 if "one-row" in case else 2, 3 if case.startswith("train") else 4)
    ours, theirs = (_outcome(m, x) for m in mods)
    assert isinstance(theirs, tuple) and ours[0] == theirs[0]
    assert ours[1].split(" at 0x")[0] == theirs[1].split(" at 0x")[0]  # (a function's address in the words)


@pytest.mark.parametrize("masked", [False, True], ids=["", "masked"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_strided_input_changed_in_place_before_backward_raises_as_torchs(masked, training):
    """Every other frame of a tensor (no dense layout: the masked path normalises a copy), changed in
    place after the forward: autograd's in-place error, as torch's batch norm raises it (the masked path
    ran on with the copy); unchanged, torch's gradient."""
    outcomes = []
    for module in (torch.nn.BatchNorm1d(3), tandem.nn.SyncBatchNorm(3)):
        module.train(training)
        for change in (False, True):
            torch.manual_seed(0)
            leaf = torch.randn(4, 3, 10, requires_grad=True)
            h = leaf * 1
            ours = isinstance(module, tandem.nn.SyncBatchNorm)
            kwargs = {"mask": torch.ones(4, 5, dtype=torch.bool)} if masked and ours else {}
            y = module(h[:, :, ::2], **kwargs)
            if change:
                h.mul_(2)
            try:
                y.square().sum().backward()
                outcomes.append(leaf.grad)
            except RuntimeError as e:
                assert "modified by an inplace operation" in str(e)
                outcomes.append("raised")
    theirs, ours = outcomes[:2], outcomes[2:]
    assert ours[1] == theirs[1] == "raised"
    torch.testing.assert_close(ours[0], theirs[0])


def test_training_without_num_batches_tracked_raises_torchs_assertion():
    mods = [tandem.nn.SyncBatchNorm(3), torch.nn.SyncBatchNorm(3)]
    for m in mods:
        m.num_batches_tracked = None
    ours, theirs = (_outcome(m, torch.randn(4, 3)) for m in mods)
    assert theirs == (AssertionError, "num_batches_tracked must not be None") == ours
    # torch checks the channels first: an input of none is its ValueError (tandem's assertion came first)
    ours, theirs = (_outcome(m, torch.randn(4, 0)) for m in mods)
    assert theirs == ours and theirs[0] is ValueError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"mask": torch.ones(3, 2)}, "mask: expected a bool tensor", id="mask-dtype"),
        pytest.param(
            {"mask": torch.ones(3, 3, dtype=torch.bool)}, r"mask: expected shape \[3, 2\]", id="mask-shape"
        ),
        pytest.param(
            {"lengths": torch.tensor([1, 2])},
            "lengths: expected a 1-D integer tensor of 3",
            id="lengths-size",
        ),
        pytest.param(
            {"lengths": torch.tensor([1, 2, 3])}, r"lengths: expected values in \[0, 2\]", id="lengths-range"
        ),
        pytest.param(
            {"mask": torch.ones(3, 2, dtype=torch.bool), "lengths": torch.tensor([1, 2, 2])},
            "got both",
            id="both",
        ),
    ],
)
def test_bad_mask_or_lengths(kwargs, message):
    bn = tandem.nn.SyncBatchNorm(4)
    with pytest.raises(ValueError, match=message):
        bn(torch.randn(3, 4, 2), **kwargs)
    assert int(bn.num_batches_tracked) == 0


def test_lengths_need_3d_and_packed_takes_no_mask():
    bn = tandem.nn.SyncBatchNorm(4)
    with pytest.raises(ValueError, match="only for 3-D input"):
        bn(torch.randn(3, 4, 2, 2), lengths=torch.tensor([1, 2, 2]))
    packed = pack_padded_sequence(torch.randn(3, 2, 4), torch.tensor([3, 2]))
    with pytest.raises(ValueError, match="PackedSequence has no padding"):
        bn(packed, mask=torch.ones(6, dtype=torch.bool))


# a batch norm without its bias, where the installed torch has the argument (2.13 has, 2.11 has not)
NO_BIAS = {"bias": False} if tandem.nn.syncbn.TAKES_BIAS else {}


def test_convert_sync_batchnorm_round_trip():
    """Every BatchNorm*d becomes a tandem.nn.SyncBatchNorm sharing its tensors; state_dict loads both
    ways; outputs are unchanged (no process group: plain batch norm)."""
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4, momentum=None),
        torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 6), torch.nn.BatchNorm1d(6, affine=False)
        ),
        torch.nn.BatchNorm1d(6, eps=1e-3, **NO_BIAS),
    )
    net(torch.randn(5, 3, 6, 6))  # non-trivial running stats
    net.eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(5, 3, 6, 6)
    want = net(x)
    bn = net[1]
    conv = tandem.nn.SyncBatchNorm.convert_sync_batchnorm(net, process_group=None)
    kinds = [type(m) for m in conv.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert kinds == [tandem.nn.SyncBatchNorm] * 3
    assert conv[1].weight is bn.weight and conv[1].running_mean is bn.running_mean
    assert conv[1].momentum is None and conv[3].eps == 1e-3 and not conv[2][2].affine
    assert (conv[3].bias is None) == bool(NO_BIAS)
    assert not conv[1].training
    assert list(conv.state_dict()) == list(before)
    assert all(torch.equal(conv.state_dict()[k], v) for k, v in before.items())
    assert torch.equal(conv(x), want)
    fresh = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4, momentum=None),
        torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 6), torch.nn.BatchNorm1d(6, affine=False)
        ),
        torch.nn.BatchNorm1d(6, eps=1e-3, **NO_BIAS),
    )
    fresh.load_state_dict(conv.state_dict())
    fresh.eval()
    assert torch.equal(fresh(x), want)
    single = tandem.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm1d(3))
    assert type(single) is tandem.nn.SyncBatchNorm


# torch 2.11's batch norms, as far as SyncBatchNorm's constructor sees them: no ``bias`` argument
_TORCH_WITHOUT_BIAS = """
import torch

base = torch.nn.modules.batchnorm._BatchNorm.__init__
sync = torch.nn.SyncBatchNorm.__init__

class _BatchNorm:  # the functions' qualified names are what a TypeError names
    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 device=None, dtype=None):
        base(self, num_features, eps, momentum, affine, track_running_stats, device, dtype)

class SyncBatchNorm:
    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_group=None, device=None, dtype=None):
        sync(self, num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype)

torch.nn.modules.batchnorm._BatchNorm.__init__ = _BatchNorm.__init__
torch.nn.SyncBatchNorm.__init__ = SyncBatchNorm.__init__
import tandem
assert not tandem.nn.syncbn.TAKES_BIAS
for cls in (torch.nn.SyncBatchNorm, tandem.nn.SyncBatchNorm):
    try:
        cls(4, bias=False)
    except TypeError as e:
        print(e)
bn = tandem.nn.SyncBatchNorm(4, 1e-3, None, False, True, None, "cpu", torch.float64)
print(bn.eps, bn.momentum, bn.affine, bn.running_mean.dtype)
net = tandem.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(3)))
print(type(net[0]).__name__)
# a bias taken off by hand: copied over as None, as torch 2.11's conversion does (2.13's own conversion
# passes bias=, so it is not run under this simulation)
bn = torch.nn.BatchNorm1d(3)
bn.bias = None
conv = tandem.nn.SyncBatchNorm.convert_sync_batchnorm(bn)
print(type(conv).__name__, conv.bias is None, conv.weight is bn.weight)
"""


def test_constructor_of_a_torch_without_bias_refuses_it_as_torch_does():
    """Under a torch whose batch norms take no ``bias`` (2.11; simulated in a fresh process), SyncBatchNorm
    has that torch's signature: ``bias=`` is torch's own TypeError, the rest builds as before, and a batch
    norm whose bias was set to None converts as torch converts it."""
    src = Path(__file__).resolve().parents[2] / "src"
    done = subprocess.run(
        [sys.executable, "-c", _TORCH_WITHOUT_BIAS],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(src)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    refusal = "SyncBatchNorm.__init__() got an unexpected keyword argument 'bias'"
    converted = "SyncBatchNorm True True"  # tandem's passed bias=False there: that torch's TypeError
    assert done.stdout.splitlines() == [
        refusal,
        refusal,
        "0.001 None False torch.float64",
        "SyncBatchNorm",
        converted,
    ]


# Every way of calling the constructor that torch.nn.SyncBatchNorm takes or refuses: the same module or
# the same error (type and message).
CONSTRUCTOR_CALLS = {
    "all-positional": ((4, 1e-3, 0.2, False, False, None, "cpu", torch.float64), {}),
    "bias-off": ((4,), dict(bias=False)),
    "momentum-none": ((4,), dict(momentum=None)),
    "unknown-keyword": ((4,), dict(foo=1)),
    "no-arguments": ((), {}),
    "num_features-zero": ((0,), {}),
    "num_features-float": ((4.0,), {}),
    "dtype-int": ((4,), dict(dtype=torch.int64)),
    "device-meta": ((4,), dict(device="meta")),
    "eps-negative": ((4,), dict(eps=-1.0)),
}


@pytest.mark.parametrize("call", list(CONSTRUCTOR_CALLS))
def test_constructor_takes_and_refuses_what_torch_does(call: str):
    args, kwargs = CONSTRUCTOR_CALLS[call]
    outcomes = []
    for cls in (torch.nn.SyncBatchNorm, tandem.nn.SyncBatchNorm):
        try:
            module = cls(*args, **kwargs)
        except Exception as e:
            outcomes.append((type(e), str(e)))
        else:
            outcomes.append(
                (str(module), [(n, t.shape, t.dtype, t.device) for n, t in module.state_dict().items()])
            )
    assert outcomes[1] == outcomes[0]


def test_masked_second_derivative_without_real_frames_is_zero_as_torchs():
    """Every frame masked out is BatchNorm of an empty batch, whose gradients are 0: with create_graph=True
    (a gradient penalty) and under torch.func.grad the mean of no frame was 0 / 0, and the weight's
    gradient NaN."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    gy = torch.randn(2, 3, 4, dtype=torch.float64)
    bn = tandem.nn.SyncBatchNorm(3).double()
    gx, gw, gb = torch.autograd.grad(bn(x, mask=mask), (x, bn.weight, bn.bias), gy, create_graph=True)
    assert not gx.any() and not gw.any() and not gb.any()
    (gx.square().sum() + gw.square().sum()).backward()
    assert not bn.weight.grad.isnan().any()
    free = tandem.nn.SyncBatchNorm(3, track_running_stats=False).double()
    params = {k: v.detach() for k, v in free.named_parameters()}

    def loss(p):
        return (torch.func.functional_call(free, p, (x.detach(),), {"mask": mask}) * gy).sum()

    assert not torch.func.grad(loss)(params)["weight"].any()


def test_masked_second_derivative_of_half_input_stays_finite():
    """float16 input of a small variance with a mask, create_graph=True: the normalisation recomputed for
    the second derivative ran in float16, where var^-1.5 overflowed (an inf/NaN input gradient); now in
    float32 as the kernels, the gradient of the plain backward to float16's rounding."""
    torch.manual_seed(0)
    x = (torch.randn(8, 3, 5, dtype=torch.float64) * 0.01).half()
    mask = torch.ones(8, 5, dtype=torch.bool)
    gy = torch.randn(8, 3, 5, dtype=torch.float64).half()
    bn = tandem.nn.SyncBatchNorm(3).half()
    grads = []
    for create_graph in (False, True):
        leaf = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(bn(leaf, mask=mask), leaf, gy, create_graph=create_graph)
        grads.append(g.detach().double())
    assert grads[1].isfinite().all()
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-2, atol=2e-2 * grads[0].abs().max().item())


@pytest.mark.parametrize("case", ["eval-dx-frozen", "train-dbias", "train-dweight-x-constant"])
def test_masked_create_graph_gradients_are_attached_as_torchs(case):
    """A gradient penalty through masked batch norm on a gradient that depends on no differentiable input
    (dx in eval with a frozen weight, dbias, dweight of an input without grad): torch's comes with its
    double-backward node, so the penalty runs (the inputs' gradients stay None); tandem's came back
    detached and the penalty raised. Reference: BatchNorm1d, every frame real."""
    torch.manual_seed(0)
    x0 = torch.randn(4, 3, 5)
    mask = torch.ones(4, 5, dtype=torch.bool)
    outcomes = []
    for cls in (torch.nn.BatchNorm1d, tandem.nn.SyncBatchNorm):
        m = cls(3).train(case != "eval-dx-frozen")
        if case == "eval-dx-frozen":
            m.requires_grad_(False)
        x = x0.clone().requires_grad_(case != "train-dweight-x-constant")
        wrt = {"eval-dx-frozen": x, "train-dbias": m.bias, "train-dweight-x-constant": m.weight}[case]
        y = m(x) if cls is torch.nn.BatchNorm1d else m(x, mask=mask)
        (g,) = torch.autograd.grad(
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(), wrt, create_graph=True
        )
        g.square().sum().backward()
        grads = [t.grad is None for t in (x, m.weight, m.bias)]
        outcomes.append((g.requires_grad, grads, g.detach()))
    assert outcomes[1][:2] == outcomes[0][:2]
    torch.testing.assert_close(outcomes[1][2], outcomes[0][2])


def test_masked_eval_gradient_of_a_non_finite_frame_is_torchs():
    """In eval torch's input gradient is dy * weight * invstd whatever x holds; the masked backward formed
    (x - mean) * 0 + ..., so an inf or NaN frame's gradient was NaN."""
    x = torch.tensor([[[0.5, float("inf"), -1.0, float("nan")]]])
    mask = torch.tensor([[True, True, True, False]])
    dy = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    ref, ours = torch.nn.BatchNorm1d(1).eval(), tandem.nn.SyncBatchNorm(1).eval()
    with torch.no_grad():
        for m in (ref, ours):
            m.running_mean.fill_(0.25)
            m.running_var.fill_(4.0)
            m.weight.fill_(1.5)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    (want,) = torch.autograd.grad(ref(a), a, dy)
    (got,) = torch.autograd.grad(ours(b, mask=mask), b, dy)
    torch.testing.assert_close(got[..., :3], want[..., :3])
    assert got[..., 3].item() == 0.0  # a padded frame's gradient is 0


def test_torch_jit_script_of_a_model_holding_it_fails_with_a_runtime_error_as_torchs():
    """Neither torch's SyncBatchNorm nor tandem's compiles; torch's fails with a RuntimeError, tandem's
    failed with TorchScript's NotSupportedError (no RuntimeError: a fallback to tracing missed it), and
    the model is left as it was."""
    import warnings

    errors = []
    for cls in (torch.nn.SyncBatchNorm, tandem.nn.SyncBatchNorm):
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), cls(4))
        with warnings.catch_warnings(), pytest.raises(Exception) as caught:
            warnings.simplefilter("ignore")  # torch.jit.script is deprecated (torch 2.13)
            torch.jit.script(model)
        errors.append(caught.value)
        assert type(model[1]) is cls
    assert isinstance(errors[0], RuntimeError) and type(errors[1]) is RuntimeError
    assert "torch.jit.script cannot compile it" in str(errors[1])

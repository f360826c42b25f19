"""``tandem.parallel.ZeroAdagrad``: Adagrad with its state sharded over the ranks (ZeRO stage 1).

Every rank keeps the whole model, but only 1/N of Adagrad's ``sum`` state: the parameters of each
(device, dtype) are laid end to end in one flat index space (in ``param_groups`` order), which is cut
into N contiguous shards of equal length (to one element: rank r owns ``[r * n // N, (r + 1) * n // N)``).
A shard boundary may fall inside a parameter; for dtypes that step through torch's per-element ops rather
than its fused kernel (bfloat16, float16), only at a multiple of 64 elements from the parameter's start:
those ops round half types differently in their vectorised body than in its scalar tail, so a slice cut
elsewhere gave a few elements other bits than the whole parameter's step (and than another world size's).
A step then runs:

1. the gradients are already averaged over the ranks: the model is wrapped in
   :class:`tandem.parallel.DistributedDataParallel` (or torch's), whose bucketed all-reduce runs during
   backward, hidden behind it;
2. each rank updates only its shard of every parameter, with its shard of ``sum``, in one fused
   ``tandem.ops.adagrad`` call per parameter group (the slices are 1-D views: no copies);
3. each rank broadcasts its updated shard to the others (one broadcast per shard piece of at least
   512 KiB, written in place in the parameters; smaller consecutive pieces of one owner travel together
   through a buffer of up to 4 MiB), all asynchronous, each waited for with a deadline.

Why the DDP all-reduce rather than a reduce-scatter of the gradients: ZeRO stage 1 keeps whole
gradients anyway (stage 2 would shard them), the all-reduce is already overlapped with backward while a
reduce-scatter in ``step()`` would be exposed, and Gloo's reduce-scatter is slower than its all-reduce
(32 MiB of float32 on 2 ranks of a 2-core machine: 36.5 ms against 25.8 ms; 3 ranks: 77 against 56 ms).
Why broadcasts for the gather: on the same machine, the N broadcasts of the shards took 13.9 ms for
32 MiB on 2 ranks (26.9 ms on 3) where ``all_gather_into_tensor`` took 52 ms (85 ms) and an all-reduce
of a zero-filled buffer 35 ms (72 ms); torch's ``ZeroRedundancyOptimizer`` broadcasts as well.

State and checkpoints: ``opt.state[p]`` holds ``"step"`` (a 0-d float32 tensor, replicated: 4 bytes a
parameter) and ``"sum"``, a 1-D view of this rank's slice of ``p``'s accumulator (empty where the rank
owns none of ``p``). As with ``ZeroRedundancyOptimizer``, :meth:`ZeroAdagrad.consolidate_state_dict`
(called on every rank) gathers the full state on one rank, where :meth:`ZeroAdagrad.state_dict` then
returns it in ``torch.optim.Adagrad``'s format; :meth:`ZeroAdagrad.load_state_dict` (called on every
rank with the full state, of a ZeroAdagrad, a ``torch.optim.Adagrad`` or a ``tandem.optim.Adagrad``)
keeps each rank's shard.
"""

from __future__ import annotations

import bisect
import copy
import datetime
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from tandem.ops.adagrad import adagrad_unchecked, hyperparameters
from tandem.ops.adagrad.reference import fused_adagrad_supported
from tandem.optim.adagrad import GROUP_DEFAULTS, check_hyperparameters
from tandem.parallel.comm import (
    all_reduce,
    check_same_on_all_ranks,
    group_timeout_seconds,
    result,
    timeout_seconds,
    wait_event,
    watch,
)

__all__ = ["ZeroAdagrad", "shard_layout"]

_WHO = "ZeroAdagrad"
# Pieces of at least this size are broadcast in place; smaller consecutive ones of an owner share a
# buffer of up to _COALESCE_BYTES, so a model of many small tensors is not one collective per tensor.
_INPLACE_BYTES = 512 * 1024
_COALESCE_BYTES = 4 * 1024 * 1024
_HYPER = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "maximize")


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened parameter ``index``, owned by group rank ``owner``;
    ``flat`` is where ``start`` lies in the flat space of the parameter's (device, dtype)."""

    index: int
    start: int
    stop: int
    owner: int
    flat: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def shard_layout(
    params: list[Tensor], world: int
) -> tuple[list[Piece], dict[tuple[torch.device, torch.dtype], list[int]]]:
    """Cut the parameters of each (device, dtype) into ``world`` contiguous shards of equal length (half
    types: each cut moved back to its parameter's start plus a multiple of :data:`HALF_CUT_ALIGN` elements).

    Returns the pieces (parameter slices, each within one shard) in flat order, and for each
    (device, dtype) the shard boundaries ``[0, n // world, ..., n]`` (``n`` elements in all).

    Example::

        >>> pieces, bounds = shard_layout([torch.zeros(5), torch.zeros(2)], world=2)
        >>> [(p.index, p.start, p.stop, p.owner) for p in pieces]
        [(0, 0, 3, 0), (0, 3, 5, 1), (1, 0, 2, 1)]
        >>> bounds
        {(device(type='cpu'), torch.float32): [0, 3, 7]}
    """
    members: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        members.setdefault((p.device, p.dtype), []).append(i)
    pieces: list[Piece] = []
    bounds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for key, idx in members.items():
        sizes = [params[i].numel() for i in idx]
        total = sum(sizes)
        cut = [total * r // world for r in range(world + 1)]
        if not fused_adagrad_supported(*key):
            cut = _aligned_cuts(cut, sizes)
        bounds[key] = cut
        offset = 0
        for i in idx:
            a, b = offset, offset + params[i].numel()
            for r in range(world):
                lo, hi = max(a, cut[r]), min(b, cut[r + 1])
                if lo < hi:
                    pieces.append(Piece(i, lo - a, hi - a, r, lo))
            offset = b
    return pieces, bounds


# where a half-type parameter may be cut: torch's elementwise CPU loops take 2 vectors a pass (64 bfloat16 or
# float16 elements with AVX-512) and the rest apart, rounded otherwise; a cut at a multiple of this from
# the parameter's start leaves every element where the whole parameter's step has it
HALF_CUT_ALIGN = 64


def _aligned_cuts(cut: list[int], sizes: list[int]) -> list[int]:
    """``cut`` (flat offsets over parameters of ``sizes`` laid end to end), each moved back to the start of
    the parameter it falls in plus a multiple of :data:`HALF_CUT_ALIGN` (still in order)."""
    starts = list(itertools.accumulate(sizes, initial=0))
    aligned = []
    for c in cut:
        start = starts[bisect.bisect_right(starts, c) - 1]
        aligned.append(start + (c - start) // HALF_CUT_ALIGN * HALF_CUT_ALIGN)
    return aligned


@dataclass
class _Transfer:
    """One broadcast of the parameter update: a piece in place, or consecutive small pieces together."""

    owner: int
    pieces: list[Piece]
    numel: int
    dtype: torch.dtype
    device: torch.device


def _agree(
    described: list[str], group: dist.ProcessGroup | None, device: torch.device, timeout: float
) -> None:
    """The constructor's agreement: every rank describes its parameters and hyperparameters (or its
    refusal of them, :func:`_refused`), and all raise the same ValueError where they differ."""
    check_same_on_all_ranks(
        described,
        group,
        device,
        timeout,
        "the optimizer's parameters and hyperparameters",
        who=_WHO,
        hint="Every rank must pass the same parameters, in the same order.",
    )


def _refused(error: Exception, group: dist.ProcessGroup | None, params: list[Any]) -> None:
    """A rank's constructor refused its arguments (``error``): take part in the agreement that the other
    ranks' constructors wait in, so that each of them raises at once (a ValueError naming this rank's
    error: the entries differ) instead of waiting for the timeout, 30 minutes by default. Every rank given
    the same bad arguments agrees, and raises its own error. Nothing is done where no group can be used
    (none initialised, one of one rank, a group this rank is not in); the agreement's own failure is not
    raised (the caller raises ``error``)."""
    try:
        if group is None and not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_world_size(group) <= 1:
            return
        tensors = [p for p in params if isinstance(p, Tensor)]
        if tensors:
            device = tensors[0].device
        elif dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        _agree(
            [f"this rank's refusal: {type(error).__name__}: {error}"],
            group,
            device,
            group_timeout_seconds(group),
        )
    except Exception:
        pass


class ZeroAdagrad(Optimizer):
    r"""Adagrad whose ``sum`` state is sharded over the ranks: each rank keeps and updates 1/N of it.

    ``torch.optim.Adagrad``'s arguments, defaults, checks and update rule; the model's gradients must
    already be averaged over the ranks when ``step()`` runs (wrap the model in
    :class:`tandem.parallel.DistributedDataParallel`), as with torch's ``ZeroRedundancyOptimizer``.
    ``step()`` updates this rank's shard of every parameter with the fused ``tandem.ops.adagrad`` and
    broadcasts it, so every rank ends the step with the same, whole parameters. See the module
    docstring for the layout and the communication.

    Args:
        params: iterable of parameters or of dicts defining parameter groups; the same, in the same
            order, on every rank (checked: a ``ValueError`` on every rank otherwise). Parameters must
            be dense and of a real floating dtype, and so must their gradients, of their parameter's
            dtype and shape (a ``RuntimeError`` on every rank at ``step()`` otherwise); a
            non-contiguous parameter (``model.to(memory_format=torch.channels_last)``, before or after
            the optimizer is made) steps through a contiguous copy.
        lr, lr_decay, weight_decay, initial_accumulator_value, eps, maximize: as
            ``torch.optim.Adagrad`` (defaults 1e-2, 0, 0, 0, 1e-10, False).
        foreach, fused: accepted (and kept in the parameter groups, so that a consolidated state dict
            loads into ``torch.optim.Adagrad``); the fused kernel always runs.
        differentiable: must be False.
        process_group: the ranks that share the state (default: the default group).
        timeout: seconds (or a ``timedelta``) to wait for any collective before raising
            :class:`~tandem.parallel.CommunicationError`; default: the process group's own timeout;
            ``float('inf')`` sets no deadline (the process group's own still ends a collective).

    Example::

        >>> model = tandem.parallel.DistributedDataParallel(net)
        >>> opt = tandem.parallel.ZeroAdagrad(model.parameters(), lr=0.1)
        >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        >>> opt.consolidate_state_dict(to=0)          # on every rank
        >>> if rank == 0:
        ...     torch.save(opt.state_dict(), "opt.pt")  # loads into torch.optim.Adagrad too
    """

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-2,
        lr_decay: float = 0,
        weight_decay: float = 0,
        initial_accumulator_value: float = 0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        process_group: dist.ProcessGroup | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> None:
        # torch.optim.Adagrad's checks and messages, then ours: all before any state. A rank that refuses
        # its arguments tells the others first (see _refused), which otherwise wait in the agreement below
        try:
            check_hyperparameters(lr, lr_decay, weight_decay, initial_accumulator_value, eps)
            if fused and differentiable:
                raise RuntimeError("`fused` does not support `differentiable`")  # torch's check, first
            if fused and foreach:
                raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
            if differentiable:
                raise ValueError(
                    "ZeroAdagrad: expected differentiable=False (a sharded step is not differentiable)"
                )
            seconds = timeout_seconds(timeout, _WHO, process_group)  # a bad one first; None: the group's own
            if process_group is None and not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "ZeroAdagrad: the default process group has not been initialized; call "
                    "torch.distributed.init_process_group(...) first or pass process_group="
                )
            self.timeout = seconds
            defaults = dict(
                lr=lr,
                lr_decay=lr_decay,
                eps=eps,
                weight_decay=weight_decay,
                initial_accumulator_value=initial_accumulator_value,
                foreach=foreach,
                maximize=maximize,
                differentiable=False,
                fused=fused,
            )
            self._constructing = True
            super().__init__(params, defaults)
            self._constructing = False
            self._params = [p for group in self.param_groups for p in group["params"]]
            first: dict[int, int] = {}
            for i, p in enumerate(self._params):
                problem = _unsupported(p)
                if problem:
                    raise ValueError(f"ZeroAdagrad: parameter {i} (shape {tuple(p.shape)}) is {problem}")
                if id(p) in first:
                    # torch's Adagrad warns and updates it twice a step; its shards would be cut twice here
                    raise ValueError(
                        f"ZeroAdagrad: parameter {i} (shape {tuple(p.shape)}) is parameter {first[id(p)]} "
                        "again; pass each parameter once"
                    )
                first[id(p)] = i
        except Exception as e:
            _refused(e, process_group, getattr(self, "_params", None) or [])
            raise
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._ranks = dist.get_process_group_ranks(process_group) if self.world_size > 1 else [0]
        if self.world_size > 1:
            described = [f"parameter {i}: {list(p.shape)}, {p.dtype}" for i, p in enumerate(self._params)]
            described += [
                f"group {g}: {len(group['params'])} parameters, "
                + ", ".join(f"{k}={group[k]!r}" for k in _HYPER if not isinstance(group[k], Tensor))
                for g, group in enumerate(self.param_groups)
            ]
            _agree(described, process_group, self._params[0].device, self.timeout)

        # what the shards are cut for: a parameter converted since (model.float()) is refused at step()
        self._made_as = [(p.shape, p.dtype, p.device) for p in self._params]
        pieces, self._bounds = shard_layout(self._params, self.world_size)
        self._mine: dict[int, Piece] = {pc.index: pc for pc in pieces if pc.owner == self.rank}
        self._transfers = _plan(pieces, self._params) if self.world_size > 1 else []
        # This rank's slice of each (device, dtype)'s accumulators: one flat tensor; state sums view it.
        self._shards: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        for (device, dtype), cut in self._bounds.items():
            self._shards[(device, dtype)] = torch.empty(
                cut[self.rank + 1] - cut[self.rank], dtype=dtype, device=device
            )
        for i, p in enumerate(self._params):
            self.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "sum": self._sum_view(i),
            }
            # the constructor's value, not a group's own: torch.optim.Adagrad's rule
            self.state[p]["sum"].fill_(initial_accumulator_value)
        self._steps_taken = 0
        # (to, steps taken, every parameter's state): what consolidate_state_dict gathered
        self._consolidated: tuple[int, int, dict[int, dict[str, Tensor]]] | None = None

    # ------------------------------------------------------------------------------------------
    # layout helpers

    def _group_indices(self, g: int) -> range:
        start = sum(len(group["params"]) for group in self.param_groups[:g])
        return range(start, start + len(self.param_groups[g]["params"]))

    def _sum_view(self, i: int) -> Tensor:
        p = self._params[i]
        shard = self._shards[(p.device, p.dtype)]
        piece = self._mine.get(i)
        if piece is None:
            return shard[0:0]
        offset = piece.flat - self._bounds[(p.device, p.dtype)][self.rank]
        return shard[offset : offset + piece.numel]

    def _slice(self, i: int, t: Tensor) -> Tensor:
        """This rank's elements of ``t`` (parameter ``i`` or its gradient), as a 1-D view when possible."""
        piece = self._mine.get(i)
        flat = t.reshape(-1)
        return flat[0:0] if piece is None else flat[piece.start : piece.stop]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_constructing", True):
            raise RuntimeError(
                "ZeroAdagrad: add_param_group after construction is not supported (the shards are cut "
                "once); pass every parameter group to the constructor"
            )
        super().add_param_group(param_group)

    # ------------------------------------------------------------------------------------------
    # step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update this rank's shard of every parameter that has a gradient, then share the shards."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Check every parameter and gradient and read every group first, on every rank: what any rank
        # refuses raises on all of them (its own error there) before anything has moved anywhere.
        staged: dict[int, Tensor] = {}
        work: list = []
        refusal: Exception | None = None
        try:
            self._check_params_as_made()
            # A non-contiguous parameter (``model.to(memory_format=torch.channels_last)``, before or after
            # the optimizer was made, as torch.optim.Adagrad allows): its shards, runs of its elements in
            # logical order, are no views of it. It steps and takes the others' shards in a contiguous
            # copy, copied back.
            staged = {
                i: p.contiguous()
                for i, p in enumerate(self._params)
                if not p.is_contiguous() and (self.world_size > 1 or p.grad is not None)
            }
            work = self._gather(staged)
        except Exception as e:  # every kind: the other ranks must not step either
            refusal = e
        stepped = self._agree(refusal)
        for (lr, lr_decay, weight_decay, eps, maximize), ps, gs, ss, ts in work:
            adagrad_unchecked(
                ps,
                gs,
                ss,
                ts,
                lr=lr,
                lr_decay=lr_decay,
                weight_decay=weight_decay,
                eps=eps,
                maximize=maximize,
                differentiable=False,
                grad_scale=None,
                found_inf=None,
                return_max_change=False,
            )
        self._steps_taken += 1
        if self.world_size > 1:
            self._share_shards(staged, stepped)
        for i, whole in staged.items():
            if stepped[i]:
                self._params[i].copy_(whole)
        return loss

    def _gather(self, staged: dict[int, Tensor]) -> list:
        """Every group's hyper-parameters and this rank's slices of its parameters, gradients and state,
        checked: ``[(hyper, params, grads, sums, steps)]``."""
        work = []
        for g, group in enumerate(self.param_groups):
            ps, gs, ss, ts = [], [], [], []
            for i, p in zip(self._group_indices(g), group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                if grad.layout != torch.strided:
                    raise RuntimeError(
                        f"ZeroAdagrad: parameter {i} has a {grad.layout} gradient; only dense gradients "
                        "are supported (use torch.optim.Adagrad for sparse ones)"
                    )
                if grad.shape != p.shape or grad.dtype != p.dtype or grad.device != p.device:
                    raise RuntimeError(
                        f"ZeroAdagrad: expected the gradient of parameter {i} to match it (shape "
                        f"{tuple(p.shape)}, {p.dtype}, {p.device}), got shape {tuple(grad.shape)}, "
                        f"{grad.dtype}, {grad.device}"
                    )
                state = self.state[p]
                ps.append(self._slice(i, staged.get(i, p)))
                gs.append(self._slice(i, grad))
                ss.append(state["sum"])
                ts.append(state["step"])  # counted on every rank, so any rank can report it
            if ps:
                # read as torch's update reads them; what it refuses, with its error, before any group moves
                hyper = hyperparameters(
                    group["lr"], group["lr_decay"], group["weight_decay"], group["eps"], group["maximize"],
                    zip(ps, gs, ss, ts),
                )  # fmt: skip
                work.append((hyper, ps, gs, ss, ts))
        return work

    def _check_params_as_made(self) -> None:
        for i, (p, (shape, dtype, device)) in enumerate(zip(self._params, self._made_as)):
            if p.shape != shape or p.dtype != dtype or p.device != device:
                raise RuntimeError(
                    f"ZeroAdagrad: parameter {i} is now {list(p.shape)}, {p.dtype} on {p.device}; it was "
                    f"{list(shape)}, {dtype} on {device} when the optimizer was made, and its shards are cut "
                    "for that (model.float(), .double() or .to(), or a new .data, since?): make the "
                    "optimizer after converting the model"
                )

    def _agree(self, refusal: Exception | None) -> list[bool]:
        """Which parameters step (those with a gradient), agreed by every rank, or every rank raises:
        ``refusal`` where this rank refused the step, a RuntimeError naming how many others did where they
        did (nothing moved anywhere), and a ValueError where a gradient is on some ranks only (DDP's
        averaged gradients are on every rank or on none: its shards would move on some ranks only). One
        all-reduce: an int32 a parameter, and one more that counts the refusals."""
        present = [p.grad is not None for p in self._params]
        if self.world_size == 1:
            if refusal is not None:
                raise refusal
            return present
        flags = torch.tensor(
            present + [refusal is not None], dtype=torch.int32, device=self._params[0].device
        )
        what = "the all-reduce of which parameters have a gradient"
        all_reduce(flags, self.process_group, self.timeout, what, who=_WHO)
        *counts, refused = flags.tolist()
        if refusal is not None:
            raise refusal
        if refused:
            raise RuntimeError(
                f"ZeroAdagrad: {refused} other rank(s) of {self.world_size} refused this step (each raised "
                "why); no rank stepped"
            )
        for i, count in enumerate(counts):
            if count not in (0, self.world_size):
                p = self._params[i]
                raise ValueError(
                    f"ZeroAdagrad: parameter {i} (shape {tuple(p.shape)}) has a gradient on {count} of "
                    f"{self.world_size} ranks; every rank must step with the same gradients (DDP's "
                    "averaged ones), or its shards would move on some ranks only"
                )
        return [count == self.world_size for count in counts]

    def _share_shards(self, staged: dict[int, Tensor], stepped: list[bool]) -> None:
        """Every rank's updated shard to every rank: one broadcast per transfer, all in flight at once.
        ``staged`` holds the contiguous copies that stand in for non-contiguous parameters. What did not
        step (no gradient on any rank) is not written: a frozen parameter that a graph saved keeps its
        version, as under torch.optim.Adagrad (a broadcast into it made that graph's backward raise on
        the ranks that do not own it)."""
        flats = [staged[i].view(-1) if i in staged else p.view(-1) for i, p in enumerate(self._params)]
        deadline = time.monotonic() + self.timeout
        pending = []
        for k, tr in enumerate(self._transfers):
            if not any(stepped[pc.index] for pc in tr.pieces):
                continue  # the same on every rank: the flags were agreed
            if len(tr.pieces) == 1:
                pc = tr.pieces[0]
                buf = flats[pc.index][pc.start : pc.stop]
            elif tr.owner == self.rank:
                buf = torch.cat([flats[pc.index][pc.start : pc.stop] for pc in tr.pieces])
            else:
                buf = torch.empty(tr.numel, dtype=tr.dtype, device=tr.device)
            work = dist.broadcast(buf, src=self._ranks[tr.owner], group=self.process_group, async_op=True)
            fut = work.get_future()
            pending.append((k, tr, buf, fut, watch(fut)))
        for k, tr, buf, fut, event in pending:
            what = (
                f"the broadcast of rank {tr.owner}'s updated parameters (transfer {k} of "
                f"{len(self._transfers)})"
            )
            wait_event(event, deadline, what, self.timeout, _WHO)
            result(fut, what, _WHO)
            if len(tr.pieces) > 1 and tr.owner != self.rank:
                offset = 0
                for pc in tr.pieces:
                    if stepped[pc.index]:
                        flats[pc.index][pc.start : pc.stop].copy_(buf[offset : offset + pc.numel])
                    offset += pc.numel

    # ------------------------------------------------------------------------------------------
    # state dict

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state on rank ``to`` of the process group; call it on every rank.

        Afterwards ``state_dict()`` on rank ``to`` returns ``torch.optim.Adagrad``'s format (every
        parameter's ``step`` and full-shape ``sum``), until the next ``step()``.
        """
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < self.world_size:
            raise ValueError(
                f"ZeroAdagrad.consolidate_state_dict: expected to (a rank of the process group) in "
                f"[0, {self.world_size}), got {to!r}"
            )
        gathered: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        deadline = time.monotonic() + self.timeout
        for key, shard in self._shards.items():
            cut = self._bounds[key]
            longest = max(cut[r + 1] - cut[r] for r in range(self.world_size))
            if self.world_size == 1:
                gathered[key] = [shard]
                continue
            # Gather wants equal sizes: shards differ by at most one element, padded here.
            send = torch.zeros(longest, dtype=shard.dtype, device=shard.device)
            send[: shard.numel()].copy_(shard)
            into = [torch.empty_like(send) for _ in range(self.world_size)] if self.rank == to else None
            work = dist.gather(send, into, dst=self._ranks[to], group=self.process_group, async_op=True)
            fut = work.get_future()
            what = f"the gather of the optimizer state on rank {to}"
            wait_event(watch(fut), deadline, what, self.timeout, _WHO)
            result(fut, what, _WHO)
            if into is not None:
                gathered[key] = into
        if self.rank != to:
            self._consolidated = (to, self._steps_taken, {})
            return
        state: dict[int, dict[str, Tensor]] = {}
        for i, p in enumerate(self._params):
            key = (p.device, p.dtype)
            whole = torch.empty(p.numel(), dtype=p.dtype, device=p.device)
            state[i] = {"step": self.state[p]["step"].clone(), "sum": whole.view(p.shape)}
        cut_of = self._bounds
        for pc in shard_layout(self._params, self.world_size)[0]:
            p = self._params[pc.index]
            key = (p.device, p.dtype)
            src = gathered[key][pc.owner]
            offset = pc.flat - cut_of[key][pc.owner]
            state[pc.index]["sum"].view(-1)[pc.start : pc.stop].copy_(src[offset : offset + pc.numel])
        self._consolidated = (to, self._steps_taken, state)

    def state_dict(self) -> dict[str, Any]:
        """The whole state, in ``torch.optim.Adagrad``'s format, on the rank it was consolidated to: the
        parameters' state as :meth:`consolidate_state_dict` gathered it, the parameter groups as they are now.

        Raises ``RuntimeError`` unless :meth:`consolidate_state_dict` ran on every rank since the last
        ``step()`` and this is the rank it gathered to.
        """
        if self._consolidated is None:
            raise RuntimeError(
                "ZeroAdagrad: the optimizer state has not been consolidated on this rank. Call "
                "consolidate_state_dict(to) on all ranks beforehand, then state_dict() on rank `to`."
            )
        to, taken, state = self._consolidated
        if taken != self._steps_taken:
            raise RuntimeError(
                f"ZeroAdagrad: the consolidated state is from before the last {self._steps_taken - taken} "
                "step(s); call consolidate_state_dict(to) on all ranks again"
            )
        if self.rank != to:
            raise RuntimeError(
                f"ZeroAdagrad: the state was consolidated on rank {to}, not on this rank ({self.rank}); "
                f"call state_dict() there"
            )
        # As torch.optim.Optimizer.state_dict: its hooks run, and every call returns a new dict (a post
        # hook may change or replace it) holding the state's tensors and the groups as they are now (a
        # scheduler may have stepped since the state was gathered), their values shared with the live ones.
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        groups = []
        for g, group in enumerate(self.param_groups):
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(self._group_indices(g))
            groups.append(packed)
        state_dict = {"state": {i: dict(entry) for i, entry in state.items()}, "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            replaced = post_hook(self, state_dict)
            if replaced is not None:
                state_dict = replaced
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state (ZeroAdagrad's consolidated one, or ``torch.optim.Adagrad``'s); every rank
        keeps its shard. Call it on every rank with the same state. Checks everything before changing
        anything. As torch's, it replaces the whole state (a parameter the dict has no state for starts
        afresh, as under torch 2.13; torch 2.11's Adagrad raises KeyError at its step) and takes copies of
        the groups' values. Its hooks run as torch.optim.Optimizer's: the pre-hooks on a shallow copy of
        ``state_dict`` (one may return another), the post-hooks once the state is loaded."""
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()
            for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
                replaced = pre_hook(self, state_dict)
                if replaced is not None:
                    state_dict = replaced
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict or "state" not in state_dict:
            raise ValueError(
                "ZeroAdagrad.load_state_dict: expected a dict with 'state' and 'param_groups' (a "
                f"consolidated or torch.optim.Adagrad state dict), got {type(state_dict).__name__}"
            )
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"ZeroAdagrad.load_state_dict: expected {len(self.param_groups)} parameter groups, "
                f"got {len(groups)}"
            )
        ids: list[Any] = []
        for g, (saved, group) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"ZeroAdagrad.load_state_dict: parameter group {g} has {len(group['params'])} "
                    f"parameters, the state dict's has {len(saved['params'])}"
                )
            ids.extend(saved["params"])
        saved_state = state_dict["state"]
        for i, (pid, p) in enumerate(zip(ids, self._params)):
            entry = saved_state.get(pid)
            if not entry:
                continue
            if "step" not in entry or "sum" not in entry:
                # torch loads it and fails at the parameter's next step with a KeyError
                raise KeyError(
                    f"ZeroAdagrad.load_state_dict: expected 'step' and 'sum' in the state of parameter {i}, "
                    f"got {list(entry)}"
                )
            try:
                float(entry["step"])
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(
                    f"ZeroAdagrad.load_state_dict: expected state['step'] of parameter {i} as a number or "
                    f"a 1-element tensor, got {entry['step']!r:.60}"
                ) from None
            total = entry["sum"]
            if not torch.is_tensor(total) or total.shape != p.shape:
                got = tuple(total.shape) if torch.is_tensor(total) else type(total).__name__
                raise ValueError(
                    f"ZeroAdagrad.load_state_dict: expected state['sum'] of parameter {i} of shape "
                    f"{tuple(p.shape)}, got {got}"
                )
        # Copies, as torch's deepcopy: a tensor lr that a scheduler changes in place must not change the
        # caller's dict (nor the caller's edits the groups).
        values = [copy.deepcopy({k: v for k, v in saved.items() if k != "params"}) for saved in groups]
        with torch.no_grad():
            for loaded, group in zip(values, self.param_groups):
                # the saved group replaces the current one, its parameters kept, as torch's (a key only the
                # current group has is dropped); then Adagrad's defaults for keys old checkpoints lack
                params, names = group["params"], group.get("param_names")
                group.clear()
                group.update(loaded, params=params)
                if names is not None:
                    group.setdefault("param_names", names)
                for key, default in GROUP_DEFAULTS.items():
                    group.setdefault(key, default)
            for i, (pid, p) in enumerate(zip(ids, self._params)):
                # The whole state is replaced, as torch's: a parameter the dict has no state for starts
                # afresh, as torch 2.13's Adagrad starts it at its next step (from the constructor's value).
                entry = saved_state.get(pid)
                state = self.state[p]
                if entry:
                    state["step"].fill_(float(entry["step"]))
                    state["sum"].copy_(self._slice(i, entry["sum"].to(p.device, p.dtype)))
                else:
                    state["step"].zero_()
                    state["sum"].fill_(self.defaults["initial_accumulator_value"])
        self._consolidated = None
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _unsupported(p: Tensor) -> str | None:
    if p.layout != torch.strided:
        return f"a {p.layout} tensor; expected a dense one"
    if not p.dtype.is_floating_point:
        return f"of dtype {p.dtype}; expected a real floating dtype"
    return None


def _plan(pieces: list[Piece], params: list[Tensor]) -> list[_Transfer]:
    """The broadcasts of a step, in the same order on every rank (from the layout alone)."""
    transfers: list[_Transfer] = []
    open_: _Transfer | None = None
    for pc in pieces:
        p = params[pc.index]
        nbytes = pc.numel * p.element_size()
        if nbytes >= _INPLACE_BYTES:
            transfers.append(_Transfer(pc.owner, [pc], pc.numel, p.dtype, p.device))
            continue
        same = (
            open_ is not None
            and open_.owner == pc.owner
            and open_.dtype == p.dtype
            and open_.device == p.device
            and (open_.numel + pc.numel) * p.element_size() <= _COALESCE_BYTES
        )
        if not same:
            open_ = _Transfer(pc.owner, [], 0, p.dtype, p.device)
            transfers.append(open_)
        open_.pieces.append(pc)
        open_.numel += pc.numel
    return transfers

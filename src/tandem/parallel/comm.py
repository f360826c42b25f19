"""Collectives with a deadline: every wait of ``tandem.parallel`` ends, with an error, in bounded time.

torch.distributed waits as long as the process group's timeout (30 minutes for Gloo by default) when a
peer is stuck. Here each asynchronous operation's future sets an event when it completes, and the
caller waits on the event until a deadline, so a dead or stuck rank turns into a
:class:`CommunicationError` on the survivors after ``timeout`` seconds at most.
"""

from __future__ import annotations

import datetime
import hashlib
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "group_timeout_seconds",
    "timeout_seconds",
    "wait_s",
    "CommunicationError",
    "watch",
    "wait_event",
    "result",
    "all_reduce",
    "wait_work",
    "broadcast_coalesced",
    "check_same_on_all_ranks",
]


# How long a rank waits for its peers before raising CommunicationError when neither a timeout= nor the
# process group's own timeout can be had: torch's default for a process group, 30 minutes.
DEFAULT_TIMEOUT_S = 1800.0


def group_timeout_seconds(group: dist.ProcessGroup | None) -> float:
    """The timeout ``group`` (None: the default group) was made with (``init_process_group(timeout=...)``,
    ``new_group(timeout=...)``), in seconds: what torch's collectives on it wait; :data:`DEFAULT_TIMEOUT_S`
    where the backend does not tell."""
    group = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError, ValueError):
            continue
    return DEFAULT_TIMEOUT_S


def timeout_seconds(
    timeout: float | datetime.timedelta | None, owner: str, group: dist.ProcessGroup | None = None
) -> float:
    """``timeout`` (seconds or a timedelta; None for the process ``group``'s own timeout, as torch's
    collectives wait) in seconds; ``owner`` names the class in the error a value of another kind (a
    TypeError) or a non-positive one (a ValueError) raises. ``float('inf')``, or any wait longer than
    :data:`threading.TIMEOUT_MAX`, sets no deadline (see :func:`wait_s`)."""
    if timeout is None:
        return group_timeout_seconds(group)
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (bool, str, bytes)) or not hasattr(timeout, "__float__"):
        # float() would take "5" and True as seconds
        raise TypeError(
            f"{owner}: expected timeout as seconds (a number) or a datetime.timedelta, got "
            f"{type(timeout).__name__} {timeout!r}"
        )
    else:
        seconds = float(timeout)
    if not seconds > 0:
        raise ValueError(f"{owner}: expected a positive timeout, got {timeout!r}")
    return seconds


def wait_s(seconds: float) -> float | None:
    """``seconds`` as a wait of :mod:`threading` (which refuses more than :data:`threading.TIMEOUT_MAX`,
    about 292 years, with an OverflowError): None, no deadline, above it; 0 below 0."""
    return None if seconds > threading.TIMEOUT_MAX else max(0.0, seconds)


class CommunicationError(RuntimeError):
    """A collective failed or did not complete in time: a peer rank has probably died or is stuck."""


def watch(fut: Future, on_done: Callable[[Future], None] | None = None) -> threading.Event:
    """An event set when ``fut`` completes (with a value or an error); ``on_done(fut)`` runs first."""
    event = threading.Event()

    def done(f: Future) -> None:
        # Runs on the backend's thread, where an exception would be lost: on_done keeps its own errors.
        try:
            if on_done is not None:
                on_done(f)
        finally:
            event.set()

    fut.add_done_callback(done)
    return event


def wait_event(
    event: threading.Event, deadline: float, what: str, timeout: float, who: str = "DistributedDataParallel"
) -> None:
    """Wait for ``event`` until ``deadline`` (``time.monotonic()`` seconds), else raise
    :class:`CommunicationError` naming ``what`` (and ``who`` waited: the class the user called)."""
    if not event.wait(wait_s(deadline - time.monotonic())):
        rank = dist.get_rank() if dist.is_initialized() else "?"
        raise CommunicationError(
            f"{who}: rank {rank} waited {timeout:g} s for {what} without it completing; "
            "another rank of the process group has probably died or is stuck. If ranks may legitimately "
            "fall this far apart (one rank writing a checkpoint), pass a larger timeout=."
        )


def result(
    fut: Future,
    what: str,
    who: str = "DistributedDataParallel",
    cause: str = "another rank has probably died",
):
    """The value of the completed ``fut``; its error as a :class:`CommunicationError` naming ``what`` and
    its likely ``cause``."""
    try:
        return fut.wait()  # done already; wait() also orders CUDA streams after the result
    except Exception as e:
        rank = dist.get_rank() if dist.is_initialized() else "?"
        raise CommunicationError(f"{who}: {what} failed on rank {rank}; {cause}: {e}") from e


def _run(work: dist.Work, deadline: float, what: str, timeout: float, who: str):
    fut = work.get_future()
    wait_event(watch(fut), deadline, what, timeout, who)
    return result(fut, what, who)


def wait_work(work: dist.Work, timeout: float, what: str, who: str = "DistributedDataParallel"):
    """The value of the collective ``work`` (its output tensors), waiting ``timeout`` seconds at most."""
    return _run(work, time.monotonic() + timeout, what, timeout, who)


def all_reduce(
    tensor: Tensor,
    group: dist.ProcessGroup | None,
    timeout: float,
    what: str,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    who: str = "DistributedDataParallel",
) -> None:
    """``tensor`` all-reduced in place over ``group``, waiting ``timeout`` seconds at most."""
    wait_work(dist.all_reduce(tensor, op=op, group=group, async_op=True), timeout, what, who)


def broadcast_coalesced(
    tensors: Sequence[Tensor],
    src: int,
    group: dist.ProcessGroup | None,
    timeout: float,
    what: str,
    who: str = "DistributedDataParallel",
) -> None:
    """Overwrite ``tensors`` with rank ``src``'s (a global rank): one broadcast per device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    deadline = time.monotonic() + timeout
    with torch.no_grad():
        pending = []
        for members in groups.values():
            flat = torch.cat([t.reshape(-1) for t in members])
            pending.append((members, flat, dist.broadcast(flat, src=src, group=group, async_op=True)))
        for members, flat, work in pending:
            _run(work, deadline, what, timeout, who)
            offset = 0
            for t in members:
                # as torch's DDP: a buffer that an earlier forward's graph saved (two forwards, then one
                # backward) keeps its version, or that backward would refuse it as modified in place
                with torch.autograd._unsafe_preserve_version_counter(t):
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def check_same_on_all_ranks(
    descriptions: Sequence[str],
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout: float,
    what: str,
    who: str = "DistributedDataParallel",
    hint: str = "Every rank must wrap the same model.",
) -> None:
    """Raise ``ValueError`` on every rank unless all ranks pass the same ``descriptions``.

    One all_gather of a 16-byte digest when they agree; when they differ every rank knows it from the
    same gathered digests, so all of them gather the descriptions to name the first difference, and
    all raise the same error: none is left waiting for the others.
    """
    world = dist.get_world_size(group)
    mine = torch.tensor(
        [len(descriptions), _digest("\n".join(descriptions))], dtype=torch.int64, device=device
    )
    gathered = [torch.empty_like(mine) for _ in range(world)]
    deadline = time.monotonic() + timeout
    _run(dist.all_gather(gathered, mine, group=group, async_op=True), deadline, what, timeout, who)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return
    everyone: list[list[str] | None] = [None] * world
    dist.all_gather_object(everyone, list(descriptions), group=group)
    reference = everyone[0] or []
    for rank, theirs in enumerate(everyone):
        theirs = theirs or []
        if theirs == reference:
            continue
        for i in range(max(len(reference), len(theirs))):
            a = reference[i] if i < len(reference) else "nothing"
            b = theirs[i] if i < len(theirs) else "nothing"
            if a != b:
                raise ValueError(
                    f"{who}: {what} differ across ranks: entry {i} is {a} on rank 0 "
                    f"but {b} on rank {rank} (rank 0 has {len(reference)} entries, rank {rank} "
                    f"{len(theirs)}). {hint}"
                )
    raise ValueError(f"{who}: {what} differ across ranks (digests {gathered})")

"""``tandem.parallel.DistributedDataParallel``: each bucket of gradients on the wire as soon as it is full.

How a synchronised step runs:

1. ``forward`` (grad enabled, outside ``no_sync()``) arms the gradient hooks; with
   ``find_unused_parameters=True`` it also walks the autograd graph from the outputs to find the
   parameters that this backward cannot reach (with ``static_graph=True``, as torch, it takes those
   the first step left without a gradient instead).
2. In backward, a hook on each parameter's gradient accumulator fires once its ``.grad`` is final
   (after the parameter's own post-accumulate-grad hooks): the gradient is copied (times
   ``1 / world_size``) into its slot of a flat bucket buffer (a one-parameter bucket with a contiguous
   gradient is reduced in the gradient itself). When a
   bucket is full and every bucket before it has been launched, its all-reduce starts
   (``async_op=True``, or through the communication hook), so buckets leave in the same order on
   every rank while the backward of the layers below goes on. For CPU tensors the copies and
   launches run on a communication thread, in order, and each bucket is copied back to ``.grad`` by
   the thread that completes its all-reduce: the autograd thread only does bookkeeping.
3. A callback queued on the autograd engine runs when backward ends (when the first gradient came
   inside a backward nested in another's node, a reentrant checkpoint's, and more may follow, it is
   queued again at the end of the enclosing one): parameters that got no gradient
   are filled in (zeros, or what ``no_sync()`` steps accumulated), the last buckets are launched, and
   every bucket is waited for, with a deadline, and written back to ``.grad`` if that has not
   happened yet (or ``.grad`` already is a view of the bucket with ``gradient_as_bucket_view=True``).
4. After the first synchronised backward the buckets are rebuilt in the order gradients actually
   became ready (rank 0's order, broadcast, so every rank cuts the same buckets).
5. Under ``join()`` (uneven inputs, torch's ``Join`` protocol) each forward first tells the others that
   this rank still trains and whether its step synchronises; a rank out of data answers every such step
   with the same collectives (buffers, zeros for each bucket, its last used map) until all have joined,
   and then every rank takes the model of the last to finish.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import inspect
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.futures import Future
from torch.nn.utils.rnn import PackedSequence

from tandem.parallel.buckets import GradBucket, bucket_assignment
from tandem.parallel.comm import (
    DEFAULT_TIMEOUT_S,
    CommunicationError,
    all_reduce,
    broadcast_coalesced,
    check_same_on_all_ranks,
    result,
    timeout_seconds,
    wait_event,
    wait_s,
    wait_work,
)

__all__ = ["DistributedDataParallel", "DDPStats", "DEFAULT_TIMEOUT_S"]

# The installed torch's DistributedDataParallel's arguments: torch 2.13 adds forward_sync_buffers (and
# deprecates broadcast_buffers for it, warning whenever it is passed) and batched_grad_copy; 2.11 has
# neither (passing one is a TypeError there), and its broadcast_buffers defaults to True, a None passed
# syncing no buffers (2.13's default is None, read as True). tandem's default is the installed torch's.
_TORCH_DDP_PARAMETERS = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
_TORCH_DDP_ARGUMENTS = frozenset(_TORCH_DDP_PARAMETERS)
_BROADCAST_BUFFERS_DEFAULT = _TORCH_DDP_PARAMETERS["broadcast_buffers"].default


class _Absent:
    """The default of an argument the installed torch's DistributedDataParallel lacks (2.11's
    batched_grad_copy and forward_sync_buffers): passing it at all, even its 2.13 default, is torch's
    TypeError."""

    def __repr__(self) -> str:
        return "<not in this torch>"


_ABSENT = _Absent()
_BATCHED_GRAD_COPY_DEFAULT = False if "batched_grad_copy" in _TORCH_DDP_ARGUMENTS else _ABSENT
_FORWARD_SYNC_BUFFERS_DEFAULT = None if "forward_sync_buffers" in _TORCH_DDP_ARGUMENTS else _ABSENT
_TORCH_DEPRECATES_BROADCAST_BUFFERS = "forward_sync_buffers" in _TORCH_DDP_ARGUMENTS
_BOTH_BUFFER_ARGUMENTS = (
    "Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` is deprecated "
    "and its value is ignored when `forward_sync_buffers` is provided."
)
_BROADCAST_BUFFERS_DEPRECATED = (
    "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
    "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init. If you rely on "
    "buffers NOT being synced at init (e.g. rank-local buffers), keep using `broadcast_buffers=False` until "
    "`init_sync_buffers` is available."
)

_MB = 1024 * 1024
_DEFAULT_BUCKET_CAP_MB = 25
# torch's default too: a small first bucket, so the last layers' gradients go out without waiting for
# 25 MB of the layers below them.
_FIRST_BUCKET_BYTES = 1 * _MB
_MIN_BUCKETS = 16


@dataclass(frozen=True)
class DDPStats:
    """Timings of the last synchronised backward (seconds) and what it sent.

    backward_s: from the first gradient reaching the module (of its output, or of a parameter) to
        the end of the local backward.
    comm_s: wall time during which at least one bucket's all-reduce was in flight.
    wait_s: time after the local backward spent waiting for the all-reduces and writing the
        averaged gradients to ``.grad``: the communication that did not overlap.
    bytes_sent: payload handed to the collectives (the compressed size with tandem's fp16/bf16
        hooks); a ring all-reduce moves about twice that over each link.
    buckets: how many buckets were all-reduced (0 for one rank without a hook: nothing to average).
    """

    backward_s: float
    comm_s: float
    wait_s: float
    bytes_sent: int
    buckets: int

    @property
    def overlap(self) -> float:
        """Fraction of the communication time hidden behind backward, ``1 - wait_s / comm_s`` (>= 0)."""
        return max(0.0, 1.0 - self.wait_s / self.comm_s) if self.comm_s > 0 else 1.0


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once (contiguous in some order of its dims:
    contiguous, channels_last, a transpose): torch's ``is_non_overlapping_and_dense``."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: (p[1], p[0])):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


class _Bucket:
    """One flat gradient buffer and the per-iteration state of its all-reduce."""

    __slots__ = (
        "index",
        "members",
        "numel",
        "nbytes",
        "_shapes",
        "_strides",
        "_dtype",
        "_device",
        "_buffer",
        "_views",
        "pending",
        "future",
        "event",
        "launch_t",
        "done_t",
        "sent_bytes",
        "copied",
        "error",
        "direct",
    )

    def __init__(self, index: int, members: list[int], params: list[Tensor]) -> None:
        self.index = index
        self.members = members
        self._shapes = [params[i].shape for i in members]
        # torch's bucket views take a dense parameter's strides (channels_last stays channels_last)
        self._strides = [params[i].stride() if _dense(params[i]) else None for i in members]
        first = params[members[0]]
        self._dtype, self._device = first.dtype, first.device
        self.numel = sum(params[i].numel() for i in members)
        self.nbytes = self.numel * first.element_size()
        # Allocated on first use: a group of one rank without a hook never needs the memory.
        self._buffer: Tensor | None = None
        self._views: list[Tensor] = []
        self.reset()

    def _allocate(self) -> None:
        self._buffer = torch.empty(self.numel, dtype=self._dtype, device=self._device)  # [sum of numels]
        offset = 0
        for shape, stride in zip(self._shapes, self._strides):
            n = shape.numel()
            flat = self._buffer[offset : offset + n]
            self._views.append(flat.view(shape) if stride is None else flat.as_strided(shape, stride))
            offset += n

    @property
    def buffer(self) -> Tensor:
        if self._buffer is None:
            self._allocate()
        return self._buffer

    @property
    def views(self) -> list[Tensor]:
        """One view of the buffer per member parameter, shaped like it."""
        if self._buffer is None:
            self._allocate()
        return self._views

    def reset(self) -> None:
        self.pending = len(self.members)
        self.future: Future | None = None
        self.event = threading.Event()  # set once the all-reduce has finished (or failed to start)
        self.launch_t = 0.0
        self.done_t = 0.0
        self.sent_bytes = 0
        self.copied = False  # the reduced values are in .grad already (copied when the all-reduce ended)
        self.error: Exception | None = None  # raised by the waiting thread
        # A one-parameter bucket whose gradient is contiguous is reduced in that gradient itself: no
        # copy in, no copy back, no buffer. Decided per step, when the gradient arrives.
        self.direct: Tensor | None = None

    def target(self) -> Tensor:
        """The flat tensor this step all-reduces: the gradient itself (direct) or the buffer."""
        return self.direct if self.direct is not None else self.buffer


def _tensors_in(obj: Any) -> Iterator[Tensor]:
    """The tensors in a (possibly nested) output: tuples, lists, dicts, namedtuples, PackedSequence,
    dataclass instances (as torch's DDP finds them)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, field.name))


def _to_device(obj: Any, device: torch.device) -> Any:
    """The inputs on the module's device, as torch's DDP moves them (``_recursive_to``): tensors copied as
    ``.to`` copies (blocking: a pinned buffer may be refilled once forward returns), a PackedSequence whole
    (its batch_sizes stay on the CPU), inside tuples, lists, dicts and namedtuples."""
    if isinstance(obj, (Tensor, PackedSequence)):
        return obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_to_device(item, device) for item in obj))
    if isinstance(obj, (list, tuple)):  # plain ones (a torch.return_types tuple too), as torch's
        items = [_to_device(item, device) for item in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    return obj


class DistributedDataParallel(torch.nn.Module, Joinable):
    r"""Data-parallel training: torch's ``DistributedDataParallel`` API, gradients averaged over ranks.

    Every rank wraps the same model; after ``loss.backward()`` each parameter's ``.grad`` is the
    average over the ranks of its local gradient, so the optimizer steps identically everywhere.
    Gradients travel in buckets as soon as backward produces them, overlapping communication with
    the backward of the layers below (see the module docstring for the mechanism).

    Args:
        module: the model. Its parameters and buffers are broadcast from rank 0 here; their shapes
            and dtypes must agree on every rank (a ``ValueError`` on every rank otherwise).
        device_ids: ``None`` for CPU and multi-device modules; ``[i]`` for a module on CUDA device
            ``i`` (inputs are then moved there).
        output_device: accepted for torch compatibility; a single-device module's outputs stay on its
            device.
        dim: kept (``self.dim``) as torch keeps it; a single-device module scatters nothing.
        broadcast_buffers: broadcast rank 0's buffers (batch-norm statistics) here and before each
            forward (default True); False keeps every rank's own. Under torch 2.13, which deprecates
            it for ``forward_sync_buffers``, passing it warns as torch's does.
        init_sync: check and broadcast the parameters (and shared buffers) here (default True).
        process_group: the group to average over (default: the default group).
        bucket_cap_mb: bucket size in MiB; 0 (or less, as torch) gives one parameter per bucket.
            Default: torch's 25 MiB (with a 1 MiB first bucket), but at most 1/16 of the model (at
            least 1 MiB), so that the last bucket, whose all-reduce nothing can hide, stays small for
            models under 400 MiB.
        find_unused_parameters: allow parameters to get no gradient in a backward (they count as
            zero for this rank). Without it, such parameters are a ``RuntimeError`` at the end of
            backward.
        check_reduction: deprecated in torch; warns as torch does.
        gradient_as_bucket_view: make ``.grad`` views of the bucket buffers: no copy back, less
            memory.
        static_graph: the same gradients; parameters may go unused, as with find_unused_parameters,
            and a gradient may accumulate several times a backward (a layer in two reentrant
            checkpoints): the first step counts how often and reduces at its end, as torch's.
        bucket_cap_mb_list: each bucket's size in MiB, in order (the last for the rest).
        batched_grad_copy: accepted (a copy strategy of torch's reducer; nothing to change here).
        forward_sync_buffers: torch 2.13's successor of broadcast_buffers: when given, it decides the
            broadcast before each forward, and the buffers are synced here whatever it says. Under
            torch 2.11, which has neither of these two, passing either is its ``TypeError``.
        delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision, device_mesh,
            skip_all_reduce_unused_params: not supported: anything but the default raises
            ``NotImplementedError`` naming it.
        timeout: seconds (or a ``timedelta``) to wait for any collective before raising
            :class:`~tandem.parallel.CommunicationError`; default: the process group's own timeout
            (``init_process_group(timeout=...)``; torch's default 30 minutes), which torch's DDP waits
            too; ``float('inf')`` sets no deadline. A dead or stuck rank makes the others raise within it
            instead of hanging (the process group is not usable afterwards: later forwards raise at
            once). The wait is on the host, so it bounds Gloo collectives; NCCL marks work done at
            enqueue, so there a hang falls to NCCL's watchdog - not tested here.

    Example::

        >>> dist.init_process_group("gloo")  # torchrun sets the rank and world size
        >>> model = tandem.parallel.DistributedDataParallel(tandem.nn.GRU(80, 256, bidirectional=True))
        >>> out, _ = model(x)                 # x: this rank's part of the batch
        >>> out.mean().backward()             # .grad now holds the average over ranks
        >>> optimizer.step(); model.stats()   # DDPStats(backward_s=..., comm_s=..., wait_s=..., ...)
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = _BROADCAST_BUFFERS_DEFAULT,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[float] | None = None,
        batched_grad_copy: bool = _BATCHED_GRAD_COPY_DEFAULT,
        forward_sync_buffers: bool | None = _FORWARD_SYNC_BUFFERS_DEFAULT,
        *,
        timeout: float | datetime.timedelta | None = None,
    ) -> None:
        # torch's arguments in torch's (2.13's) order, so that positional calls
        # mean the same; what tandem's wrapper does not do is refused by name, never ignored
        unsupported = {
            "delay_all_reduce_named_params": delay_all_reduce_named_params is not None,
            "param_to_hook_all_reduce": param_to_hook_all_reduce is not None,
            "mixed_precision": mixed_precision is not None,
            "device_mesh": device_mesh is not None,
            "skip_all_reduce_unused_params": bool(skip_all_reduce_unused_params),
        }
        for name, given in unsupported.items():
            if given:
                raise NotImplementedError(
                    f"DistributedDataParallel: tandem's wrapper does not take {name}= (torch's "
                    "DistributedDataParallel does)"
                )
        if check_reduction:
            warnings.warn(  # torch's words
                "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please "
                "avoid using it.",
                FutureWarning,
                stacklevel=2,
            )
        newer = {"batched_grad_copy": batched_grad_copy, "forward_sync_buffers": forward_sync_buffers}
        for name, given in newer.items():
            if given is not _ABSENT and name not in _TORCH_DDP_ARGUMENTS:  # (Python's words)
                raise TypeError(
                    f"DistributedDataParallel.__init__() got an unexpected keyword argument '{name}'"
                )
        forward_sync_buffers = None if forward_sync_buffers is _ABSENT else forward_sync_buffers
        if broadcast_buffers is not None and _TORCH_DEPRECATES_BROADCAST_BUFFERS:
            both = forward_sync_buffers is not None
            warnings.warn(
                _BOTH_BUFFER_ARGUMENTS if both else _BROADCAST_BUFFERS_DEPRECATED, FutureWarning, stacklevel=2
            )
        super().__init__()
        Joinable.__init__(self)  # join() sets its configuration
        self._divide_by_initial_world_size = True
        if process_group is None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError(  # torch's type
                "DistributedDataParallel: the default process group has not been initialized; call "
                "torch.distributed.init_process_group(...) first or pass process_group="
            )
        if not isinstance(module, torch.nn.Module):
            raise AttributeError(  # torch's type: its module.named_parameters() fails
                f"DistributedDataParallel: expected a torch.nn.Module, got {type(module).__name__}"
            )
        if bucket_cap_mb_list is not None and not all(c >= 0 for c in bucket_cap_mb_list):
            raise TypeError(  # torch's type (its C++ sizes are unsigned)
                "DistributedDataParallel: expected bucket_cap_mb_list of sizes >= 0, got "
                f"{bucket_cap_mb_list}"
            )
        # torch's DDP leaves what DistributedDataParallel._set_params_and_buffers_to_ignore_for_model named
        # rank-local: neither broadcast nor averaged
        self._ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        # torch's checks in torch's order, with its types (and words where they are its own)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in self._ignored]
        if not named:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any parameter that "
                "requires a gradient."
            )
        types = {p.device.type for n, p in module.named_parameters() if n not in self._ignored}
        if len(types) != 1:
            raise ValueError(
                "DistributedDataParallel's input module must be on the same type of devices, but input "
                f"module parameters locate in {types}."
            )
        if any(torch.nn.parameter.is_lazy(p) for p in module.parameters()):
            raise RuntimeError(  # torch's words
                "Modules with uninitialized parameters can't be used with `DistributedDataParallel`. Run a "
                "dummy forward pass to correctly initialize the modules"
            )
        if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            raise RuntimeError(  # torch's type (its message comes from deep inside)
                "DistributedDataParallel: the module has parameters or buffers on the meta device, which "
                "hold no values; materialize it first (module.to_empty(device=...), then load its state)"
            )
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(  # torch's type (from its C++ binding)
                "DistributedDataParallel: expected process_group a torch.distributed.ProcessGroup, got "
                f"{type(process_group).__name__}"
            )
        for flag, value in (
            ("find_unused_parameters", find_unused_parameters),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("static_graph", static_graph),
        ):
            # what torch's C++ reducer takes as a bool: None, or what has a truth value of its own
            if value is not None and not hasattr(type(value), "__bool__"):
                raise TypeError(
                    f"DistributedDataParallel: expected {flag} a bool, got {type(value).__name__}"
                )
        self.timeout = timeout_seconds(timeout, "DistributedDataParallel", process_group)
        # torch's attribute: the device of the module's first parameter it keeps (one may not need grad)
        self.device = next(p for n, p in module.named_parameters() if n not in self._ignored).device
        devices = {t.device for t in [*module.parameters(), *module.buffers()]}
        self._set_devices(devices, device_ids, output_device)

        self.module = module
        self.dim = dim
        # torch's DDP keeps the default group itself when given none (hooks and Join compare groups)
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        # torch 2.13's rule: forward_sync_buffers, when given, decides the broadcast before each forward
        # and the buffers are synced at construction; otherwise broadcast_buffers (None reads as True)
        # decides both. torch 2.11 (default True) takes broadcast_buffers by its truth: None syncs nothing.
        # Both keep the value given, as torch's does (will_sync_module_buffers() may return it).
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, self._init_sync_buffers = forward_sync_buffers, True
        else:
            sync = broadcast_buffers
            if sync is None and _TORCH_DEPRECATES_BROADCAST_BUFFERS:
                sync = True
            self.forward_sync_buffers, self._init_sync_buffers = sync, sync
        self.static_graph = static_graph
        # torch's static graph lets a parameter go unused without find_unused_parameters (the first
        # iteration tells); here that is find_unused_parameters' handling, the same gradients
        self.find_unused_parameters = find_unused_parameters  # torch's attribute, as given
        self._find_unused = find_unused_parameters or static_graph  # static_graph lets them go unused too
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        params = [p for _, p in named]
        if bucket_cap_mb_list:
            self._caps = [int(c * _MB) for c in bucket_cap_mb_list]
        elif bucket_cap_mb is None:
            # torch's 25 MiB, but at least ~16 buckets for smaller models: the last bucket's all-reduce
            # cannot overlap anything, so it should be a small part of the whole.
            total = sum(p.numel() * p.element_size() for p in params)
            cap = min(_DEFAULT_BUCKET_CAP_MB * _MB, max(_FIRST_BUCKET_BYTES, total // _MIN_BUCKETS))
            self._caps = [_FIRST_BUCKET_BYTES, cap]
        else:
            # a cap below 0 closes every bucket at its first parameter, as torch's (which takes it): 0
            self._caps = [max(0, int(bucket_cap_mb * _MB))]
        if bucket_cap_mb_list:  # torch's: the largest of the list
            self.bucket_bytes_cap = int(max(bucket_cap_mb_list) * _MB)
        else:
            self.bucket_bytes_cap = self._caps[-1] if bucket_cap_mb is None else int(bucket_cap_mb * _MB)
        # what a copy keeps: the settings made so far; everything _set_up makes is rebuilt
        self._settings = frozenset(self.__dict__) | {"_settings"}
        self._set_up(threaded=True)
        if init_sync:
            self._sync_module_state()

    def _set_up(self, threaded: bool) -> None:
        """Everything that does not survive a copy: the group's facts, the parameters' order, the
        communication thread, the buckets and the hooks on the parameters."""
        process_group, module = self.process_group, self.module
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._src = dist.get_process_group_ranks(process_group)[0] if self.world_size > 1 else 0
        self._comm_device = next(iter(module.parameters())).device
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in self._ignored]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        # Copies are memory passes that need not hold up backward. For CPU buckets the gradients go into
        # their bucket, and buckets are launched, on a communication thread (in submission order, so
        # collectives are issued in the same order on every rank); the thread that completes an
        # all-reduce copies the result back to .grad (unless find_unused_parameters needs the used map
        # first). CUDA copies are asynchronous already and stay on the caller's stream.
        on_cpu = self._comm_device.type == "cpu"
        # Collectives issued from that thread would interleave, in a different order on each rank, with
        # collectives the program issues on ``process_group`` during backward (a SyncBatchNorm's backward
        # all-reduce): Gloo pairs collectives by order, so the ranks would mix up their messages. The
        # thread therefore communicates on a group of its own over the same ranks. torch's reducer needs
        # none: it issues every collective from the autograd thread, in backward's order, as this wrapper
        # does for CUDA buckets, and for a group smaller than the world, which it cannot duplicate
        # (every rank of the world must take part in creating a group, and only members construct this).
        # A copy (deepcopy, pickle) does the same: making a group is a collective, and a copy may be
        # made on one rank alone.
        use_thread = threaded and on_cpu and not self.gradient_as_bucket_view and _spans_world(process_group)
        # One thread and one private group serve every such wrapper of the world (in one queue, so that
        # two wrappers' collectives also come in the same order on every rank): a group a wrapper kept
        # its files and threads open until the process ended (~200 wrappers exhausted 1024 descriptors)
        self._comm_thread, self._comm_group = None, process_group
        if use_thread:
            self._comm_thread, private = _shared_comm()
            self._comm_group = private if self.world_size > 1 else process_group
        self._comm_errors: list[Exception] = []  # what this wrapper's tasks on the thread raised
        self._copy_when_done = on_cpu and not self._find_unused and not self.gradient_as_bucket_view
        self._index_of = {id(p): i for i, p in enumerate(self._params)}

        n = len(self._params)
        self._comm_hook: Callable[[Any, GradBucket], Future] | None = None
        self._comm_state: Any = None
        self._buckets: list[_Bucket] = []
        self._slot: list[tuple[_Bucket, int]] = []
        # torch's first layout: buckets cut along the reverse parameter order, each bucket's parameters
        # in module order (a bucket-wise hook such as PowerSGD sees the same buffers)
        self._build_buckets(list(reversed(range(n))), module_order_inside=True)
        self._rebuilt = False
        self._steps_to_rebuild = self._steps_before_rebuild()
        self._fires_expected: list[int] | None = None  # static_graph: accumulations a backward, learnt
        self._expect_hooks = False
        self._in_backward = False
        self._sync_buffers_next = True
        self._failure: Exception | None = None
        # why a backward that ended before its reduction leaves this wrapper unusable (see _settle)
        self._unfinished: str | None = None
        self._last_stats: DDPStats | None = None
        self._unreachable: list[int] = []
        self._leaf_output_hooks: list[Any] = []
        self._output_grad_hook = _output_grad_hook_not_traced()  # here: dynamo would trace the first call
        self._warned_create_graph = False
        self._used_since_sync = bytearray(n)
        self._used_counts: Tensor | None = None  # the last used-parameter map, as reduced
        # what gradients are divided by: the world, or under join(divide_by_initial_world_size=False) the
        # ranks that have not joined (counted at each forward)
        self._grad_divisor = self.world_size
        self._reset_iteration()
        me = weakref.ref(self)
        # Each parameter's gradient accumulator (autograd's AccumulateGrad node), held, with a hook that
        # runs after the node: after the parameter's own post-accumulate-grad hooks, also those
        # registered after this wrapper (a per-parameter clip, an optimizer step in backward), as
        # torch's reducer reads the gradient. A post-accumulate-grad hook of the wrapper's ran before
        # them and wrote the average over what they changed.
        self._accumulators = []
        self._handles = []
        with torch.enable_grad():
            for i, p in enumerate(self._params):
                accumulator = p.view_as(p).grad_fn.next_functions[0][0]
                self._accumulators.append(accumulator)
                hook = functools.partial(_grad_ready_hook, me, i, p)
                self._handles.append(accumulator.register_hook(hook))

    def __getstate__(self) -> dict[str, Any]:
        """As torch's DDP: a copy (``copy.deepcopy``, pickle, ``torch.save``) holds the module and the
        settings; not the process group (the copy takes the default one), nor the communication hook."""
        state = {name: value for name, value in self.__dict__.items() if name in self._settings}
        del state["process_group"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.process_group = dist.group.WORLD
        self._set_up(threaded=False)

    # ------------------------------------------------------------------------------------------
    # construction

    def _set_devices(self, devices: set[torch.device], device_ids, output_device) -> None:
        device_type = next(iter(devices)).type if devices else "cpu"
        if device_ids is None or len(device_ids) == 0 or device_type == "cpu" or len(devices) > 1:
            if device_ids or output_device:  # torch's test: output_device=0 passes on a CPU module
                raise ValueError(
                    "DistributedDataParallel device_ids and output_device arguments only work with "
                    "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                    f"{device_ids}, output_device {output_device}, and module parameters {devices}."
                )
            self.device_ids = None
            self.output_device = None
            return
        if len(device_ids) != 1:
            raise ValueError(
                f"DistributedDataParallel: expected device_ids to name one device, got {device_ids}"
            )
        (device,) = devices
        wanted = torch.device(device_type, torch.device(device_type, device_ids[0]).index or 0)
        if wanted != device:
            raise ValueError(
                f"DistributedDataParallel: device_ids {device_ids} names {wanted}, "
                f"but the module is on {device}"
            )
        self.device_ids = [wanted.index]
        self.output_device = (
            wanted.index if output_device is None else torch.device(device_type, output_device).index
        )

    def _set_static_graph(self) -> None:
        """torch's (private, used) way to turn on ``static_graph`` after construction, before training: as
        the constructor's argument, with its warnings."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        user_find_unused = self.find_unused_parameters
        self.static_graph = self._find_unused = True
        self._copy_when_done = False  # the used map comes first, as with find_unused_parameters
        if not self._rebuilt:
            self._steps_to_rebuild = self._steps_before_rebuild()
        if user_find_unused:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` "
                "will detect unused parameters automatically, so you do not need to set "
                "find_unused_parameters=true, just be sure these unused parameters will not change during "
                "training loop while calling `_set_static_graph`.",
                stacklevel=2,
            )

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
        module: torch.nn.Module, params_and_buffers_to_ignore: list[str]
    ) -> None:
        """torch's (private, widely used) way to keep parameters and buffers rank-local: neither
        broadcast nor averaged. Call before wrapping; names as ``named_parameters()`` gives them."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore

    @property
    def broadcast_buffers(self) -> bool:
        """Whether rank 0's buffers are broadcast before each forward (torch 2.13's name for it is
        ``forward_sync_buffers``; the two are one setting)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def _shared_buffers(self, share: bool) -> list[tuple[str, Tensor]]:
        """The buffers every rank takes from rank 0: none unless ``share``, and never the ignored ones."""
        if not share:
            return []
        return [(n, t) for n, t in self.module.named_buffers() if n not in self._ignored]

    def _sync_module_state(self) -> None:
        """Check that every rank has the same parameters and buffers (those it shares), then take rank 0's
        values."""
        if self.world_size == 1:
            return
        params = [(n, t) for n, t in self.module.named_parameters() if n not in self._ignored]
        described = [
            # the strides of those it reduces too, as torch checks them: the buckets view each rank's
            # gradients in its parameter's memory order, and buffers of different orders would be summed
            # element by element
            f"parameter {name!r} of shape {list(t.shape)}, "
            + (f"strides {list(t.stride())}, " if t.requires_grad else "")
            + f"{t.dtype}, requires_grad={t.requires_grad}"
            for name, t in params
        ]
        buffers = self._shared_buffers(self._init_sync_buffers)
        described += [f"buffer {name!r} of shape {list(t.shape)}, {t.dtype}" for name, t in buffers]
        check_same_on_all_ranks(
            described, self.process_group, self._comm_device, self.timeout, "parameters and buffers"
        )
        state = [t for _, t in params + buffers]
        if state:
            broadcast_coalesced(
                [t.detach() for t in state],
                self._src,
                self.process_group,
                self.timeout,
                "the broadcast of rank 0's parameters and buffers",
            )

    def _build_buckets(self, order: list[int], module_order_inside: bool = False) -> None:
        groups = bucket_assignment(order, self._params, self._caps)
        if module_order_inside:
            groups = [sorted(members) for members in groups]
        self._buckets = [_Bucket(k, members, self._params) for k, members in enumerate(groups)]
        slot: list[tuple[_Bucket, int] | None] = [None] * len(self._params)
        for b in self._buckets:
            for pos, i in enumerate(b.members):
                slot[i] = (b, pos)
        self._slot = slot  # type: ignore[assignment]

    def _reset_iteration(self) -> None:
        n = len(self._params)
        self._ready = bytearray(n)
        self._fired = bytearray(n)
        self._fire_counts = [0] * n
        self._order: list[int] = []
        self._next_bucket = 0
        self._unreachable_filled = False
        self._t_backward: float | None = None
        for b in self._buckets:
            b.reset()

    # ------------------------------------------------------------------------------------------
    # public API

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._failure is not None:
            raise CommunicationError(
                "DistributedDataParallel: an earlier collective failed, so the process group can no longer "
                f"be trusted: {self._failure}"
            ) from self._failure
        if self._in_backward:  # the last synchronised backward raised before its end: its reduction too
            self._settle_unfinished()
        joining = self._join_config.enable
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if sync and self._unfinished is not None:  # (as torch's, a forward that will not sync goes on)
            raise RuntimeError(self._unfinished)
        self.require_forward_param_sync = sync  # torch's attribute: whether this forward's step syncs
        if joining:
            self._count_nonjoined(Join.notify_join_context(self))
        self._sync_buffers_before_forward(joined=False)
        if joining:
            self._step_flag(sync)
        if self.device_ids is not None:
            device = torch.device(self._comm_device.type, self.device_ids[0])
            inputs, kwargs = _to_device(inputs, device), _to_device(kwargs, device)
        output = self.module(*inputs, **kwargs)
        self._sync_buffers_next = sync  # as torch: buffers follow rank 0 before a synchronised step
        if sync:
            self._expect_hooks = True
            tensors = [t for t in _tensors_in(output) if t.requires_grad]
            if self.static_graph:
                # as torch's reducer, no walk of the graph: unused are those the first step left unused
                expected = self._fires_expected
                self._unreachable = [] if expected is None else [i for i, n in enumerate(expected) if not n]
            elif self._find_unused:
                self._unreachable = self._unreachable_from(tensors)
            me = weakref.ref(self)
            # a hook on a leaf output (a parameter, an input returned as it is) outlives the graph: the
            # previous forward's are removed, or they piled up, one a step
            for handle in self._leaf_output_hooks:
                handle.remove()
            self._leaf_output_hooks = []
            for t in tensors:
                handle = t.register_hook(functools.partial(self._output_grad_hook, me))
                if t.grad_fn is None:
                    self._leaf_output_hooks.append(handle)
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: forwards inside skip the all-reduce in their backward.

        The next synchronised backward reduces everything accumulated, as torch's ``no_sync`` does.

        Example::

            >>> with ddp.no_sync():
            ...     ddp(x1).sum().backward()  # local only
            >>> ddp(x2).sum().backward()      # .grad = average over ranks of (g1 + g2)
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Callable[[Any, GradBucket], Future]) -> None:
        """Send buckets through ``hook(state, bucket) -> Future[Tensor]`` instead of a plain all-reduce.

        The hook gets the raw local gradients in ``bucket.buffer()`` and must average them itself (the
        built-in :mod:`tandem.parallel.hooks` divide by the world size); torch's own hooks work too.
        It can be registered once, before training.

        Example::

            >>> ddp.register_comm_hook(None, tandem.parallel.hooks.bf16_compress_hook)
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook: expected a callable hook, got {type(hook).__name__}")
        # torch's checks of the signature, with its errors: a parameter named bucket (a KeyError without
        # one), annotated (if at all) with a GradBucket, and a Future[Tensor] returned
        signature = inspect.signature(hook)
        if signature.parameters["bucket"].annotation not in (
            inspect.Parameter.empty,
            dist.GradBucket,
            GradBucket,
        ):
            raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
        if signature.return_annotation not in (inspect.Signature.empty, Future[Tensor]):
            raise ValueError(
                "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]."
            )
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if self._in_backward:
            raise RuntimeError("register_comm_hook: cannot register a hook during backward")
        if self._comm_thread is not None:
            # torch's reducer calls a hook on the autograd thread, in backward's order. A hook may issue
            # collectives of its own on the default group (torch's docstring's example ignores its
            # state): from the communication thread they would interleave with the program's (a
            # SyncBatchNorm's backward all-reduce) in another order on each rank, and the ranks would
            # mix up their messages. With a hook, buckets are launched from the autograd thread, on the
            # wrapper's group, as for a subgroup.
            self._comm_thread.drain(self.timeout)
            self._comm_thread, self._comm_group = None, self.process_group
        self._comm_state, self._comm_hook = state, hook

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """A context manager for uneven inputs, as torch's ``join()``: a rank whose data ran out leaves the
        loop and, at the end of the ``with`` block, takes part in the collectives of the ranks still
        training (zeros for its gradients) until they are all done; then every rank takes the model of
        the last rank to finish.

        Args:
            divide_by_initial_world_size: average the gradients over the whole world (joined ranks count
                as zeros), or, if False, over the ranks that have not joined.
            enable: False makes the context manager do nothing (even inputs).
            throw_on_early_termination: raise ``RuntimeError`` on every rank as soon as one runs out.

        Collectives that the model itself issues in forward or backward (a ``SyncBatchNorm``'s) have no
        counterpart on a joined rank: as with torch's, such a model cannot train on uneven inputs.

        Example::

            >>> with ddp.join():
            ...     for x, y in loader:               # a different number of batches on each rank
            ...         loss_fn(ddp(x), y).backward()
            ...         optimizer.step(); optimizer.zero_grad()
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a :class:`~torch.distributed.algorithms.Join` runs on this rank once it has joined:
        each step of the others shadowed, then the final model taken (``divide_by_initial_world_size``
        as in :meth:`join`)."""
        return _DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._comm_device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def will_sync_module_buffers(self) -> bool | None:
        """Whether the next forward broadcasts buffers (as torch's method tells)."""
        return self._sync_buffers_next and self.forward_sync_buffers and len(self._shared_buffers(True)) > 0

    def stats(self) -> DDPStats:
        """Timings and bytes of the last synchronised backward (see :class:`DDPStats`)."""
        if self._last_stats is None:
            raise RuntimeError("DistributedDataParallel.stats(): no synchronised backward has run yet")
        return self._last_stats

    # ------------------------------------------------------------------------------------------
    # buffers before forward, and uneven inputs (join)

    def _sync_buffers_before_forward(self, joined: bool) -> None:
        """Broadcast the shared buffers before a synchronised step's forward: rank 0's, or in a join the
        highest rank that has not joined (rank 0 may have, with stale statistics)."""
        if not (self._sync_buffers_next and self.forward_sync_buffers and self.world_size > 1):
            return
        buffers = [t for _, t in self._shared_buffers(True)]
        if not buffers:
            return
        src = self._common_rank(not joined) if self._join_config.enable else self._src
        self._guarded(
            broadcast_coalesced,
            buffers,
            src,
            self.process_group,
            self.timeout,
            "the broadcast of buffers before forward",
        )

    def _common_rank(self, candidate: bool) -> int:
        """The highest group rank among the candidates, as a global rank (one all-reduce)."""
        rank = torch.tensor([self.rank if candidate else -1], device=self._comm_device)
        what = "the all-reduce choosing the rank to copy from (join)"
        self._guarded(all_reduce, rank, self.process_group, self.timeout, what, dist.ReduceOp.MAX)
        chosen = int(rank.item())
        if chosen < 0:
            raise RuntimeError("DistributedDataParallel: no rank could be chosen to copy the model from")
        return dist.get_global_rank(self.process_group, chosen)

    def _count_nonjoined(self, work: dist.Work | None) -> None:
        """The divisor of this step's gradients: the world, or the ranks still training (``work``: the
        join's all-reduce of ones) under ``divide_by_initial_world_size=False``."""
        self._grad_divisor = self.world_size
        if work is not None and not self._divide_by_initial_world_size:
            what = "the join's count of ranks still training"
            (count,) = self._guarded(wait_work, work, self.timeout, what)
            self._grad_divisor = int(count.item())

    def _step_flag(self, sync: bool) -> Tensor:
        """The join's step flag, both sides of it: each rank still training sends whether its step's
        backward all-reduces (torch sends 1 whenever require_backward_grad_sync is set; a forward without
        grad says 0 here, as it has no backward), a joined rank sends 0; the sum tells the joined ones."""
        flag = torch.tensor([float(sync)], device=self._comm_device)
        what = "the join's step flag (synchronised or not)"
        self._guarded(all_reduce, flag, self.process_group, self.timeout, what)
        return flag

    def _shadow_step(self) -> None:
        """On a joined rank: the collectives of one step of the ranks still training, in their order
        (buffers, the step flag, then zeros for every bucket, its last used-parameter map as torch's
        reducer sends it, and the bucket rebuild after the first synchronised step)."""
        self._sync_buffers_before_forward(joined=True)
        sync = bool(self._step_flag(False).item())
        self._sync_buffers_next = sync
        if not sync:
            return
        for bucket in self._buckets:
            self._submit(functools.partial(self._launch, bucket, True))
        ops = []
        if self._find_unused:
            # as torch's reducer: the used map of this rank's last synchronised step, as it was reduced
            # then (and again at each step shadowed since); zeros if it never trained
            if self._used_counts is None:
                self._used_counts = torch.zeros(
                    len(self._params), dtype=torch.int32, device=self._comm_device
                )
            op = _Op()
            self._submit(functools.partial(op.all_reduce, self._used_counts, self._comm_group))
            ops.append(op)
        deadline = time.monotonic() + self.timeout
        try:
            for b in self._buckets:
                what = f"the all-reduce of gradient bucket {b.index} (zeros, for a joined rank)"
                self._guarded(self._await, b, deadline, what)
            for op in ops:
                self._guarded(
                    self._await, op, deadline, "the all-reduce of the used-parameter map (for a joined rank)"
                )
        finally:
            self._reset_iteration()
        self._count_towards_rebuild([])

    def _sync_final_model(self, last_joiner: bool) -> None:
        """After a join: every rank takes the parameters (and shared buffers) of the last rank to join."""
        if self.world_size == 1:
            return
        src = self._common_rank(last_joiner)
        params = [t for n, t in self.module.named_parameters() if n not in self._ignored]
        state = params + [t for _, t in self._shared_buffers(self.forward_sync_buffers)]
        self._guarded(
            broadcast_coalesced,
            [t.detach() for t in state],
            src,
            self.process_group,
            self.timeout,
            "the broadcast of the final model after a join",
        )

    # ------------------------------------------------------------------------------------------
    # backward machinery

    def _unreachable_from(self, outputs: list[Tensor]) -> list[int]:
        """Parameters no gradient of ``outputs`` can reach (a walk of the autograd graph)."""
        reached = bytearray(len(self._params))
        stack = []
        for t in outputs:
            if t.grad_fn is not None:
                stack.append(t.grad_fn)
            elif id(t) in self._index_of:
                reached[self._index_of[id(t)]] = 1
        seen = set()
        while stack:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            variable = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf
            if variable is not None and id(variable) in self._index_of:
                reached[self._index_of[id(variable)]] = 1
            stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
        return [i for i, r in enumerate(reached) if not r]

    def _begin_backward(self) -> None:
        self._in_backward = True
        if self._t_backward is None:
            self._t_backward = time.perf_counter()
        _queue_backward_done(weakref.ref(self))

    def _grad_ready(self, i: int, param: Tensor) -> None:
        if not self._expect_hooks:
            self._used_since_sync[i] = 1  # no_sync() accumulation: reduced at the next synchronised step
            return
        if not self._in_backward:
            self._begin_backward()
        if param.grad is not None and param.grad.requires_grad and not self._warned_create_graph:
            self._warned_create_graph = True
            warnings.warn(  # as torch's reducer warns
                "DistributedDataParallel: backward(create_graph=True): the gradients are averaged over the "
                "ranks, their graphs are not: a backward through .grad (a gradient penalty) computes this "
                "rank's higher-order gradient alone, not synchronised (torch's DistributedDataParallel "
                "does not synchronise it either)",
                stacklevel=2,
            )
        if not self._unreachable_filled:
            # At the first parameter gradient (as torch does): parameters the outputs cannot reach count
            # as ready now, so their buckets need not wait for the end of backward.
            self._unreachable_filled = True
            for j in self._unreachable:
                self._fill_unused(j)
        if self.static_graph:
            # torch's static graph: a gradient may accumulate several times in one backward (a layer in
            # two reentrant checkpoints); the first step counts how often, and reduces at its end, and
            # later steps take each gradient at its last accumulation
            self._fire_counts[i] += 1
            expected = self._fires_expected
            if expected is None or self._fire_counts[i] < expected[i]:
                return
            if self._fire_counts[i] > expected[i]:
                self._settle_unfinished()
                raise RuntimeError(
                    f"DistributedDataParallel: static_graph=True, but parameter {self._names[i]!r} got its "
                    f"gradient more often in this backward than the {expected[i]} time(s) of the first: the "
                    "graph changed between iterations (use find_unused_parameters=True instead)"
                )
        self._take_gradient(i, param)

    def _take_gradient(self, i: int, param: Tensor) -> None:
        """Parameter ``i``'s gradient is final for this backward: into its bucket, and launch what is full."""
        bucket, pos = self._slot[i]
        if self._ready[i]:
            if self._fired[i]:  # a second gradient in this backward
                self._settle_unfinished()
                raise RuntimeError(
                    f"DistributedDataParallel: parameter {self._names[i]!r} got a second gradient in this "
                    "backward after its first was taken for reduction (it is used in a reentrant checkpoint "
                    "and outside it, or in two): pass static_graph=True, which waits for every "
                    "accumulation, or use a non-reentrant checkpoint (use_reentrant=False)."
                )
            if bucket.index < self._next_bucket:  # counted unused, and its bucket submitted for launch
                self._settle_unfinished()
                raise RuntimeError(
                    f"DistributedDataParallel: parameter {self._names[i]!r} got its gradient after its "
                    "bucket was sent. It is used by the loss without being reachable from the module's "
                    "outputs (find_unused_parameters=True counted it as unused); use it inside the "
                    "module's forward instead."
                )
            bucket.pending += 1  # counted as unused at backward start: take the real gradient instead
        self._copy_in(bucket, pos, param.grad, param, repoint=True)
        self._ready[i] = 1
        self._fired[i] = 1
        if not self._rebuilt and self._steps_to_rebuild:
            self._order.append(i)
        bucket.pending -= 1
        if self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            self._launch_ready()

    @property
    def _identity(self) -> bool:
        """One rank and no hook: the average is the local gradient, so nothing is copied or sent."""
        return self.world_size == 1 and self._comm_hook is None

    def _copy_in(self, bucket: _Bucket, pos: int, grad: Tensor | None, param: Tensor, repoint: bool) -> None:
        """Stage ``grad`` (``None``: zeros) for bucket ``bucket``; ``repoint``: it came from a hook."""
        if grad is not None and grad.layout != torch.strided:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {self._names[self._index_of[id(param)]]!r} has a "
                f"{grad.layout} gradient; tandem only reduces dense gradients (use torch's DDP)"
            )
        if self._identity:
            return
        # Without a hook the average is taken here, on the copy (torch's reducer does the same); a hook
        # receives raw gradients and divides itself.
        scale = 1.0 / self._grad_divisor if self._comm_hook is None else 1.0
        if repoint and grad is not None and len(bucket.members) == 1 and grad.is_contiguous():
            # Only for a gradient of this backward: one counted as unused must stay untouched if no
            # rank used it, so it goes through the buffer.
            bucket.direct = grad.view(-1)
            if scale != 1.0:
                self._submit(functools.partial(_scale_in_place, grad, scale))
            return
        bucket.direct = None
        view = bucket.views[pos]
        self._submit(functools.partial(_copy_scaled, view, grad, scale))
        if repoint and self.gradient_as_bucket_view and param.grad is not view:
            param.grad = view

    def _fill_unused(self, i: int) -> None:
        """Count parameter ``i`` as ready: its accumulated ``.grad`` (``no_sync()`` steps) or zeros."""
        bucket, pos = self._slot[i]
        param = self._params[i]
        # .grad is re-pointed at the bucket only if some rank used it (in _copy_out)
        self._copy_in(bucket, pos, param.grad, param, repoint=False)
        self._ready[i] = 1
        bucket.pending -= 1

    def _launch_ready(self) -> None:
        """Launch, in order, every complete bucket from the next one on (same order on every rank)."""
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            if not self._identity:
                self._submit(functools.partial(self._launch, buckets[self._next_bucket]))
            self._next_bucket += 1

    def _submit(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the communication thread (in submission order), or here for CUDA buckets."""
        if self._comm_thread is not None:
            self._comm_thread.submit(task, self._comm_errors)
        else:
            task()

    def _launch(self, bucket: _Bucket, zeros: bool = False) -> None:
        try:
            self._start(bucket, zeros)
        except Exception as e:  # kept for the waiting thread (this may be the communication thread)
            bucket.error = e
            bucket.event.set()

    def _start(self, bucket: _Bucket, zeros: bool = False) -> None:
        """Start ``bucket``'s all-reduce (or hook); ``zeros``: a joined rank's, of zeros, not copied back."""
        bucket.launch_t = time.perf_counter()
        if zeros:
            target = torch.zeros(bucket.numel, dtype=bucket._dtype, device=bucket._device)
        else:
            target = bucket.target()
        if self._comm_hook is None:
            fut = dist.all_reduce(target, group=self._comm_group, async_op=True).get_future()
            bucket.sent_bytes = bucket.nbytes
        else:
            # torch's GradBucket.gradients(): each parameter's slice of the buffer viewed in its shape
            # (row-major, whatever the parameter's strides), so that PowerSGD's view(n, -1) takes them
            sizes = [s.numel() for s in bucket._shapes]
            rows = [v.view(s) for v, s in zip(target.split(sizes), bucket._shapes)]
            grad_bucket = GradBucket(
                bucket.index,
                target,
                rows,
                [self._params[i] for i in bucket.members],
                bucket.index == len(self._buckets) - 1,
            )
            fut = self._comm_hook(self._comm_state, grad_bucket)
            # Future.then() returns the C++ future class: check what is used, not the Python type.
            if not (hasattr(fut, "add_done_callback") and hasattr(fut, "wait")):
                raise RuntimeError(  # torch's type
                    f"DistributedDataParallel: a communication hook must return a torch.futures.Future, "
                    f"got {type(fut).__name__}"
                )
            sent = grad_bucket._sent_bytes
            bucket.sent_bytes = bucket.nbytes if sent is None else sent
        bucket.future = fut
        fut.add_done_callback(functools.partial(_bucket_done, None if zeros else weakref.ref(self), bucket))

    def _settle_unfinished(self) -> None:
        """A synchronised backward that stops before its end (an exception in a hook, a custom function or
        our own checks; found at the next forward, or where this wrapper raises) never runs the callback
        that waits for its buckets: the communication thread's copies of it finish first, so that none
        lands in the next step. If no bucket was sent, the next step starts afresh (as torch's reducer,
        which has nothing to finish then). If some were, their collectives are in flight on this rank and
        may pair with another step's on others: as torch's DDP, every later forward raises (a
        wrapper whose collectives no longer pair would mix steps' gradients, or abort the process)."""
        sent = self._next_bucket
        self._expect_hooks = self._in_backward = False
        if self._comm_thread is not None:
            self._comm_thread.drain(self.timeout)
        if sent:
            self._copy_when_done = False  # a late all-reduce writes into no .grad
            self._unfinished = (
                "DistributedDataParallel: expected to have finished reduction in the prior iteration "
                f"before starting a new one: its backward raised after {sent} of {len(self._buckets)} "
                "gradient bucket(s) were sent, whose collectives may no longer pair with the other ranks'. "
                "This wrapper cannot synchronise again (nor can torch's): fix what raised, and start again "
                "from a checkpoint with a new process group."
            )
        self._reset_iteration()

    def _may_get_more_gradients(self) -> bool:
        """Whether a gradient of this backward may still come: a parameter not ready yet, or static_graph's
        first step, which learns how often each gradient accumulates."""
        return (self.static_graph and self._fires_expected is None) or not all(self._ready)

    def _finish_backward(self) -> None:
        t_local_end = time.perf_counter()
        if self.static_graph and self._fires_expected is None and any(self._fire_counts):
            # static_graph's first step: now every gradient is final; how often each accumulated is learnt
            self._fires_expected = list(self._fire_counts)
            for i, fires in enumerate(self._fire_counts):
                if fires:
                    self._take_gradient(i, self._params[i])
        if not any(self._fired):
            # A backward that reached the outputs but no parameter (torch.autograd.grad for a gradient
            # penalty): nothing was launched, nothing to reduce; the real backward is still to come.
            self._in_backward = False
            self._reset_iteration()
            return
        try:
            self._complete_and_wait()
        except CommunicationError as e:
            if not getattr(e, "hook_failed", False):
                self._failure = e
            raise
        finally:
            t_backward = self._t_backward or t_local_end
            buckets = self._buckets
            self._expect_hooks = False
            self._in_backward = False
            stats_inputs = [(b.launch_t, b.done_t, b.sent_bytes) for b in buckets if b.future is not None]
            order = self._order
            self._reset_iteration()
        self._used_since_sync = bytearray(len(self._params))
        self._last_stats = DDPStats(
            backward_s=t_local_end - t_backward,
            comm_s=_union_length([(a, b) for a, b, _ in stats_inputs]),
            wait_s=time.perf_counter() - t_local_end,
            bytes_sent=sum(s for _, _, s in stats_inputs) + self._used_map_bytes(),
            buckets=len(stats_inputs),
        )
        self._count_towards_rebuild(order)

    def _steps_before_rebuild(self) -> int:
        """Synchronised steps before the buckets are re-cut in gradient order, as torch's reducer: the
        first, the second with static_graph, never (0) with find_unused_parameters alone (bucket-wise comm
        hooks such as PowerSGD see torch's buckets)."""
        return 2 if self.static_graph else 0 if self._find_unused else 1

    def _count_towards_rebuild(self, order: list[int]) -> None:
        """One synchronised step done (``order``: this rank's gradient order in it): re-cut the buckets
        when it is the step torch's reducer re-cuts after."""
        if self._rebuilt or self._steps_to_rebuild == 0:
            return
        self._steps_to_rebuild -= 1
        if self._steps_to_rebuild == 0:
            self._rebuild(order)

    def _used_map_bytes(self) -> int:
        return 4 * len(self._params) if self._find_unused else 0

    def _complete_and_wait(self) -> None:
        missing = [i for i, r in enumerate(self._ready) if not r]
        if missing:
            if not self._find_unused:
                names = ", ".join(repr(self._names[i]) for i in missing[:10])
                more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
                # buckets sent before this must not complete into the next step's .grad (a loop that skips
                # the batch and goes on): as torch's reducer, every later synchronised forward raises
                self._settle_unfinished()
                raise RuntimeError(
                    f"DistributedDataParallel: {len(missing)} parameter(s) received no gradient in this "
                    f"backward: {names}{more}. Pass find_unused_parameters=True to DistributedDataParallel "
                    "if some parameters are legitimately unused in some steps, or make sure every "
                    "parameter contributes to the loss."
                )
            for i in missing:
                self._fill_unused(i)
            self._launch_ready()
        if self._identity:
            return  # .grad already holds the average of one rank: untouched, as torch leaves unused ones

        deadline = time.monotonic() + self.timeout
        skip: list[bool] | None = None
        if self._find_unused:
            # A parameter no rank used (this step or in no_sync() steps before it) keeps its .grad
            # untouched, as with torch. Issued after the buckets, by the thread that issued them.
            used = [a | b for a, b in zip(self._fired, self._used_since_sync)]
            counts = torch.tensor(used, dtype=torch.int32, device=self._comm_device)
            op = _Op()
            self._submit(functools.partial(op.all_reduce, counts, self._comm_group))
            self._await(op, deadline, "the all-reduce of the used-parameter map")
            skip = [c == 0 for c in counts.tolist()]
            self._used_counts = counts  # what a joined rank sends in the steps it shadows (as torch's)

        nbuckets = len(self._buckets)
        for b in self._buckets:
            what = (
                f"the all-reduce of gradient bucket {b.index} of {nbuckets} "
                f"({_size(b.nbytes)}, {len(b.members)} parameters)"
            )
            try:
                reduced = self._await(b, deadline, what)
            except CommunicationError as e:
                if getattr(e, "hook_failed", False):
                    # the other buckets' hooks end first: none may complete into the next step
                    for other in self._buckets:
                        wait_event(
                            other.event, deadline, "the other buckets' communication hooks", self.timeout
                        )
                raise
            if not b.copied:
                self._copy_out(b, reduced, skip)
        if self._comm_errors:
            raise self._comm_errors.pop(0)

    def _await(self, task: _Bucket | _Op, deadline: float, what: str) -> Any:
        """The value of ``task``'s collective (a bucket's, or another of ours), waited for until ``deadline``;
        raises its error if it could not start, or :class:`CommunicationError` naming ``what``."""
        wait_event(task.event, deadline, what, self.timeout)
        if task.error is not None:
            raise task.error
        if isinstance(task, _Bucket) and self._comm_hook is not None:
            # the bucket's future is the hook's: its own code may have raised
            try:
                return result(task.future, what, cause="the communication hook raised, or another rank died")
            except CommunicationError as e:
                # the hook's future failed, not a collective of ours: as torch's DDP, the next step may go on
                e.hook_failed = True  # type: ignore[attr-defined]
                raise
        return result(task.future, what)

    def _copy_out(self, bucket: _Bucket, result: Any, skip: list[bool] | None) -> None:
        """Write bucket ``bucket``'s reduced values (the collective's or hook's result) to ``.grad``."""
        flat = result[0] if isinstance(result, (list, tuple)) else result
        if isinstance(flat, Tensor) and bucket._dtype.is_complex and not flat.is_complex():
            # torch.distributed all-reduces a complex tensor as its real view: pairs of (re, im)
            flat = torch.view_as_complex(flat.reshape(-1, 2)) if flat.numel() == 2 * bucket.numel else flat
        if not isinstance(flat, Tensor) or flat.numel() != bucket.numel:
            got = f"{flat.numel()} elements" if isinstance(flat, Tensor) else type(flat).__name__
            raise RuntimeError(
                f"DistributedDataParallel: the communication hook's future for bucket {bucket.index} "
                f"returned {got}; expected a tensor of {bucket.numel} elements"
            )
        flat = flat.contiguous()
        with torch.no_grad():
            if bucket.direct is not None:  # reduced in the gradient itself: it is .grad already
                if flat.data_ptr() != bucket.direct.data_ptr():
                    bucket.direct.copy_(flat.view_as(bucket.direct))
                return
            in_place = flat.data_ptr() == bucket.buffer.data_ptr()
            if self.gradient_as_bucket_view and not in_place:
                bucket.buffer.copy_(flat.view_as(bucket.buffer))
                in_place = True
            offset = 0
            for pos, i in enumerate(bucket.members):
                view = bucket.views[pos]
                if skip is not None and skip[i]:
                    offset += view.numel()
                    continue
                param = self._params[i]
                # a result of the hook's own is laid out as the buffer is (a channels_last parameter's
                # strides), as torch reads it
                src = (
                    view
                    if in_place
                    else flat[offset : offset + view.numel()].as_strided(view.shape, view.stride())
                )
                offset += view.numel()
                if self.gradient_as_bucket_view:
                    if param.grad is not view:
                        param.grad = view
                elif param.grad is None:
                    param.grad = src.clone()
                else:
                    param.grad.copy_(src)

    def _rebuild(self, order: list[int]) -> None:
        """Re-cut the buckets in the order gradients became ready on rank 0 (once: see
        ``_count_towards_rebuild``)."""
        n = len(self._params)
        seen = set(order)
        order = order + [i for i in reversed(range(n)) if i not in seen]
        if self.world_size > 1:
            agreed = torch.tensor(order, dtype=torch.int64, device=self._comm_device)
            self._guarded(
                broadcast_coalesced,
                [agreed],
                self._src,
                self.process_group,
                self.timeout,
                "the broadcast of rank 0's gradient order (bucket rebuild)",
            )
            order = agreed.tolist()
        if sorted(order) != list(range(n)):
            raise RuntimeError(
                f"DistributedDataParallel: rank 0's gradient order is not a permutation: {order}"
            )
        self._rebuilt = True
        if order == [i for b in self._buckets for i in b.members]:
            return
        self._build_buckets(order)
        self._reset_iteration()
        if self.gradient_as_bucket_view and not self._identity:
            with torch.no_grad():
                for b in self._buckets:
                    for pos, i in enumerate(b.members):
                        param = self._params[i]
                        if param.grad is not None:
                            b.views[pos].copy_(param.grad)
                            param.grad = b.views[pos]

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except CommunicationError as e:
            self._failure = e
            raise


def _spans_world(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` (None: the default group) holds every rank of the world."""
    return group is None or dist.get_world_size(group) == dist.get_world_size()


def _copy_scaled(view: Tensor, grad: Tensor | None, scale: float) -> None:
    """``view = grad * scale`` (zeros for no gradient); nothing if ``grad`` already is ``view``."""
    with torch.no_grad():
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr() and grad.shape == view.shape:
            if scale != 1.0:  # .grad already is the bucket view (gradient_as_bucket_view)
                view.mul_(scale)
        elif scale != 1.0:
            torch.mul(grad, scale, out=view)
        else:
            view.copy_(grad)


def _scale_in_place(grad: Tensor, scale: float) -> None:
    with torch.no_grad():
        grad.mul_(scale)


def _size(nbytes: int) -> str:
    return f"{nbytes / _MB:.1f} MiB" if nbytes >= _MB // 10 else f"{nbytes / 1024:.1f} KiB"


class _Op:
    """An asynchronous collective of ours other than a bucket (the used-parameter map)."""

    def __init__(self) -> None:
        self.future: Future | None = None
        self.event = threading.Event()
        self.error: Exception | None = None

    def all_reduce(self, tensor: Tensor, group: dist.ProcessGroup | None) -> None:
        try:
            self.future = dist.all_reduce(tensor, group=group, async_op=True).get_future()
            self.future.add_done_callback(lambda _: self.event.set())
        except Exception as e:
            self.error = e
            self.event.set()


class _CommThread:
    """A daemon thread running submitted tasks in order: gradient copies and bucket launches. What a task
    raises goes to the list submitted with it, for the waiting thread to raise. Tasks hold what they need;
    the thread holds nothing else, and stops at :meth:`stop` or when collected."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], None], list[Exception]] | None]
        self._tasks = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(self._tasks,), daemon=True, name="tandem-ddp-comm"
        )
        self._thread.start()
        weakref.finalize(self, self._tasks.put, None)

    def submit(self, task: Callable[[], None], errors: list[Exception]) -> None:
        self._tasks.put((task, errors))

    def stop(self) -> None:
        """End the thread once the tasks submitted so far have run."""
        self._tasks.put(None)

    def drain(self, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) until the tasks submitted so far have run."""
        done = threading.Event()
        self._tasks.put((done.set, []))
        done.wait(wait_s(timeout))

    @staticmethod
    def _run(tasks: queue.SimpleQueue) -> None:
        while (item := tasks.get()) is not None:
            task, errors = item
            try:
                task()
            except Exception as e:
                errors.append(e)
            del task, item  # waiting for the next one must not keep this one's wrapper and tensors alive


# (the default group, the communication thread, the private group) of the current world: see _shared_comm
_SHARED_COMM: tuple[dist.ProcessGroup, _CommThread, dist.ProcessGroup | None] | None = None


def _shared_comm() -> tuple[_CommThread, dist.ProcessGroup | None]:
    """The communication thread and private group (None in a world of one) of the current default group's
    world, made by its first threaded wrapper (making the group is a collective: every rank makes that
    wrapper in the same order, as it makes every wrapper). Those of a default group since destroyed are
    let go."""
    global _SHARED_COMM
    world = dist.group.WORLD
    if _SHARED_COMM is None or _SHARED_COMM[0] is not world:
        if _SHARED_COMM is not None:
            _SHARED_COMM[1].stop()
        private = dist.new_group() if dist.get_world_size() > 1 else None
        _SHARED_COMM = (world, _CommThread(), private)
    return _SHARED_COMM[1], _SHARED_COMM[2]


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


# Hooks hold the wrapper weakly: a dropped wrapper leaves the module's parameters with inert hooks.
def _grad_ready_hook(ref: weakref.ref, i: int, param: Tensor, *node_grads: Any) -> None:
    """The post hook of parameter ``i``'s gradient accumulator (``node_grads``: its inputs and outputs)."""
    ddp = ref()
    if ddp is not None:
        ddp._grad_ready(i, param)


def _output_grad_hook(ref: weakref.ref, grad: Tensor) -> None:
    ddp = ref()
    if ddp is not None and ddp._expect_hooks and not ddp._in_backward:
        ddp._begin_backward()


@functools.cache
def _output_grad_hook_not_traced() -> Callable[[weakref.ref, Tensor], None]:
    """Host-side bookkeeping: under torch.compile(DistributedDataParallel(model)) dynamo would trace the
    hook on the outputs into the backward and warn of its time.perf_counter, a warning torch's DDP never
    draws. Made by the first wrapper, not at import: torch.compiler.disable imports torch._dynamo (0.7 s of
    ``import tandem``)."""
    return torch.compiler.disable(_output_grad_hook)


def _bucket_done(ref: weakref.ref | None, bucket: _Bucket, fut: Future) -> None:
    """Runs on the thread that completed a bucket's all-reduce (or hook): copy back, then tell (``ref``
    None: a joined rank's zeros, nothing to copy)."""
    bucket.done_t = time.perf_counter()
    try:
        ddp = ref() if ref is not None else None
        if ddp is not None and ddp._copy_when_done:
            ddp._copy_out(bucket, fut.value(), None)  # value() raises if the all-reduce failed
            bucket.copied = True
    except Exception:
        pass  # a failed all-reduce or a bad hook result: the waiting thread raises it (not copied)
    finally:
        bucket.event.set()


def _queue_backward_done(ref: weakref.ref) -> None:
    """Finish the reduction when the running backward (its graph task) ends."""
    torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_backward_done, ref))


def _backward_done(ref: weakref.ref) -> None:
    ddp = ref()
    if ddp is None:
        return
    node = torch._C._current_autograd_node()
    if node is not None and ddp._may_get_more_gradients():
        # This backward runs inside a node of another (a reentrant checkpoint's recomputation, begun
        # before any hook on the outputs could see it: they were not found in what forward returned),
        # and gradients are still to come from the enclosing one: finish at its end instead.
        queued = []

        def requeue(*_: Any) -> None:
            if not queued:  # once, should the graph be kept and run again
                queued.append(True)
                _queue_backward_done(ref)

        node.register_hook(requeue)
        return
    ddp._finish_backward()


class _DDPJoinHook(JoinHook):
    """What a joined rank does in a :meth:`DistributedDataParallel.join` (torch's protocol): shadow each
    step of the ranks still training, then take the last one's model."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        self.ddp._shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)

"""``tandem.nn.SyncBatchNorm``: a drop-in ``torch.nn.SyncBatchNorm`` that also runs on CPU tensors (Gloo),
communicates once per direction, stays accurate at large means, and can normalise sequences by their
real frames only (a mask, lengths, or a PackedSequence)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils.rnn import PackedSequence

from tandem.nn._fx import fx_leaf
from tandem.ops.syncbn import check_eps, sync_batch_norm, sync_group

__all__ = ["SyncBatchNorm"]

# What a non-reentrant checkpoint raises to end its recomputation once the tensors it needs are back: not
# a failed forward (a private class; where a torch lacks it, nothing is mistaken for it).
_STOP_RECOMPUTATION: type | tuple[type, ...] = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())

# Whether torch.nn.SyncBatchNorm (and so torch's _BatchNorm) takes ``bias``: 2.13 does, 2.11 does not.
TAKES_BIAS = "bias" in inspect.signature(torch.nn.SyncBatchNorm.__init__).parameters


class SyncBatchNorm(_BatchNorm):
    r"""Batch norm over ``[N, C, *]`` inputs whose statistics cover every process of ``process_group``.

    The constructor, parameters, buffers and ``state_dict`` keys are ``torch.nn.BatchNormNd``'s
    (``weight, bias, running_mean, running_var, num_batches_tracked``), so checkpoints load both ways.
    In training the mean and variance are those of all ranks' frames together, weighted by each rank's
    frame count (uneven batches are right, a rank may have 0 or 1 sample): one ``all_gather`` of every
    rank's ``2C + 1`` float64 statistics (mean, centred sum of squares, count), merged on every rank from
    centred differences, so it stays accurate however large ``|mean| / std`` is
    (:func:`tandem.ops.syncbn.gather_over_ranks`); ``running_mean``/``running_var`` (unbiased) come out
    identical on every rank. The backward does one collective of ``2C`` float64 sums (an ``all_reduce``
    on GPUs; on CPUs an ``all_gather`` and a local sum, which Gloo does faster for so small a tensor:
    :func:`tandem.ops.syncbn.sum_over_ranks`), so ranks may normalise different float dtypes; weight and
    bias gradients are local, as torch's (the data-parallel wrapper averages them). In eval mode, in a group
    of one process, or when torch.distributed is not initialised, it is plain batch norm and
    communicates nothing.
    Every rank of the group must call it the same number of times (it is a collective).

    Sequence-wise normalisation (recurrent stacks): padded frames can be left out of the statistics.
    They get output 0 and gradient 0, and what they hold does not matter (NaN included).

    - ``forward(x, mask=m)``: ``m`` is a bool tensor of ``x``'s shape without the channel dim
      (``[N]`` for ``[N, C]``, ``[N, L]`` for ``[N, C, L]``, ``[N, H, W]`` for ``[N, C, H, W]``),
      True on real frames.
    - ``forward(x, lengths=l)`` for ``x`` ``[N, C, L]``: sequence ``n`` is real on ``[0, l[n])``.
    - ``forward(packed)``: a ``PackedSequence`` whose ``data`` is ``[P, C]`` (it has no padding) gives a
      PackedSequence with the same ``batch_sizes`` and indices.

    Args:
        num_features: ``C``.
        eps, momentum, affine, track_running_stats, device, dtype, bias: as for ``torch.nn.BatchNorm1d``
            (``momentum=None``: cumulative average; ``bias`` where the installed torch's batch norms take it).
        process_group: the group whose ranks share statistics; None is the default (world) group.

    Shapes:
        input ``[N, C]``, ``[N, C, L]``, ``[N, C, H, W]`` or ``[N, C, D, H, W]``, any float dtype
        (float16/bfloat16 inputs keep float32 statistics); output: the same shape, dtype and memory
        format (channels_last stays channels_last).

    Example::

        >>> bn = SyncBatchNorm(64)
        >>> x = torch.randn(8, 64, 50)  # [N, C, L], padded to L = 50
        >>> lengths = torch.randint(1, 51, (8,))
        >>> y = bn(x, lengths=lengths)  # statistics over the real frames of all ranks
        >>> # time-major RNN features [T, B, H], DeepSpeech style: flatten frames, mask [T * B]
        >>> h = torch.randn(50, 8, 64)
        >>> m = torch.arange(50)[:, None] < lengths[None, :]  # [T, B]
        >>> y = bn(h.reshape(-1, 64), mask=m.reshape(-1)).view(50, 8, 64)
    """

    if TAKES_BIAS:

        def __init__(
            self,
            num_features: int,
            eps: float = 1e-5,
            momentum: float | None = 0.1,
            affine: bool = True,
            track_running_stats: bool = True,
            process_group: Any | None = None,
            device: torch.device | str | None = None,
            dtype: torch.dtype | None = None,
            *,
            bias: bool = True,
        ) -> None:
            super().__init__(
                num_features,
                eps,
                momentum,
                affine,
                track_running_stats,
                device=device,
                dtype=dtype,
                bias=bias,
            )
            self.process_group = process_group

    else:  # a torch without the argument (2.11): its SyncBatchNorm's signature, and so its TypeError

        def __init__(
            self,
            num_features: int,
            eps: float = 1e-5,
            momentum: float | None = 0.1,
            affine: bool = True,
            track_running_stats: bool = True,
            process_group: Any | None = None,
            device: torch.device | str | None = None,
            dtype: torch.dtype | None = None,
        ) -> None:
            super().__init__(
                num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
            )
            self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _batch_statistics(self) -> bool:
        """Whether the batch's own statistics normalise it: in training, and in eval when there are no
        running statistics (torch's ``bn_training``)."""
        return self.training or (self.running_mean is None and self.running_var is None)

    def _check_channels(self, input: Tensor, mask: Tensor | None) -> None:
        per_channel = (self.weight, self.bias, self.running_mean, self.running_var)
        if any(isinstance(t, torch.nn.parameter.UninitializedTensorMixin) for t in per_channel):
            return  # a lazy module converted before its first forward: F.batch_norm's error, as torch's
        if (
            input.numel() == 0
            and mask is None
            and not (self.training and sync_group(self.process_group) is not None)
        ):
            return  # F.batch_norm's path, as torch's module takes: an empty batch of any width comes back
        # torch only notices a wrong channel count through a per-channel tensor that batch_norm is given
        # (running statistics only in eval or when tracked); so do we
        has_stats = self.running_mean is not None and (not self.training or self.track_running_stats)
        has_per_channel = self.weight is not None or self.bias is not None or has_stats
        if has_per_channel and input.size(1) != self.num_features:
            # what torch's batch_norm checks before it meets the channels, with its exception types
            bn_training = self._batch_statistics()
            if bn_training and mask is None:
                torch.nn.functional._verify_batch_size(input.size())
            check_eps(self.eps, bn_training, 0.0 if self.momentum is None else self.momentum)
            raise RuntimeError(
                f"SyncBatchNorm: expected input with {self.num_features} channels in dim 1 (num_features), "
                f"got {input.size(1)} (input of shape {list(input.shape)})"
            )

    @staticmethod
    def _lengths_mask(input: Tensor, lengths: Tensor) -> Tensor:
        if input.dim() != 3:
            raise ValueError(
                f"lengths: only for 3-D input [N, C, L] (use mask= for others), got {input.dim()}-D input"
            )
        batch, steps = input.shape[0], input.shape[2]
        # a list on the CPU, not on the default device (torch.set_default_device, a torch.device context)
        if not isinstance(lengths, Tensor):
            lengths = torch.as_tensor(lengths, device="cpu")
        if lengths.dim() != 1 or lengths.numel() != batch or lengths.is_floating_point():
            raise ValueError(
                f"lengths: expected a 1-D integer tensor of {batch} (N) elements, got "
                f"{lengths.dim()}-D {lengths.dtype} with {lengths.numel()} elements"
            )
        if (
            not lengths.is_cuda
            and lengths.numel()
            and not 0 <= int(lengths.min()) <= int(lengths.max()) <= steps
        ):
            raise ValueError(
                f"lengths: expected values in [0, {steps}] (L), "
                f"got {lengths.min().item()}..{lengths.max().item()}"
            )
        lengths = lengths.to(input.device)
        return torch.arange(steps, device=input.device) < lengths.unsqueeze(1)  # [N, L]

    def __prepare_scriptable__(self) -> SyncBatchNorm:
        """torch.jit.script cannot compile this module (nor torch.nn.SyncBatchNorm, which fails with a
        RuntimeError): the same type of error, saying so, not TorchScript's NotSupportedError of the
        keyword ``lengths`` (a fallback that catches RuntimeError would miss it)."""
        raise RuntimeError(
            "tandem.nn.SyncBatchNorm: torch.jit.script cannot compile it (nor torch.nn.SyncBatchNorm); "
            "use torch.jit.trace or torch.compile"
        )

    def forward(  # type: ignore[override]
        self, input: Tensor | PackedSequence, mask: Tensor | None = None, *, lengths: Tensor | None = None
    ) -> Tensor | PackedSequence:
        """Normalise ``input``; ``mask`` ``[N, *]`` or ``lengths`` ``[N]`` mark the real frames (see the
        class docstring). A PackedSequence comes back as a PackedSequence."""
        args = (input,) if mask is None else (input, mask)
        traced = fx_leaf(self, args, {} if lengths is None else {"lengths": lengths})  # torch.fx: a leaf
        if traced is not None:
            return traced
        if isinstance(input, PackedSequence):
            if mask is not None or lengths is not None:
                raise ValueError(
                    "SyncBatchNorm: a PackedSequence has no padding; expected mask=None, lengths=None"
                )
            # the constructor, not _replace: torch.compile cannot rebuild a _replace'd PackedSequence across
            # a graph break (torch 2.13's dynamo), and a model with one fails to compile
            data, batch_sizes, sorted_indices, unsorted_indices = input
            return PackedSequence(self._normalize(data, None), batch_sizes, sorted_indices, unsorted_indices)
        self._check_input_dim(input)  # first, as torch's (traced as the root by torch.fx: its TraceError)
        if mask is not None and lengths is not None:
            raise ValueError("SyncBatchNorm: expected mask or lengths, got both")
        if lengths is not None:
            mask = self._lengths_mask(input, lengths)
        return self._normalize(input, mask)

    def _normalize(self, input: Tensor, mask: Tensor | None) -> Tensor:
        self._check_input_dim(input)
        if input.size(1) == 0:  # torch's order: the dimensions, the channels, then num_batches_tracked
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")
        if self.training and self.track_running_stats and self.num_batches_tracked is None:
            raise AssertionError("num_batches_tracked must not be None")  # torch.nn.SyncBatchNorm's check
        self._check_channels(input, mask)
        # torch's logic, except that num_batches_tracked moves back when the step fails
        factor = 0.0 if self.momentum is None else self.momentum
        tracking = self.training and self.track_running_stats
        if tracking and self.momentum is None:
            factor = 1.0 / (float(self.num_batches_tracked) + 1.0)
        bn_training = self._batch_statistics()
        keep_buffers = not self.training or self.track_running_stats
        if tracking:
            # before the op, as torch's: a non-reentrant checkpoint's recomputation stops right after the
            # op (its early stop) and must count too
            self.num_batches_tracked.add_(1)
        try:
            return sync_batch_norm(
                input,
                self.running_mean if keep_buffers else None,
                self.running_var if keep_buffers else None,
                self.weight,
                self.bias,
                bn_training,
                factor,
                self.eps,
                mask=mask,
                process_group=self.process_group,
                sync=self.training,  # torch.nn.SyncBatchNorm never communicates in eval mode
            )
        except BaseException as e:
            if tracking and not isinstance(e, _STOP_RECOMPUTATION):  # a refused forward counts nothing
                self.num_batches_tracked.sub_(1)
            raise

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_group: Any | None = None
    ) -> torch.nn.Module:
        """Replace every ``BatchNorm*d`` (any ``_BatchNorm``) in ``module`` by a :class:`SyncBatchNorm`
        that shares its parameters, running statistics and ``num_batches_tracked``.

        Returns ``module`` with its children converted, or a new :class:`SyncBatchNorm` when ``module``
        itself is a batch norm.

        Example::

            >>> net = torch.nn.Sequential(torch.nn.Conv1d(13, 32, 5), torch.nn.BatchNorm1d(32))
            >>> net = SyncBatchNorm.convert_sync_batchnorm(net)
            >>> type(net[1]).__name__
            'SyncBatchNorm'
        """
        output = module
        if isinstance(module, _BatchNorm):
            # bias=False where the installed torch takes the argument (TAKES_BIAS); under torch 2.11 a bias
            # set to None by hand is copied over as it is, below (as torch's conversion does)
            extra = {"bias": False} if TAKES_BIAS and module.affine and module.bias is None else {}
            output = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group,
                **extra,
            )
            if module.affine:
                with torch.no_grad():
                    output.weight = module.weight
                    output.bias = module.bias
            output.running_mean = module.running_mean
            output.running_var = module.running_var
            output.num_batches_tracked = module.num_batches_tracked
            output.training = module.training
            if hasattr(module, "qconfig"):
                output.qconfig = module.qconfig
        for name, child in module.named_children():
            output.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return output

"""The recognizer: DeepSpeech2's shape (Amodei et al. 2016), sized for a CPU.

log-mel ``[B, T, F]`` -> 2-D convolutions over (frequency, time), each stride 2 in frequency and in time,
each followed by batch norm and a clipped ReLU -> bidirectional recurrent layers (GRU or LSTM) on packed
sequences, with sequence-wise batch norm on the input of every layer after the first and dropout on the input
of every layer (training) -> a linear layer to the
alphabet -> CTC log-probabilities.

Every batch norm sees the real frames only: padding never enters the statistics, and padded frames are
zeroed after each convolution, so an utterance's output does not depend on what it was batched with.
The parts are pluggable (:class:`Parts`): the same network, with the same parameter names, is built from
tandem's modules for training and from torch's for :func:`to_torch` and the side-by-side benchmark.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import tandem

__all__ = [
    "ModelConfig",
    "Parts",
    "DeepSpeech2",
    "TANDEM_PARTS",
    "TORCH_PARTS",
    "conv2d_one_channel",
    "dropout",
]


@dataclass(frozen=True)
class Parts:
    """The module classes a :class:`DeepSpeech2` is built from: the recurrent layer per cell name and the
    batch norm (called on ``[N, C]`` and ``[N, C, L]`` inputs of real frames only)."""

    rnn: dict[str, type[nn.Module]] = field(default_factory=dict)
    norm: type[nn.Module] = nn.BatchNorm1d


TANDEM_PARTS = Parts(rnn={"gru": tandem.nn.GRU, "lstm": tandem.nn.LSTM}, norm=tandem.nn.SyncBatchNorm)
TORCH_PARTS = Parts(rnn={"gru": nn.GRU, "lstm": nn.LSTM}, norm=nn.BatchNorm1d)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture; saved in checkpoints so a model can be rebuilt from one."""

    n_mels: int = 40
    n_classes: int = 29
    cell: str = "gru"
    hidden: int = 128
    layers: int = 3
    conv_channels: int = 16
    conv_layers: int = 2
    conv_kernel: tuple[int, int] = (11, 5)  # (frequency, time)
    # Time stride of each convolution (each also halves the frequency bands). A total of 4 (40 ms a frame)
    # halves the recurrent layers' steps against DeepSpeech2's 2 for characters; measured on the digits,
    # 2 learned more slowly in the same time (test WER 11% against 4.5% after 5 minutes), still
    # writing "three" as "thre" most often.
    conv_time_strides: tuple[int, ...] = (2, 2)
    # Dropout on the input of every recurrent layer, in training. Measured with speaker theo held out: test
    # WER 13.0% without, 10.3% with 0.25, ~13% with 0.4; the customary split is unchanged (1.33%).
    dropout: float = 0.25

    def __post_init__(self) -> None:
        if self.cell not in ("gru", "lstm"):
            raise ValueError(f"ModelConfig: expected cell 'gru' or 'lstm', got {self.cell!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig: expected dropout in [0, 1), got {self.dropout}")
        if self.conv_layers not in (1, 2):
            raise ValueError(f"ModelConfig: expected conv_layers 1 or 2, got {self.conv_layers}")
        object.__setattr__(self, "conv_kernel", tuple(self.conv_kernel))
        object.__setattr__(self, "conv_time_strides", tuple(self.conv_time_strides))
        if len(self.conv_time_strides) != self.conv_layers or not set(self.conv_time_strides) <= {1, 2}:
            raise ValueError(
                f"ModelConfig: expected a time stride of 1 or 2 per convolution ({self.conv_layers}), "
                f"got {self.conv_time_strides}"
            )

    def output_frames(self, frames: Tensor) -> Tensor:
        """Output frames of inputs of ``frames`` frames (a stride of 2 halves them, rounding up)."""
        for stride in self.conv_time_strides:
            frames = (frames + stride - 1) // stride
        return frames

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class DeepSpeech2(nn.Module):
    """DeepSpeech2-shaped CTC acoustic model (see the module docstring).

    Args:
        config: the architecture.
        parts: the module classes (default: tandem's GRU/LSTM and SyncBatchNorm).

    Shapes:
        features ``[B, T, n_mels]`` (padded), frames ``[B]`` ->
        log-probabilities ``[T', B, n_classes]`` (``torch.nn.CTCLoss``'s layout), output frames ``[B]``.

    Example::

        >>> model = DeepSpeech2(ModelConfig(n_mels=40, n_classes=29, hidden=64, layers=2))
        >>> log_probs, out_frames = model(torch.randn(3, 100, 40), torch.tensor([100, 80, 37]))
        >>> log_probs.shape, out_frames.tolist()
        (torch.Size([25, 3, 29]), [25, 20, 10])
    """

    def __init__(self, config: ModelConfig, parts: Parts = TANDEM_PARTS) -> None:
        super().__init__()
        self.config = config
        kf, kt = config.conv_kernel
        channels, bands = config.conv_channels, config.n_mels
        self.convs = nn.ModuleList()
        self.conv_norms = nn.ModuleList()
        for i in range(config.conv_layers):
            stride = (2, config.conv_time_strides[i])
            conv = nn.Conv2d(
                1 if i == 0 else channels, channels, (kf, kt), stride, padding=(kf // 2, kt // 2)
            )
            self.convs.append(conv)
            self.conv_norms.append(parts.norm(channels))
            bands = (bands + 1) // 2
        rnn_class = parts.rnn[config.cell]
        width = channels * bands
        self.rnns = nn.ModuleList()
        self.rnn_norms = nn.ModuleList()
        for i in range(config.layers):
            if i > 0:
                self.rnn_norms.append(parts.norm(width))
            self.rnns.append(rnn_class(width, config.hidden, bidirectional=True))
            width = 2 * config.hidden
        self.head = nn.Linear(width, config.n_classes)
        self.clip = nn.Hardtanh(0.0, 20.0)

    def forward(self, features: Tensor, frames: Tensor) -> tuple[Tensor, Tensor]:
        x = features.transpose(1, 2).unsqueeze(1)  # [B, 1, F, T]
        frames = frames.cpu()
        for i, (conv, norm) in enumerate(zip(self.convs, self.conv_norms)):
            x = conv2d_one_channel(x, conv)  # [B, C, F', T']
            frames = (frames + conv.stride[1] - 1) // conv.stride[1]
            if i + 1 < len(self.convs):
                x = self._conv_norm(norm, x, frames)
        # [B, T', C * F'] -> the real frames only, as a PackedSequence
        x = x.permute(0, 3, 1, 2)
        packed = pack_padded_sequence(x, frames, batch_first=True, enforce_sorted=False)
        batch, steps, channels, bands = x.shape
        data = self.clip(self.conv_norms[-1](packed.data)).reshape(-1, channels * bands)  # [P, C * F']
        for i, rnn in enumerate(self.rnns):
            if i > 0:
                data = self.rnn_norms[i - 1](data)
            data = dropout(data, self.config.dropout, self.training)
            data, _ = rnn(
                PackedSequence(data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
            )
            data = data.data
        logits = self.head(data)
        out = PackedSequence(
            logits.log_softmax(-1), packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices
        )
        log_probs, out_frames = pad_packed_sequence(out, total_length=steps)  # [T', B, K]
        return log_probs, out_frames

    def _conv_norm(self, norm: nn.Module, x: Tensor, frames: Tensor) -> Tensor:
        """Batch norm and clip of ``x`` ``[B, C, F, T]`` over its real frames; padded frames become 0."""
        valid = torch.arange(x.shape[3], device=frames.device) < frames[:, None]  # [B, T]
        valid = valid.to(x.device)
        real = x.permute(0, 3, 1, 2)[valid]  # [P, C, F]
        # written through a [B, T, C, F] view of a [B, C, F, T] tensor, which the next convolution takes as
        # it is (a [B, T, C, F] tensor permuted cost it a copy): the same numbers, one process's step 1-2%
        # faster (one thread; at 2 ranks within an epoch's noise)
        out = torch.zeros_like(x, memory_format=torch.contiguous_format)
        out.permute(0, 3, 1, 2)[valid] = self.clip(norm(real))
        return out


class _OneChannelConv(torch.autograd.Function):
    """``F.conv2d`` of a one-channel input, with a cheaper weight gradient: the correlation of the input
    with the output gradient as one convolution (the batch as channels, the stride as dilation). For one
    input channel torch's (oneDNN's) backward takes 2-3x its forward: the recognizer's first convolution
    over 16 utterances of 1.6 s, forward and backward, 14.0 ms with torch's, 7.3 ms with this (one
    thread)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        stride: tuple[int, int],
        padding: tuple[int, int],
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.stride, ctx.padding = stride, padding
        return F.conv2d(x, weight, bias, stride, padding)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        (sf, st), (pf, pt) = ctx.stride, ctx.padding
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.nn.grad.conv2d_input(x.shape, weight, grad, ctx.stride, ctx.padding)
        if ctx.needs_input_grad[1]:
            kf, kt = weight.shape[2:]
            padded = F.pad(x.transpose(0, 1), (pt, pt, pf, pf))  # [1, B, F + 2 pf, T + 2 pt]
            # out[0, c, i, j] = sum_{b, f, t} x[b, 0, sf f + i, st t + j] grad[b, c, f, t]
            full = F.conv2d(padded, grad.transpose(0, 1), dilation=(sf, st))  # [1, C, >= kf, >= kt]
            grad_w = full[:, :, :kf, :kt].transpose(0, 1)
        if ctx.needs_input_grad[2]:  # False without a bias
            grad_b = grad.sum((0, 2, 3))
        return grad_x, grad_w, grad_b, None, None


def conv2d_one_channel(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """``conv(x)`` for a :class:`torch.nn.Conv2d` with one input channel (no groups, dilation 1, zero
    padding given as numbers), with the same values and gradients as torch's, computed faster on a CPU
    (see :class:`_OneChannelConv`); any other convolution is ``conv(x)`` itself."""
    plain = (
        conv.in_channels != 1
        or conv.groups != 1
        or conv.dilation != (1, 1)
        or conv.padding_mode != "zeros"
        or isinstance(conv.padding, str)
        or x.device.type != "cpu"
    )
    if plain:
        return conv(x)
    return _OneChannelConv.apply(x, conv.weight, conv.bias, conv.stride, conv.padding)


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``F.dropout(x, p, training)``'s distribution (each element zeroed with probability ``p``, the rest
    scaled by ``1 / (1 - p)``) from uniform draws: torch's CPU bernoulli draws one number at a time
    (3.5 ms against 2.3 for a ``[640, 320]`` batch, one thread)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: expected p between 0 and 1, got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    keep = (torch.rand_like(x) >= p).to(x.dtype).mul_(1.0 / (1.0 - p))
    return x * keep

"""``tandem.nn.GRU``: a drop-in ``torch.nn.GRU`` whose layers run ``tandem::gru_fwd`` / ``gru_bwd``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from tandem.ops.gru import gru as gru_layer

__all__ = ["GRU"]


class GRU(torch.nn.RNNBase):
    r"""Multi-layer GRU with ``torch.nn.GRU``'s constructor, parameters, gate math and outputs.

    Built on ``torch.nn.RNNBase`` (as ``torch.nn.GRU`` is), so argument checks, parameter names
    (``weight_ih_l0``, ``bias_hh_l1_reverse``, ...), shapes, initialisation and ``state_dict`` are
    torch's own and load both ways. Each layer runs both directions at once through
    :func:`tandem.ops.gru`, on packed rows: padded frames of a ``PackedSequence`` cost nothing.

    Args:
        input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, device, dtype:
            as for ``torch.nn.GRU``.

    Shapes (``D = 2`` if bidirectional else 1, ``L = num_layers``):
        input ``[T, B, I]`` (``[B, T, I]`` if batch_first), ``[T, I]`` unbatched, or a PackedSequence;
        hx ``[D*L, B, H]`` (``[D*L, H]`` unbatched), zeros if omitted;
        output ``[T, B, D*H]`` (or a PackedSequence), h_n ``[D*L, B, H]``.

    Example::

        >>> gru = GRU(12, 64, num_layers=2, bidirectional=True)
        >>> out, h_n = gru(torch.randn(29, 8, 12))
        >>> out.shape, h_n.shape
        (torch.Size([29, 8, 128]), torch.Size([4, 8, 64]))
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            "GRU",
            input_size,
            hidden_size,
            num_layers=num_layers,
            bias=bias,
            batch_first=batch_first,
            dropout=dropout,
            bidirectional=bidirectional,
            device=device,
            dtype=dtype,
        )

    def _layer_weights(self, layer: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """The layer's weights stacked over directions: ``[D, 3H, I]``, ``[D, 3H, H]``, ``[D, 3H]``."""
        suffixes = ("", "_reverse") if self.bidirectional else ("",)
        stacked = []
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            if name.startswith("bias") and not self.bias:
                stacked.append(None)
                continue
            # getattr each call, so torch.func.functional_call and reassigned parameters are honoured
            per_direction = [getattr(self, f"{name}_l{layer}{s}") for s in suffixes]
            stacked.append(
                per_direction[0].unsqueeze(0) if len(suffixes) == 1 else torch.stack(per_direction)
            )
        return stacked[0], stacked[1], stacked[2], stacked[3]

    def _check_devices_and_dtypes(self, data: Tensor, hx: Tensor) -> None:
        weight = self.weight_ih_l0
        if data.device != weight.device:
            raise RuntimeError(
                "Input and parameter tensors are not at the same device, found input tensor at "
                f"{data.device} and parameter tensor at {weight.device}"
            )
        if hx.device != data.device:
            raise RuntimeError(
                "Input and hidden tensors are not at the same device, found input tensor at "
                f"{data.device} and hidden tensor at {hx.device}"
            )
        if hx.dtype != data.dtype:
            raise RuntimeError(f"GRU: expected hx of dtype {data.dtype} (the input's dtype), got {hx.dtype}")

    def forward(  # type: ignore[override]
        self, input: Tensor | PackedSequence, hx: Tensor | None = None
    ) -> tuple[Tensor | PackedSequence, Tensor]:
        num_directions = 2 if self.bidirectional else 1
        is_packed = isinstance(input, PackedSequence)
        is_batched = True
        if is_packed:
            data, batch_sizes, sorted_indices, unsorted_indices = input
            mini_batch = int(batch_sizes[0])
            if hx is not None:
                # hx follows the caller's batch order; the packed rows are sorted by length
                hx = self.permute_hidden(hx, sorted_indices)
            check_input, check_sizes = data, batch_sizes
        else:
            if input.dim() not in (2, 3):
                raise ValueError(f"GRU: Expected input to be 2D or 3D, got {input.dim()}D instead")
            is_batched = input.dim() == 3
            batch_dim = 0 if self.batch_first else 1
            if not is_batched:
                input = input.unsqueeze(batch_dim)
                if hx is not None:
                    if hx.dim() != 2:
                        raise RuntimeError(
                            f"For unbatched 2-D input, hx should also be 2-D but got {hx.dim()}-D tensor"
                        )
                    hx = hx.unsqueeze(1)
            elif hx is not None and hx.dim() != 3:
                raise RuntimeError(
                    f"For batched 3-D input, hx should also be 3-D but got {hx.dim()}-D tensor"
                )
            mini_batch = input.size(batch_dim)
            check_input, check_sizes = input, None
        if hx is None:
            hx = torch.zeros(
                self.num_layers * num_directions,
                mini_batch,
                self.hidden_size,
                dtype=check_input.dtype,
                device=check_input.device,
            )
        self.check_forward_args(check_input, hx, check_sizes)
        self._check_devices_and_dtypes(check_input, hx)

        if not is_packed:
            # time-major rows: a padded batch is a packed one whose sequences all have length T
            steps = input.size(1) if self.batch_first else input.size(0)
            x = input.transpose(0, 1) if self.batch_first else input
            data = x.reshape(steps * mini_batch, self.input_size)
            batch_sizes = torch.full((steps,), mini_batch, dtype=torch.long)

        h_n = []
        layer_input = data
        for layer in range(self.num_layers):
            h0 = hx[layer * num_directions : (layer + 1) * num_directions]
            layer_input, h_last = gru_layer(layer_input, batch_sizes, h0, *self._layer_weights(layer))
            h_n.append(h_last)
            if self.dropout > 0 and self.training and layer < self.num_layers - 1:
                layer_input = F.dropout(layer_input, self.dropout, training=True)
        hidden = torch.cat(h_n, 0) if len(h_n) > 1 else h_n[0]

        if is_packed:
            output = PackedSequence(layer_input, batch_sizes, sorted_indices, unsorted_indices)
            return output, self.permute_hidden(hidden, unsorted_indices)
        out = layer_input.view(steps, mini_batch, num_directions * self.hidden_size)
        if self.batch_first:
            out = out.transpose(0, 1)
        if not is_batched:
            out = out.squeeze(batch_dim)
            hidden = hidden.squeeze(1)
        return out, hidden

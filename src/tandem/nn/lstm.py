"""``tandem.nn.LSTM``: a drop-in ``torch.nn.LSTM`` whose layers run ``tandem::lstm_fwd`` / ``lstm_bwd``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from tandem.ops.lstm import lstm as lstm_layer

__all__ = ["LSTM"]


class LSTM(torch.nn.RNNBase):
    r"""Multi-layer LSTM with ``torch.nn.LSTM``'s constructor, parameters, gate math and outputs.

    Built on ``torch.nn.RNNBase`` (as ``torch.nn.LSTM`` is), so argument checks, parameter names
    (``weight_ih_l0``, ``weight_hr_l1_reverse``, ...), shapes, initialisation and ``state_dict`` are
    torch's own and load both ways. Each layer runs both directions at once through
    :func:`tandem.ops.lstm`, on packed rows: padded frames of a ``PackedSequence`` cost nothing.

    Args:
        input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, proj_size,
        device, dtype: as for ``torch.nn.LSTM``.

    Shapes (``D = 2`` if bidirectional else 1, ``L = num_layers``, ``R = proj_size or hidden_size``):
        input ``[T, B, I]`` (``[B, T, I]`` if batch_first), ``[T, I]`` unbatched, or a PackedSequence;
        hx ``(h0 [D*L, B, R], c0 [D*L, B, H])`` (without the batch dim unbatched), zeros if omitted;
        output ``[T, B, D*R]`` (or a PackedSequence) and ``(h_n [D*L, B, R], c_n [D*L, B, H])``.

    Example::

        >>> lstm = LSTM(12, 64, num_layers=2, bidirectional=True)
        >>> out, (h_n, c_n) = lstm(torch.randn(29, 8, 12))
        >>> out.shape, h_n.shape, c_n.shape
        (torch.Size([29, 8, 128]), torch.Size([4, 8, 64]), torch.Size([4, 8, 64]))
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
        proj_size: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            "LSTM",
            input_size,
            hidden_size,
            num_layers=num_layers,
            bias=bias,
            batch_first=batch_first,
            dropout=dropout,
            bidirectional=bidirectional,
            proj_size=proj_size,
            device=device,
            dtype=dtype,
        )

    def _layer_weights(self, layer: int) -> tuple[Tensor | None, ...]:
        """The layer's weights stacked over directions: w_ih, w_hh, b_ih, b_hh, w_hr (None if absent)."""
        suffixes = ("", "_reverse") if self.bidirectional else ("",)
        stacked: list[Tensor | None] = []
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr"):
            if (name.startswith("bias") and not self.bias) or (name == "weight_hr" and not self.proj_size):
                stacked.append(None)
                continue
            # getattr each call, so torch.func.functional_call and reassigned parameters are honoured
            per_direction = [getattr(self, f"{name}_l{layer}{s}") for s in suffixes]
            stacked.append(
                per_direction[0].unsqueeze(0) if len(suffixes) == 1 else torch.stack(per_direction)
            )
        return tuple(stacked)

    def get_expected_cell_size(self, input: Tensor, batch_sizes: Tensor | None) -> tuple[int, int, int]:
        if batch_sizes is not None:
            mini_batch = int(batch_sizes[0])
        else:
            mini_batch = input.size(0) if self.batch_first else input.size(1)
        num_directions = 2 if self.bidirectional else 1
        return (self.num_layers * num_directions, mini_batch, self.hidden_size)

    def check_forward_args(  # type: ignore[override]
        self, input: Tensor, hidden: tuple[Tensor, Tensor], batch_sizes: Tensor | None
    ) -> None:
        # torch.nn.LSTM's checks and messages
        self.check_input(input, batch_sizes)
        self.check_hidden_size(
            hidden[0], self.get_expected_hidden_size(input, batch_sizes), "Expected hidden[0] size {}, got {}"
        )
        self.check_hidden_size(
            hidden[1], self.get_expected_cell_size(input, batch_sizes), "Expected hidden[1] size {}, got {}"
        )

    def permute_hidden(  # type: ignore[override]
        self, hx: tuple[Tensor, Tensor], permutation: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        if permutation is None:
            return hx
        return hx[0].index_select(1, permutation), hx[1].index_select(1, permutation)

    def _check_devices_and_dtypes(self, data: Tensor, hx: tuple[Tensor, Tensor]) -> None:
        weight = self.weight_ih_l0
        if data.device != weight.device:
            raise RuntimeError(
                "Input and parameter tensors are not at the same device, found input tensor at "
                f"{data.device} and parameter tensor at {weight.device}"
            )
        for name, t in zip(("hx", "cx"), hx):
            if t.device != data.device:
                raise RuntimeError(
                    "Input and hidden tensors are not at the same device, found input tensor at "
                    f"{data.device} and hidden tensor at {t.device}"
                )
            if t.dtype != data.dtype:
                raise RuntimeError(
                    f"LSTM: expected {name} of dtype {data.dtype} (the input's dtype), got {t.dtype}"
                )

    def forward(  # type: ignore[override]
        self, input: Tensor | PackedSequence, hx: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor | PackedSequence, tuple[Tensor, Tensor]]:
        num_directions = 2 if self.bidirectional else 1
        out_size = self.proj_size if self.proj_size > 0 else self.hidden_size
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
                raise ValueError(f"LSTM: Expected input to be 2D or 3D, got {input.dim()}D instead")
            is_batched = input.dim() == 3
            batch_dim = 0 if self.batch_first else 1
            if not is_batched:
                input = input.unsqueeze(batch_dim)
            if hx is not None:
                dims = 3 if is_batched else 2
                if hx[0].dim() != dims or hx[1].dim() != dims:
                    kind = "batched 3-D" if is_batched else "unbatched 2-D"
                    raise RuntimeError(
                        f"For {kind} input, hx and cx should also be {dims}-D but got "
                        f"({hx[0].dim()}-D, {hx[1].dim()}-D) tensors"
                    )
                if not is_batched:
                    hx = (hx[0].unsqueeze(1), hx[1].unsqueeze(1))
            mini_batch = input.size(batch_dim)
            check_input, check_sizes = input, None
        if hx is None:
            shape = (self.num_layers * num_directions, mini_batch)
            kwargs = dict(dtype=check_input.dtype, device=check_input.device)
            hx = (torch.zeros(*shape, out_size, **kwargs), torch.zeros(*shape, self.hidden_size, **kwargs))
        self.check_forward_args(check_input, hx, check_sizes)
        self._check_devices_and_dtypes(check_input, hx)

        if not is_packed:
            # time-major rows: a padded batch is a packed one whose sequences all have length T
            steps = input.size(1) if self.batch_first else input.size(0)
            x = input.transpose(0, 1) if self.batch_first else input
            data = x.reshape(steps * mini_batch, self.input_size)
            batch_sizes = torch.full((steps,), mini_batch, dtype=torch.long)

        h_n, c_n = [], []
        layer_input = data
        for layer in range(self.num_layers):
            span = slice(layer * num_directions, (layer + 1) * num_directions)
            layer_input, h_last, c_last = lstm_layer(
                layer_input, batch_sizes, hx[0][span], hx[1][span], *self._layer_weights(layer)
            )
            h_n.append(h_last)
            c_n.append(c_last)
            if self.dropout > 0 and self.training and layer < self.num_layers - 1:
                layer_input = F.dropout(layer_input, self.dropout, training=True)
        hidden = (torch.cat(h_n, 0), torch.cat(c_n, 0)) if len(h_n) > 1 else (h_n[0], c_n[0])

        if is_packed:
            output = PackedSequence(layer_input, batch_sizes, sorted_indices, unsorted_indices)
            return output, self.permute_hidden(hidden, unsorted_indices)
        out = layer_input.view(steps, mini_batch, num_directions * out_size)
        if self.batch_first:
            out = out.transpose(0, 1)
        if not is_batched:
            out = out.squeeze(batch_dim)
            hidden = (hidden[0].squeeze(1), hidden[1].squeeze(1))
        return out, hidden

"""``tandem.nn.GRU``: a drop-in ``torch.nn.GRU`` whose layers run ``tandem::gru_fwd`` / ``gru_bwd``."""

from __future__ import annotations

from typing import Any, overload

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from tandem.nn._fx import fx_leaf
from tandem.nn._rnn import RNNLayers, needs_formulas
from tandem.ops.gru import gru as gru_layer
from tandem.ops.gru.reference import gru_layer_autograd

__all__ = ["GRU"]


class GRU(RNNLayers):
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

    _GATES = 3

    @overload
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
    ) -> None: ...

    @overload
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # torch.nn.GRU's constructor: the arguments reach torch.nn.RNNBase as given, so every one torch
        # takes is taken the same way, and every wrong one (an unknown keyword included) raises torch's error
        if "proj_size" in kwargs:
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")  # torch's words
        super().__init__("GRU", *args, **kwargs)

    def forward(  # type: ignore[override]
        self, input: Tensor | PackedSequence, hx: Tensor | None = None
    ) -> tuple[Tensor | PackedSequence, Tensor]:
        traced = fx_leaf(self, (input,) if hx is None else (input, hx))  # torch.fx: a leaf, as torch's
        if traced is not None:
            return traced
        return self._dispatch(input, hx)

    def _forward(
        self, input: Tensor | PackedSequence, hx: Tensor | None, dtype: torch.dtype | None
    ) -> tuple[Tensor | PackedSequence, Tensor]:
        """The forward of :meth:`_dispatch`, ``dtype`` the one autocast makes the layers run in (None:
        the input's own)."""
        weights_now = self._current_weights()
        num_directions = 2 if self.bidirectional else 1
        rows = self._take_input(input)
        if dtype is not None:
            rows.data = rows.data.to(dtype)
        if hx is not None:
            if rows.packed:
                # hx follows the caller's batch order; the packed rows are sorted by length
                hx = self.permute_hidden(hx, rows.sorted_indices)
            elif not rows.batched:
                if hx.dim() != 2:
                    raise RuntimeError(
                        f"For unbatched 2-D input, hx should also be 2-D but got {hx.dim()}-D tensor"
                    )
                hx = hx.unsqueeze(1)
            elif hx.dim() != 3:
                raise RuntimeError(
                    f"For batched 3-D input, hx should also be 3-D but got {hx.dim()}-D tensor"
                )
        if hx is None:
            shape = (self.num_layers * num_directions, self._state_batch(rows), self.hidden_size)
            hx = torch.zeros(shape, dtype=rows.data.dtype, device=rows.data.device)
        hx = self._autocast_state(hx, dtype)
        # torch.nn.GRU's check_forward_args: its checks and messages (a subclass's own, where it has one)
        with self._as_called(dtype, rows.data):
            if self._checks_overridden():
                self.check_forward_args(rows.checked, hx, rows.batch_sizes if rows.packed else None)
            else:
                self.check_input(rows.checked, rows.batch_sizes if rows.packed else None)
                self._check_state_size(rows, hx, self.hidden_size, "Expected hidden size {}, got {}")
        self._check_devices_and_dtypes(rows.data, {"hx": hx}, weights_now["weight_ih_l0"])
        self._refuse_inference_weights(list(weights_now.values()), [rows.data, hx])
        if dtype is None:  # (autocast casts the weights)
            self._check_weight_dtypes(weights_now, rows.data)
        self._to_rows(rows)

        h_n = []
        layer_input = rows.data
        one_step = self._one_step(rows)
        for layer in range(self.num_layers):
            h0 = hx[layer * num_directions : (layer + 1) * num_directions]
            frozen: list = []
            weights = self._layer_weights(
                weights_now,
                layer,
                ("weight_ih", "weight_hh", "bias_ih", "bias_hh"),
                dtype,
                input_requires_grad=layer_input.requires_grad,
                frozen=frozen,
                state_requires_grad=h0.requires_grad or not one_step,
            )
            formulas = needs_formulas(rows.mini_batch, layer_input, h0, *weights)
            if formulas:  # (autograd-tracked ops: they save what torch's save)
                layer_input, h_last = gru_layer_autograd(
                    layer_input, rows.step_sizes or rows.batch_sizes, h0, *weights
                )
            else:
                x, h0 = self._unsaved(layer_input, h0, *weights)
                layer_input, h_last = gru_layer(x, rows.batch_sizes, h0, *weights)
            if frozen:
                self._check_frozen_in_backward((layer_input, h_last), frozen)
            h_n.append(h_last)
            layer_input = self._dropout(layer_input, layer)
        hidden = torch.cat(h_n, 0) if len(h_n) > 1 else h_n[0]

        if rows.packed:
            hidden = self.permute_hidden(hidden, rows.unsorted_indices)
        elif not rows.batched:
            hidden = hidden.squeeze(1)
        return self._give_output(rows, layer_input), hidden

"""``tandem.nn.LSTM``: a drop-in ``torch.nn.LSTM`` whose layers run ``tandem::lstm_fwd`` / ``lstm_bwd``, or on
the CPU, where torch.nn.LSTM itself runs oneDNN's fused LSTM, that same primitive."""

from __future__ import annotations

from typing import Any, overload

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from tandem.nn._fx import fx_leaf
from tandem.nn._rnn import RNNLayers, needs_formulas
from tandem.ops.lstm import lstm as lstm_layer
from tandem.ops.lstm.onednn import (
    lstm_layer_onednn,
    onednn_applies,
    torch_runs_onednn,
    torch_runs_onednn_when_packed_uniform,
)
from tandem.ops.lstm.reference import lstm_layer_autograd

__all__ = ["LSTM"]


# torch's lstm op's refusal of a Tensor for hx, in short
_HX_TENSOR = (
    "lstm() received an invalid combination of arguments - got a Tensor for hx, but expected a tuple of "
    "Tensors (h_0, c_0)"
)


class LSTM(RNNLayers):
    r"""Multi-layer LSTM with ``torch.nn.LSTM``'s constructor, parameters, gate math and outputs.

    Built on ``torch.nn.RNNBase`` (as ``torch.nn.LSTM`` is), so argument checks, parameter names
    (``weight_ih_l0``, ``weight_hr_l1_reverse``, ...), shapes, initialisation and ``state_dict`` are
    torch's own and load both ways. Each layer runs both directions at once through
    :func:`tandem.ops.lstm`, on packed rows: padded frames of a ``PackedSequence`` cost nothing. On the
    CPU, for the inputs torch.nn.LSTM hands to oneDNN (padded float32, no projection, oneDNN enabled),
    the layers run that same oneDNN primitive instead (:mod:`tandem.ops.lstm.onednn`): tandem's kernel
    does not reach it there, and the results equal torch's bit for bit.

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

    _GATES = 4

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
        proj_size: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None: ...

    @overload
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # torch.nn.LSTM's constructor: the arguments reach torch.nn.RNNBase as given, so every one torch
        # takes is taken the same way, and every wrong one (an unknown keyword included) raises torch's error
        super().__init__("LSTM", *args, **kwargs)

    _CHECKS = (*RNNLayers._CHECKS, "get_expected_cell_size")

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

    def _direction_weights(
        self, weights: dict[str, Tensor], layer: int
    ) -> list[tuple[Tensor, Tensor, Tensor | None, Tensor | None]]:
        """``(w_ih, w_hh, b_ih, b_hh)`` of each direction of ``layer``, the parameters themselves (of
        ``weights``, :meth:`_current_weights`)."""
        suffixes = ("", "_reverse") if self.bidirectional else ("",)
        names = ("weight_ih", "weight_hh") + (("bias_ih", "bias_hh") if self.bias else ())
        directions = []
        for s in suffixes:
            ws = [weights[f"{n}_l{layer}{s}"] for n in names]
            directions.append((*ws, None, None) if not self.bias else tuple(ws))
        return directions

    def forward(  # type: ignore[override]
        self, input: Tensor | PackedSequence, hx: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor | PackedSequence, tuple[Tensor, Tensor]]:
        traced = fx_leaf(self, (input,) if hx is None else (input, hx))  # torch.fx: a leaf, as torch's
        if traced is not None:
            return traced
        return self._dispatch(input, hx)

    def _forward(
        self, input: Tensor | PackedSequence, hx: tuple[Tensor, Tensor] | None, dtype: torch.dtype | None
    ) -> tuple[Tensor | PackedSequence, tuple[Tensor, Tensor]]:
        """The forward of :meth:`_dispatch`, ``dtype`` the one autocast makes the layers run in (None:
        the input's own)."""
        weights_now = self._current_weights()
        num_directions = 2 if self.bidirectional else 1
        out_size = self.proj_size if self.proj_size > 0 else self.hidden_size
        rows = self._take_input(input)
        if dtype is not None:
            rows.data = rows.data.to(dtype)
        if hx is not None:
            if rows.packed:
                # torch's LSTM checks no packed input before its op, which refuses a Tensor for hx first, and
                # raises an IndexError for states without a batch dimension (and a RuntimeError for the
                # input's dtype, below)
                if isinstance(hx, Tensor):
                    raise TypeError(_HX_TENSOR)
                if not isinstance(hx, (tuple, list)) or not all(isinstance(t, Tensor) for t in hx):
                    # refused by torch's permutation of hx or by its op's argument parser, before any
                    # computation: torch's forward, for its error (its type's qualified name among them)
                    return self._torch_forward(input, hx)
                if rows.sorted_indices is None and len(hx) != 2:
                    # no permutation takes hx apart first (torch's raises its IndexError there)
                    raise RuntimeError("lstm expects two hidden states")
                # hx follows the caller's batch order; the packed rows are sorted by length (torch's
                # permutation runs before its op, so its errors come first: a state of fewer than 2 dims an
                # IndexError, one with fewer sequences a RuntimeError)
                hx = self.permute_hidden(hx, rows.sorted_indices)
                if isinstance(hx, (tuple, list)) and len(hx) == 2 and (hx[0].dim() != 3 or hx[1].dim() != 3):
                    # torch's op: an IndexError where a state has fewer dims, a RuntimeError where more
                    error = IndexError if min(hx[0].dim(), hx[1].dim()) < 3 else RuntimeError
                    raise error(
                        "Expected hidden[0] and hidden[1] of 3 dimensions (layers * directions, batch, size) "
                        f"with a packed input, got {hx[0].dim()}-D and {hx[1].dim()}-D"
                    )
            else:
                dims = 3 if rows.batched else 2
                if hx[0].dim() != dims or hx[1].dim() != dims:
                    kind = "batched 3-D" if rows.batched else "unbatched 2-D"
                    raise RuntimeError(
                        f"For {kind} input, hx and cx should also be {dims}-D but got "
                        f"({hx[0].dim()}-D, {hx[1].dim()}-D) tensors"
                    )
                if not rows.batched:
                    hx = (hx[0].unsqueeze(1), hx[1].unsqueeze(1))
        if hx is None:
            shape = (self.num_layers * num_directions, self._state_batch(rows))
            kwargs = dict(dtype=rows.data.dtype, device=rows.data.device)
            hx = (torch.zeros(*shape, out_size, **kwargs), torch.zeros(*shape, self.hidden_size, **kwargs))
        # torch.nn.LSTM's check_forward_args (above): its checks and messages. A subclass's own, where it
        # has one, runs for input that is not packed, as in torch's forward (which checks packed input in
        # its op, as the checks below do)
        overridden = not rows.packed and self._checks_overridden()
        try:
            with self._as_called(dtype, rows.data):
                if overridden:
                    self.check_forward_args(rows.checked, hx, None)
                elif rows.packed:  # (torch's op's check: not a subclass's check_input)
                    torch.nn.RNNBase.check_input(self, rows.checked, rows.batch_sizes)
                else:
                    self.check_input(rows.checked, None)
        except ValueError as e:
            if not rows.packed:
                raise
            # torch's type and words: its op's first matrix product (input by weight_ih_l0) refuses the dtypes
            bias = weights_now.get("bias_ih_l0") if self.bias else None
            raise RuntimeError(
                _product_refusal(rows.data, weights_now["weight_ih_l0"], bias, str(e))
            ) from None
        if not overridden:
            self._check_state_size(rows, hx[0], out_size, "Expected hidden[0] size {}, got {}")
            self._check_state_size(rows, hx[1], self.hidden_size, "Expected hidden[1] size {}, got {}")
        # what torch's lstm op refuses once the checks above passed (packed and unbatched input have made a
        # pair of hx by then, in torch's forward as here)
        if isinstance(hx, Tensor):
            raise TypeError(_HX_TENSOR)
        if len(hx) != 2:
            raise RuntimeError("lstm expects two hidden states")
        torch_onednn = torch_runs_onednn(rows.data, rows.packed and not _uniform(rows), self.proj_size)
        hx = (
            self._autocast_state(hx[0], dtype),
            _promoted_cx(rows.data, self._autocast_state(hx[1], dtype), torch_onednn),
        )
        # oneDNN's bfloat16 cell keeps a float32 cell state as it is (c_n float32 too): torch takes one
        float_cx = rows.data.dtype == torch.bfloat16 and hx[1].dtype == torch.float32 and torch_onednn
        self._check_devices_and_dtypes(
            rows.data, {"hx": hx[0], "cx": hx[1]}, weights_now["weight_ih_l0"], exempt=("cx",) * float_cx
        )
        self._refuse_inference_weights(list(weights_now.values()), [rows.data, *hx])
        if dtype is None and not torch_onednn:
            # (autocast casts the weights; oneDNN's op, which runs there, checks them as torch's does)
            self._check_weight_dtypes(weights_now, rows.data)
        self._to_rows(rows)

        h_n, c_n = [], []
        layer_input = rows.data
        names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")
        # where torch.nn.LSTM runs oneDNN's fused cell (dense float32 or bfloat16 CPU input, no projection),
        # so does this module; tandem's own kernel everywhere else (see tandem.ops.lstm.onednn)
        onednn = dtype is None and rows.mini_batch > 0 and onednn_applies(torch_onednn)
        if float_cx and not onednn:  # torch.compile traces tandem's own kernel: one dtype throughout
            hx = (hx[0], hx[1].to(rows.data.dtype))
        one_step = not torch_onednn and self._one_step(rows)  # (oneDNN's cell saves W_hh at any length)
        for layer in range(self.num_layers):
            span = slice(layer * num_directions, (layer + 1) * num_directions)
            if onednn:
                directions = self._direction_weights(weights_now, layer)
                layer_input, h_last, c_last = lstm_layer_onednn(
                    layer_input, rows.mini_batch, hx[0][span], hx[1][span], directions
                )
            else:
                frozen: list = []
                h0, c0 = hx[0][span], hx[1][span]
                weights = self._layer_weights(
                    weights_now,
                    layer,
                    names,
                    dtype,
                    input_requires_grad=layer_input.requires_grad,
                    frozen=frozen,
                    state_requires_grad=h0.requires_grad or not one_step,
                )
                formulas = needs_formulas(rows.mini_batch, layer_input, h0, c0, *weights)
                if formulas:  # (autograd-tracked ops: they save what torch's save)
                    layer_input, h_last, c_last = lstm_layer_autograd(
                        layer_input, rows.step_sizes or rows.batch_sizes, h0, c0, *weights
                    )
                else:
                    c0 = self._unsaved_c0(c0, layer_input, h0, *weights[:4])
                    x, h0 = self._unsaved(layer_input, h0, weights[0], weights[1], c0, *weights[2:])
                    layer_input, h_last, c_last = lstm_layer(x, rows.batch_sizes, h0, c0, *weights)
                if frozen:
                    self._check_frozen_in_backward((layer_input, h_last, c_last), frozen)
            h_n.append(h_last)
            c_n.append(c_last)
            layer_input = self._dropout(layer_input, layer)
        hidden = (torch.cat(h_n, 0), torch.cat(c_n, 0)) if len(h_n) > 1 else (h_n[0], c_n[0])
        if float_cx and not onednn:
            hidden = (hidden[0], hidden[1].float())

        if rows.packed:
            hidden = self.permute_hidden(hidden, rows.unsorted_indices)
        elif not rows.batched:
            hidden = (hidden[0].squeeze(1), hidden[1].squeeze(1))
        return self._give_output(rows, layer_input), hidden

    @staticmethod
    def _unsaved_c0(c0: Tensor, x: Tensor, h0: Tensor, *gate_weights: Tensor | None) -> Tensor:
        """``c0`` as a layer's op takes it: a copy where no gate of the first step needs a gradient (neither
        the layer's input, ``h0`` nor an input or recurrent weight or bias requires one). torch's cell
        saves ``c0`` only for the forget gate's gradient (autograd's product ``f * c0``), so a caller may
        change a learned initial cell state in place before backward where nothing else is learned;
        tandem's op saves it whatever reads it, and raised autograd's error."""
        if not LSTM._copies_may_matter():
            return c0
        if not c0.requires_grad or any(t is not None and t.requires_grad for t in (x, h0, *gate_weights)):
            return c0
        return c0.clone()


def _product_refusal(x: Tensor, weight: Tensor, bias: Tensor | None, fallback: str) -> str:
    """What torch's ``linear(x, weight, bias)`` says of an ``x`` of another dtype than the weight's, in its
    own words (asked of it on one-element operands; they differ with and without a bias); ``fallback``
    where it takes them."""
    try:
        b = None if bias is None else bias.new_empty(1)
        torch.nn.functional.linear(x.new_empty(1, 1), weight.new_empty(1, 1), b)
    except RuntimeError as e:
        return str(e)
    return fallback


def _uniform(rows: Any) -> bool:
    """Whether every step of a packed batch holds every sequence (their lengths all equal) and this torch's
    LSTM runs oneDNN's cell on it then, as on a padded batch (the rows are laid out alike; torch 2.13 does,
    2.11 runs its native loop). Traced by torch.compile, tandem's own kernel (the lengths are data there)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or not torch_runs_onednn_when_packed_uniform():
        return False
    sizes = rows.batch_sizes
    return bool((sizes == sizes[0]).all())


def _promoted_cx(data: Tensor, cx: Tensor, torch_onednn: bool) -> Tensor:
    """``cx`` in the input's dtype where torch.nn.LSTM's own CPU cell takes it in another
    (``torch_onednn``: whether torch runs oneDNN's cell instead, :func:`torch_runs_onednn`).

    Where torch runs its native cell on the CPU (float64 input; float32 input that is packed, or with a
    projection, or with oneDNN off), the first step multiplies ``cx`` by the forget gate: a ``cx`` of a
    dtype that promotes to the input's (float32 or float16 for float64 input; float16 or bfloat16 for
    float32) is taken and ``c_n`` comes out in the input's dtype. Casting it first gives the same numbers
    (the widening is exact) and its gradient flows back in its own dtype, as torch's does. Everywhere
    else a dtype unlike the input's is refused, as torch's cells refuse it (oneDNN's, which runs dense
    float32 input without a projection, among them), but for the float32 ``cx`` that oneDNN's bfloat16
    cell takes (:meth:`LSTM._forward`)."""
    if (
        data.device.type == "cpu"
        and data.dtype in (torch.float32, torch.float64)
        and not torch_onednn
        and cx.dtype != data.dtype
        and cx.is_floating_point()
        and torch.promote_types(cx.dtype, data.dtype) == data.dtype
    ):
        return cx.to(data.dtype)
    return cx

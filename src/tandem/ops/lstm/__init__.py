"""``tandem.ops.lstm``: one LSTM layer (all directions) over a packed batch, as a custom op."""

from __future__ import annotations

import torch
from torch import Tensor

from tandem.ops.lstm import op as _op  # noqa: F401  (registers torch.ops.tandem.lstm_fwd / lstm_bwd)

__all__ = ["lstm"]


def lstm(
    x: Tensor,
    batch_sizes: Tensor,
    h0: Tensor,
    c0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None = None,
    b_hh: Tensor | None = None,
    w_hr: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run one LSTM layer, both directions at once when ``D = 2``, with torch.nn.LSTM's gate math.

    Args:
        x: ``[P, I]`` rows in ``PackedSequence.data`` order (a padded ``[T, B, I]`` batch reshaped to
            ``[T*B, I]`` with ``batch_sizes = [B] * T`` is the unpadded case).
        batch_sizes: ``[T]`` int64 CPU tensor, non-increasing (``PackedSequence.batch_sizes``).
        h0: ``[D, B, R]`` initial output state, ``R`` = proj_size (H without projection); ``D`` (1 or
            2) is the number of directions.
        c0: ``[D, B, H]`` initial cell state.
        w_ih, w_hh: ``[D, 4H, I]`` and ``[D, 4H, R]``, gates in torch's order (i, f, g, o).
        b_ih, b_hh: ``[D, 4H]`` or None.
        w_hr: ``[D, R, H]`` projection weight or None.

    Returns:
        ``y`` ``[P, D*R]`` (the reverse direction's half aligned with the input frames), ``h_n``
        ``[D, B, R]`` and ``c_n`` ``[D, B, H]`` (each sequence's last states; for the reverse
        direction, its states after the sequence's first frame).

    Example::

        >>> T, B, I, H = 5, 3, 4, 8
        >>> x = torch.randn(T * B, I)
        >>> y, h_n, c_n = lstm(x, torch.full((T,), B), torch.zeros(2, B, H), torch.zeros(2, B, H),
        ...                    torch.randn(2, 4 * H, I), torch.randn(2, 4 * H, H))
        >>> y.shape, h_n.shape, c_n.shape
        (torch.Size([15, 16]), torch.Size([2, 3, 8]), torch.Size([2, 3, 8]))
    """
    _check_args(x, batch_sizes, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr)
    tensors = (x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr)
    # Without autograd (inference, torch.no_grad) nothing is saved and the activations live in scratch;
    # a trace saves whatever the grad mode: need_saved is a constant in it, and torch.jit.trace's check
    # re-runs without grad (a trace made under no_grad must still train)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    need_saved = needs_grad or torch.jit.is_tracing()
    y, h_n, c_n, *_ = torch.ops.tandem.lstm_fwd(
        x, batch_sizes, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, need_saved
    )
    if need_saved and h0.shape[0] == 1:
        y = y.clone()  # one direction: the op saved y as the states; the caller may change this in place
    return y, h_n, c_n


def _check_args(x, batch_sizes, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr) -> None:
    """Shape checks that need no data, so torch.compile traces them; the kernel checks the rows."""
    if x.dim() != 2:
        raise ValueError(f"lstm: expected x of shape [P, I] (2 dims), got {x.dim()} dims")
    if batch_sizes.dim() != 1 or batch_sizes.dtype != torch.long or batch_sizes.device.type != "cpu":
        raise ValueError(
            "lstm: expected batch_sizes as a 1-D int64 CPU tensor, got "
            f"{batch_sizes.dim()}-D {batch_sizes.dtype} on {batch_sizes.device}"
        )
    if c0.dim() != 3 or c0.shape[0] not in (1, 2):
        raise ValueError(f"lstm: expected c0 of shape [D, B, H] with D in (1, 2), got {list(c0.shape)}")
    d_, batch, hid = c0.shape
    # R: the output size, proj_size with a projection (read from h0) and H without
    out_size = h0.shape[-1] if w_hr is not None else hid
    expected = {
        "h0": (h0, [d_, batch, out_size]),
        "w_ih": (w_ih, [d_, 4 * hid, x.shape[1]]),
        "w_hh": (w_hh, [d_, 4 * hid, out_size]),
        "b_ih": (b_ih, [d_, 4 * hid]),
        "b_hh": (b_hh, [d_, 4 * hid]),
        "w_hr": (w_hr, [d_, out_size, hid]),
    }
    for name, (t, shape) in expected.items():
        if t is not None and list(t.shape) != shape:
            raise ValueError(
                f"lstm: expected {name} of shape {shape} (from x, c0 and h0), got {list(t.shape)}"
            )
    if (b_ih is None) != (b_hh is None):
        raise ValueError("lstm: expected both b_ih and b_hh or neither, got only one")
    if w_hr is not None and not 0 < out_size < hid:
        raise ValueError(f"lstm: expected a proj_size (h0.shape[2]) in [1, {hid}) with w_hr, got {out_size}")

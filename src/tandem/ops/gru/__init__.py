"""``tandem.ops.gru``: one GRU layer (all directions) over a packed batch, as a custom op."""

from __future__ import annotations

import torch
from torch import Tensor

from tandem.ops.gru import op as _op  # noqa: F401  (registers torch.ops.tandem.gru_fwd / gru_bwd)

__all__ = ["gru"]


def gru(
    x: Tensor,
    batch_sizes: Tensor,
    h0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None = None,
    b_hh: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Run one GRU layer, both directions at once when ``D = 2``, with torch.nn.GRU's gate math.

    Args:
        x: ``[P, I]`` rows in ``PackedSequence.data`` order (a padded ``[T, B, I]`` batch reshaped to
            ``[T*B, I]`` with ``batch_sizes = [B] * T`` is the unpadded case).
        batch_sizes: ``[T]`` int64 CPU tensor, non-increasing (``PackedSequence.batch_sizes``).
        h0: ``[D, B, H]`` initial state; ``D`` (1 or 2) is the number of directions.
        w_ih, w_hh: ``[D, 3H, I]`` and ``[D, 3H, H]``, gates in torch's order (r, z, n).
        b_ih, b_hh: ``[D, 3H]`` or None.

    Returns:
        ``y`` ``[P, D*H]`` (the reverse direction's half aligned with the input frames) and
        ``h_n`` ``[D, B, H]`` (each sequence's last state; for the reverse direction, its state after
        the sequence's first frame).

    Example::

        >>> T, B, I, H = 5, 3, 4, 8
        >>> x = torch.randn(T * B, I)
        >>> y, h_n = gru(x, torch.full((T,), B), torch.zeros(2, B, H),
        ...              torch.randn(2, 3 * H, I), torch.randn(2, 3 * H, H))
        >>> y.shape, h_n.shape
        (torch.Size([15, 16]), torch.Size([2, 3, 8]))
    """
    _check_args(x, batch_sizes, h0, w_ih, w_hh, b_ih, b_hh)
    y, h_n, *_ = torch.ops.tandem.gru_fwd(x, batch_sizes, h0, w_ih, w_hh, b_ih, b_hh)
    # one direction: the op saved y as the states; the caller may change this in place (a trace clones
    # whatever the grad mode, so that torch.jit.trace's check, run without grad, sees the same graph)
    if h0.shape[0] == 1 and (y.requires_grad or torch.jit.is_tracing()):
        y = y.clone()
    return y, h_n


def _check_args(x, batch_sizes, h0, w_ih, w_hh, b_ih, b_hh) -> None:
    """Shape checks that need no data, so torch.compile traces them; the kernel checks the rows."""
    if x.dim() != 2:
        raise ValueError(f"gru: expected x of shape [P, I] (2 dims), got {x.dim()} dims")
    if batch_sizes.dim() != 1 or batch_sizes.dtype != torch.long or batch_sizes.device.type != "cpu":
        raise ValueError(
            "gru: expected batch_sizes as a 1-D int64 CPU tensor, got "
            f"{batch_sizes.dim()}-D {batch_sizes.dtype} on {batch_sizes.device}"
        )
    if h0.dim() != 3 or h0.shape[0] not in (1, 2):
        raise ValueError(f"gru: expected h0 of shape [D, B, H] with D in (1, 2), got {list(h0.shape)}")
    d_, _, hid = h0.shape
    expected = {
        "w_ih": (w_ih, [d_, 3 * hid, x.shape[1]]),
        "w_hh": (w_hh, [d_, 3 * hid, hid]),
        "b_ih": (b_ih, [d_, 3 * hid]),
        "b_hh": (b_hh, [d_, 3 * hid]),
    }
    for name, (t, shape) in expected.items():
        if t is not None and list(t.shape) != shape:
            raise ValueError(f"gru: expected {name} of shape {shape} (from x and h0), got {list(t.shape)}")
    if (b_ih is None) != (b_hh is None):
        raise ValueError("gru: expected both b_ih and b_hh or neither, got only one")

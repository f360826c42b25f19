"""FLOP formulas of the recurrent layers' ops, for ``torch.utils.flop_counter.FlopCounterMode``.

The counter sees a custom op as one call and cannot look inside it: without a formula a tandem layer
counted no FLOPs where torch's native GRU and LSTM count their matrix products. Each formula counts the
matrix products the op computes, 2 FLOPs a multiply-add, as the counter counts torch's ``mm``/``addmm``:
the forward's input and recurrent products (and the projection's), the backward's weight, state and
(when asked) input gradients. Forward counts equal torch's native layers'; a backward counts the state
gradient's product at every step, the first included: tandem's backward always computes the gradient of
``h_0``, which torch's autograd skips where ``h_0`` needs none. Elementwise work is not counted, as torch
counts none. (torch's oneDNN LSTM counts nothing, nor does tandem's, which runs the same op.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch.utils.flop_counter import register_flop_formula

__all__ = ["gru_fwd_flops", "gru_bwd_flops", "lstm_fwd_flops", "lstm_bwd_flops", "register"]

Shape = tuple[int, ...]


def _products(
    x: Shape, h0: Shape, gates: int, out: int, hidden: int, projected: bool
) -> tuple[int, int, int]:
    """FLOPs of the input product, the recurrent product and the projection, over every row and direction."""
    directions, rows, inputs = h0[0], x[0], x[1]
    per_row = 2 * directions * gates
    proj = 2 * directions * rows * hidden * out if projected else 0
    return rows * per_row * inputs, rows * per_row * out, proj


def gru_fwd_flops(x: Shape, batch_sizes: Shape, h0: Shape, *_: Any, **__: Any) -> int:
    hidden = h0[2]
    into, recurrent, _ = _products(x, h0, 3 * hidden, hidden, hidden, False)
    return into + recurrent


def gru_bwd_flops(
    dy: Any, dh_n: Any, x: Shape, batch_sizes: Shape, h0: Shape, *args: Any, out_shape: Any = None, **__: Any
) -> int:
    need_dx = args[-1]
    hidden = h0[2]
    into, recurrent, _ = _products(x, h0, 3 * hidden, hidden, hidden, False)
    # weight gradients of both products, the state's gradient through the recurrent one, dx's
    return into + 2 * recurrent + (into if need_dx else 0)


def lstm_fwd_flops(
    x: Shape, batch_sizes: Shape, h0: Shape, c0: Shape, w_ih: Shape, w_hh: Shape, b_ih: Any, b_hh: Any,
    w_hr: Any, *_: Any, **__: Any,
) -> int:  # fmt: skip
    hidden, out = c0[2], h0[2]
    into, recurrent, proj = _products(x, h0, 4 * hidden, out, hidden, w_hr is not None)
    return into + recurrent + proj


def lstm_bwd_flops(
    dy: Any, dh_n: Any, dc_n: Any, x: Shape, batch_sizes: Shape, h0: Shape, c0: Shape, w_ih: Shape,
    w_hh: Shape, w_hr: Any, *args: Any, out_shape: Any = None, **__: Any,
) -> int:  # fmt: skip
    need_dx = args[-1]
    hidden, out = c0[2], h0[2]
    into, recurrent, proj = _products(x, h0, 4 * hidden, out, hidden, w_hr is not None)
    return into + 2 * recurrent + 2 * proj + (into if need_dx else 0)


def register(op: Any, formula: Callable[..., int]) -> None:
    """Register ``formula`` for the custom op ``op`` (``torch.ops.tandem.<name>``), once."""
    with contextlib.suppress(RuntimeError):  # already registered (a reloaded module)
        register_flop_formula(op)(formula)

"""The ops tandem::gru_fwd / gru_bwd: gradcheck, opcheck and the packed-layout index arithmetic."""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem.ops.gru.reference import PackedSteps

SHAPES = [
    pytest.param(1, [3, 3, 3], id="T3-B3-uni"),
    pytest.param(2, [3, 3, 3], id="T3-B3-bi"),
    pytest.param(2, [3, 2, 1, 1], id="T4-packed-bi"),
    pytest.param(1, [2, 1], id="T2-packed-uni"),
]


def _inputs(directions: int, batch_sizes: list[int], bias: bool = True, hid: int = 2, inp: int = 3):
    total, batch = sum(batch_sizes), batch_sizes[0]
    d = dict(dtype=torch.float64, requires_grad=True)
    x = torch.randn(total, inp, **d)
    h0 = torch.randn(directions, batch, hid, **d)
    w_ih = torch.randn(directions, 3 * hid, inp, **d)
    w_hh = torch.randn(directions, 3 * hid, hid, **d)
    b_ih = torch.randn(directions, 3 * hid, **d) if bias else None
    b_hh = torch.randn(directions, 3 * hid, **d) if bias else None
    return x, torch.tensor(batch_sizes), h0, w_ih, w_hh, b_ih, b_hh


@pytest.mark.parametrize("directions, batch_sizes", SHAPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_gradcheck(directions, batch_sizes, bias):
    x, bs, h0, w_ih, w_hh, b_ih, b_hh = _inputs(directions, batch_sizes, bias)
    tensors = [t for t in (x, h0, w_ih, w_hh, b_ih, b_hh) if t is not None]

    def fn(x, h0, w_ih, w_hh, *biases):
        b = biases if biases else (None, None)
        return tandem.ops.gru(x, bs, h0, w_ih, w_hh, *b)

    assert torch.autograd.gradcheck(fn, tensors)


def test_gradcheck_single_output_used():
    """Only h_n (or only y) feeding the loss: the unused gradient arrives as None and is handled."""
    x, bs, h0, w_ih, w_hh, b_ih, b_hh = _inputs(2, [3, 2, 2])
    assert torch.autograd.gradcheck(
        lambda *t: tandem.ops.gru(t[0], bs, *t[1:])[1], (x, h0, w_ih, w_hh, b_ih, b_hh)
    )
    assert torch.autograd.gradcheck(
        lambda *t: tandem.ops.gru(t[0], bs, *t[1:])[0], (x, h0, w_ih, w_hh, b_ih, b_hh)
    )


@pytest.mark.parametrize("directions, batch_sizes", SHAPES)
def test_opcheck_fwd(directions, batch_sizes):
    args = _inputs(directions, batch_sizes)
    torch.library.opcheck(torch.ops.tandem.gru_fwd.default, args)


@pytest.mark.parametrize("directions, batch_sizes", SHAPES)
@pytest.mark.parametrize("need_dx", [True, False], ids=["dx", "no-dx"])
def test_opcheck_bwd(directions, batch_sizes, need_dx):
    x, bs, h0, w_ih, w_hh, b_ih, b_hh = (
        t.detach() if t is not None and t.dim() else t for t in _inputs(directions, batch_sizes)
    )
    y, h_n, gates, hn, states = torch.ops.tandem.gru_fwd(x, bs, h0, w_ih, w_hh, b_ih, b_hh)
    args = (
        torch.randn_like(y),
        torch.randn_like(h_n),
        x,
        bs,
        h0,
        w_ih,
        w_hh,
        y,
        gates,
        hn,
        states,
        True,
        need_dx,
    )
    torch.library.opcheck(torch.ops.tandem.gru_bwd.default, args)


def test_packed_steps_reverse_rows_are_each_sequences_own_frames():
    # lengths 4, 2, 1: reverse step s of sequence b reads frame len_b - 1 - s
    steps = PackedSteps.build(torch.tensor([3, 2, 1, 1]), 7, 3, 2, torch.device("cpu"))
    assert steps.offsets == [0, 3, 5, 6]
    row = {(t, b): off + b for t, (off, n) in enumerate(zip(steps.offsets, steps.sizes)) for b in range(n)}
    lengths = [4, 2, 1]
    for (s, b), r in row.items():
        assert steps.rev_rows[r].item() == row[(lengths[b] - 1 - s, b)]
    assert torch.equal(steps.rev_rows[steps.rev_rows], torch.arange(7))  # an involution
    assert steps.last_rows.tolist() == [row[(3, 0)], row[(1, 1)], row[(0, 2)]]


BAD_ARGS = {
    "x-1d": (lambda a: {**a, "x": a["x"][:, 0]}, "x of shape"),
    "x-width": (lambda a: {**a, "x": a["x"][:, :2]}, "w_ih of shape"),
    "batch-sizes-float": (lambda a: {**a, "batch_sizes": a["batch_sizes"].double()}, "batch_sizes"),
    "h0-4-directions": (lambda a: {**a, "h0": a["h0"].repeat(4, 1, 1)}, "h0 of shape"),
    "w-hh-shape": (lambda a: {**a, "w_hh": a["w_hh"][:, :, :1]}, "w_hh of shape"),
    "one-bias": (lambda a: {**a, "b_hh": None}, "b_ih and b_hh"),
    "rows-vs-batch-sizes": (lambda a: {**a, "batch_sizes": torch.tensor([2, 1])}, "sum\\(batch_sizes\\)"),
    "increasing-batch-sizes": (lambda a: {**a, "batch_sizes": torch.tensor([1, 2, 1])}, "non-increasing"),
}


@pytest.mark.parametrize("name", list(BAD_ARGS))
def test_bad_arguments_name_the_argument(name):
    x, bs, h0, w_ih, w_hh, b_ih, b_hh = _inputs(1, [2, 2])
    args = dict(x=x, batch_sizes=bs, h0=h0, w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh)
    change, message = BAD_ARGS[name]
    with pytest.raises(ValueError, match=message):
        tandem.ops.gru(**change(args))

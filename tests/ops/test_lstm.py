"""The ops tandem::lstm_fwd / lstm_bwd: gradcheck, opcheck and argument checks."""

from __future__ import annotations

import pytest
import torch

import tandem

SHAPES = [
    pytest.param(1, [3, 3, 3], 0, id="T3-B3-uni"),
    pytest.param(2, [3, 3, 3], 0, id="T3-B3-bi"),
    pytest.param(2, [3, 2, 1, 1], 0, id="T4-packed-bi"),
    pytest.param(1, [2, 1], 0, id="T2-packed-uni"),
    pytest.param(1, [2, 2], 2, id="T2-B2-uni-proj"),
    pytest.param(2, [3, 2, 1], 2, id="T3-packed-bi-proj"),
]


def _inputs(
    directions: int, batch_sizes: list[int], proj: int = 0, bias: bool = True, hid: int = 3, inp: int = 2
):
    total, batch = sum(batch_sizes), batch_sizes[0]
    out = proj or hid
    d = dict(dtype=torch.float64, requires_grad=True)
    x = torch.randn(total, inp, **d)
    h0 = torch.randn(directions, batch, out, **d)
    c0 = torch.randn(directions, batch, hid, **d)
    w_ih = torch.randn(directions, 4 * hid, inp, **d)
    w_hh = torch.randn(directions, 4 * hid, out, **d)
    b_ih = torch.randn(directions, 4 * hid, **d) if bias else None
    b_hh = torch.randn(directions, 4 * hid, **d) if bias else None
    w_hr = torch.randn(directions, proj, hid, **d) if proj else None
    return x, torch.tensor(batch_sizes), h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr


def _fn(bs, present):
    """``lstm`` as a function of the tensors that are present (None for the absent ones)."""

    def fn(*tensors):
        it = iter(tensors)
        x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr = (next(it) if p else None for p in present)
        return tandem.ops.lstm(x, bs, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr)

    return fn


@pytest.mark.parametrize("directions, batch_sizes, proj", SHAPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_gradcheck(directions, batch_sizes, proj, bias):
    x, bs, *rest = _inputs(directions, batch_sizes, proj, bias)
    tensors = (x, *rest)
    present = [t is not None for t in tensors]
    assert torch.autograd.gradcheck(_fn(bs, present), [t for t in tensors if t is not None])


@pytest.mark.parametrize("output", [0, 1, 2], ids=["y", "h_n", "c_n"])
def test_gradcheck_single_output_used(output):
    """One output feeding the loss: the unused gradients arrive as None and are handled."""
    x, bs, *rest = _inputs(2, [3, 2, 2], proj=2)
    tensors = (x, *rest)
    fn = _fn(bs, [True] * len(tensors))
    assert torch.autograd.gradcheck(lambda *t: fn(*t)[output], tensors)


@pytest.mark.parametrize("directions, batch_sizes, proj", SHAPES)
@pytest.mark.parametrize("need_saved", [True, False], ids=["saved", "no-saved"])
def test_opcheck_fwd(directions, batch_sizes, proj, need_saved):
    args = _inputs(directions, batch_sizes, proj)
    if not need_saved:  # inference: no input asks for a gradient
        args = tuple(t.detach() if t is not None and t.dim() else t for t in args)
    torch.library.opcheck(torch.ops.tandem.lstm_fwd.default, (*args, need_saved))


@pytest.mark.parametrize("directions, batch_sizes, proj", SHAPES)
@pytest.mark.parametrize("need_dx", [True, False], ids=["dx", "no-dx"])
def test_opcheck_bwd(directions, batch_sizes, proj, need_dx):
    x, bs, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr = (
        t.detach() if t is not None and t.dim() else t for t in _inputs(directions, batch_sizes, proj)
    )
    y, h_n, c_n, *saved = torch.ops.tandem.lstm_fwd(x, bs, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, True)
    grads = (torch.randn_like(y), torch.randn_like(h_n), torch.randn_like(c_n))
    args = (*grads, x, bs, h0, c0, w_ih, w_hh, w_hr, y, *saved, True, need_dx)
    torch.library.opcheck(torch.ops.tandem.lstm_bwd.default, args)


def test_opcheck_bwd_without_output_grads():
    x, bs, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr = (
        t.detach() if t is not None and t.dim() else t for t in _inputs(2, [3, 1], 0, bias=False)
    )
    y, h_n, c_n, *saved = torch.ops.tandem.lstm_fwd(x, bs, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, True)
    args = (None, None, torch.randn_like(c_n), x, bs, h0, c0, w_ih, w_hh, w_hr, y, *saved, False, True)
    torch.library.opcheck(torch.ops.tandem.lstm_bwd.default, args)


BAD_ARGS = {
    "x-1d": (lambda a: {**a, "x": a["x"][:, 0]}, "x of shape"),
    "x-width": (lambda a: {**a, "x": a["x"][:, :1]}, "w_ih of shape"),
    "batch-sizes-float": (lambda a: {**a, "batch_sizes": a["batch_sizes"].double()}, "batch_sizes"),
    "c0-4-directions": (lambda a: {**a, "c0": a["c0"].repeat(4, 1, 1)}, "c0 of shape"),
    "h0-vs-c0": (lambda a: {**a, "h0": a["h0"][:, :, :2]}, "h0 of shape"),
    "w-hh-shape": (lambda a: {**a, "w_hh": a["w_hh"][:, :, :1]}, "w_hh of shape"),
    "w-hr-shape": (lambda a: {**a, "w_hr": torch.randn(1, 2, 2, dtype=torch.float64)}, "w_hr of shape"),
    "one-bias": (lambda a: {**a, "b_hh": None}, "b_ih and b_hh"),
    "rows-vs-batch-sizes": (lambda a: {**a, "batch_sizes": torch.tensor([2, 1])}, "sum\\(batch_sizes\\)"),
    "increasing-batch-sizes": (lambda a: {**a, "batch_sizes": torch.tensor([1, 2, 1])}, "non-increasing"),
}


@pytest.mark.parametrize("name", list(BAD_ARGS))
def test_bad_arguments_name_the_argument(name):
    x, bs, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr = _inputs(1, [2, 2])
    args = dict(x=x, batch_sizes=bs, h0=h0, c0=c0, w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh, w_hr=w_hr)
    change, message = BAD_ARGS[name]
    with pytest.raises(ValueError, match=message):
        tandem.ops.lstm(**change(args))


def test_projection_must_be_smaller_than_hidden():
    x, bs, h0, c0, w_ih, w_hh, b_ih, b_hh, _ = _inputs(1, [2, 2])  # hid = 3, no projection
    w_hr = torch.randn(1, 3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="proj_size"):
        tandem.ops.lstm(x, bs, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr)


def test_workspace_reuse_leaves_no_trace():
    """Backward temporaries live in a reused per-thread workspace: interleaved calls of different
    shapes give the same gradients as the first, fresh call."""
    from tandem.ops import _workspace

    _workspace.release()
    cases = [_inputs(2, [3, 2, 1], proj=2), _inputs(1, [4, 4, 4], hid=5), _inputs(2, [2, 2], bias=False)]

    def grads(case):
        x, bs, *rest = case
        tensors = [t for t in (x, *rest) if t is not None]
        y, h_n, c_n = _fn(bs, [t is not None for t in (x, *rest)])(*tensors)
        return torch.autograd.grad(y.sum() + h_n.square().sum() + c_n.sum(), tensors)

    first = [grads(case) for case in cases]
    for case, expected in reversed(list(zip(cases, first))):
        for got, want in zip(grads(case), expected):
            assert torch.equal(got, want)


def test_scratch_views_are_aligned_and_large_requests_are_not_kept(monkeypatch):
    from tandem.ops import _workspace

    _workspace.release()
    like = torch.empty(0)
    a, b = _workspace.scratch(like, (3, 5), (7,))
    assert a.shape == (3, 5) and b.shape == (7,)
    assert a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0
    (c,) = _workspace.scratch(like, (3, 5))
    assert c.data_ptr() == a.data_ptr()  # the same memory, handed out again
    monkeypatch.setattr(_workspace, "MAX_CACHED_BYTES", 1024)
    (big,) = _workspace.scratch(like, (1024,))
    (small,) = _workspace.scratch(like, (4,))
    assert small.data_ptr() == a.data_ptr() and big.data_ptr() != a.data_ptr()


@pytest.mark.parametrize("directions, batch_sizes, proj", SHAPES)
def test_no_grad_forward_saves_nothing_and_matches(directions, batch_sizes, proj):
    x, bs, *rest = _inputs(directions, batch_sizes, proj)
    with_grad = tandem.ops.lstm(x, bs, *rest)
    with torch.no_grad():
        without = tandem.ops.lstm(x, bs, *rest)
        _, _, _, *saved = torch.ops.tandem.lstm_fwd(x, bs, *rest, False)
    assert all(t.numel() == 0 for t in saved)
    for a, b in zip(without, with_grad):
        assert torch.equal(a, b)


def test_backward_without_saved_activations_is_an_error():
    x, bs, *rest = _inputs(1, [2, 2])
    y, *_ = torch.ops.tandem.lstm_fwd(x, bs, *rest, False)
    with pytest.raises(RuntimeError, match="need_saved=False"):
        y.sum().backward()

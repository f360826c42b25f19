"""Second derivatives of tandem.nn.GRU / tandem.nn.LSTM (a backward with ``create_graph=True``, as in a
gradient penalty) against torch.nn.GRU / torch.nn.LSTM with copied weights, which are twice
differentiable on the CPU; gradgradcheck of the ops; and the first-order backward staying on the fast
kernels."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import tandem
from tandem.ops.gru import gru
from tandem.ops.lstm import lstm

MODULES = {
    "gru": (torch.nn.GRU, tandem.nn.GRU, {}),
    "gru-nobias": (torch.nn.GRU, tandem.nn.GRU, {"bias": False}),
    "lstm": (torch.nn.LSTM, tandem.nn.LSTM, {}),
    "lstm-proj": (torch.nn.LSTM, tandem.nn.LSTM, {"proj_size": 3}),
}


def _penalty_grads(module, x, states, packed):
    """Gradients of a gradient penalty on the input and on every parameter: ``x``, the states and every
    parameter get a ``.grad`` that needs the second derivative of the module."""
    x = x.clone().requires_grad_()
    states = tuple(s.clone().requires_grad_() for s in states)
    inp = pack_padded_sequence(x, [3, 6, 1], enforce_sorted=False) if packed else x
    hx = states if len(states) == 2 else states[0]
    out, hidden = module(inp, hx)
    hidden = hidden if isinstance(hidden, tuple) else (hidden,)
    out = out.data if packed else out
    loss = out.pow(2).sum() + sum(h.pow(3).sum() for h in hidden)
    params = list(module.parameters())
    grads = torch.autograd.grad(loss, [x, *params], create_graph=True)
    penalty = sum(g.pow(2).sum() for g in grads) + (grads[0] * out.detach().sum()).sum()
    penalty.backward()
    return [x.grad, *(s.grad for s in states), *(p.grad for p in params)]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed-unsorted"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("kind", list(MODULES))
def test_gradient_penalty_matches_torch(kind, bidirectional, packed):
    ref_cls, cls, kwargs = MODULES[kind]
    torch.manual_seed(0)
    ref = ref_cls(4, 5, 2, bidirectional=bidirectional, **kwargs).double()
    mod = cls(4, 5, 2, bidirectional=bidirectional, **kwargs).double()
    mod.load_state_dict(ref.state_dict())
    d_ = 2 if bidirectional else 1
    x = torch.randn(6, 3, 4, dtype=torch.float64)
    out_size = kwargs.get("proj_size") or 5
    states = (torch.randn(2 * d_, 3, out_size, dtype=torch.float64),)
    if ref_cls is torch.nn.LSTM:
        states += (torch.randn(2 * d_, 3, 5, dtype=torch.float64),)
    expected = _penalty_grads(ref, x, states, packed)
    got = _penalty_grads(mod, x, states, packed)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-11)


def _gru_args(seed: int = 1) -> tuple:
    """Tiny float64 arguments of :func:`tandem.ops.gru.gru`: two directions, packed lengths 3, 2, 1."""
    torch.manual_seed(seed)
    kw = dict(dtype=torch.float64, requires_grad=True)
    d_, hid, inp = 2, 2, 3
    return (
        torch.randn(6, inp, **kw),
        torch.tensor([3, 2, 1]),
        torch.randn(d_, 3, hid, **kw),
        torch.randn(d_, 3 * hid, inp, **kw),
        torch.randn(d_, 3 * hid, hid, **kw),
        torch.randn(d_, 3 * hid, **kw),
        torch.randn(d_, 3 * hid, **kw),
    )


def _lstm_args(seed: int = 2) -> tuple:
    """Tiny float64 arguments of :func:`tandem.ops.lstm.lstm`: two directions, a projection, packed."""
    torch.manual_seed(seed)
    kw = dict(dtype=torch.float64, requires_grad=True)
    d_, hid, proj, inp = 2, 3, 2, 2
    return (
        torch.randn(6, inp, **kw),
        torch.tensor([3, 2, 1]),
        torch.randn(d_, 3, proj, **kw),
        torch.randn(d_, 3, hid, **kw),
        torch.randn(d_, 4 * hid, inp, **kw),
        torch.randn(d_, 4 * hid, proj, **kw),
        torch.randn(d_, 4 * hid, **kw),
        torch.randn(d_, 4 * hid, **kw),
        torch.randn(d_, proj, hid, **kw),
    )


OPS = {"gru": (gru, _gru_args), "lstm": (lstm, _lstm_args)}


@pytest.mark.parametrize("kind", list(OPS))
def test_op_gradgradcheck(kind):
    fn, make_args = OPS[kind]
    assert torch.autograd.gradgradcheck(fn, make_args(), fast_mode=True)


@pytest.mark.parametrize("kind", list(OPS))
def test_recomputed_gradients_equal_the_kernels(kind):
    """The first derivatives a create_graph backward returns (the recompute) equal the backward
    kernel's, so the second derivatives are those of the op that ran."""
    fn, make_args = OPS[kind]
    args = make_args()
    wrt = [a for a in args if a.requires_grad]
    outputs = fn(*args)
    weights = [torch.randn_like(o) for o in outputs]
    loss = sum((o * w).sum() for o, w in zip(outputs, weights))
    kernel = torch.autograd.grad(loss, wrt, retain_graph=True)
    recomputed = torch.autograd.grad(loss, wrt, create_graph=True)
    assert all(r.grad_fn is not None for r in recomputed)
    for r, k in zip(recomputed, kernel):
        torch.testing.assert_close(r, k, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_first_order_backward_does_not_recompute(kind, monkeypatch):
    """A plain backward (no create_graph) runs the backward kernel, never the step-by-step recompute."""
    op = sys.modules[f"tandem.ops.{kind}.op"]
    name = f"{kind}_layer_autograd"
    calls = []
    original = getattr(op, name)
    monkeypatch.setattr(op, name, lambda *a: calls.append(1) or original(*a))
    module = (tandem.nn.GRU if kind == "gru" else tandem.nn.LSTM)(4, 5, bidirectional=True).double()
    x = torch.randn(6, 3, 4, dtype=torch.float64, requires_grad=True)
    out = module(x)[0]
    out.sum().backward()
    assert calls == [] and x.grad is not None
    torch.autograd.grad(module(x)[0].sum(), x, create_graph=True)[0].sum().backward()
    assert calls == [1]

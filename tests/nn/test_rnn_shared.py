"""Behaviour tandem.nn.GRU and tandem.nn.LSTM share, checked once for both against torch."""

from __future__ import annotations

import pytest
import torch

import tandem

PAIRS = [
    pytest.param(torch.nn.GRU, tandem.nn.GRU, id="gru"),
    pytest.param(torch.nn.LSTM, tandem.nn.LSTM, id="lstm"),
]


def _states_sum(hidden: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The sum of h_n (GRU) or of h_n and c_n (LSTM)."""
    return sum(h.sum() for h in hidden) if isinstance(hidden, tuple) else hidden.sum()


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_dropout_between_layers_matches_torch_and_is_off_in_eval(torch_cls, tandem_cls):
    kwargs = dict(num_layers=3, dropout=0.4, bidirectional=True, dtype=torch.float64)
    ref, ours = torch_cls(5, 6, **kwargs), tandem_cls(5, 6, **kwargs)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(7, 3, 5, dtype=torch.float64)
    torch.manual_seed(11)
    expected, _ = ref(x)
    torch.manual_seed(11)
    got, _ = ours(x)
    torch.testing.assert_close(got, expected)  # same dropout masks: same draws on same-shaped outputs
    ours.eval()
    first, _ = ours(x)
    second, _ = ours(x)
    assert torch.equal(first, second)
    ref.eval()
    torch.testing.assert_close(first, ref(x)[0])


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_input_without_grad_skips_dx_and_keeps_parameter_grads(torch_cls, tandem_cls):
    """Layer 0 of a model gets features that need no gradient: dx is skipped, the rest is unchanged."""
    kwargs = dict(num_layers=2, bidirectional=True, dtype=torch.float64)
    ref, ours = torch_cls(5, 6, **kwargs), tandem_cls(5, 6, **kwargs)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(7, 3, 5, dtype=torch.float64)
    for module in (ref, ours):
        out, hidden = module(x)
        (out.square().sum() + _states_sum(hidden)).backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


@pytest.mark.parametrize("batch_first", [False, True], ids=["tm", "bf"])
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_empty_batch_matches_torch(torch_cls, tandem_cls, batch_first):
    """B = 0: empty outputs and states of torch's shapes, and zero (not missing) parameter gradients."""
    kwargs = dict(num_layers=2, bidirectional=True, batch_first=batch_first)
    ref, ours = torch_cls(5, 6, **kwargs), tandem_cls(5, 6, **kwargs)
    ours.load_state_dict(ref.state_dict())
    shape = (0, 7, 5) if batch_first else (7, 0, 5)
    results = []
    for module in (ref, ours):
        x = torch.randn(shape, requires_grad=True)
        out, hidden = module(x)
        (out.sum() + _states_sum(hidden)).backward()
        states = hidden if isinstance(hidden, tuple) else (hidden,)
        results.append((out, states, x.grad, [p.grad for p in module.parameters()]))
    (out_ref, states_ref, dx_ref, grads_ref), (out, states, dx, grads) = results
    assert out.shape == out_ref.shape and dx.shape == dx_ref.shape
    assert [s.shape for s in states] == [s.shape for s in states_ref]
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref)  # zeros of the parameter's shape in both


@pytest.mark.parametrize("unbatched", [False, True], ids=["batched", "unbatched"])
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_no_time_steps_is_torchs_error(torch_cls, tandem_cls, unbatched):
    x = torch.randn(0, 5) if unbatched else torch.randn(0, 3, 5)
    with pytest.raises(RuntimeError) as expected:
        torch_cls(5, 6)(x)
    with pytest.raises(RuntimeError, match="sequence length") as got:
        tandem_cls(5, 6)(x)
    assert str(got.value) == str(expected.value)

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
